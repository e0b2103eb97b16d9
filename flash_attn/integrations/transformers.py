"""Our kernels as a Hugging Face `transformers` attention implementation.

    from flash_attn.integrations.transformers import register
    name = register()                     # "fa_exact"
    model = AutoModel.from_config(config, attn_implementation=name)

`register` adds an attention function to transformers' AttentionInterface and a mask function
to its AttentionMaskInterface under the same name. For plain causal or bidirectional layers the
mask function hands the attention the 2-D padding mask (batch, kv_length), True = a real token,
which becomes a (batch, 1, 1, kv_length) bool attn_bias (no N x N tensor) next to the causal
flag; any other pattern (sliding windows, packed sequences, custom mask functions) comes as
transformers' 4-D boolean mask and is passed as it is. Fully masked query rows (left padding in
a causal model) give 0, where eager attention averages over the masked keys. Packed sequences
with transformers' flash kwargs (cu_seq_lens_q / _k, max_length_q / _k, from
DataCollatorWithFlattening(return_flash_attn_kwargs=True)) run as one varlen call, as in
transformers' flash-attention path. Attention sinks (`s_aux`: one logit per head that joins every
row's softmax and carries no value, as gpt-oss has them; `sinks`: one per head and query row) and
an additive `position_bias` (T5's relative positions) are supported on padded batches, and so
are `indices` (DeepSeek sparse attention: the keys each query may see, (batch, q_len, topk)).
transformers is an optional dependency: nothing here imports it before `register` is called.
"""

from typing import Optional

import torch
import torch.nn.functional as F

from .. import ops
from ..interface import flash_attn_func, flash_attn_varlen_func, last_dim_contiguous

# transformers routes every implementation name containing "flash" to its own flash-attention
# loaders, so ours goes without the word.
NAME = "fa_exact"


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                      is_causal: Optional[bool] = None, sliding_window: Optional[int] = None,
                      softcap: Optional[float] = None, **kwargs):
    """transformers' attention-function signature: query (batch, heads, q_len, head_dim), key and
    value (batch, kv_heads, kv_len, head_dim). Returns (out (batch, q_len, heads, head_dim), None)."""
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", False)
    packing = [kwargs.get(name) for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")]
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    position_bias = kwargs.get("position_bias")
    if all(x is not None for x in packing) and (attention_mask is None or attention_mask.dim() == 4):
        if sinks is not None or position_bias is not None or kwargs.get("indices") is not None:
            raise NotImplementedError("fa_exact: attention sinks (s_aux, sinks), position_bias and indices with "
                                      "packed sequences (flash kwargs) are not supported; pad the batch instead")
        return _packed_forward(q, k, v, *packing, dropout, scaling, bool(causal), sliding_window, softcap), None
    bias = None
    if attention_mask is not None:
        if attention_mask.dim() == 2:  # padding: True / 1 = a real key
            bias = attention_mask[:, -k.shape[1]:].bool()[:, None, None, :]
        else:  # the full pattern (bool True = attend, or additive), causality included
            bias, causal = attention_mask, False
    if kwargs.get("block_indices") is not None:  # (MiniMax-M3's block selection: a mask its own code builds)
        raise NotImplementedError("fa_exact: block_indices (block-sparse key selection) is not supported; use "
                                  "attn_implementation='eager' or 'sdpa' for this model")
    indices = kwargs.get("indices")
    if indices is not None:  # a query sees only its selected keys (within the mask)
        keep = torch.zeros(*q.shape[:2], k.shape[1], dtype=torch.bool, device=q.device)
        keep = keep.scatter(-1, indices.long(), True)[:, None]
        if bias is None or bias.dtype == torch.bool:
            bias = keep if bias is None else bias & keep
        else:  # (as eager masks: the dtype's lowest value)
            bias = bias.masked_fill(~keep, torch.finfo(bias.dtype).min)
    if position_bias is not None:  # added to the scores before the mask (its gradient flows back)
        mask = 0.0 if bias is None else torch.where(bias, 0.0, float("-inf")) if bias.dtype == torch.bool else bias
        bias = position_bias + mask
    # (A 4-D mask holds any window already.)
    window = _window(sliding_window if attention_mask is None or attention_mask.dim() == 2 else None, causal)
    if sinks is not None:
        return _with_sinks(q, k, v, sinks, bias, bool(causal), window, dropout, scaling, softcap or 0.0), None
    out = flash_attn_func(q, k, v, dropout_p=dropout, softmax_scale=scaling, causal=bool(causal), window_size=window,
                          softcap=softcap or 0.0, attn_bias=bias)
    return out, None


def _with_sinks(q, k, v, sinks, bias, causal, window, dropout, scaling, softcap):
    """Attention with a sink logit per row: softmax over [the row's scores, its sink], the sink's
    share dropped (it has no value); sinks (heads,) or (batch, heads, seqlen_q, 1). Without
    gradients, exactly the plain output scaled by the keys' share of each row, sigmoid(lse - sink).
    With them, a key is prepended whose score is the sink: the head dim gains a feature, the row's
    sink / scale in q and 1 in that key (0 in the others), and the key's value is 0 (v gains a zero
    feature too), so the kernels' own backward gives every gradient, the sinks' included (through
    q). Masks get a visible column for it; causal alignment is unchanged (the queries keep their
    distance to the last key)."""
    b, sq, h, d = q.shape
    rows = (sinks[None, :, None] if sinks.dim() == 1 else sinks.reshape(sinks.shape[0], h, -1)).expand(b, h, sq)
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, sinks, bias) if t is not None)):
        out, lse, _, _ = ops.fwd(*(last_dim_contiguous(t) for t in (q, k, v)), float(dropout), scaling, causal,
                                 window[0], window[1], False, False, attn_bias=bias, softcap=float(softcap))
        keep = torch.sigmoid(lse - rows.float()).transpose(1, 2)[..., None]  # (b, sq, h, 1)
        return (out.float() * keep).to(out.dtype)
    if softcap or window != (-1, -1):
        raise NotImplementedError("fa_exact: training with attention sinks (s_aux) takes no softcap and no "
                                  "sliding_window without a mask")
    scale = scaling if scaling is not None else d ** -0.5
    q1 = torch.cat([q, (rows.to(q.dtype) / scale).transpose(1, 2)[..., None]], dim=-1)
    sink_key = F.pad(torch.ones_like(k[:, :1, :, :1]), (d, 0))  # (b, 1, h_k, d + 1): 0, ..., 0, 1
    k1 = torch.cat([sink_key, F.pad(k, (0, 1))], dim=1)
    v1 = F.pad(v, (0, 1, 0, 0, 1, 0))  # (the kernels take one head dim for q, k and v)
    if bias is not None:  # the sink's column: visible (True, or 0 added)
        edge = torch.ones if bias.dtype == torch.bool else torch.zeros
        bias = torch.cat([edge(*bias.shape[:-1], 1, dtype=bias.dtype, device=bias.device), bias], dim=-1)
    out = flash_attn_func(q1, k1, v1, dropout_p=dropout, softmax_scale=scale, causal=causal, attn_bias=bias)
    return out[..., :d]


