"""flash-attn 2.x's attention layers (flash_attn.modules.mha): FlashSelfAttention and
FlashCrossAttention over packed qkv / kv, and MHA, a multi-head attention block with a fused QKV
projection, rotary embeddings, GQA/MQA, cross-attention, ALiBi, sliding windows and a causal flag.
Same names, constructor arguments, parameter names and layouts, so code written for flash-attn
runs unchanged; the options that only select another implementation there are accepted."""

import math
from typing import List

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..interface import (flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_kvpacked_func,
                         flash_attn_varlen_qkvpacked_func)
from ..kvcache import flash_attn_with_kvcache
from ..layers.rotary import RotaryEmbedding


def get_alibi_slopes(nheads: int) -> List[float]:
    """ALiBi's per-head slopes: a geometric sequence from 2^(-8 / n) for the nearest power of two
    n <= nheads, the remaining heads taking every other slope of the sequence for 2 n."""
    def power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start ** i for i in range(n)]
    if math.log2(nheads).is_integer():
        return power_of_2(nheads)
    closest = 2 ** math.floor(math.log2(nheads))
    return power_of_2(closest) + get_alibi_slopes(2 * closest)[0::2][: nheads - closest]


class FlashSelfAttention(nn.Module):
    """softmax(Q K^T * softmax_scale) V over a packed qkv: (batch, seqlen, 3, nheads, headdim), or
    (total, 3, nheads, headdim) with cu_seqlens / max_seqlen. attention_dropout applies in
    training mode only."""

    def __init__(self, causal=False, softmax_scale=None, attention_dropout=0.0, window_size=(-1, -1),
                 alibi_slopes=None, deterministic=False):
        super().__init__()
        self.causal, self.softmax_scale, self.drop = causal, softmax_scale, nn.Dropout(attention_dropout)
        self.window_size, self.deterministic = window_size, deterministic
        self.register_buffer("alibi_slopes", alibi_slopes, persistent=False)

    def _kwargs(self, causal):
        slopes = None if self.alibi_slopes is None else self.alibi_slopes.float()  # kept float32 under .to(dtype)
        return dict(dropout_p=self.drop.p if self.training else 0.0, softmax_scale=self.softmax_scale,
                    causal=self.causal if causal is None else causal, window_size=self.window_size,
                    alibi_slopes=slopes, deterministic=self.deterministic)

    def forward(self, qkv, causal=None, cu_seqlens=None, max_seqlen=None):
        """Returns (batch, seqlen, nheads, headdim), or (total, nheads, headdim)."""
        if cu_seqlens is not None:
            if max_seqlen is None:
                raise ValueError("FlashSelfAttention: cu_seqlens needs max_seqlen")
            return flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, **self._kwargs(causal))
        return flash_attn_qkvpacked_func(qkv, **self._kwargs(causal))


class FlashCrossAttention(FlashSelfAttention):
    """Attention of q (batch, seqlen_q, nheads, headdim) over a packed kv (batch, seqlen_k, 2,
    nheads_k, headdim), nheads a multiple of nheads_k; or packed sequences with cu_seqlens /
    max_seqlen (queries) and cu_seqlens_k / max_seqlen_k."""

    def forward(self, q, kv, causal=None, cu_seqlens=None, max_seqlen=None, cu_seqlens_k=None, max_seqlen_k=None):
        if cu_seqlens is not None:
            if None in (max_seqlen, cu_seqlens_k, max_seqlen_k):
                raise ValueError("FlashCrossAttention: cu_seqlens needs max_seqlen, cu_seqlens_k and max_seqlen_k")
            return flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens, cu_seqlens_k, max_seqlen, max_seqlen_k,
                                                   **self._kwargs(causal))
        return flash_attn_kvpacked_func(q, kv, **self._kwargs(causal))


def causal_dwconv(conv: nn.Conv1d, t: torch.Tensor) -> torch.Tensor:
    """conv (depthwise, 3 taps, padding 2) over the sequence of t (batch, seqlen, channels),
    keeping the outputs that see only the current and earlier tokens."""
    return conv(t.transpose(1, 2))[..., :-2].transpose(1, 2)


