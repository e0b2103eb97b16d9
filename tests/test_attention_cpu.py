"""Forward, logsumexp and every gradient of the CPU implementation against a float64 reference."""

import math

import pytest
import torch

from flash_attn import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func
from reference import attention_ref, check_grads_against_reference, visible_mask

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim): odd sizes, sq != sk, GQA/MQA, head dims to 256
SHAPES = [
    (1, 1, 1, 1, 1, 8),
    (2, 17, 113, 4, 2, 32),
    (1, 128, 128, 2, 2, 64),
    (2, 113, 203, 4, 1, 40),
    (1, 203, 113, 6, 3, 96),
    (1, 257, 300, 2, 2, 128),
    (1, 65, 77, 2, 1, 160),
    (1, 77, 64, 2, 2, 256),
    (1, 150, 700, 1, 1, 64),  # one head: the backward splits the key blocks across threads
]


def make_qkv(shape, dtype, requires_grad=True):
    b, sq, sk, h, hk, d = shape
    q = torch.randn(b, sq, h, d, dtype=dtype)
    k = torch.randn(b, sk, hk, d, dtype=dtype)
    v = torch.randn(b, sk, hk, d, dtype=dtype)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def run_and_check(q, k, v, dtype, causal=False, window_size=(-1, -1), dropout_p=0.0, softmax_scale=None):
    out, lse, s_dmask = flash_attn_func(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                                        window_size=window_size, return_attn_probs=True)
    keep = None if dropout_p == 0.0 else ~torch.signbit(s_dmask)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)

    ref_probs = check_grads_against_reference(q, k, v, out, dout, grads, dtype, causal=causal, window_size=window_size,
                                              softmax_scale=softmax_scale, dropout_p=dropout_p, keep_mask=keep)

    # logsumexp of the scaled scores, -inf for rows that see nothing
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    h, hk = q.shape[2], k.shape[2]
    scores = torch.einsum("bihd,bjhd->bhij", q.double() * scale, k.double().repeat_interleave(h // hk, 2))
    scores = scores.masked_fill(~visible_mask(q.shape[1], k.shape[1], causal, window_size), float("-inf"))
    ref_lse = torch.logsumexp(scores, dim=-1)
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert torch.allclose(lse[finite].double(), ref_lse[finite], atol=1e-4, rtol=1e-5)
    # returned probabilities are the exact softmax (sign carries the dropout pattern)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(s_dmask.abs().double(), ref_probs, atol=tol)
    return out, grads


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_forward_backward(shape, dtype, causal):
    q, k, v = make_qkv(shape, dtype)
    run_and_check(q, k, v, dtype, causal=causal)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[3], SHAPES[4]])
@pytest.mark.parametrize("causal", [False, True])
def test_dropout_matches_reference_with_same_mask(shape, dtype, causal):
    q, k, v = make_qkv(shape, dtype)
    run_and_check(q, k, v, dtype, causal=causal, dropout_p=0.17)


@pytest.mark.parametrize("window_size", [(0, 0), (16, 0), (5, 9), (-1, 3), (40, -1)])
@pytest.mark.parametrize("shape", [SHAPES[3], SHAPES[4]])
def test_sliding_window(shape, window_size):
    q, k, v = make_qkv(shape, torch.float32)
    run_and_check(q, k, v, torch.float32, window_size=window_size)


def test_softmax_scale():
    q, k, v = make_qkv(SHAPES[1], torch.float32)
    run_and_check(q, k, v, torch.float32, softmax_scale=0.37)


def test_rows_with_nothing_to_attend_give_zero():
    # causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k rows see no key
    q, k, v = make_qkv((1, 40, 10, 2, 2, 32), torch.float32)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.all(out[:, :30] == 0) and torch.isneginf(lse[:, :, :30]).all()
    out.sum().backward()
    for g in (q.grad, k.grad, v.grad):
        assert torch.isfinite(g).all()
    assert torch.all(q.grad[:, :30] == 0)
    run_and_check(*make_qkv((1, 40, 10, 2, 2, 32), torch.float32), torch.float32, causal=True)


def test_empty_key_sequence():
    q = torch.randn(1, 5, 2, 16, requires_grad=True)
    k = torch.randn(1, 0, 2, 16, requires_grad=True)
    v = torch.randn(1, 0, 2, 16, requires_grad=True)
    out = flash_attn_func(q, k, v)
    assert out.shape == q.shape and torch.all(out == 0)
    out.sum().backward()
    assert torch.all(q.grad == 0) and k.grad.shape == k.shape