def _window(sliding_window: Optional[int], causal: bool):
    """transformers' sliding_window (the keys a query sees, itself included) as window_size."""
    if sliding_window is None:
        return (-1, -1)
    return (sliding_window - 1, 0 if causal else sliding_window - 1)


def _packed_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout, scaling, causal, sliding_window, softcap):
    """Sequences packed into the rows of each batch entry, as the flash kwargs describe them
    (DataCollatorWithFlattening(return_flash_attn_kwargs=True)): one varlen call, as transformers'
    own flash-attention path makes, so no tile spans two sequences. The 4-D mask transformers also
    built for them is not read: the offsets, the causal flag and sliding_window are the pattern."""
    batch, seqlen = q.shape[:2]
    window = _window(sliding_window, causal)
    out = flash_attn_varlen_func(q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]),
                                 cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k, dropout_p=dropout,
                                 softmax_scale=scaling, causal=causal, window_size=window, softcap=softcap or 0.0)
    return out.view(batch, seqlen, *out.shape[1:])


# Set by register() (imports inside traced functions would break torch.compile's graph).
_PLAIN_MASKS: tuple = ()
_sdpa_mask = None


def _mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
          mask_function=None, attention_mask: Optional[torch.Tensor] = None, **kwargs):
    if mask_function in _PLAIN_MASKS:
        # The layer's own causal flag covers the pattern; only padding remains (no .all() check,
        # so torch.compile sees no data-dependent branch).
        return None if attention_mask is None else attention_mask[:, -kv_length:].bool()
    kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)  # a mask, never None
    return _sdpa_mask(batch_size, q_length, kv_length, q_offset=q_offset, kv_offset=kv_offset,
                      mask_function=mask_function, attention_mask=attention_mask, **kwargs)


def register(name: str = NAME) -> str:
    """Register the attention and mask functions with transformers under name (which must not
    contain "flash"); returns name."""
    if "flash" in name:
        raise ValueError(f"register: transformers reserves names containing 'flash' for its own loaders, got {name!r}")
    global _PLAIN_MASKS, _sdpa_mask
    from transformers import AttentionInterface
    from transformers import masking_utils
    _PLAIN_MASKS = (masking_utils.causal_mask_function, masking_utils.bidirectional_mask_function)
    _sdpa_mask = masking_utils.sdpa_mask
    AttentionInterface.register(name, attention_forward)
    masking_utils.AttentionMaskInterface.register(name, _mask)
    return name
