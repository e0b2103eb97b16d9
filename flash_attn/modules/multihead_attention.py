"""A drop-in for torch.nn.MultiheadAttention whose attention runs on the flash_attn kernels.

`MultiheadAttention` subclasses `torch.nn.MultiheadAttention`: the constructor, the parameters,
their initialisation and the `state_dict` keys are PyTorch's, so weights load either way and
`replace_attention(model)` can swap the class of existing layers in place. Only `forward` differs:

- with `need_weights=False` (what `nn.TransformerEncoderLayer` / `DecoderLayer` pass) the
  projections feed `flash_attn_func`, with `key_padding_mask` and `attn_mask` (bool, True = not
  allowed, or float, added) as one `attn_bias`, `is_causal` as the kernel's causal flag, dropout
  in training mode, `add_bias_kv` and `add_zero_attn` as extra key columns;
- `need_weights=True` (PyTorch's default) has to build the (L, S) weights anyway, so it runs
  PyTorch's own implementation, as do dtypes the kernels do not take (on CUDA: float32 and
  float64 outside autocast; on the CPU: float64) and nested-tensor inputs.

Where every key of a query row is masked, the output row is 0 (PyTorch's gives NaN).
"""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..interface import flash_attn_func

_KERNEL_DTYPES = {
    "cuda": (torch.float16, torch.bfloat16),
    "cpu": (torch.float32, torch.float16, torch.bfloat16),
}


def _kernel_takes(x: torch.Tensor) -> bool:
    """Whether the projections of x (under autocast: in its dtype) are a dtype the kernels take."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    return not x.is_nested and dtype in _KERNEL_DTYPES.get(device, ())


def _mask_bias(key_padding_mask, attn_mask, batch: int, heads: int, tgt_len: int, src_len: int,
               dtype: torch.dtype) -> Optional[torch.Tensor]:
    """key_padding_mask (batch, S) and attn_mask ((L, S) or (batch * heads, L, S)) as one additive
    bias broadcastable to (batch, heads, L, S), in PyTorch's conversion (bool True -> -inf)."""
    bias = None
    if key_padding_mask is not None:
        if key_padding_mask.shape != (batch, src_len):
            raise AssertionError(f"expecting key_padding_mask shape of {(batch, src_len)}, but got "
                                 f"{tuple(key_padding_mask.shape)}")
        kpm = F._canonical_mask(mask=key_padding_mask, mask_name="key_padding_mask",
                                other_type=F._none_or_dtype(attn_mask), other_name="attn_mask", target_type=dtype)
        bias = kpm.view(batch, 1, 1, src_len)
    if attn_mask is not None:
        am = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
                               target_type=dtype, check_other=False)
        if am.dim() == 2:
            if am.shape != (tgt_len, src_len):
                raise RuntimeError(f"The shape of the 2D attn_mask is {tuple(am.shape)}, but should be "
                                   f"{(tgt_len, src_len)}.")
            am = am.view(1, 1, tgt_len, src_len)
        elif am.dim() == 3:
            if am.shape != (batch * heads, tgt_len, src_len):
                raise RuntimeError(f"The shape of the 3D attn_mask is {tuple(am.shape)}, but should be "
                                   f"{(batch * heads, tgt_len, src_len)}.")
            am = am.view(batch, heads, tgt_len, src_len)
        else:
            raise RuntimeError(f"attn_mask's dimension {am.dim()} is not supported")
        bias = am if bias is None else bias + am
    return bias


