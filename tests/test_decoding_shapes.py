"""Decoding shapes through flash_attn_func: one query per head under GQA runs the query heads of a
key head as rows of it (folded), forward and backward against the float64 reference and against
the unfolded path. CPU always; CUDA (marked gpu) on a GPU, where a few rows over many keys also
split the keys over CTAs (tests/test_attention_gpu.py covers that alone)."""

import pytest
import torch

from flash_attn import flash_attn_func
from reference import check_grads_against_reference

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("h, hk", [(8, 2), (6, 1), (4, 4)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sk", [1, 77, 3000])
def test_one_query_per_head(h, hk, causal, sk, device):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q = torch.randn(2, 1, h, 64, dtype=dtype, device=device, requires_grad=True)
    k, v = (torch.randn(2, sk, hk, 64, dtype=dtype, device=device, requires_grad=True) for _ in range(2))
    out = flash_attn_func(q, k, v, causal=causal, softcap=20.0)
    assert out.shape == q.shape and out.is_contiguous()
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_grads_against_reference(q, k, v, out, dout, grads, dtype, causal=causal, softcap=20.0)
    # The same function unfolded: a window that hides nothing turns the fold off.
    unfolded = flash_attn_func(q, k, v, causal=causal, softcap=20.0, window_size=(sk, sk))
    tol = 1e-6 if device == "cpu" else 1e-2
    torch.testing.assert_close(out, unfolded, rtol=tol, atol=tol)


@pytest.mark.parametrize("device", DEVICES)
def test_one_query_per_head_strided_q(device):
    """q a strided view (a slice of a packed qkv): the fold reshapes it, copying where it must."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    qkv = torch.randn(3, 1, 8 + 2 * 2, 64, dtype=dtype, device=device)
    q, k, v = qkv[:, :, :8], qkv[:, :, 8:10].expand(3, 1, 2, 64), qkv[:, :, 10:]
    k = torch.cat([k, torch.randn(3, 40, 2, 64, dtype=dtype, device=device)], dim=1)
    v = torch.cat([v, torch.randn(3, 40, 2, 64, dtype=dtype, device=device)], dim=1)
    out = flash_attn_func(q, k, v)
    tol = 1e-6 if device == "cpu" else 1e-2
    torch.testing.assert_close(out, flash_attn_func(q.contiguous(), k, v, window_size=(41, 41)), rtol=tol, atol=tol)


@pytest.mark.parametrize("device", DEVICES)
def test_one_query_per_head_output_is_not_copied(device):
    """The folded forward writes its output with the folded q's strides, so unfolding it is a
    view: no copy or clone runs in the call (float32 on the CPU, where nothing else copies)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q = torch.randn(2, 1, 8, 64, dtype=dtype, device=device)
    k, v = (torch.randn(2, 50, 2, 64, dtype=dtype, device=device) for _ in range(2))
    flash_attn_func(q, k, v)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = flash_attn_func(q, k, v)
    names = [e.name for e in prof.events()]
    assert out.is_contiguous() and names.count("aten::clone") + names.count("aten::copy_") == 0, names
    tol = 1e-6 if device == "cpu" else 1e-2
    torch.testing.assert_close(out, flash_attn_func(q, k, v, window_size=(50, 50)), rtol=tol, atol=tol)
