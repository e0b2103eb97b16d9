"""flash_attn_with_kvcache: attention of new queries over a key/value cache (incremental decoding),
with flash-attn 2.x's name, arguments, layouts and return values."""

from typing import Optional, Union

import torch

from . import ops  # noqa: F401  (registers the ops and their fake kernels)
from .interface import _window, last_dim_contiguous, max_length
from .layers.rotary import apply_rotary_emb


def _per_batch(x, batch: int, device) -> torch.Tensor:
    return torch.full((batch,), x, dtype=torch.int32, device=device) if isinstance(x, int) else x


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens: Optional[Union[int, torch.Tensor]] = None,
                            cache_batch_idx: Optional[torch.Tensor] = None,
                            cache_leftpad: Optional[torch.Tensor] = None, block_table: Optional[torch.Tensor] = None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """Attention of q over a KV cache, after appending k and v to it in place (decoding a step).

    q: (batch, seqlen_q, nheads, headdim); k_cache, v_cache: (batch_cache, seqlen_cache, nheads_k,
    headdim), nheads a multiple of nheads_k. Batch entry i attends to cache rows
    [cache_leftpad[i], cache_seqlens[i] + seqlen_new) of cache entry cache_batch_idx[i] (default i;
    with batch_cache == batch when not given).
    k, v (optional, together): (batch, seqlen_new, nheads_k, headdim), written into the cache at
    rows cache_seqlens[i] .. cache_seqlens[i] + seqlen_new - 1 before the attention; the cache must
    have room (checked on the host, with the varlen offsets' policy: a device sync, skipped while a
    CUDA graph is captured or with FLASH_ATTN_SKIP_VARLEN_CHECKS=1). With duplicate
    cache_batch_idx entries any one of them may win.
    rotary_cos, rotary_sin (optional, with k): (seqlen_ro >= seqlen_cache, rotary_dim / 2). The new
    keys are rotated at their cache positions; q at positions cache_seqlens[i] + j when causal or
    windowed, else all at cache_seqlens[i]. rotary_interleaved: GPT-J pairs (0, 1), (2, 3), ...;
    False: GPT-NeoX halves.
    cache_seqlens: int or (batch,) int32, the keys already in each entry (required with k; None:
    every entry is full). cache_leftpad: (batch,) int32, the first cache row of each entry.
    block_table (optional): (batch, max_num_blocks_per_seq) int32, a paged cache. k_cache and
    v_cache are then (num_blocks, page_block_size, nheads_k, headdim) with page_block_size a
    multiple of 256, and row r of batch entry i is row r % page_block_size of page
    block_table[i, r // page_block_size]; the pages that hold an entry's keys (and the new ones)
    must be pages of the cache (checked with cache_seqlens). Not with cache_batch_idx or
    cache_leftpad. Pages may be shared between entries for reading; two entries appending to the
    same page rows race.
    causal, window_size, softcap, alibi_slopes, softmax_scale: as in flash_attn_func, bottom-right
    aligned to each entry's keys (a row that sees no key gets output 0).
    num_splits: on CUDA, how many CTAs share each query block's keys (split-KV, then a combine
    kernel): 0 picks enough to fill the GPU when batch x heads x query blocks would not, 1 never
    splits, n asks for n. One decoding query per head under GQA (seqlen_q 1, no window or ALiBi)
    runs as nheads / nheads_k query rows of each key head, so the cache is read once per key head.

    Returns out (batch, seqlen_q, nheads, headdim); with return_softmax_lse=True also softmax_lse
    (batch, nheads, seqlen_q), float32. Forward only, like flash-attn 2.x's: the result carries no
    gradient.
    """
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("flash_attn_with_kvcache: rotary_cos and rotary_sin must be given together")
    left, right = _window(window_size)
    q, k, v = (last_dim_contiguous(x) for x in (q, k, v))  # not the caches: the append writes into them
    batch = q.shape[0]
    cache_seqlens = _per_batch(cache_seqlens, batch, q.device)
    if rotary_cos is not None:
        if k is None:
            raise ValueError("flash_attn_with_kvcache: rotary_cos / rotary_sin rotate the new keys: pass k and v too")
        rows = k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)
        if rotary_cos.shape[0] < rows:
            raise ValueError(f"flash_attn_with_kvcache: rotary_cos covers {rotary_cos.shape[0]} positions, fewer "
                             f"than the cache's {rows} rows")
        if cache_seqlens is None:
            raise ValueError("flash_attn_with_kvcache: k and v are appended at cache_seqlens, which must then be "
                             "given, got None")
        # (Positions past the table only where the op will refuse the call for want of room.)
        start = cache_seqlens.clamp(max=max(rotary_cos.shape[0] - k.shape[1], 0))
        k = apply_rotary_emb(k, rotary_cos, rotary_sin, rotary_interleaved, seqlen_offsets=start)
        if causal or (left, right) != (-1, -1):
            q = apply_rotary_emb(q, rotary_cos, rotary_sin, rotary_interleaved,
                                 seqlen_offsets=cache_seqlens.clamp(max=max(rotary_cos.shape[0] - q.shape[1], 0)))
        else:  # every query at position cache_seqlens: one "position" of seqlen_q x nheads heads
            sq, h = q.shape[1], q.shape[2]
            q = apply_rotary_emb(q.reshape(batch, 1, sq * h, q.shape[3]), rotary_cos, rotary_sin,
                                 rotary_interleaved, seqlen_offsets=start).view(q.shape)
    with torch.no_grad():
        out, lse = ops.fwd_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad,
                                   block_table, softmax_scale, bool(causal), left, right, alibi_slopes, float(softcap),
                                   int(num_splits))
    return (out, lse) if return_softmax_lse else out


def varlen_paged_forward(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
                         dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                         alibi_slopes=None, return_attn_probs=False):
    """flash_attn_varlen_func with block_table (see there): packed queries over a paged cache."""
    if dropout_p != 0.0:
        raise NotImplementedError(f"flash_attn_varlen_func: with block_table (a paged KV cache) the call is "
                                  f"inference only: dropout_p must be 0, got {dropout_p}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_cache, v_cache)):
        raise NotImplementedError("flash_attn_varlen_func: with block_table (a paged KV cache) there is no gradient; "
                                  "call it under torch.no_grad() or pass tensors that do not require grad")
    left, right = _window(window_size)
    q = last_dim_contiguous(q)
    out, lse = ops.fwd_varlen_paged(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_length(max_seqlen_q),
                                    max_length(max_seqlen_k), block_table, softmax_scale, bool(causal), left, right,
                                    alibi_slopes, float(softcap))
    return (out, lse, None) if return_attn_probs else out
