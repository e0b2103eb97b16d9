"""Score modifiers: attn_bias (float, with its gradient, and bool masks), ALiBi and soft-capping,
alone and combined with causal, windows, dropout, GQA, block masks and varlen, against the float64
reference under the tolerance rule; argument checks, opcheck and torch.compile. CPU always; CUDA
(marked gpu) on a GPU."""


import pytest
import torch

from flash_attn import BlockSparseMask, flash_attn_blocksparse_func, flash_attn_func, flash_attn_varlen_func
from reference import attention_ref, check_rule, masked_scores, poison_allocator

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
CUDA_HEAD_DIMS = [32, 40, 64, 96, 128, 160, 192, 224, 256]


def default_dtype(device):
    return torch.float32 if device == "cpu" else torch.bfloat16


def make(b, sq, sk, h, hk, d, dtype, device):
    return [torch.randn(b, s, n, d, dtype=dtype, device=device, requires_grad=True)
            for s, n in ((sq, h), (sk, hk), (sk, hk))]


def bias_of(shape, dtype, device, requires_grad=True):
    return (torch.randn(shape, device=device) * 2).to(dtype).requires_grad_(requires_grad)


def slopes_of(shape, device):
    return torch.rand(shape, device=device) * 0.5 + 0.05


def check_mods(q, k, v, dropout_p=0.0, deterministic=False, **kw):
    """Output, softmax_lse, S_dmask and every gradient (the bias's too when it requires grad)
    against the float64 reference and PyTorch in the same precision."""
    dtype, device = q.dtype, q.device
    bias = kw.get("attn_bias")
    if device.type == "cuda":
        poison_allocator()
    out, lse, s_dmask = flash_attn_func(q, k, v, dropout_p=dropout_p, deterministic=deterministic,
                                        return_attn_probs=True, **kw)
    keep = None if dropout_p == 0.0 else ~torch.signbit(s_dmask)
    inputs = [q, k, v] + ([bias] if bias is not None and bias.requires_grad else [])
    dout = torch.randn_like(out)
    if device.type == "cuda":
        poison_allocator()
    grads = torch.autograd.grad(out, inputs, dout)

    ref, ref_probs = attention_ref(q, k, v, keep_mask=keep, dropout_p=dropout_p, **kw)
    ref_grads = torch.autograd.grad(ref, inputs, dout.double())
    pt, _ = attention_ref(q, k, v, keep_mask=keep, dropout_p=dropout_p, upcast=False, **kw)
    pt_grads = torch.autograd.grad(pt, inputs, dout)
    check_rule("out", out, ref, pt, dtype)
    for name, g, rg, pg in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads, pt_grads):
        check_rule(name, g, rg, pg, dtype)
    if bias is not None and bias.requires_grad:
        assert grads[3].shape == bias.shape and grads[3].dtype == bias.dtype

    # softmax_lse: the reference's, -inf exactly where a row attends to nothing
    ref_lse = torch.logsumexp(masked_scores(q, k, **kw), dim=-1)
    assert torch.equal(torch.isneginf(lse.cpu()), torch.isneginf(ref_lse.cpu()))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], atol=2e-3 if dtype != torch.float32 else 1e-4,
                               rtol=1e-3)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(s_dmask.abs().double(), ref_probs, atol=tol)
    return out, lse, grads


