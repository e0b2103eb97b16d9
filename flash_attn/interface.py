"""The functional API, with flash-attn 2.x's names, arguments, layouts and return values.

Tensors are (batch, seqlen, nheads, headdim), or for the varlen functions (total, nheads, headdim)
with the sequences packed along the first dim. Validation happens in the C++ op layer, which every
caller (Python, C++, torch.compile) goes through; this module only normalises arguments.
"""

from typing import Tuple

import torch

from . import ops
from .block_sparse import BlockSparseMask


def _window(window_size: Tuple[int, int]) -> Tuple[int, int]:
    if len(window_size) != 2:
        raise ValueError(f"flash_attn: window_size must be a pair (left, right), got {window_size!r}")
    return int(window_size[0]), int(window_size[1])


def last_dim_contiguous(x):
    """x with a unit stride in its last dim (the kernels' only layout rule), copied only when it
    has not. flash-attn 2.x makes the same copy, so a transposed or strided head dim works there."""
    return x if x is None or x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def _block_mask_tensors(block_mask, q, k) -> tuple:
    if block_mask is None:
        return ()
    if isinstance(block_mask, torch.Tensor):  # a layout at the kernels' granularity, built on the fly
        block_mask = BlockSparseMask.from_layout(block_mask, q.shape[1], k.shape[1])
    if not isinstance(block_mask, BlockSparseMask):
        raise TypeError(f"flash_attn: block_mask must be a BlockSparseMask or a bool layout tensor, got "
                        f"{type(block_mask).__name__}")
    if (block_mask.seqlen_q, block_mask.seqlen_k) != (q.shape[1], k.shape[1]):
        raise ValueError(f"flash_attn: block_mask was built for seqlen_q={block_mask.seqlen_q}, "
                         f"seqlen_k={block_mask.seqlen_k}, got q and k with seqlen {q.shape[1]} and {k.shape[1]}")
    b, h = block_mask.layout.shape[:2]
    if block_mask.full and block_mask.device == q.device and b in (1, q.shape[0]) and h in (1, q.shape[2]):
        # Every tile kept: the dense kernels give the same result bit for bit, without the sparse
        # instantiations' list walk and its registers.
        return ()
    return block_mask.layout, block_mask.q_lists, block_mask.k_lists


def _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
               deterministic, return_attn_probs, block_mask=None, varlen=None, attn_bias=None):
    left, right = _window(window_size)
    q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
    out, softmax_lse, s_dmask, _ = ops.fwd(q, k, v, float(dropout_p), softmax_scale, bool(causal), left, right,
                                           bool(return_attn_probs), bool(deterministic),
                                           *_block_mask_tensors(block_mask, q, k), **(varlen or {}),
                                           attn_bias=attn_bias, alibi_slopes=alibi_slopes, softcap=float(softcap))
    return (out, softmax_lse, s_dmask) if return_attn_probs else out


def max_length(n):
    """A max_seqlen as the ops take it: an int, or under torch.compile a symbolic one left so (the
    ops' schema says SymInt), so that a new longest sequence does not recompile the graph."""
    return n if isinstance(n, torch.SymInt) else int(n)


def _varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> dict:
    return dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_length(max_seqlen_q),
                max_seqlen_k=max_length(max_seqlen_k))


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, attn_bias=None):
    """Exact attention softmax(q k^T * softmax_scale) v.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim) with nheads a
    multiple of nheads_k (MQA/GQA). causal masks bottom-right aligned (query i sees keys
    j <= i + seqlen_k - seqlen_q); window_size=(left, right) limits that to a band, -1 = unbounded.

    Score terms (flash-attn 2.x's order): the scaled score x becomes softcap * tanh(x / softcap)
    when softcap > 0; then alibi_slopes (float32, (nheads,) or (batch, nheads)) subtracts
    slope * |i + seqlen_k - seqlen_q - j|; then attn_bias (not in flash-attn 2.x; SDPA's attn_mask)
    is added: a tensor broadcastable to (batch, nheads, seqlen_q, seqlen_k), float (added; its
    gradient is computed when it requires grad) or bool (True = attend). A row that can attend to
    nothing gets output 0 and softmax_lse -inf.

    Returns out (batch, seqlen_q, nheads, headdim); with return_attn_probs=True also softmax_lse
    (batch, nheads, seqlen_q), float32, natural log, -inf for rows that see no key) and S_dmask
    (batch, nheads, seqlen_q, seqlen_k): the exact probabilities before dropout, negated where
    dropout dropped the entry. S_dmask is for testing small sizes.
    """
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                      deterministic, return_attn_probs, attn_bias=attn_bias)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                              attn_bias=None):
    """flash_attn_func on qkv of shape (batch, seqlen, 3, nheads, headdim)."""
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"flash_attn: qkv must have shape (batch, seqlen, 3, nheads, headdim), got {tuple(qkv.shape)}")
    return _attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
                      softcap, alibi_slopes, deterministic, return_attn_probs, attn_bias=attn_bias)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                             attn_bias=None):
    """flash_attn_func on q (batch, seqlen_q, nheads, headdim) and kv (batch, seqlen_k, 2, nheads_k, headdim)."""
    if kv.dim() != 5 or kv.shape[2] != 2:
        raise ValueError(f"flash_attn: kv must have shape (batch, seqlen_k, 2, nheads_k, headdim), got {tuple(kv.shape)}")
    return _attention(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, return_attn_probs, attn_bias=attn_bias)


