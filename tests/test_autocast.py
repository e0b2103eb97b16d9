"""torch.autocast, as scaled_dot_product_attention has it: inside a region q, k, v and a float
attn_bias run in the region's dtype, the casts on the autograd graph (float32 leaves get float32
gradients); alibi_slopes stays float32, bool masks and float64 are not cast. On CUDA this is what
lets an fp32 model under autocast call the kernels at all."""

import pytest
import torch

from flash_attn import flash_attn_func, flash_attn_varlen_func

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPES = {"cpu": [torch.bfloat16], "cuda": [torch.bfloat16, torch.float16]}


def leaves(*shapes, device):
    return [torch.randn(*s, device=device, requires_grad=True) for s in shapes]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [None, "float", "bool"])
def test_autocast_runs_in_the_region_dtype(device, bias):
    for dtype in DTYPES[device]:
        q, k, v = leaves((2, 37, 4, 32), (2, 45, 2, 32), (2, 45, 2, 32), device=device)
        kw = dict(causal=True, alibi_slopes=torch.rand(4, device=device))
        if bias == "float":
            kw["attn_bias"] = torch.randn(37, 45, device=device, requires_grad=True)
        elif bias == "bool":
            kw["attn_bias"] = torch.rand(37, 45, device=device) < 0.8
        with torch.autocast(device, dtype=dtype):
            out = flash_attn_func(q, k, v, **kw)
        assert out.dtype == dtype
        inputs = [q, k, v] + ([kw["attn_bias"]] if bias == "float" else [])
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, inputs, dout)
        # The same call on inputs cast by hand, outside any region.
        cast = [x.detach().to(dtype).requires_grad_() for x in inputs]
        ref_kw = dict(kw, attn_bias=cast[3]) if bias == "float" else kw
        ref = flash_attn_func(*cast[:3], **ref_kw)
        ref_grads = torch.autograd.grad(ref, cast, dout)
        assert torch.equal(out, ref)
        for g, rg, x in zip(grads, ref_grads, inputs):
            assert g.dtype == x.dtype == torch.float32
            torch.testing.assert_close(g, rg.float(), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_varlen_and_compile(device):
    dtype = torch.bfloat16
    lengths = [5, 0, 30]
    cu = torch.tensor([0] + lengths, device=device).cumsum(0).to(torch.int32)
    q, k, v = leaves((35, 4, 32), (35, 4, 32), (35, 4, 32), device=device)

    def step(q, k, v):
        with torch.autocast(device, dtype=dtype):
            return flash_attn_varlen_func(q, k, v, cu, cu, 30, 30, causal=True)

    eager = step(q, k, v)
    assert eager.dtype == dtype
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)(q, k, v)
    assert compiled.dtype == dtype
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    compiled.float().sum().backward()
    assert q.grad.dtype == torch.float32 and q.grad.isfinite().all()


def test_outside_a_region_nothing_is_cast():
    q, k, v = leaves((1, 9, 2, 16), (1, 9, 2, 16), (1, 9, 2, 16), device="cpu")
    assert flash_attn_func(q, k, v).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        x = torch.randn(1, 9, 2, 16, dtype=torch.float64)
        with pytest.raises(RuntimeError, match="q must be float16, bfloat16 or float32, got Double"):
            flash_attn_func(x, x, x)