class MultiheadAttention(nn.MultiheadAttention):
    """torch.nn.MultiheadAttention with its attention on the flash_attn kernels (see the module
    docstring for which calls take that path). Same constructor, forward and outputs."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: Optional[torch.Tensor] = None, need_weights: bool = True,
                attn_mask: Optional[torch.Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if need_weights or not _kernel_takes(query):
            return super().forward(query, key, value, key_padding_mask=key_padding_mask, need_weights=need_weights,
                                   attn_mask=attn_mask, average_attn_weights=average_attn_weights,
                                   is_causal=is_causal)
        return self._flash_forward(query, key, value, key_padding_mask, attn_mask, is_causal), None

    def _flash_forward(self, query, key, value, key_padding_mask, attn_mask, is_causal) -> torch.Tensor:
        batched = F._mha_shape_check(query, key, value, key_padding_mask, attn_mask, self.num_heads)
        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint. You may use the Transformer module "
                               "method `generate_square_subsequent_mask` to create this mask.")
        # (batch, seqlen, features) from here on.
        if not batched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        batch, tgt_len, embed_dim = query.shape
        if embed_dim != self.embed_dim:
            raise AssertionError(f"was expecting embedding dimension of {self.embed_dim}, but got {embed_dim}")
        if key.shape[:2] != value.shape[:2]:
            raise AssertionError(f"key's sequence and batch dims {tuple(key.shape[:2])} do not match value's "
                                 f"{tuple(value.shape[:2])}")
        heads, head_dim = self.num_heads, self.head_dim

        q, k, v = self._project(query, key, value)
        # The is_causal hint stands for attn_mask, as in PyTorch, where no key padding is merged
        # into it; the kernel's causal mask is bottom-right aligned, so only for square attention.
        causal = is_causal and key_padding_mask is None and tgt_len == key.shape[1]
        bias = _mask_bias(key_padding_mask, None if causal else attn_mask, batch, heads, tgt_len, key.shape[1],
                          q.dtype)
        # Extra key columns, as PyTorch appends them: the learnt bias_k / bias_v, then zeros. Masks
        # leave them visible; PyTorch's is_causal path (SDPA's top-left causal mask over all keys)
        # hides them from square attention, so that mask becomes an explicit bias here.
        extra = []
        if self.bias_k is not None and self.bias_v is not None:
            extra.append((self.bias_k.expand(batch, 1, embed_dim), self.bias_v.expand(batch, 1, embed_dim)))
        if self.add_zero_attn:
            zeros = q.new_zeros(batch, 1, embed_dim)
            extra.append((zeros, zeros))
        for bk, bv in extra:
            k, v = torch.cat([k, bk.to(k.dtype)], dim=1), torch.cat([v, bv.to(v.dtype)], dim=1)
            if bias is not None:
                bias = F.pad(bias, (0, 1))
        if extra and causal:
            causal = False
            hidden = torch.ones(tgt_len, k.shape[1], dtype=torch.bool, device=q.device).triu(1)
            bias = torch.zeros(1, 1, tgt_len, k.shape[1], dtype=q.dtype, device=q.device).masked_fill(
                hidden, float("-inf"))

        out = flash_attn_func(q.view(batch, tgt_len, heads, head_dim), k.view(batch, -1, heads, head_dim),
                              v.view(batch, -1, heads, head_dim), dropout_p=self.dropout if self.training else 0.0,
                              causal=causal, attn_bias=bias)
        out = F.linear(out.reshape(batch, tgt_len, embed_dim), self.out_proj.weight, self.out_proj.bias)
        if not batched:
            return out.squeeze(0)
        return out if self.batch_first else out.transpose(0, 1)

    def _project(self, query, key, value):
        """q, k, v = the input projections, (batch, seqlen, embed_dim) each; one GEMM for self-attention."""
        if self._qkv_same_embed_dim:
            if query is key and key is value:
                return F.linear(query, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
            w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        else:
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        b_q, b_k, b_v = self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None, None, None)
        return F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)


def replace_attention(model: nn.Module) -> nn.Module:
    """Swap every torch.nn.MultiheadAttention in model (model itself included, and those inside
    nn.TransformerEncoderLayer / DecoderLayer) for MultiheadAttention, in place: the class
    changes, the parameters, buffers and hooks stay. Returns model.

    In inference (no grad, eval mode, batch_first) nn.TransformerEncoderLayer may still take
    PyTorch's fused fast path, which reads the weights directly and does not call the layer."""
    for module in model.modules():
        if type(module) is nn.MultiheadAttention:
            module.__class__ = MultiheadAttention
    return model
