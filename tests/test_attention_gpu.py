"""CUDA kernels against a float64 reference (tolerance rule of DEVELOPERS.md), against the CPU
implementation, and for determinism. Skipped without a GPU."""

import os
import subprocess
import sys

import pytest
import torch

from flash_attn import flash_attn_func
from reference import attention_ref, check_grads_against_reference, check_rule, poison_allocator

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]
HEAD_DIMS = [32, 40, 64, 96, 128, 160, 192, 224, 256]


def make(b, sq, sk, h, hk, d, dtype):
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, requires_grad=True)
    return q, k, v


def check_against_reference(q, k, v, causal=False, window_size=(-1, -1), dropout_p=0.0, deterministic=False,
                            softmax_scale=None):
    dtype = q.dtype
    poison_allocator()
    out, lse, s_dmask = flash_attn_func(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                                        window_size=window_size, return_attn_probs=True, deterministic=deterministic)
    keep = None if dropout_p == 0 else ~torch.signbit(s_dmask)
    dout = torch.randn_like(out)
    poison_allocator()
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_grads_against_reference(q, k, v, out, dout, grads, dtype, causal=causal, window_size=window_size,
                                  dropout_p=dropout_p, keep_mask=keep, softmax_scale=softmax_scale)
    assert torch.isfinite(lse[~torch.isneginf(lse)]).all()
    return out, grads


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(1, 1), (1, 17), (17, 113), (113, 17), (128, 128), (113, 1000), (300, 40)])
def test_small(sq, sk, d, causal, dtype):
    check_against_reference(*make(2, sq, sk, 4, 2, d, dtype), causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s", [1000, 2048, 4097])
def test_long(s, d, causal, dtype):
    check_against_reference(*make(1, s, s, 2, 2, d, dtype), causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq", [1, 7, 64])
def test_decoding_shapes_split_keys(sq, d, causal, dtype):
    """A few query rows over many keys with few heads (far fewer query blocks than SMs): the
    forward splits the keys over CTAs and merges their partial outputs; the output and, through
    the logsumexp the merge writes, the gradients as the reference's."""
    q, k, v = make(1, sq, 3000, 4, 2, d, dtype)
    poison_allocator()
    out = flash_attn_func(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_grads_against_reference(q, k, v, out, dout, grads, dtype, causal=causal)


def test_decoding_shapes_split_keys_with_score_mods():
    """The split forward with a window, ALiBi, softcap and a float bias (with its gradient), and
    that it did split (the merge kernel ran)."""
    q, k, v = make(2, 3, 2500, 4, 4, 128, torch.bfloat16)
    bias = torch.randn(2, 4, 3, 2500, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    slopes = torch.rand(4, device="cuda") * 0.01
    kw = dict(window_size=(700, 0), softcap=8.0, alibi_slopes=slopes)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = flash_attn_func(q, k, v, attn_bias=bias, **kw)
        torch.cuda.synchronize()
    assert any("combine" in e.name for e in prof.events()), "the forward did not split"
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, bias), dout)
    check_grads_against_reference(q, k, v, out, dout, grads[:3], torch.bfloat16, attn_bias=bias, **kw)
    ref, _ = attention_ref(q, k, v, attn_bias=bias, **kw)
    pt, _ = attention_ref(q, k, v, attn_bias=bias, upcast=False, **kw)
    (ref_db,), (pt_db,) = torch.autograd.grad(ref, (bias,), dout.double()), torch.autograd.grad(pt, (bias,), dout)
    check_rule("dbias", grads[3], ref_db, pt_db, torch.bfloat16)


@pytest.mark.parametrize("hk", [1, 2, 8])
def test_gqa_ratios(hk):
    check_against_reference(*make(2, 300, 257, 8, hk, 64, torch.bfloat16), causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(113, 203), (1000, 1000)])
def test_dropout(sq, sk, d, causal, dtype):
    check_against_reference(*make(2, sq, sk, 4, 2, d, dtype), causal=causal, dropout_p=0.17)


@pytest.mark.parametrize("d", [64, 192, 256])
@pytest.mark.parametrize("window_size", [(0, 0), (16, 0), (5, 9), (-1, 3), (100, -1)])
def test_window(window_size, d):
    check_against_reference(*make(2, 500, 700, 4, 4, d, torch.bfloat16), window_size=window_size)


# The kernels fold the scale into their exponents and assume it is not negative; a negative
# scale runs as (-q, |scale|).
@pytest.mark.parametrize("softmax_scale", [0.3, 0.0, -0.2])
@pytest.mark.parametrize("deterministic", [False, True])
def test_softmax_scale(softmax_scale, deterministic):
    check_against_reference(*make(2, 150, 200, 4, 2, 64, torch.bfloat16), causal=True, softmax_scale=softmax_scale,
                            deterministic=deterministic)


SMALL_SMEM = 99 * 1024  # what sm_86 / sm_89 grant per block


@pytest.mark.skipif(os.environ.get("FLASH_ATTN_SMEM_LIMIT") != str(SMALL_SMEM), reason="child of the test below")
def test_small_smem_child():
    for d in (32, 64, 96, 128):
        for deterministic, dropout_p in ((False, 0.0), (True, 0.0), (False, 0.17)):
            check_against_reference(*make(2, 300, 257, 4, 2, d, torch.float16), causal=True, dropout_p=dropout_p,
                                    deterministic=deterministic)
    for d in (160, 256):  # the forward fits; the backward needs more than 99 KB
        q, k, v = make(1, 64, 64, 2, 2, d, torch.bfloat16)
        check_rule("out", flash_attn_func(q, k, v), attention_ref(q, k, v)[0], attention_ref(q, k, v, upcast=False)[0],
                   torch.bfloat16)
        with pytest.raises(RuntimeError, match="bytes of shared memory per block"):
            flash_attn_func(q, k, v).sum().backward()


def test_small_shared_memory_gpus():
    # The configurations of GPUs with 99 KB of shared memory per block, run here in a child
    # process that caps what the launchers may ask for.
    env = dict(os.environ, FLASH_ATTN_SMEM_LIMIT=str(SMALL_SMEM))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", __file__, "-k", "test_small_smem_child", "-p",
                        "no:cacheprovider"], env=env, capture_output=True, text=True, cwd=os.path.dirname(__file__))
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


