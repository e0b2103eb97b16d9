"""flash-attn 2.7's private entry points (flash_attn.flash_attn_interface._flash_attn_forward /
_backward and their varlen forms), as ring / context-parallel attention libraries use them: the
keys split into blocks, each block's output and logsumexp merged, and each block's backward run
with the merged output and logsumexp, against flash_attn_func on all the keys at once."""

import pytest
import torch

from flash_attn import flash_attn_func, flash_attn_varlen_func
from flash_attn.flash_attn_interface import (_flash_attn_backward, _flash_attn_forward, _flash_attn_varlen_backward,
                                             _flash_attn_varlen_forward)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def merge(outs, lses):
    """Blocks' outputs (b, s, h, d) and logsumexps (b, h, s) into those of all their keys."""
    lse = torch.logsumexp(torch.stack(lses), dim=0)
    out = sum(o.float() * torch.exp(l - lse).transpose(1, 2)[..., None] for o, l in zip(outs, lses))
    return out, lse


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
def test_blockwise_forward_and_backward_equal_the_whole(device, causal):
    # Causal with the query block last (its keys: every earlier block whole, then its own causally).
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    b, sq, h, hk, d, blocks = 2, 96, 4, 2, 64, 3
    q = torch.randn(b, sq, h, d, dtype=dtype, device=device)
    k, v = (torch.randn(b, blocks * sq, hk, d, dtype=dtype, device=device) for _ in range(2))
    dout = torch.randn_like(q)
    kb, vb = k.chunk(blocks, dim=1), v.chunk(blocks, dim=1)
    outs, lses = [], []
    for i in range(blocks):
        last = causal and i == blocks - 1
        out, lse, s_dmask, rng_state = _flash_attn_forward(q, kb[i], vb[i], 0.0, None, last)
        assert out.grad_fn is None and lse.shape == (b, h, sq) and rng_state.shape == (2,)
        outs.append(out)
        lses.append(lse)
    out, lse = merge(outs, lses)
    out = out.to(dtype)

    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    ref, ref_lse, _ = flash_attn_func(qr, kr, vr, causal=causal, return_attn_probs=True)
    ref_grads = torch.autograd.grad(ref, (qr, kr, vr), dout)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(lse, ref_lse, **tol)

    dq = torch.zeros_like(q)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    for i in range(blocks):
        dq_i = torch.empty_like(q)
        softmax_d = _flash_attn_backward(dout, q, kb[i], vb[i], out, lse, dq_i, dk[:, i * sq:(i + 1) * sq],
                                         dv[:, i * sq:(i + 1) * sq], 0.0, None, causal and i == blocks - 1)
        dq += dq_i
    torch.testing.assert_close(softmax_d, (dout.float() * out.float()).sum(-1).transpose(1, 2))
    for name, g, rg in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads):
        torch.testing.assert_close(g, rg, **tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_forms(device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    lengths = [5, 0, 70, 33]
    cu = torch.tensor([0] + lengths, device=device).cumsum(0).to(torch.int32)
    q, k, v = (torch.randn(sum(lengths), 4, 32, dtype=dtype, device=device) for _ in range(3))
    out, lse, _, rng_state = _flash_attn_varlen_forward(q, k, v, cu, cu, 70, 70, 0.0, None, True)
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    ref, ref_lse, _ = flash_attn_varlen_func(qr, kr, vr, cu, cu, 70, 70, causal=True, return_attn_probs=True)
    assert torch.equal(out, ref.detach()) and torch.equal(lse, ref_lse) and lse.shape == (4, sum(lengths))
    dout = torch.randn_like(out)
    grads = [torch.empty_like(x) for x in (q, k, v)]
    softmax_d = _flash_attn_varlen_backward(dout, q, k, v, out, lse, *grads, cu, cu, 70, 70, 0.0, None, True)
    for g, rg in zip(grads, torch.autograd.grad(ref, (qr, kr, vr), dout)):
        assert torch.equal(g, rg)
    assert softmax_d.shape == (4, sum(lengths))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("which", ["seqused_k", "leftpad_k", "both"])
def test_varlen_forward_with_used_keys(device, which):
    """leftpad_k / seqused_k: sequence i reads only its key rows [leftpad_k[i], seqused_k[i]),
    the same as a call on those rows alone (causal aligned to them)."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    lens_q, lens_k = [3, 0, 9, 1], [70, 4, 33, 10]
    first = [5, 0, 0, 10] if which != "seqused_k" else [0] * 4
    end = [60, 4, 1, 10] if which != "leftpad_k" else lens_k
    cu_q, cu_k = (torch.tensor([0] + n, device=device).cumsum(0).to(torch.int32) for n in (lens_q, lens_k))
    q = torch.randn(sum(lens_q), 4, 32, dtype=dtype, device=device)
    k, v = (torch.randn(sum(lens_k), 2, 32, dtype=dtype, device=device) for _ in range(2))
    i32 = dict(dtype=torch.int32, device=device)
    extra = dict(leftpad_k=torch.tensor(first, **i32) if which != "seqused_k" else None,
                 seqused_k=torch.tensor(end, **i32) if which != "leftpad_k" else None)
    out, lse, _, _ = _flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 9, 70, 0.0, None, True, alibi_slopes=None,
                                                 **extra)
    rows = torch.cat([torch.arange(c + f, c + e) for c, f, e in zip(cu_k[:-1].tolist(), first, end)]).to(device)
    cu_used = torch.tensor([0] + [e - f for f, e in zip(first, end)], device=device).cumsum(0).to(torch.int32)
    ref, ref_lse, _, _ = _flash_attn_varlen_forward(q, k[rows], v[rows], cu_q, cu_used, 9, 70, 0.0, None, True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    assert torch.isfinite(out).all()
    if which != "seqused_k":  # the last sequence has no keys left
        assert (out[cu_q[3]:] == 0).all() and (lse[:, cu_q[3]:] == float("-inf")).all()
    bad = dict(extra, seqused_k=torch.tensor([71, 4, 33, 10], **i32))
    with pytest.raises(ValueError, match="seqused_k"):
        _flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 9, 70, 0.0, None, True, **bad)
    with pytest.raises(ValueError, match="int32 tensor of shape"):
        _flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 9, 70, 0.0, None, True, seqused_k=cu_k[1:].long())


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_forward_with_block_table(device):
    """block_table: k and v are a paged cache, read as flash_attn_varlen_func reads it."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    lens_q, lens_k, page, h, hk, d = [3, 1, 0, 5], [300, 7, 0, 40], 256, 4, 2, 32
    cu_q = torch.tensor([0] + lens_q, device=device).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device=device).cumsum(0).to(torch.int32)
    table = torch.randperm(8, device=device)[:8].view(4, 2).to(torch.int32)
    kp, vp = (torch.randn(8, page, hk, d, dtype=dtype, device=device) for _ in range(2))
    q = torch.randn(sum(lens_q), h, d, dtype=dtype, device=device)
    out, lse, s_dmask, rng_state = _flash_attn_varlen_forward(q, kp, vp, cu_q, cu_k, 5, 300, 0.0, None, True,
                                                              block_table=table)
    ref, ref_lse, _ = flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, 5, 300, causal=True, block_table=table,
                                             return_attn_probs=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse) and s_dmask is None and rng_state.shape == (2,)
    used = [200, 7, 0, 1]  # seqused_k: the first keys of each sequence's pages
    cu_used = torch.tensor([0] + used, device=device).cumsum(0).to(torch.int32)
    out, lse, _, _ = _flash_attn_varlen_forward(q, kp, vp, cu_q, cu_k, 5, 300, 0.0, None, True, block_table=table,
                                                 seqused_k=torch.tensor(used, dtype=torch.int32, device=device))
    ref, ref_lse, _ = flash_attn_varlen_func(q, kp, vp, cu_q, cu_used, 5, 300, causal=True, block_table=table,
                                             return_attn_probs=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    with pytest.raises(NotImplementedError, match="leftpad_k"):
        _flash_attn_varlen_forward(q, kp, vp, cu_q, cu_k, 5, 300, 0.0, None, True, block_table=table,
                                   leftpad_k=torch.zeros(4, dtype=torch.int32, device=device))
    with pytest.raises(NotImplementedError, match="dropout_p must be 0"):
        _flash_attn_varlen_forward(q, kp, vp, cu_q, cu_k, 5, 300, 0.1, None, True, block_table=table)
    with pytest.raises(NotImplementedError, match="return_softmax"):
        _flash_attn_varlen_forward(q, kp, vp, cu_q, cu_k, 5, 300, 0.0, None, True, return_softmax=True,
                                   block_table=table)
