"""`make demo`: our attention against the reference on an embedded default problem.

Runs on the GPU where the CUDA kernels are available, else on the CPU. Prints the time of the
forward and forward+backward, the peak memory, and the max error against a float64 reference.
"""

import argparse
import math
import os
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from flash_attn import flash_attn_func  # noqa: E402


def pick_device():
    if not torch.cuda.is_available():
        return "cpu", "no CUDA device"
    try:
        x = torch.randn(1, 8, 1, 64, device="cuda", dtype=torch.bfloat16)
        flash_attn_func(x, x, x)
        return "cuda", "CUDA kernels available"
    except RuntimeError as e:  # a build without the CUDA kernels
        return "cpu", f"CUDA kernels unavailable ({str(e).splitlines()[0]})"


def timed(fn, device, repeat=3):
    fn()
    times = []
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seqlen", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--headdim", type=int, default=64)
    ap.add_argument("--causal", action="store_true", default=True)
    args = ap.parse_args()

    device, why = pick_device()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    b, s, h, d = args.batch, args.seqlen, args.heads, args.headdim
    print(f"flash_attn demo on {device} ({why}): batch={b} seqlen={s} heads={h} headdim={d} "
          f"causal={args.causal} dtype={dtype}")
    q, k, v = [torch.randn(b, s, h, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3)]
    dout = torch.randn(b, s, h, d, device=device, dtype=dtype)

    def fwd_bwd():
        out = flash_attn_func(q, k, v, causal=args.causal)
        out.backward(dout)
        return out

    with torch.no_grad():
        t_fwd = timed(lambda: flash_attn_func(q, k, v, causal=args.causal), device)
    fwd_bwd()  # first-call allocations (thread pools, BLAS buffers, .grad) stay out of the peak
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t_fb = timed(fwd_bwd, device)
    peak_mb = (torch.cuda.max_memory_allocated() / 2**20 if device == "cuda"
               else (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024)

    # Float64 reference on the CPU
    q.grad = k.grad = v.grad = None
    out = fwd_bwd()
    qd, kd, vd = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    scores = torch.einsum("bihd,bjhd->bhij", qd, kd) / math.sqrt(d)
    if args.causal:
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("bhij,bjhd->bihd", torch.softmax(scores, -1), vd)
    ref.backward(dout.cpu().double())
    errs = {"out": (out.detach().cpu().double() - ref).abs().max().item()}
    for name, ours, r in (("dq", q, qd), ("dk", k, kd), ("dv", v, vd)):
        errs[name] = (ours.grad.cpu().double() - r.grad).abs().max().item()

    flops = 4 * b * h * s * s * d / (2 if args.causal else 1)
    print(f"forward          {t_fwd * 1e3:8.2f} ms  {flops / t_fwd / 1e12:8.3f} TFLOP/s")
    print(f"forward+backward {t_fb * 1e3:8.2f} ms  {3.5 * flops / t_fb / 1e12:8.3f} TFLOP/s")
    print(f"peak extra memory during forward+backward: {peak_mb:.1f} MB "
          f"(standard attention holds the {b * h * s * s * 4 / 2**20:.0f} MB float32 score matrix, several times)")
    print("max |error| vs float64 reference: " + ", ".join(f"{k}={v:.2e}" for k, v in errs.items()))


if __name__ == "__main__":
    main()