def flash_attn_blocksparse_func(q, k, v, block_mask, dropout_p=0.0, softmax_scale=None, causal=False,
                                window_size=(-1, -1), deterministic=False, return_attn_probs=False, softcap=0.0,
                                alibi_slopes=None, attn_bias=None):
    """Block-sparse attention: flash_attn_func computed only on the (query block, key block) tiles
    that block_mask keeps; every other tile is skipped, forward and backward.

    block_mask: a BlockSparseMask (build it once with BlockSparseMask.from_layout and reuse it across
    layers and steps; it must be on q's device) or a bool layout of shape ([batch or 1,] [nheads or
    1,] ceil(seqlen_q / 128), ceil(seqlen_k / 128)). The result equals dense attention with the
    element-wise mask that expands each kept block (and causal / window_size on top); a query row
    with no kept key gets output 0 and softmax_lse -inf. Other arguments and the return values are
    flash_attn_func's (softcap, alibi_slopes and attn_bias too).
    """
    if block_mask is None:
        raise TypeError("flash_attn: block_mask is required (use flash_attn_func for dense attention)")
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                      return_attn_probs, block_mask, attn_bias=attn_bias)


def flash_attn_blocksparse_qkvpacked_func(qkv, block_mask, dropout_p=0.0, softmax_scale=None, causal=False,
                                          window_size=(-1, -1), deterministic=False, return_attn_probs=False):
    """flash_attn_blocksparse_func on qkv of shape (batch, seqlen, 3, nheads, headdim)."""
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"flash_attn: qkv must have shape (batch, seqlen, 3, nheads, headdim), got {tuple(qkv.shape)}")
    return flash_attn_blocksparse_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], block_mask, dropout_p,
                                       softmax_scale, causal, window_size, deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """flash_attn_func on a batch of sequences of different lengths, packed without padding.

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim). Sequence i is rows
    cu_seqlens_q[i]:cu_seqlens_q[i + 1] of q and cu_seqlens_k[i]:cu_seqlens_k[i + 1] of k and v
    (int32 offsets of length batch + 1, starting at 0 and ending at total_q / total_k); sequences
    of length 0 are fine. max_seqlen_q / max_seqlen_k: Python ints at least the longest lengths
    (flash_attn.bert_padding.unpad_input returns them). causal and window_size apply within each
    sequence, bottom-right aligned as in flash_attn_func.

    Returns out (total_q, nheads, headdim); with return_attn_probs=True also softmax_lse (nheads,
    total_q) and S_dmask (batch, nheads, max_seqlen_q, max_seqlen_k), zero past each sequence.
    Checking the offsets reads them on the host (a device sync in the forward; skipped while a
    CUDA graph is being captured and when FLASH_ATTN_SKIP_VARLEN_CHECKS=1).

    block_table (batch, max_num_blocks_per_seq) int32: k and v are a paged KV cache (num_blocks,
    page_block_size, nheads_k, headdim), page_block_size a multiple of 256, and sequence i's keys
    are the first cu_seqlens_k[i + 1] - cu_seqlens_k[i] rows of the pages block_table[i] lists
    (flash_attn_with_kvcache's layout). Forward only: no dropout, no gradient (a clear error where
    one is asked for); return_attn_probs gives (out, softmax_lse, None).
    """
    if block_table is not None:
        from .kvcache import varlen_paged_forward
        return varlen_paged_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
                                    dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                    return_attn_probs)
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                      return_attn_probs, varlen=_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """flash_attn_varlen_func on qkv of shape (total, 3, nheads, headdim), one set of offsets."""
    if qkv.dim() != 4 or qkv.shape[1] != 3:
        raise ValueError(f"flash_attn: qkv must have shape (total, 3, nheads, headdim), got {tuple(qkv.shape)}")
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_varlen_func on q (total_q, nheads, headdim) and kv (total_k, 2, nheads_k, headdim)."""
    if kv.dim() != 4 or kv.shape[1] != 2:
        raise ValueError(f"flash_attn: kv must have shape (total_k, 2, nheads_k, headdim), got {tuple(kv.shape)}")
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)