class MHA(nn.Module):
    """Multi-head attention block: Wqkv (or Wq and Wkv with cross_attn), rotary embeddings on the
    first rotary_emb_dim features of q and k, attention on the flash_attn kernels, out_proj.

    x: (batch, seqlen, embed_dim), or (total, embed_dim) with cu_seqlens / max_seqlen (packed
    sequences). num_heads_kv < num_heads: GQA / MQA. key_padding_mask: (batch, seqlen) bool, True
    = a real token (padding keys are masked; padded query rows come out as out_proj's bias).
    use_alibi adds ALiBi with the standard slopes.

    inference_params (flash_attn.utils.generation.InferenceParams): incremental decoding. The new
    tokens' keys and values are appended to this layer's cache (key_value_memory_dict[layer_idx],
    allocated on first use; allocate_inference_cache makes one) at seqlen_offset, or
    lengths_per_sample per sequence, rotary embeddings applied at those positions, and the queries
    attend to everything cached (flash_attn_with_kvcache). A prompt is the same call at offset 0.

    mixer_subset (cross_attn only): the queries are x[:, mixer_subset] (e.g. a ViT's class token in
    its last layer), the keys all of x_kv (default x).

    dwconv (self-attention, padded batches, no decoding, as in flash-attn): the projected q, k and
    v go through a causal depthwise convolution over the sequence (3 taps: each token mixes in its
    two predecessors; parameters dwconv_qkv, or dwconv_q and dwconv_kv under GQA / MQA).
    fused_bias_fc and use_flash_attn only select implementations in flash-attn and change nothing
    here.
    """

    def __init__(self, embed_dim, num_heads, num_heads_kv=None, cross_attn=False, qkv_proj_bias=True,
                 out_proj_bias=True, dropout=0.0, softmax_scale=None, causal=False, layer_idx=None, dwconv=False,
                 rotary_emb_dim=0, rotary_emb_base=10000.0, rotary_emb_scale_base=None, rotary_emb_interleaved=False,
                 use_alibi=False, window_size=(-1, -1), fused_bias_fc=False, use_flash_attn=True,
                 return_residual=False, checkpointing=False, device=None, dtype=None):
        super().__init__()
        factory = dict(device=device, dtype=dtype)
        self.embed_dim, self.num_heads, self.cross_attn, self.causal = embed_dim, num_heads, cross_attn, causal
        self.num_heads_kv = num_heads if num_heads_kv is None else num_heads_kv
        self.layer_idx, self.return_residual, self.checkpointing = layer_idx, return_residual, checkpointing
        if embed_dim % num_heads != 0:
            raise ValueError(f"MHA: embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if num_heads % self.num_heads_kv != 0:
            raise ValueError(f"MHA: num_heads ({num_heads}) must be a multiple of num_heads_kv ({self.num_heads_kv})")
        if dwconv and cross_attn:
            raise NotImplementedError("MHA: dwconv is for self-attention (cross_attn=False)")
        self.head_dim = embed_dim // num_heads
        qkv_dim = self.head_dim * (num_heads + 2 * self.num_heads_kv)
        kv_dim = 2 * self.head_dim * self.num_heads_kv
        self.dwconv = dwconv
        if dwconv:  # (padding 2 and the last 2 outputs dropped: causal)
            conv = lambda c: nn.Conv1d(c, c, kernel_size=3, padding=2, groups=c, **factory)
            if self.num_heads_kv == num_heads:
                self.dwconv_qkv = conv(qkv_dim)
            else:
                self.dwconv_q, self.dwconv_kv = conv(embed_dim), conv(kv_dim)
        self.rotary_emb_dim = rotary_emb_dim
        if rotary_emb_dim > 0:
            self.rotary_emb = RotaryEmbedding(rotary_emb_dim, base=rotary_emb_base, interleaved=rotary_emb_interleaved,
                                              scale_base=rotary_emb_scale_base, device=device)
        alibi = torch.tensor(get_alibi_slopes(num_heads), device=device, dtype=torch.float32) if use_alibi else None
        if cross_attn:
            self.Wq = nn.Linear(embed_dim, embed_dim, bias=qkv_proj_bias, **factory)
            self.Wkv = nn.Linear(embed_dim, kv_dim, bias=qkv_proj_bias, **factory)
        else:
            self.Wqkv = nn.Linear(embed_dim, qkv_dim, bias=qkv_proj_bias, **factory)
        self.inner_attn = FlashSelfAttention(causal=causal, softmax_scale=softmax_scale, attention_dropout=dropout,
                                             window_size=window_size, alibi_slopes=alibi)
        self.inner_cross_attn = FlashCrossAttention(causal=causal, softmax_scale=softmax_scale,
                                                    attention_dropout=dropout, window_size=window_size,
                                                    alibi_slopes=alibi)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=out_proj_bias, **factory)

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None):
        """An empty KV cache for this layer: (batch_size, max_seqlen, 2, num_heads_kv, head_dim)."""
        w = self.Wkv.weight if self.cross_attn else self.Wqkv.weight
        return torch.empty(batch_size, max_seqlen, 2, self.num_heads_kv, self.head_dim, dtype=dtype or w.dtype,
                           device=w.device)

    def _decode(self, q, kv, inference_params):
        """q (batch, seqlen, h, d) over this layer's cache after kv (batch, seqlen, 2, h_k, d) is
        appended to it at the current offsets."""
        if self.layer_idx is None:
            raise ValueError("MHA: inference_params needs the layer's layer_idx (its cache's key)")
        caches = inference_params.key_value_memory_dict
        if self.layer_idx not in caches:
            caches[self.layer_idx] = self.allocate_inference_cache(inference_params.max_batch_size,
                                                                   inference_params.max_seqlen, kv.dtype)
        start = inference_params.batch_size_offset
        cache = caches[self.layer_idx][start:start + q.shape[0]]
        if cache.dtype != q.dtype:
            raise ValueError(f"MHA: the layer's KV cache is {cache.dtype} and its keys {q.dtype}; allocate the cache "
                             "in the dtype the layer computes in")
        lengths = inference_params.lengths_per_sample
        offset = lengths if lengths is not None else inference_params.seqlen_offset
        kw = self.inner_attn._kwargs(None)  # (no dropout or backward when decoding)
        del kw["dropout_p"], kw["deterministic"]
        return flash_attn_with_kvcache(q, cache[:, :, 0], cache[:, :, 1], kv[:, :, 0], kv[:, :, 1],
                                       cache_seqlens=offset, **kw)

    def _attend(self, fn, *args, **kwargs):
        if self.checkpointing and self.training:
            return checkpoint(fn, *args, use_reentrant=False, **kwargs)
        return fn(*args, **kwargs)

    def forward(self, x, x_kv=None, key_padding_mask=None, cu_seqlens=None, max_seqlen=None, mixer_subset=None,
                inference_params=None, **kwargs):
        if mixer_subset is not None and not self.cross_attn:
            raise ValueError("MHA: mixer_subset (a subset of the queries) is for cross_attn=True")
        if inference_params is not None:
            if cu_seqlens is not None or key_padding_mask is not None:
                raise ValueError("MHA: inference_params excludes cu_seqlens and key_padding_mask (sequences of "
                                 "different lengths: lengths_per_sample)")
            if self.dwconv:
                raise NotImplementedError("MHA: dwconv does not decode with inference_params (no convolution "
                                          "state is kept)")
            return self._forward_decoding(x, x_kv, inference_params)
        if cu_seqlens is not None and (max_seqlen is None or key_padding_mask is not None):
            raise ValueError("MHA: cu_seqlens needs max_seqlen and excludes key_padding_mask")
        if self.dwconv and (cu_seqlens is not None or x.dim() != 3):
            raise ValueError(f"MHA: dwconv takes x as (batch, seqlen, embed_dim), not packed sequences, got shape "
                             f"{tuple(x.shape)}{' with cu_seqlens' if cu_seqlens is not None else ''}")
        if x_kv is not None and not self.cross_attn:
            raise ValueError("MHA: x_kv is for cross_attn=True")
        packed = cu_seqlens is not None
        h, hk, d = self.num_heads, self.num_heads_kv, self.head_dim
        varlen = dict(cu_seqlens=cu_seqlens, max_seqlen=max_seqlen) if packed else {}
        if self.cross_attn:
            if packed:
                raise NotImplementedError("MHA: cross_attn with cu_seqlens is not supported")
            q, kv = self._project(x, x_kv, mixer_subset)
            if self.rotary_emb_dim > 0:  # (as flash-attn: queries and keys each from position 0)
                q, kv = self.rotary_emb(q, kv)
            out = self._attend(self._cross, q, kv, key_padding_mask)
        else:
            if h == hk:
                qkv = self.Wqkv(x)
                if self.dwconv:
                    qkv = causal_dwconv(self.dwconv_qkv, qkv)
                qkv = qkv.unflatten(-1, (3, h, d))
                if self.rotary_emb_dim > 0:
                    qkv = self.rotary_emb(qkv, **varlen)
                if key_padding_mask is not None:
                    out = self._attend(self._cross, qkv.select(-3, 0), qkv[..., 1:, :, :], key_padding_mask)
                else:
                    out = self._attend(self.inner_attn, qkv, **varlen)
            else:
                q, kv = self._project(x)
                if self.rotary_emb_dim > 0:
                    q, kv = self.rotary_emb(q, kv, **varlen)
                if packed:
                    out = self._attend(self.inner_cross_attn, q, kv, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                                       cu_seqlens_k=cu_seqlens, max_seqlen_k=max_seqlen)
                else:
                    out = self._attend(self._cross, q, kv, key_padding_mask)
        out = self.out_proj(out.flatten(-2))  # (batch, seqlen_q, embed_dim) or (total, embed_dim)
        return (out, x) if self.return_residual else out

    def _project(self, x, x_kv=None, mixer_subset=None):
        """q (..., h, d) and kv (..., 2, h_k, d): of x through Wqkv, or with cross_attn of x (its
        mixer_subset rows) through Wq and of x_kv (default x) through Wkv."""
        h, hk, d = self.num_heads, self.num_heads_kv, self.head_dim
        if self.cross_attn:
            x_q = x if mixer_subset is None else x[:, mixer_subset]
            return self.Wq(x_q).unflatten(-1, (h, d)), self.Wkv(x if x_kv is None else x_kv).unflatten(-1, (2, hk, d))
        qkv = self.Wqkv(x)
        q, kv = qkv[..., : h * d], qkv[..., h * d:]
        if self.dwconv:
            q, kv = causal_dwconv(self.dwconv_q, q), causal_dwconv(self.dwconv_kv, kv)
        return q.unflatten(-1, (h, d)), kv.unflatten(-1, (2, hk, d))

    def _forward_decoding(self, x, x_kv, inference_params):
        if x_kv is not None and not self.cross_attn:
            raise ValueError("MHA: x_kv is for cross_attn=True")
        q, kv = self._project(x, x_kv)
        if self.rotary_emb_dim > 0:
            lengths, most = inference_params.lengths_per_sample, inference_params.max_seqlen
            # (Clamped into the tables: positions past them only where the cache has no room, which
            # flash_attn_with_kvcache then refuses.)
            offset = (lengths.clamp(max=max(most - x.shape[1], 0)) if lengths is not None
                      else inference_params.seqlen_offset)
            q, kv = self.rotary_emb(q, kv, seqlen_offset=offset, max_seqlen=most)
        out = self.out_proj(self._decode(q, kv, inference_params).reshape(*x.shape[:-1], self.embed_dim))
        return (out, x) if self.return_residual else out

    def _cross(self, q, kv, key_padding_mask):
        """inner_cross_attn with padding keys masked through a bool attention bias (True = attend)."""
        if key_padding_mask is None:
            return self.inner_cross_attn(q, kv)
        if key_padding_mask.shape != kv.shape[:2]:
            raise ValueError(f"MHA: key_padding_mask must be (batch, seqlen_k) = {tuple(kv.shape[:2])}, got "
                             f"{tuple(key_padding_mask.shape)}")
        return flash_attn_kvpacked_func(q, kv, attn_bias=key_padding_mask.bool()[:, None, None, :],
                                        **self.inner_cross_attn._kwargs(None))