def test_non_contiguous_inputs():
    b, s, h, d = 2, 75, 4, 64
    big = torch.randn(b, s, 3 * h, 2 * d)
    q = big[:, :, :h, :d].requires_grad_()  # strided batch/row/head, contiguous last dim
    k = big[:, :, h:2 * h, d:].detach().clone().transpose(0, 0).requires_grad_()
    v = torch.randn(b, 2 * h, s, d).transpose(1, 2)[:, :, ::2].requires_grad_()
    assert not q.is_contiguous() and not v.is_contiguous()
    run_and_check(q, k, v, torch.float32, causal=True)


def test_strided_head_dim_is_copied_as_flash_attn_2_does():
    # A head dim with stride != 1 (a transposed or sliced view) runs on a contiguous copy: the same
    # result and gradients as the contiguous call, the gradients shaped like the views.
    b, s, h, d = 2, 70, 4, 32
    q = torch.randn(b, s, h, 2 * d)[..., ::2].requires_grad_()
    k = torch.randn(b, s, d, h).transpose(-1, -2).requires_grad_()
    v = torch.randn(b, s, h, d, requires_grad=True)
    assert q.stride(-1) == 2 and k.stride(-1) == h
    out = flash_attn_func(q, k, v, causal=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    dense = [x.detach().contiguous().requires_grad_() for x in (q, k, v)]
    ref = flash_attn_func(*dense, causal=True)
    assert torch.equal(out, ref)
    for g, rg, x in zip(grads, torch.autograd.grad(ref, dense, dout), (q, k, v)):
        assert g.shape == x.shape and torch.equal(g, rg)


@pytest.mark.parametrize("sq, sk", [(1, 200), (150, 1), (1, 1)])
def test_size_one_dims_with_any_stride(sq, sk):
    # torch gives a size-1 dim any stride (here 1, below a row's length, or 0); the CPU GEMMs once
    # passed it to BLAS as a leading dim, which BLAS refused, leaving the tile unwritten.
    b, h, d = 2, 3, 40

    def odd(s, n):
        x = torch.randn(b, s, n, d)
        stride = list(x.stride())
        if s == 1:
            stride[1] = 1
        return x.as_strided(x.shape, stride).requires_grad_()

    q, k, v = odd(sq, h), odd(sk, h), odd(sk, h)
    out = flash_attn_func(q, k, v)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref, _ = attention_ref(q, k, v)
    tol = dict(rtol=1e-4, atol=1e-4)  # (float32 against float64; a tile left unwritten is off by O(1))
    torch.testing.assert_close(out.double(), ref, **tol)
    for g, rg in zip(grads, torch.autograd.grad(ref, (q, k, v), dout.double())):
        torch.testing.assert_close(g.double(), rg.double(), **tol)
    # A query broadcast along its rows (stride 0): rows that overlap in memory.
    q0 = torch.randn(b, 1, h, d).expand(b, 5, h, d)
    torch.testing.assert_close(flash_attn_func(q0, k, v).double(), attention_ref(q0, k, v)[0], **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_packed_variants_match_unpacked(dtype):
    b, s, h, d = 2, 67, 4, 32
    qkv = torch.randn(b, s, 3, h, d, dtype=dtype, requires_grad=True)
    out = flash_attn_qkvpacked_func(qkv, causal=True)
    ref = flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True)
    assert torch.equal(out, ref)
    (g,) = torch.autograd.grad(out, qkv, torch.ones_like(out))
    g_ref = torch.stack(torch.autograd.grad(ref, (qkv,), torch.ones_like(ref)), 0)[0]
    assert torch.equal(g, g_ref)

    q = torch.randn(b, s, h, d, dtype=dtype)
    kv = torch.randn(b, 50, 2, 2, d, dtype=dtype)
    assert torch.equal(flash_attn_kvpacked_func(q, kv), flash_attn_func(q, kv[:, :, 0], kv[:, :, 1]))


def test_mqa_gradients_are_summed_over_the_group():
    q, k, v = make_qkv((2, 33, 45, 8, 1, 16), torch.float32)
    _, (dq, dk, dv) = run_and_check(q, k, v, torch.float32)  # reference repeats k/v: its grads sum the group
    assert dk.shape == k.shape and dv.shape == v.shape


def test_backward_is_deterministic():
    q, k, v = make_qkv((1, 150, 700, 1, 1, 64), torch.float32)
    dout = torch.randn(1, 150, 1, 64)
    first = torch.autograd.grad(flash_attn_func(q, k, v, causal=True, deterministic=True), (q, k, v), dout)
    second = torch.autograd.grad(flash_attn_func(q, k, v, causal=True, deterministic=True), (q, k, v), dout)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