def kernel_names(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events()]


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                    reason="Hopper (sm_90) only")
def test_hopper_kernels_run_on_sm90(monkeypatch):
    # Without dropout the forward runs the warp-specialized wgmma kernel (TMA loads), and so does
    # the (non-deterministic) backward at head dims 32, 64, 96 and 128 (warp-specialized, keys
    # split over warpgroups) and 192 and 256 (head dim split); FLASH_ATTN_DISABLE_SM90, dropout and
    # (above head dim 128) deterministic=True select the portable ones, as do head dims 160 and 224
    # (test_deterministic_gpu.py: the deterministic sm90 backward).
    fwd_kernel = "flash_fwd_sm90_ws_kernel"
    ws, split_d = "flash_bwd_sm90_ws_kernel", "flash_bwd_sm90_split_d_kernel"
    for d, bwd_kernel in ((32, ws), (64, ws), (96, ws), (128, ws), (160, None), (192, split_d), (256, split_d)):
        q, k, v = make(1, 300, 300, 2, 2, d, torch.bfloat16)
        names = kernel_names(lambda: flash_attn_func(q, k, v).sum().backward())
        assert any(fwd_kernel + "<" in n for n in names), names
        sm90_bwd = [n for n in names if "flash_bwd_sm90" in n]
        assert (bwd_kernel is None and not sm90_bwd) or (sm90_bwd and all(bwd_kernel + "<" in n for n in sm90_bwd)), names
    names = kernel_names(lambda: flash_attn_func(q, k, v, deterministic=True).sum().backward())  # (d = 256)
    assert not any("flash_bwd_sm90" in n for n in names) and any("flash_bwd_dq_kernel" in n for n in names)
    names = kernel_names(lambda: flash_attn_func(q, k, v, dropout_p=0.1).sum().backward())
    assert not any("sm90" in n for n in names) and any("flash_fwd_kernel" in n for n in names)
    monkeypatch.setenv("FLASH_ATTN_DISABLE_SM90", "1")
    names = kernel_names(lambda: flash_attn_func(q, k, v).sum().backward())
    assert not any("sm90" in n for n in names) and any("flash_fwd_kernel" in n for n in names)


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                    reason="Hopper (sm_90) only")
@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_tma_strides(d, causal, monkeypatch):
    # TMA descriptors need 16-byte strides. The op layer copies inputs whose strides are not, but
    # a dim of length 1 may keep any stride (here the batch of q and the seqlen of k, v): the
    # warp-specialized kernels (forward; backward up to head dim 128) still take them.
    # FLASH_ATTN_SM90_FWD_SYNC=1 selects the cp.async forward.
    def odd_strided(b, s, h, stride):
        base = torch.randn(b * s * h * d + 4096, device="cuda", dtype=torch.bfloat16)
        return base.as_strided((b, s, h, d), stride).detach().requires_grad_()
    q = odd_strided(1, 300, 4, (12345, 4 * d, d, 1))
    k, v = odd_strided(1, 1, 2, (777, 3, d, 1)), odd_strided(1, 1, 2, (999, 5, d, 1))
    q2, k2, v2 = make(2, 300, 457, 4, 2, d, torch.float16)
    names = kernel_names(lambda: (flash_attn_func(q, k, v, causal=causal).sum().backward(),
                                  flash_attn_func(q2, k2, v2, causal=causal).sum().backward()))
    assert sum("flash_fwd_sm90_ws_kernel<" in n for n in names) == 2, names
    assert sum("flash_bwd_sm90_ws_kernel<" in n for n in names) == (2 if d <= 128 else 0), names
    check_against_reference(q, k, v, causal=causal)
    check_against_reference(q2, k2, v2, causal=causal)
    monkeypatch.setenv("FLASH_ATTN_SM90_FWD_SYNC", "1")
    names = kernel_names(lambda: flash_attn_func(q2, k2, v2, causal=causal).sum().backward())
    assert any("flash_fwd_sm90_kernel<" in n for n in names) and not any("flash_fwd_sm90_ws" in n for n in names), names
    check_against_reference(q2, k2, v2, causal=causal)


