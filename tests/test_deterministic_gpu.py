"""The deterministic CUDA backward: bitwise reproducible gradients that still meet the tolerance
rule, across the features it combines with. On Hopper (up to head dim 128, no dropout) the sm90
kernel adds dQ in a fixed order of the key blocks (per-query-block turns); elsewhere a separate
dQ kernel runs. Block masks: tests/test_block_sparse.py. Skipped without a GPU."""

import pytest
import torch

from flash_attn import BlockSparseMask, flash_attn_blocksparse_func, flash_attn_func, flash_attn_varlen_func
from reference import check_grads_against_reference

pytestmark = pytest.mark.gpu

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def kernel_names(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events()]


def make(b, sq, sk, h, hk, d, dtype=torch.bfloat16):
    return [torch.randn(b, s, n, d, device="cuda", dtype=dtype, requires_grad=True)
            for s, n in ((sq, h), (sk, hk), (sk, hk))]


def grads_twice(fn, inputs, repeats=3):
    """fn(*inputs) -> out; the gradients of out with one fixed dout, `repeats` times (asserted
    bitwise equal); returns out and the first gradients."""
    out = fn(*inputs)
    dout = torch.randn_like(out)
    first = torch.autograd.grad(out, inputs, dout)
    for _ in range(repeats - 1):
        again = torch.autograd.grad(fn(*inputs), inputs, dout)
        for a, b in zip(first, again):
            assert torch.equal(a, b)
    return out, dout, first


# Many key blocks per query block (so the order of their dQ additions matters), sq != sk, lengths
# off the 64/128 tiles, GQA, causal and windows (whose key blocks start at different query blocks).
@pytest.mark.parametrize("d", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (300, 100)), (True, (700, 0))])
@pytest.mark.parametrize("sq,sk,h,hk", [(1000, 1000, 4, 4), (333, 1500, 6, 2), (1500, 257, 2, 1)])
def test_reproducible_and_exact(sq, sk, h, hk, d, causal, window):
    q, k, v = make(2, sq, sk, h, hk, d)
    fn = lambda q, k, v: flash_attn_func(q, k, v, causal=causal, window_size=window, deterministic=True)  # noqa: E731
    out, dout, grads = grads_twice(fn, (q, k, v))
    check_grads_against_reference(q, k, v, out, dout, grads, q.dtype, causal=causal, window_size=window)


def test_matches_the_atomic_backward():
    # Same function as the default backward: only the order of the float32 dQ additions differs.
    q, k, v = make(2, 2000, 2000, 4, 4, 64)
    dout = torch.randn_like(q)
    det = torch.autograd.grad(flash_attn_func(q, k, v, causal=True, deterministic=True), (q, k, v), dout)
    fast = torch.autograd.grad(flash_attn_func(q, k, v, causal=True), (q, k, v), dout)
    for a, b in zip(det, fast):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    assert torch.equal(det[1], fast[1]) and torch.equal(det[2], fast[2])  # dK and dV take no atomics


@pytest.mark.parametrize("causal", [False, True])
def test_more_key_blocks_than_sms(causal):
    # One head with more key blocks than the GPU has SMs: every CTA may hold a tile of the same
    # head, and the turns must still come round (a wrong claim order would hang here).
    sk = 160 * 128 + 77
    q, k, v = make(1, sk, sk, 1, 1, 64)
    fn = lambda q, k, v: flash_attn_func(q, k, v, causal=causal, deterministic=True)  # noqa: E731
    _, dout, det = grads_twice(fn, (q, k, v), repeats=2)
    fast = torch.autograd.grad(flash_attn_func(q, k, v, causal=causal), (q, k, v), dout)
    for a, b in zip(det, fast):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("persistent", ["2", ""])
@pytest.mark.parametrize("d", [32, 64, 96, 128])
def test_block_mask_with_one_query_block_per_key_column(d, persistent, monkeypatch):
    # Key blocks with fewer query blocks than the ordered kernel has dQ buffers (one or two here),
    # with whole query blocks empty, at the head dims whose warpgroups split dQ's keys (32, 64, 96)
    # and one that splits its columns (128); on two CTAs each walks many such tiles. racecheck
    # reports write-write pairs on this input (NOTES, thirty-second session): these repeats would
    # show a real race as differing bits.
    monkeypatch.setenv("FLASH_ATTN_SM90_BWD_PERSISTENT", persistent)
    torch.manual_seed(d)
    nb = 8
    layout = torch.zeros(2, nb, nb, dtype=torch.bool)
    for h in range(2):
        for j in range(nb):
            layout[h, torch.randperm(nb - 1)[: 1 + j % 2] + (1 if h == 0 else 0), j] = True
    mask = BlockSparseMask.from_layout(layout, nb * 128 - 30, nb * 128 - 30).to("cuda")
    q, k, v = make(2, nb * 128 - 30, nb * 128 - 30, 2, 2, d)
    fn = lambda q, k, v: flash_attn_blocksparse_func(q, k, v, mask, deterministic=True)  # noqa: E731
    out, dout, grads = grads_twice(fn, (q, k, v), repeats=20)
    check_grads_against_reference(q, k, v, out, dout, grads, q.dtype, attn_mask=mask.dense().to("cuda"))