# Bias shapes: full, broadcast over batch / heads / query rows / keys, 2-D and 3-D.
BIAS_SHAPES = {
    "full": lambda b, h, sq, sk: (b, h, sq, sk),
    "per_head": lambda b, h, sq, sk: (1, h, sq, sk),
    "key_padding": lambda b, h, sq, sk: (b, 1, 1, sk),
    "per_query": lambda b, h, sq, sk: (b, h, sq, 1),
    "2d": lambda b, h, sq, sk: (sq, sk),
    "3d": lambda b, h, sq, sk: (h, 1, sk),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape_name", list(BIAS_SHAPES))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_float_bias_and_its_gradient(device, shape_name, causal, deterministic):
    b, sq, sk, h, hk, d = 2, 77, 131, 4, 2, 64
    dtype = default_dtype(device)
    q, k, v = make(b, sq, sk, h, hk, d, dtype, device)
    bias = bias_of(BIAS_SHAPES[shape_name](b, h, sq, sk), dtype, device)
    check_mods(q, k, v, causal=causal, deterministic=deterministic, attn_bias=bias)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sq,sk", [(1, 1), (1, 40), (40, 1), (130, 257), (257, 130)])
def test_bias_odd_sizes(device, sq, sk):
    dtype = default_dtype(device)
    q, k, v = make(2, sq, sk, 2, 1, 32, dtype, device)
    check_mods(q, k, v, attn_bias=bias_of((2, 2, sq, sk), dtype, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("softcap, deterministic", [(0.0, False), (0.0, True), (5.0, False), (5.0, True)])
def test_large_bias_on_the_last_query_row(device, softcap, deterministic):
    """A bias of 100 on the last row, whose query block runs past seqlen_q: the kernels' rows past
    the end read that row's bias (once past the bias's end: compute-sanitizer) and must give it
    no weight (exp2 of it overflowed and made dK, dV NaN)."""
    q, k, v = make(1, 63, 130, 2, 2, 64, default_dtype(device), device)
    bias = bias_of((63, 130), default_dtype(device), device, requires_grad=False)
    with torch.no_grad():
        bias[-1] = 100.0
    check_mods(q, k, v, causal=True, softcap=softcap, deterministic=deterministic, attn_bias=bias)


@pytest.mark.parametrize("device", DEVICES)
def test_bias_without_grad_and_float32_bias_for_16bit_inputs(device):
    dtype = torch.float16 if device == "cuda" else torch.float32
    q, k, v = make(1, 65, 90, 2, 2, 64, dtype, device)
    check_mods(q, k, v, attn_bias=bias_of((1, 2, 65, 90), dtype, device, requires_grad=False))
    bias32 = bias_of((65, 90), torch.float32, device)
    out = flash_attn_func(q, k, v, attn_bias=bias32)
    (g,) = torch.autograd.grad(out.sum(), bias32)
    assert g.dtype == torch.float32 and g.shape == bias32.shape and torch.isfinite(g).all()
    ref = flash_attn_func(q, k, v, attn_bias=bias32.detach().to(dtype))
    torch.testing.assert_close(out, ref, atol=2e-2 if dtype != torch.float32 else 1e-5, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_bool_mask_with_fully_masked_rows(device):
    b, sq, sk, h, d = 2, 70, 100, 2, 64
    dtype = default_dtype(device)
    q, k, v = make(b, sq, sk, h, h, d, dtype, device)
    mask = torch.rand(b, 1, sq, sk, device=device) > 0.3
    mask[0, :, 5] = False  # rows 5 of batch 0 and the last rows of batch 1 attend to nothing
    mask[1, :, sq - 3:] = False
    out, lse, grads = check_mods(q, k, v, attn_bias=mask)
    assert torch.isneginf(lse[0, :, 5]).all() and torch.isneginf(lse[1, :, sq - 3:]).all()
    assert (out[0, 5] == 0).all() and (out[1, sq - 3:] == 0).all()
    assert all(torch.isfinite(g).all() for g in grads)
    # A bias of -inf behaves like the bool mask
    inf_bias = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(~mask, float("-inf"))
    out2 = flash_attn_func(q, k, v, attn_bias=inf_bias)
    torch.testing.assert_close(out2, out, atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("slopes_shape", ["heads", "batch_heads"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(90, 90), (33, 160), (160, 33)])
def test_alibi(device, slopes_shape, causal, sq, sk):
    b, h = 2, 4
    dtype = default_dtype(device)
    q, k, v = make(b, sq, sk, h, 2, 64, dtype, device)
    slopes = slopes_of((h,) if slopes_shape == "heads" else (b, h), device)
    check_mods(q, k, v, causal=causal, alibi_slopes=slopes)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("softcap", [0.5, 5.0, 30.0])
@pytest.mark.parametrize("causal", [False, True])
def test_softcap(device, softcap, causal):
    dtype = default_dtype(device)
    q, k, v = make(2, 100, 140, 4, 4, 64, dtype, device)
    check_mods(q, k, v, causal=causal, softcap=softcap, softmax_scale=0.3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dropout_p", [0.0, 0.17])
@pytest.mark.parametrize("deterministic", [False, True])
def test_everything_combined(device, dropout_p, deterministic):
    b, sq, sk, h, hk, d = 2, 150, 190, 6, 2, 96
    dtype = default_dtype(device)
    q, k, v = make(b, sq, sk, h, hk, d, dtype, device)
    check_mods(q, k, v, dropout_p=dropout_p, deterministic=deterministic, window_size=(70, 20), softcap=4.0,
               alibi_slopes=slopes_of((b, h), device), attn_bias=bias_of((1, h, sq, sk), dtype, device))


@pytest.mark.parametrize("d", [8, 40, 128, 256])
def test_head_dims_cpu(d):
    q, k, v = make(1, 65, 80, 2, 1, d, torch.float32, "cpu")
    check_mods(q, k, v, causal=True, softcap=3.0, alibi_slopes=slopes_of((2,), "cpu"),
               attn_bias=bias_of((1, 2, 65, 80), torch.float32, "cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", CUDA_HEAD_DIMS)
def test_head_dims_cuda(d, dtype):
    q, k, v = make(2, 200, 300, 4, 2, d, dtype, "cuda")
    check_mods(q, k, v, causal=True, softcap=3.0, alibi_slopes=slopes_of((4,), "cuda"),
               attn_bias=bias_of((2, 4, 200, 300), dtype, "cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [32, 64, 96, 128])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("shape_name", ["full", "key_padding"])
def test_bias_and_alibi_without_cap_cuda(d, dtype, deterministic, shape_name):
    # Without a cap, head dims up to 128 run the warp-specialized backward (bias, ALiBi, dbias).
    b, sq, sk, h = 2, 190, 333, 4
    q, k, v = make(b, sq, sk, h, 2, d, dtype, "cuda")
    check_mods(q, k, v, deterministic=deterministic, alibi_slopes=slopes_of((h,), "cuda"),
               attn_bias=bias_of(BIAS_SHAPES[shape_name](b, h, sq, sk), dtype, "cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("shape_name", ["full", "key_padding"])
def test_longer_sequences_cuda(shape_name):
    b, s, h, d = 2, 1100, 4, 128
    q, k, v = make(b, s, s, h, h, d, torch.bfloat16, "cuda")
    check_mods(q, k, v, causal=True, attn_bias=bias_of(BIAS_SHAPES[shape_name](b, h, s, s), torch.bfloat16, "cuda"))


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_inputs_and_bias(device):
    dtype = default_dtype(device)
    b, sq, sk, h, d = 2, 60, 70, 2, 64
    q, k, v = [t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
               for t in make(b, sq, sk, h, h, d, dtype, device)]
    bias = bias_of((b, h, sk, sq), dtype, device).detach().transpose(-1, -2).requires_grad_()
    assert not bias.is_contiguous()
    check_mods(q, k, v, attn_bias=bias)


@pytest.mark.parametrize("device", DEVICES)
def test_with_block_mask(device):
    b, s, h, d = 1, 300, 2, 64
    dtype = default_dtype(device)
    q, k, v = make(b, s, s, h, h, d, dtype, device)
    layout = torch.tensor([[1, 0, 1], [0, 1, 0], [1, 1, 1]], dtype=torch.bool, device=device)
    bias = bias_of((b, h, s, s), dtype, device)
    mask = BlockSparseMask.from_layout(layout, s, s)
    ours = flash_attn_blocksparse_func(q, k, v, mask, softcap=2.0, attn_bias=bias)
    dout = torch.randn_like(ours)
    grads = torch.autograd.grad(ours, (q, k, v, bias), dout)
    elem = layout.repeat_interleave(128, 0).repeat_interleave(128, 1)[:s, :s]
    ref, _ = attention_ref(q, k, v, attn_mask=elem, softcap=2.0, attn_bias=bias)
    ref_grads = torch.autograd.grad(ref, (q, k, v, bias), dout.double())
    pt, _ = attention_ref(q, k, v, attn_mask=elem, softcap=2.0, attn_bias=bias, upcast=False)
    pt_grads = torch.autograd.grad(pt, (q, k, v, bias), dout)
    check_rule("out", ours, ref, pt, dtype)
    for name, g, rg, pg in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads, pt_grads):
        check_rule(name, g, rg, pg, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_with_alibi_and_softcap_equals_each_sequence(device):
    dtype = default_dtype(device)
    lengths = [(40, 50), (0, 7), (130, 90), (1, 1)]
    h, d = 4, 64
    qs = [torch.randn(sq, h, d, dtype=dtype, device=device) for sq, _ in lengths]
    ks = [torch.randn(sk, h, d, dtype=dtype, device=device) for _, sk in lengths]
    vs = [torch.randn(sk, h, d, dtype=dtype, device=device) for _, sk in lengths]
    cu_q = torch.tensor([0] + list(torch.tensor([s for s, _ in lengths]).cumsum(0)), dtype=torch.int32, device=device)
    cu_k = torch.tensor([0] + list(torch.tensor([s for _, s in lengths]).cumsum(0)), dtype=torch.int32, device=device)
    slopes = slopes_of((len(lengths), h), device)
    out = flash_attn_varlen_func(torch.cat(qs), torch.cat(ks), torch.cat(vs), cu_q, cu_k, 130, 90, causal=True,
                                 softcap=3.0, alibi_slopes=slopes)
    for i, (qi, ki, vi) in enumerate(zip(qs, ks, vs)):
        alone = flash_attn_func(qi[None], ki[None], vi[None], causal=True, softcap=3.0, alibi_slopes=slopes[i:i + 1])
        torch.testing.assert_close(out[cu_q[i]:cu_q[i + 1]], alone[0], atol=0, rtol=0)


def test_argument_checks():
    q, k, v = make(2, 16, 24, 4, 2, 32, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match=r"attn_bias must be broadcastable to \(batch, nheads, seqlen_q, seqlen_k\) "
                                           r"= \(2, 4, 16, 24\), got shape \[2, 4, 16, 23\]"):
        flash_attn_func(q, k, v, attn_bias=torch.zeros(2, 4, 16, 23))
    with pytest.raises(RuntimeError, match=r"attn_bias must be broadcastable.*got shape \[1, 2, 4, 16, 24\]"):
        flash_attn_func(q, k, v, attn_bias=torch.zeros(1, 2, 4, 16, 24))
    with pytest.raises(RuntimeError, match=r"attn_bias must be bool \(True = attend\) or float16, bfloat16 or "
                                           r"float32, got Int"):
        flash_attn_func(q, k, v, attn_bias=torch.zeros(16, 24, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"alibi_slopes must be float32, got Double"):
        flash_attn_func(q, k, v, alibi_slopes=torch.zeros(4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"alibi_slopes must have shape \(nheads,\) = \(4,\) or \(batch, nheads\) = "
                                           r"\(2, 4\), got \[3\]"):
        flash_attn_func(q, k, v, alibi_slopes=torch.zeros(3))
    with pytest.raises(RuntimeError, match=r"softcap must be >= 0 \(0 = off\), got -1"):
        flash_attn_func(q, k, v, softcap=-1.0)
    cu = torch.tensor([0, 16], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"attn_bias cannot be combined with cu_seqlens"):
        torch.ops.flash_attn.fwd(q[0], k[0, :16], v[0, :16], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=16,
                                 max_seqlen_k=16, attn_bias=torch.zeros(16, 16))
    out, lse, _, _ = torch.ops.flash_attn.fwd(q, k, v)
    with pytest.raises(RuntimeError, match=r"bias_requires_grad needs a floating-point attn_bias"):
        torch.ops.flash_attn.bwd(out, q, k, v, out, lse, attn_bias=torch.ones(16, 24, dtype=torch.bool),
                                 bias_requires_grad=True)


@pytest.mark.gpu
def test_argument_checks_cuda():
    q, k, v = make(1, 16, 16, 2, 2, 32, torch.bfloat16, "cuda")
    with pytest.raises(RuntimeError, match=r"attn_bias must be on the device of q \(cuda:0\), got cpu"):
        flash_attn_func(q, k, v, attn_bias=torch.zeros(16, 16))
    with pytest.raises(RuntimeError, match=r"alibi_slopes must be on the device of q \(cuda:0\), got cpu"):
        flash_attn_func(q, k, v, alibi_slopes=torch.zeros(2))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    dtype = default_dtype(device)
    q, k, v = [t.detach() for t in make(1, 20, 30, 2, 1, 32, dtype, device)]
    bias = torch.randn(1, 2, 20, 30, dtype=dtype, device=device)
    slopes = slopes_of((2,), device)
    kw = dict(attn_bias=bias, alibi_slopes=slopes, softcap=2.0)
    torch.library.opcheck(torch.ops.flash_attn.fwd.default, (q, k, v), dict(causal=True, **kw))
    out, lse, _, rng = torch.ops.flash_attn.fwd(q, k, v, causal=True, **kw)
    torch.library.opcheck(torch.ops.flash_attn.bwd.default, (torch.randn_like(out), q, k, v, out, lse),
                          dict(causal=True, rng_state=rng, bias_requires_grad=True, **kw))


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph_with_bias_grad(device):
    dtype = default_dtype(device)
    q, k, v = make(2, 40, 40, 2, 2, 32, dtype, device)
    bias = bias_of((2, 1, 1, 40), dtype, device)
    slopes = slopes_of((2,), device)

    def step(q, k, v, bias):
        return flash_attn_func(q, k, v, causal=True, softcap=5.0, alibi_slopes=slopes, attn_bias=bias).square().sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    loss = compiled(q, k, v, bias)
    grads = torch.autograd.grad(loss, (q, k, v, bias))
    eager = step(q, k, v, bias)
    eager_grads = torch.autograd.grad(eager, (q, k, v, bias))
    torch.testing.assert_close(loss, eager)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e)
