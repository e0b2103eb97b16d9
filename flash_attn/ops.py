"""Fake (meta) kernels and autograd for the C++ ops in torch.ops.flash_attn.

The C++ library names this module (set_python_module), so torch imports it whenever it needs a
fake kernel, e.g. under torch.compile or FakeTensorMode.
"""

import torch

from . import _library  # noqa: F401  (registers the ops)

fwd = torch.ops.flash_attn.fwd.default
bwd = torch.ops.flash_attn.bwd.default


@torch.library.register_fake("flash_attn::fwd")
def _fwd_fake(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size_left=-1,
              window_size_right=-1, return_softmax=False, deterministic=False, block_layout=None,
              q_block_lists=None, k_block_lists=None):
    b, sq, h, d = q.shape
    sk = k.shape[1]
    out = q.new_empty((b, sq, h, d))
    lse = q.new_empty((b, h, sq), dtype=torch.float32)
    probs = q.new_empty((b, h, sq, sk)) if return_softmax else q.new_empty((0,))
    rng_state = q.new_empty((2,), dtype=torch.int64)
    return out, lse, probs, rng_state


@torch.library.register_fake("flash_attn::bwd")
def _bwd_fake(dout, q, k, v, out, softmax_lse, dropout_p=0.0, softmax_scale=None, causal=False,
              window_size_left=-1, window_size_right=-1, deterministic=False, rng_state=None, block_layout=None,
              q_block_lists=None, k_block_lists=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _fwd_setup_context(ctx, inputs, output):
    # torch passes every schema argument, defaults filled in.
    q, k, v, dropout_p, softmax_scale, causal, window_left, window_right, _, deterministic, *block_mask = inputs
    out, lse, _, rng_state = output
    ctx.save_for_backward(q, k, v, out, lse, rng_state, *block_mask)
    ctx.args = (dropout_p, softmax_scale, causal, window_left, window_right, deterministic)
    ctx.mark_non_differentiable(lse, output[2], rng_state)
    # The other outputs' gradients are never used: skip making zero tensors for them (one
    # allocation and fill launch each per backward).
    ctx.set_materialize_grads(False)


def _fwd_backward(ctx, dout, *_unused_grads):
    if dout is None:  # out does not reach the loss
        return (None,) * 13
    q, k, v, out, lse, rng_state, *block_mask = ctx.saved_tensors
    dropout_p, softmax_scale, causal, window_left, window_right, deterministic = ctx.args
    dq, dk, dv = bwd(dout.contiguous() if dout.stride(-1) != 1 else dout, q, k, v, out, lse, dropout_p,
                     softmax_scale, causal, window_left, window_right, deterministic, rng_state, *block_mask)
    return (dq, dk, dv) + (None,) * 10


torch.library.register_autograd("flash_attn::fwd", _fwd_backward, setup_context=_fwd_setup_context)