def check_input_kind(case, d, sizes, windows, softcap):
    """One kind of input against the reference, for tests that switch a kernel variant on: sq x sk
    sizes (fp16, causal or not), GQA with causal and windows, varlen, or bias + ALiBi (+ softcap)."""
    from test_score_mods import bias_of, check_mods, slopes_of
    from test_varlen import LENGTHS, check_varlen
    if case == "sizes":
        for sq, sk in sizes:
            for causal in (False, True):
                check_against_reference(*make(2, sq, sk, 4, 2, d, torch.float16), causal=causal)
    elif case == "gqa_window":
        check_against_reference(*make(2, 600, 257, 8, 2, d, torch.bfloat16), causal=True)
        for window_size in windows:
            check_against_reference(*make(2, 500, 700, 4, 4, d, torch.bfloat16), window_size=window_size)
    elif case == "varlen":
        for causal in (False, True):
            check_varlen(LENGTHS["mixed"] + LENGTHS["long"], 4, 2, d, torch.bfloat16, "cuda", causal=causal)
    else:
        assert case == "mods", case
        q, k, v = make(2, 400, 333, 4, 4, d, torch.bfloat16)
        check_mods(q, k, v, causal=True, attn_bias=bias_of((2, 4, 400, 333), torch.bfloat16, "cuda"),
                   alibi_slopes=slopes_of((4,), "cuda"), softcap=softcap)


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                    reason="Hopper (sm_90) only")
@pytest.mark.parametrize("rows", ["128", "192"])
@pytest.mark.parametrize("d", [32, 64])
@pytest.mark.parametrize("case", ["sizes", "gqa_window", "varlen", "mods", "persistent"])
def test_sm90_forward_rows(case, d, rows, monkeypatch):
    # Up to head dim 64 the warp-specialized forward runs 192-row tiles (three consumer warpgroups)
    # on long unmasked rows and 128-row ones otherwise; FLASH_ATTN_SM90_FWD_ROWS forces either, and
    # both must give the reference's results on every kind of input.
    monkeypatch.setenv("FLASH_ATTN_SM90_FWD_ROWS", rows)
    q, k, v = make(2, 385, 300, 4, 2, d, torch.bfloat16)
    names = kernel_names(lambda: flash_attn_func(q, k, v, causal=True))
    assert any("flash_fwd_sm90_ws_kernel<" in n and f", {rows}>" in n for n in names), names
    if case != "persistent":  # sizes: seqlens below, at and past one 192-row tile, sq != sk
        check_input_kind(case, d, [(1, 1), (1, 17), (113, 17), (191, 193), (192, 1000), (385, 385)],
                         ((16, 0), (5, 9), (100, -1)), softcap=5.0)
    else:  # many tiles per CTA: the same bits as with a CTA per tile
        q, k, v = make(3, 1500, 1300, 8, 2, d, torch.bfloat16)
        run = lambda: flash_attn_func(q, k, v, return_attn_probs=True)[:2]
        persistent, three_ctas, per_tile = three_schedules("FLASH_ATTN_SM90_FWD_PERSISTENT", run, monkeypatch)
        for a, b, c in zip(persistent, three_ctas, per_tile):
            assert torch.equal(a, c) and torch.equal(b, c)
        check_against_reference(q, k, v)


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_portable_kernels_on_this_gpu(d, causal, monkeypatch):
    # On Hopper the rest of the suite runs the sm90 kernels where they apply; this keeps the
    # portable ones (what sm_80 and sm_86/sm_89 GPUs run) checked on the same GPU.
    monkeypatch.setenv("FLASH_ATTN_DISABLE_SM90", "1")
    check_against_reference(*make(2, 113, 257, 4, 2, d, torch.bfloat16), causal=causal)
    check_against_reference(*make(1, 1000, 1000, 2, 1, d, torch.float16), causal=causal)


