"""Bad input gets a clear error naming the argument, never a crash or a silent wrong answer."""

import pytest
import torch

from flash_attn import flash_attn_func, flash_attn_qkvpacked_func


def t(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


GOOD = dict(q=(2, 16, 4, 32), k=(2, 20, 2, 32), v=(2, 20, 2, 32))


def call(q=None, k=None, v=None, **kw):
    q = t(*GOOD["q"]) if q is None else q
    k = t(*GOOD["k"]) if k is None else k
    v = t(*GOOD["v"]) if v is None else v
    return flash_attn_func(q, k, v, **kw)


@pytest.mark.parametrize("kwargs, match", [
    (dict(q=t(2, 16, 32)), r"q must have shape \(batch, seqlen, nheads, headdim\), got a tensor of rank 3"),
    (dict(k=t(2, 20, 2, 32, 1)), r"k must have shape .* rank 5"),
    (dict(v=t(2, 20, 2)), r"v must have shape .* rank 3"),
    (dict(k=t(3, 20, 2, 32), v=t(3, 20, 2, 32)), r"same batch size, got 2, 3 and 3"),
    (dict(k=t(2, 20, 2, 16), v=t(2, 20, 2, 16)), r"same head dim, got 32, 16 and 16"),
    (dict(v=t(2, 21, 2, 32)), r"k and v must have the same seqlen, got 20 and 21"),
    (dict(v=t(2, 20, 4, 32)), r"k and v must have the same number of heads, got 2 and 4"),
    (dict(k=t(2, 20, 3, 32), v=t(2, 20, 3, 32)), r"multiple of the number of key/value heads, got 4 query heads and 3"),
    (dict(q=t(2, 16, 4, 32, dtype=torch.float64)), r"q must be float16, bfloat16 or float32, got Double"),
    (dict(q=torch.zeros(2, 16, 4, 32, dtype=torch.int32)), r"q must be float16, bfloat16 or float32, got Int"),
    (dict(k=t(2, 20, 2, 32, dtype=torch.float16)), r"k must have the dtype of q \(Float\), got Half"),
    (dict(q=t(2, 16, 4, 320), k=t(2, 20, 2, 320), v=t(2, 20, 2, 320)), r"head dim must be between 1 and 256, got 320"),
    (dict(dropout_p=1.0), r"dropout_p must be in \[0, 1\), got 1"),
    (dict(dropout_p=-0.1), r"dropout_p must be in \[0, 1\), got -0.1"),
    (dict(window_size=(-2, 0)), r"window sizes must be -1 \(unbounded\) or >= 0, got \(-2, 0\)"),
    # (one query per head under GQA runs folded: it once skipped the window check)
    (dict(q=t(2, 1, 4, 32), window_size=(-2, -1)), r"window sizes must be -1 \(unbounded\) or >= 0, got \(-2, -1\)"),
    (dict(softmax_scale=float("nan")), r"softmax_scale must be finite"),
])
def test_bad_input_raises_clear_error(kwargs, match):
    with pytest.raises(RuntimeError, match=match):
        call(**kwargs)


def test_op_wants_a_contiguous_last_dimension():
    # The functions copy such operands as flash-attn 2.x does; the op itself names the operand.
    q = t(2, 16, 4, 32)
    with pytest.raises(RuntimeError, match=r"q must have a contiguous last dimension \(stride 1\), got stride 2"):
        torch.ops.flash_attn.fwd(t(2, 16, 4, 64)[..., ::2], q, q)
    with pytest.raises(RuntimeError, match=r"v must have a contiguous last dimension"):
        torch.ops.flash_attn.fwd(q, q, t(2, 16, 4, 64)[..., ::2])


def test_meta_device_is_rejected():
    q = torch.empty(2, 16, 4, 32, device="meta")
    # meta tensors go to the fake kernel (shapes only); the real kernels never see them
    out = flash_attn_func(q, q, q)
    assert out.device.type == "meta" and out.shape == q.shape


def test_unsupported_features_say_so():
    with pytest.raises(ValueError, match=r"qkv must have shape \(batch, seqlen, 3, nheads, headdim\)"):
        flash_attn_qkvpacked_func(t(2, 16, 4, 32))


def test_backward_op_checks_its_inputs():
    q, k, v = t(1, 8, 2, 16), t(1, 8, 2, 16), t(1, 8, 2, 16)
    out, lse, _, rng = torch.ops.flash_attn.fwd(q, k, v)
    bwd = torch.ops.flash_attn.bwd
    with pytest.raises(RuntimeError, match=r"dout must have the shape of q"):
        bwd(t(1, 9, 2, 16), q, k, v, out, lse)
    with pytest.raises(RuntimeError, match=r"softmax_lse must have shape \(batch, nheads, seqlen_q\)"):
        bwd(out, q, k, v, out, lse[:, :1])
    with pytest.raises(RuntimeError, match=r"softmax_lse must be float32, got Half"):
        bwd(out, q, k, v, out, lse.half())
    with pytest.raises(RuntimeError, match=r"rng_state is required when dropout_p > 0"):
        bwd(out, q, k, v, out, lse, 0.1)
    with pytest.raises(RuntimeError, match=r"rng_state must be an int64 tensor of 2 elements"):
        bwd(out, q, k, v, out, lse, 0.1, rng_state=torch.zeros(3, dtype=torch.int64))


@pytest.mark.parametrize("bias", [False, True])
def test_second_derivative_raises_instead_of_being_wrong(bias):
    """The backward is not differentiable: differentiating a gradient taken with create_graph=True
    raises (the dispatcher's fallback let it run with no gradient reaching q, k, v); the
    first-order gradients under create_graph=True are the plain ones."""
    q, k, v = (t(*GOOD[n]).requires_grad_() for n in "qkv")
    kw = dict(causal=True, attn_bias=t(16, 20).requires_grad_() if bias else None)
    inputs = (q, k, v) + ((kw["attn_bias"],) if bias else ())
    first = torch.autograd.grad(flash_attn_func(q, k, v, **kw).sum(), inputs, create_graph=True)
    plain = torch.autograd.grad(flash_attn_func(q, k, v, **kw).sum(), inputs)
    assert all(torch.equal(a, b) for a, b in zip(first, plain)) and first[0].requires_grad
    with pytest.raises(RuntimeError, match="second derivatives are not supported"):
        first[0].square().sum().backward()
