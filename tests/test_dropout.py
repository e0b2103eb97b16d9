"""Dropout: the keep rate, reproducibility from the seed, and forward/backward agreement."""

import pytest
import torch

import flash_attn
from flash_attn import flash_attn_func


def qkv(b=2, s=256, h=4, d=32, requires_grad=False):
    return [torch.randn(b, s, h, d, requires_grad=requires_grad) for _ in range(3)]


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate(p):
    q, k, v = qkv()
    _, _, s_dmask = flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True)
    n = s_dmask.numel()
    kept = (~torch.signbit(s_dmask)).double().mean().item()
    # binomial standard deviation over 524288 draws is under 7e-4
    assert abs(kept - (1 - p)) < 5 * ((p * (1 - p) / n) ** 0.5) + 2e-5


def test_mask_differs_between_heads_and_batches():
    q, k, v = qkv(b=2, s=64, h=2)
    _, _, s_dmask = flash_attn_func(q, k, v, dropout_p=0.5, return_attn_probs=True)
    keep = ~torch.signbit(s_dmask)
    assert not torch.equal(keep[0, 0], keep[0, 1])
    assert not torch.equal(keep[0, 0], keep[1, 0])


def test_same_seed_same_result_and_fresh_seed_different():
    q, k, v = qkv()
    torch.manual_seed(123)
    a = flash_attn_func(q, k, v, dropout_p=0.3)
    torch.manual_seed(123)
    b = flash_attn_func(q, k, v, dropout_p=0.3)
    c = flash_attn_func(q, k, v, dropout_p=0.3)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_backward_regenerates_the_forward_mask():
    # Gradients computed through the op must equal gradients of the explicit formula using the
    # mask the forward reported, which fails if the backward drew a different mask.
    q, k, v = qkv(b=1, s=96, h=2, d=16, requires_grad=True)
    out, _, s_dmask = flash_attn_func(q, k, v, dropout_p=0.4, return_attn_probs=True)
    keep = ~torch.signbit(s_dmask)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    scores = torch.einsum("bihd,bjhd->bhij", q.double(), k.double()) / 4.0
    p = torch.softmax(scores, -1).masked_fill(~keep, 0) / 0.6
    ref = torch.einsum("bhij,bjhd->bihd", p, v.double())
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout.double())
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), r.double(), atol=2e-5, rtol=1e-4)


def test_rng_state_replays_the_backward():
    q, k, v = qkv(b=1, s=80, h=2, d=16)
    out, lse, _, rng_state = torch.ops.flash_attn.fwd(q, k, v, 0.25)
    dout = torch.randn_like(out)
    g1 = torch.ops.flash_attn.bwd(dout, q, k, v, out, lse, 0.25, rng_state=rng_state)
    g2 = torch.ops.flash_attn.bwd(dout, q, k, v, out, lse, 0.25, rng_state=rng_state)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)
    other = rng_state.clone()
    other[0] += 1
    g3 = torch.ops.flash_attn.bwd(dout, q, k, v, out, lse, 0.25, rng_state=other)
    assert not torch.equal(g1[0], g3[0])
