"""Errors against a float64 reference at GPT-2 124M's attention shape (b16, s1024, h12, d64, causal,
bf16): ours (default and deterministic backward) and SDPA's kernels, mean and max |error| of out,
dq, dk, dv, each mean as a ratio to FlashAttention-2's, and each one's fwd+bwd time (CUDA events). Tells whether the GPT-2 example's loss
drift (issue 6) follows from a less accurate kernel. GPU: PYTHONPATH=. python3 scripts/attention_errors_gpt2_shape.py"""
import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from flash_attn import flash_attn_func

torch.manual_seed(0)
b, s, h, d = 16, 1024, 12, 64
# Inputs rounded to bf16 first, so the reference sees the same numbers as the kernels.
q, k, v = (torch.randn(b, s, h, d, device="cuda").bfloat16().float() for _ in range(3))
dout = torch.randn(b, s, h, d, device="cuda").bfloat16().float()


def sdpa(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True).transpose(1, 2)


def grads(fn, dtype):
    x = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    o = fn(*x)
    return [o.float()] + [g.float() for g in torch.autograd.grad(o, x, dout.to(dtype))]


with sdpa_kernel(SDPBackend.MATH):
    ref = grads(sdpa, torch.float64)
impls = {"ours": (None, lambda *x: flash_attn_func(*x, causal=True)),
         "ours_det": (None, lambda *x: flash_attn_func(*x, causal=True, deterministic=True)),
         "fa2": (SDPBackend.FLASH_ATTENTION, sdpa), "cudnn": (SDPBackend.CUDNN_ATTENTION, sdpa),
         "efficient": (SDPBackend.EFFICIENT_ATTENTION, sdpa), "math_bf16": (SDPBackend.MATH, sdpa)}


def fwd_bwd_ms(fn, iters=20):
    for i in range(iters + 5):
        if i == 5:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        grads(fn, torch.bfloat16)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


rows, times = {}, {}
for name, (be, fn) in impls.items():
    with sdpa_kernel(be) if be is not None else contextlib.nullcontext():
        try:
            out = grads(fn, torch.bfloat16)
        except Exception as e:
            print(name, "failed", str(e)[:100])
            continue
        ms = fwd_bwd_ms(fn)
    rows[name] = [((a.double() - r).abs().mean().item(), (a.double() - r).abs().max().item()) for a, r in zip(out, ref)]
    times[name] = ms
print("fwd+bwd ms; mean |err| (max |err|) against float64; ratio of mean to fa2's")
for name, r in rows.items():
    print(f"{name:10s} {times[name]:6.2f} ms", "  ".join(f"{t}: {m:.2e} ({x:.2e}) x{m / rows['fa2'][i][0]:.2f}" for i, (t, (m, x)) in enumerate(zip(("out", "dq", "dk", "dv"), r))))
