"""Fake (meta) kernels for the C++ ops in torch.ops.flash_attn (their autograd is in C++:
csrc/flash_autograd.cpp).

The C++ library names this module (set_python_module), so torch imports it whenever it needs a
fake kernel, e.g. under torch.compile or FakeTensorMode.
"""

import torch

from . import _library  # noqa: F401  (registers the ops)

fwd = torch.ops.flash_attn.fwd.default
fwd_kvcache = torch.ops.flash_attn.fwd_kvcache.default
bwd = torch.ops.flash_attn.bwd.default
fwd_varlen_paged = torch.ops.flash_attn.fwd_varlen_paged.default


@torch.library.register_fake("flash_attn::fwd")
def _fwd_fake(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size_left=-1,
              window_size_right=-1, return_softmax=False, deterministic=False, block_layout=None,
              q_block_lists=None, k_block_lists=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0,
              max_seqlen_k=0, attn_bias=None, alibi_slopes=None, softcap=0.0):
    out = q.new_empty(q.shape)
    if cu_seqlens_q is not None:  # packed (total, h, d): lse (h, total_q), probs at the longest lengths
        b, (total_q, h, _) = cu_seqlens_q.shape[0] - 1, q.shape
        sq, sk = max_seqlen_q, max_seqlen_k
        lse = q.new_empty((h, total_q), dtype=torch.float32)
    else:
        b, sq, h, _ = q.shape
        sk = k.shape[1]
        lse = q.new_empty((b, h, sq), dtype=torch.float32)
    probs = q.new_empty((b, h, sq, sk)) if return_softmax else q.new_empty((0,))
    rng_state = q.new_empty((2,), dtype=torch.int64)
    return out, lse, probs, rng_state


@torch.library.register_fake("flash_attn::bwd")
def _bwd_fake(dout, q, k, v, out, softmax_lse, dropout_p=0.0, softmax_scale=None, causal=False,
              window_size_left=-1, window_size_right=-1, deterministic=False, rng_state=None, block_layout=None,
              q_block_lists=None, k_block_lists=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0,
              max_seqlen_k=0, attn_bias=None, alibi_slopes=None, softcap=0.0, bias_requires_grad=False):
    dbias = attn_bias.new_empty(attn_bias.shape) if bias_requires_grad else q.new_empty((0,))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias


@torch.library.register_fake("flash_attn::fwd_kvcache")
def _fwd_kvcache_fake(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, cache_batch_idx=None,
                      cache_leftpad=None, block_table=None, softmax_scale=None, causal=False, window_size_left=-1,
                      window_size_right=-1, alibi_slopes=None, softcap=0.0, num_splits=0):
    b, sq, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, sq), dtype=torch.float32)


@torch.library.register_fake("flash_attn::fwd_varlen_paged")
def _fwd_varlen_paged_fake(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
                           softmax_scale=None, causal=False, window_size_left=-1, window_size_right=-1,
                           alibi_slopes=None, softcap=0.0):
    total_q, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((h, total_q), dtype=torch.float32)