@pytest.mark.parametrize("d", [33, 180, 250])  # run on the kernels of head dims 64, 192 and 256
def test_odd_head_dim_is_padded(d):
    check_against_reference(*make(2, 77, 99, 2, 1, d, torch.float16), causal=True)


def test_non_contiguous_inputs():
    b, s, h, d = 2, 300, 4, 64
    qkv = torch.randn(b, s, 3, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    check_against_reference(q, k, v, causal=True)


@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_cuda_matches_cpu(dropout_p):
    # Same inputs, same rng_state: the CUDA backward must regenerate the CPU's dropout mask.
    q, k, v = [t.detach() for t in make(2, 200, 300, 4, 2, 64, torch.bfloat16)]
    out, lse, _, rng = torch.ops.flash_attn.fwd(q, k, v, dropout_p, None, True)
    dout = torch.randn_like(out)
    gpu = torch.ops.flash_attn.bwd(dout, q, k, v, out, lse, dropout_p, None, True, -1, -1, False, rng)
    cpu = torch.ops.flash_attn.bwd(*[t.cpu().float() for t in (dout, q, k, v, out)], lse.cpu(), dropout_p, None, True,
                                   -1, -1, False, rng.cpu())
    for g, c in zip(gpu, cpu):
        torch.testing.assert_close(g.float().cpu(), c, atol=2e-2, rtol=2e-2)
    if dropout_p == 0:
        cpu_out, cpu_lse, _, _ = torch.ops.flash_attn.fwd(q.cpu().float(), k.cpu().float(), v.cpu().float(), 0.0, None, True)
        torch.testing.assert_close(out.float().cpu(), cpu_out, atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(lse.cpu(), cpu_lse, atol=1e-3, rtol=1e-3)


# deterministic=True takes another dQ path (ordered additions on sm90, else its own kernel instead
# of atomics): same grid of checks.
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("causal,dropout_p", [(False, 0.0), (True, 0.0), (True, 0.17)])
@pytest.mark.parametrize("sq,sk", [(17, 113), (300, 257)])
def test_deterministic_path(sq, sk, d, causal, dropout_p):
    check_against_reference(*make(2, sq, sk, 4, 2, d, torch.bfloat16), causal=causal, dropout_p=dropout_p,
                            deterministic=True)


def test_deterministic_backward():
    q, k, v = make(2, 1000, 1000, 4, 2, 128, torch.bfloat16)
    dout = torch.randn(2, 1000, 4, 128, device="cuda", dtype=torch.bfloat16)
    first = torch.autograd.grad(flash_attn_func(q, k, v, causal=True, deterministic=True), (q, k, v), dout)
    second = torch.autograd.grad(flash_attn_func(q, k, v, causal=True, deterministic=True), (q, k, v), dout)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("d", [64, 256])
def test_global_deterministic_mode_selects_the_deterministic_backward(d):
    # torch.use_deterministic_algorithms(True) gives deterministic=False the deterministic backward
    # (ordered dQ on sm90 up to head dim 128, else its dQ kernel): the kernels that run and the
    # gradients, bit for bit.
    q, k, v = make(2, 600, 600, 4, 2, d, torch.bfloat16)
    dout = torch.randn_like(q)
    grads = lambda **kw: torch.autograd.grad(flash_attn_func(q, k, v, causal=True, **kw), (q, k, v), dout)  # noqa: E731
    explicit = grads(deterministic=True)
    kernels = lambda **kw: sorted({n for n in kernel_names(lambda: grads(**kw)) if "flash" in n})  # noqa: E731
    assert not any("flash_bwd_dq_kernel" in n for n in kernels())
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        names = kernels()
        implied = grads()
    finally:
        torch.use_deterministic_algorithms(before)
    assert names == kernels(deterministic=True), names
    ordered = torch.cuda.get_device_capability()[0] == 9 and d <= 128
    assert any("flash_bwd_dq_kernel" in n for n in names) != ordered, names
    for a, b in zip(explicit, implied):
        assert torch.equal(a, b)


def test_dropout_keep_rate_and_seed():
    q, k, v = [t.detach() for t in make(2, 512, 512, 4, 4, 64, torch.float16)]
    torch.manual_seed(7)
    a, _, s_dmask = flash_attn_func(q, k, v, dropout_p=0.3, return_attn_probs=True)
    torch.manual_seed(7)
    b = flash_attn_func(q, k, v, dropout_p=0.3)
    assert torch.equal(a, b)
    kept = (~torch.signbit(s_dmask)).float().mean().item()
    assert abs(kept - 0.7) < 3e-3


@pytest.mark.parametrize("b,sq,sk", [(2, 37, 0), (2, 0, 37), (0, 5, 5)])
def test_empty_sequences(b, sq, sk):
    # No keys: output 0, logsumexp -inf, zero gradients; no queries or no batch: empty results.
    for d in (64, 128, 256):
        q, k, v = make(b, sq, sk, 4, 2, d, torch.bfloat16)
        out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
        assert out.shape == q.shape and lse.shape == (b, 4, sq)
        assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())
        grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        for g, x in zip(grads, (q, k, v)):
            assert g.shape == x.shape and torch.equal(g, torch.zeros_like(g))


def test_rows_with_nothing_to_attend_give_zero():
    q, k, v = make(1, 40, 10, 2, 2, 64, torch.bfloat16)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.all(out[:, :30] == 0) and torch.isneginf(lse[:, :, :30]).all()
    out.sum().backward()
    assert all(torch.isfinite(g).all() for g in (q.grad, k.grad, v.grad))


def test_over_2_31_elements():
    # 64-bit offsets: q, k, v of 8193 x 2048 x 1 x 128 > 2^31 elements each; check the last batches.
    b, s, d = 8193, 2048, 128
    q, k, v = [torch.randn(b, s, 1, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    assert q.numel() > 2**31
    out = flash_attn_func(q, k, v, causal=True)
    tail = slice(b - 2, b)
    ref, _ = attention_ref(q[tail], k[tail], v[tail], causal=True)
    pt, _ = attention_ref(q[tail], k[tail], v[tail], causal=True, upcast=False)
    check_rule("out", out[tail], ref, pt, torch.bfloat16)


def test_cuda_errors():
    q = torch.randn(1, 8, 2, 64, device="cuda")
    with pytest.raises(RuntimeError, match="CUDA kernels take float16 or bfloat16"):
        flash_attn_func(q, q, q)


@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_compile_and_cuda_graphs(dropout_p):
    torch._dynamo.reset()
    lin = torch.nn.Linear(128, 3 * 128, device="cuda", dtype=torch.bfloat16)

    def step(x):
        b, s, _ = x.shape
        qkv = lin(x).view(b, s, 3, 2, 64)
        return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p=dropout_p, causal=True)

    compiled = torch.compile(step, fullgraph=True, mode="reduce-overhead")
    x = torch.randn(2, 256, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for _ in range(3):
        torch.compiler.cudagraph_mark_step_begin()
        x.grad = None  # gradients of a replayed graph live in its memory pool: do not accumulate
        lin.zero_grad(set_to_none=True)
        out = compiled(x)
        out.float().sum().backward()
        out = out.detach().clone()
    assert torch.isfinite(x.grad).all()
    if dropout_p == 0:
        torch.testing.assert_close(out, step(x), atol=2e-2, rtol=2e-2)


def three_schedules(env_var, fn, monkeypatch):
    """fn() under a persistent kernel's three schedules: a CTA per SM (the default), three CTAs
    (a hundred tiles or more each) and a CTA per tile (env_var = 0)."""
    results = [fn()]
    for ctas in ("3", "0"):
        monkeypatch.setenv(env_var, ctas)
        results.append(fn())
    return results


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                    reason="Hopper (sm_90) only")
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("case", ["dense", "causal", "window", "gqa", "varlen", "block_sparse"])
def test_persistent_forward_equals_a_cta_per_tile(case, d, monkeypatch):
    # More (query block, head, batch) tiles than SMs, so the persistent forward's CTAs claim tiles
    # from its counter and carry Q and the K/V ring from tile to tile. Each tile's arithmetic is
    # the same as with one CTA per tile (FLASH_ATTN_SM90_FWD_PERSISTENT=0): equal bit for bit, and
    # so with the CTAs capped at three.
    from flash_attn import BlockSparseMask, flash_attn_blocksparse_func, flash_attn_varlen_func
    torch.manual_seed(0)
    q, k, v = make(3, 1500, 1300, 8, 2 if case == "gqa" else 8, d, torch.bfloat16)
    if case == "varlen":
        lens = torch.tensor([0, 1, 700, 1500, 129, 2000])
        cu = torch.cat([torch.zeros(1), lens.cumsum(0)]).int().cuda()
        qp, kp, vp = (torch.randn(int(lens.sum()), 8, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        run = lambda: flash_attn_varlen_func(qp, kp, vp, cu, cu, 2000, 2000, causal=True, return_attn_probs=True)[:2]
    elif case == "block_sparse":
        layout = torch.rand(3, 8, 12, 11) < 0.4
        layout[:, :, 2] = False  # a query block that keeps nothing
        layout[:, :, 5] = True  # one that keeps everything
        mask = BlockSparseMask.from_layout(layout, 1500, 1300).to("cuda")
        run = lambda: flash_attn_blocksparse_func(q, k, v, mask, causal=True, return_attn_probs=True)[:2]
    else:
        kw = dict(causal=case in ("causal", "gqa"), window_size=(300, 100) if case == "window" else (-1, -1))
        run = lambda: flash_attn_func(q, k, v, return_attn_probs=True, **kw)[:2]
        check_against_reference(q, k, v, **kw)
    names = kernel_names(run)
    assert any("flash_fwd_sm90_ws_kernel<" in n for n in names), names
    persistent, three_ctas, per_tile = three_schedules("FLASH_ATTN_SM90_FWD_PERSISTENT", run, monkeypatch)
    for a, b, c in zip(persistent, three_ctas, per_tile):
        assert torch.equal(a, c) and torch.equal(b, c)


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                    reason="Hopper (sm_90) only")
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("case", ["dense", "causal", "window", "gqa", "varlen", "block_sparse", "bias"])
def test_persistent_backward_equals_a_cta_per_tile(case, d, monkeypatch):
    # More (key block, head, batch) tiles than SMs, so the persistent backward's CTAs claim tiles
    # from its counter and carry their barriers and K/V buffers from tile to tile. dK and dV are
    # each tile's own sums, the same bit for bit as with a CTA per tile
    # (FLASH_ATTN_SM90_BWD_PERSISTENT=0) or three CTAs; dQ's adds come in another order.
    from flash_attn import BlockSparseMask, flash_attn_blocksparse_func, flash_attn_varlen_func
    torch.manual_seed(0)
    q, k, v = make(3, 1300, 1500, 8, 2 if case == "gqa" else 8, d, torch.bfloat16)
    inputs = (q, k, v)
    if case == "varlen":
        lens = torch.tensor([0, 1, 700, 1500, 129, 2000])
        cu = torch.cat([torch.zeros(1), lens.cumsum(0)]).int().cuda()
        inputs = tuple(torch.randn(int(lens.sum()), 8, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
        run = lambda: flash_attn_varlen_func(*inputs, cu, cu, 2000, 2000, causal=True)
    elif case == "block_sparse":
        layout = torch.rand(3, 8, 11, 12) < 0.4
        layout[:, :, :, 2] = False  # a key block no query block keeps
        layout[:, :, 5] = True
        mask = BlockSparseMask.from_layout(layout, 1300, 1500).to("cuda")
        run = lambda: flash_attn_blocksparse_func(q, k, v, mask, causal=True)
    elif case == "bias":
        bias = torch.randn(3, 8, 1300, 1500, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        inputs = (q, k, v, bias)
        run = lambda: flash_attn_func(q, k, v, attn_bias=bias)
    else:
        kw = dict(causal=case in ("causal", "gqa"), window_size=(300, 100) if case == "window" else (-1, -1))
        run = lambda: flash_attn_func(q, k, v, **kw)
        check_against_reference(q, k, v, **kw)
    out = run()
    dout = torch.randn_like(out)
    grads = lambda: torch.autograd.grad(run(), inputs, dout)  # noqa: E731
    names = kernel_names(grads)
    assert any("flash_bwd_sm90_ws_kernel<" in n for n in names), names
    persistent, three_ctas, per_tile = three_schedules("FLASH_ATTN_SM90_BWD_PERSISTENT", grads, monkeypatch)
    for i, (a, b, c) in enumerate(zip(persistent, three_ctas, per_tile)):
        assert torch.isfinite(a).all()
        if i in (1, 2):  # dK, dV
            assert torch.equal(a, c) and torch.equal(b, c)
        else:  # dQ (and the bias gradient): float32 adds in another order, then rounded
            torch.testing.assert_close(a, c, atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(b, c, atol=2e-2, rtol=2e-2)