@pytest.mark.parametrize("d", [64, 128])
def test_varlen_bias_alibi(d):
    # Packed sequences (an empty one, a single token, lengths off the tiles), then a float bias with
    # its gradient and ALiBi on a padded batch.
    lengths = [(700, 900), (0, 5), (1, 1), (129, 300), (513, 513)]
    lq, lk = [s for s, _ in lengths], [s for _, s in lengths]
    cu_q, cu_k = (torch.tensor([0] + list(torch.tensor(ls).cumsum(0)), dtype=torch.int32, device="cuda")
                  for ls in (lq, lk))
    q, k, v = (torch.randn(sum(ls), n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for ls, n in ((lq, 4), (lk, 2), (lk, 2)))
    for causal in (False, True):
        fn = lambda q, k, v: flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal,  # noqa: E731
                                                    deterministic=True)
        _, dout, det = grads_twice(fn, (q, k, v))
        # each sequence alone through the padded path
        for i in range(len(lengths)):
            (a, a1), (b, b1) = cu_q[i:i + 2].tolist(), cu_k[i:i + 2].tolist()
            if a1 == a:
                continue
            qi, ki, vi = (t.detach()[lo:hi].unsqueeze(0).requires_grad_() for t, lo, hi in
                          ((q, a, a1), (k, b, b1), (v, b, b1)))
            alone = torch.autograd.grad(flash_attn_func(qi, ki, vi, causal=causal, deterministic=True), (qi, ki, vi),
                                        dout[a:a1].unsqueeze(0))
            for g, ref, lo, hi in zip(alone, det, (a, b, b), (a1, b1, b1)):
                torch.testing.assert_close(g[0], ref[lo:hi], atol=2e-2, rtol=2e-2)

    q, k, v = make(2, 700, 900, 4, 4, d)
    bias = torch.randn(2, 4, 700, 900, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    slopes = torch.rand(4, device="cuda") * 0.1
    fn = lambda q, k, v, bias: flash_attn_func(q, k, v, attn_bias=bias, alibi_slopes=slopes,  # noqa: E731
                                               deterministic=True)
    _, dout, det = grads_twice(fn, (q, k, v, bias))
    fast = torch.autograd.grad(flash_attn_func(q, k, v, attn_bias=bias, alibi_slopes=slopes), (q, k, v, bias), dout)
    for a, b in zip(det, fast):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not HOPPER, reason="Hopper (sm_90) only")
def test_sm90_kernel_runs_deterministic():
    # Up to head dim 128 the deterministic backward is the sm90 kernel's (no dQ kernel), block
    # masks included; dropout and head dims above 128 take the dQ kernel.
    def names(d, mask=None, **kw):
        q, k, v = make(1, 300, 300, 2, 2, d)
        if mask is not None:
            fn = lambda: flash_attn_blocksparse_func(q, k, v, mask, deterministic=True, **kw)  # noqa: E731
        else:
            fn = lambda: flash_attn_func(q, k, v, deterministic=True, **kw)  # noqa: E731
        return kernel_names(lambda: fn().sum().backward())
    layout = torch.tensor([[True, False, True], [False, True, False], [True, True, True]])
    mask = BlockSparseMask.from_layout(layout, 300, 300).to("cuda")
    for d, m in ((32, None), (64, None), (96, None), (128, None), (64, mask), (128, mask)):
        n = names(d, m, causal=True)
        assert any("flash_bwd_sm90_ws_kernel<" in x for x in n) and not any("flash_bwd_dq_kernel" in x for x in n), n
    for d, kw in ((64, dict(dropout_p=0.1)), (256, {})):
        n = names(d, **kw)
        assert not any("flash_bwd_sm90" in x for x in n) and any("flash_bwd_dq_kernel" in x for x in n), n


@pytest.mark.skipif(not HOPPER, reason="Hopper (sm_90) only")
def test_sm90_deterministic_under_the_persistence_switch(monkeypatch):
    # FLASH_ATTN_SM90_BWD_PERSISTENT=0 (a CTA per tile) or a cap still gives the ordered kernel at
    # most a CTA per SM and the same bits.
    q, k, v = make(2, 1000, 1000, 4, 4, 64)
    dout = torch.randn_like(q)
    run = lambda: torch.autograd.grad(flash_attn_func(q, k, v, causal=True, deterministic=True), (q, k, v), dout)  # noqa: E731
    base = run()
    for cap in ("0", "7", "100000"):
        monkeypatch.setenv("FLASH_ATTN_SM90_BWD_PERSISTENT", cap)
        for a, b in zip(base, run()):
            assert torch.equal(a, b)
