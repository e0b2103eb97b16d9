"""flash-attn 2.x's module path for its functions (code written as `from
flash_attn.flash_attn_interface import flash_attn_func` runs unchanged): the same objects as the
package's own (flash_attn.interface, flash_attn.kvcache).

It also has flash-attn 2.7's private forward and backward entry points, which ring / context-
parallel attention libraries call on one block of keys at a time: `_flash_attn_forward` returns
the block's output and logsumexp, and `_flash_attn_backward` takes the merged output and
logsumexp of every block and writes this block's share of the gradients into dq, dk, dv.
"""

from typing import Optional

import torch

from . import ops
from .interface import (flash_attn_blocksparse_func, flash_attn_blocksparse_qkvpacked_func, flash_attn_func,
                        flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_func,
                        flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func, last_dim_contiguous,
                        max_length)
from .kvcache import flash_attn_with_kvcache, varlen_paged_forward

__all__ = ["flash_attn_blocksparse_func", "flash_attn_blocksparse_qkvpacked_func", "flash_attn_func",
           "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]


def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left=-1, window_size_right=-1,
                        softcap=0.0, alibi_slopes=None, return_softmax=False, **varlen):
    """flash-attn 2.7's: (out, softmax_lse, S_dmask, rng_state), no autograd graph."""
    q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
    with torch.no_grad():
        return ops.fwd(q, k, v, float(dropout_p), softmax_scale, bool(causal), int(window_size_left),
                       int(window_size_right), bool(return_softmax), False, alibi_slopes=alibi_slopes,
                       softcap=float(softcap), **varlen)


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                         window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
                         deterministic=False, rng_state=None, **varlen):
    """flash-attn 2.7's: the gradients into dq, dk, dv (each may be None); returns softmax_d, the
    rows' sum of dout * out (batch, nheads, seqlen_q), float32 ((nheads, total_q) for varlen)."""
    dout, q, k, v, out = (last_dim_contiguous(x) for x in (dout, q, k, v, out))
    with torch.no_grad():
        grads = ops.bwd(dout, q, k, v, out, softmax_lse, float(dropout_p), softmax_scale, bool(causal),
                        int(window_size_left), int(window_size_right), bool(deterministic), rng_state,
                        alibi_slopes=alibi_slopes, softcap=float(softcap), **varlen)
        for dst, g in zip((dq, dk, dv), grads):
            if dst is not None:
                dst.copy_(g)
        softmax_d = (dout.float() * out.float()).sum(-1)
    return softmax_d.transpose(0, 1) if varlen else softmax_d.transpose(1, 2)


def _varlen_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> dict:
    return dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_length(max_seqlen_q),
                max_seqlen_k=max_length(max_seqlen_k))


def _used_keys(k, v, cu_seqlens_k, leftpad_k, seqused_k, paged: bool):
    """flash-attn 2.7's leftpad_k / seqused_k (int32, (batch,)): sequence i's keys are its rows
    [leftpad_k[i], seqused_k[i]) (default 0 and all of them). Returns k, v and cu_seqlens_k of
    those keys alone: the packed operands gathered (a copy), or a paged cache's new counts."""
    if leftpad_k is None and seqused_k is None:
        return k, v, cu_seqlens_k
    if paged and leftpad_k is not None:
        raise NotImplementedError("flash_attn: _flash_attn_varlen_forward with block_table takes no leftpad_k "
                                  "(flash-attn 2.x refuses the pair too); pass None")
    batch = cu_seqlens_k.numel() - 1
    rows = cu_seqlens_k.diff().long()
    for name, t in (("leftpad_k", leftpad_k), ("seqused_k", seqused_k)):
        if t is not None and (t.dtype != torch.int32 or t.shape != (batch,) or t.device != cu_seqlens_k.device):
            raise ValueError(f"flash_attn: {name} must be an int32 tensor of shape ({batch},) on "
                             f"{cu_seqlens_k.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
    first = leftpad_k.long() if leftpad_k is not None else torch.zeros_like(rows)
    end = seqused_k.long() if seqused_k is not None else rows
    bad = (first < 0) | (first > end)
    if not paged:  # (a paged sequence's keys are bounded by its pages, which the op checks)
        bad |= end > rows
    if bool(bad.any()):
        raise ValueError(f"flash_attn: need 0 <= leftpad_k <= seqused_k <= each sequence's keys "
                         f"(cu_seqlens_k's differences {rows.tolist()}); got leftpad_k "
                         f"{None if leftpad_k is None else leftpad_k.tolist()}, seqused_k "
                         f"{None if seqused_k is None else seqused_k.tolist()}")
    count = end - first
    cu = torch.zeros(batch + 1, dtype=torch.int32, device=count.device)
    cu[1:] = count.cumsum(0)
    if paged:  # a sequence's keys are read from its pages' first rows on
        return k, v, cu
    shift = (cu_seqlens_k[:-1].long() + first - cu[:-1].long()).repeat_interleave(count)
    idx = shift + torch.arange(shift.numel(), device=shift.device)  # packed key j of sequence i: its row
    return k.index_select(0, idx), v.index_select(0, idx), cu


def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                               softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                               alibi_slopes=None, return_softmax=False, block_table: Optional[torch.Tensor] = None,
                               leftpad_k=None, seqused_k=None, zero_tensors=False):
    """flash-attn 2.7's varlen forward: (out, softmax_lse (nheads, total_q), S_dmask, rng_state).
    With block_table, k and v are a paged cache (num_blocks, page_block_size, nheads_k, headdim),
    as flash_attn_varlen_func takes them (inference only: no dropout, no probabilities)."""
    k, v, cu_seqlens_k = _used_keys(k, v, cu_seqlens_k, leftpad_k, seqused_k, block_table is not None)
    varlen = _varlen_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if block_table is None:
        return _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                                   softcap, alibi_slopes, return_softmax, **varlen)
    if return_softmax:
        raise NotImplementedError("flash_attn: _flash_attn_varlen_forward with block_table (a paged KV cache) "
                                  "returns no attention probabilities; pass return_softmax=False")
    with torch.no_grad():
        out, lse, _ = varlen_paged_forward(q, k, v, *varlen.values(), block_table, dropout_p, softmax_scale, causal,
                                           (window_size_left, window_size_right), softcap, alibi_slopes, True)
    return out, lse, None, torch.zeros(2, dtype=torch.int64, device=q.device)


def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left=-1,
                                window_size_right=-1, softcap=0.0, alibi_slopes=None, deterministic=False,
                                rng_state=None, zero_tensors=False):
    """flash-attn 2.7's varlen backward (see _flash_attn_backward)."""
    return _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                                window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state,
                                **_varlen_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
