"""CPU benchmark: our forward and forward+backward against torch's CPU scaled_dot_product_attention
(its default CPU kernel, and the MATH backend for memory), float32 unless --dtype, b=1, h=8, d=64.

Prints a table and writes JSON (benchmarks/results/cpu.json unless --out). Memory is the peak
resident-set growth of a child process running one forward+backward, so runs do not interfere.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from flash_attn import flash_attn_func  # noqa: E402

B, H, D = 1, 8, 64


def make(s, requires_grad=False, dtype=torch.float32):
    return [torch.randn(B, s, H, D, dtype=dtype, requires_grad=requires_grad) for _ in range(3)]


def run(impl, q, k, v, causal):
    if impl == "flash_attn":
        return flash_attn_func(q, k, v, causal=causal)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    if impl == "sdpa_math":
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)
    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)


def median_ms(fn, repeat):
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times)[len(times) // 2]


MEM_CHILD = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from benchmarks.benchmark_cpu import make, run
impl, s, causal, dtype = sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1", getattr(torch, sys.argv[5])
run(impl, *make(64, True, dtype), causal).sum().backward()  # warm-up at a tiny size
q, k, v = make(s, True, dtype)
dout = torch.randn_like(q)
def status_kb(key):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key + ":"))
open("/proc/self/clear_refs", "w").write("5")  # reset the peak-RSS mark (VmHWM) to the current RSS
before = status_kb("VmRSS")
run(impl, q, k, v, causal).backward(dout)
print((status_kb("VmHWM") - before) / 1024)
"""


def cpu_model():
    try:
        return next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def peak_mb(impl, s, causal, dtype):
    res = subprocess.run([sys.executable, "-c", MEM_CHILD, ROOT, impl, str(s), "1" if causal else "0", dtype],
                         capture_output=True, text=True, timeout=900)
    return float(res.stdout.strip().splitlines()[-1]) if res.returncode == 0 else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seqlens", default="512,1024,2048,4096")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "cpu.json"))
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    rows = []
    for causal in (False, True):
        for s in map(int, args.seqlens.split(",")):
            flops = 4 * B * H * s * s * D / (2 if causal else 1)
            for impl in ("flash_attn", "sdpa", "sdpa_math"):
                q, k, v = make(s, dtype=dtype)
                with torch.no_grad():
                    fwd = median_ms(lambda: run(impl, q, k, v, causal), args.repeat)
                qg, kg, vg = make(s, True, dtype)
                dout = torch.randn_like(qg)
                fb = median_ms(lambda: run(impl, qg, kg, vg, causal).backward(dout), max(2, args.repeat // 2))
                rows.append(dict(impl=impl, seqlen=s, causal=causal, fwd_ms=fwd, fwd_bwd_ms=fb,
                                 fwd_gflops=flops / fwd / 1e6, fwd_bwd_gflops=3.5 * flops / fb / 1e6,
                                 peak_mb=peak_mb(impl, s, causal, args.dtype)))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    meta = dict(torch=torch.__version__, threads=torch.get_num_threads(), batch=B, heads=H, headdim=D, dtype=args.dtype,
                cpu=cpu_model())
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)

    print(f"{meta['cpu']} ({torch.backends.cpu.get_cpu_capability()}), {torch.get_num_threads()} threads, "
          f"{args.dtype}, b={B} h={H} d={D}; times in ms, memory = peak RSS growth in MB")
    print(f"{'causal':>6} {'seqlen':>6} | {'ours fwd':>9} {'sdpa fwd':>9} {'ratio':>6} | {'ours f+b':>9} {'sdpa f+b':>9} {'ratio':>6} | "
          f"{'ours MB':>8} {'sdpa MB':>8} {'math MB':>8}")
    by = {(r["impl"], r["seqlen"], r["causal"]): r for r in rows}
    for causal in (False, True):
        for s in map(int, args.seqlens.split(",")):
            o, t, m = by["flash_attn", s, causal], by["sdpa", s, causal], by["sdpa_math", s, causal]
            print(f"{str(causal):>6} {s:>6} | {o['fwd_ms']:9.1f} {t['fwd_ms']:9.1f} {t['fwd_ms'] / o['fwd_ms']:6.2f} | "
                  f"{o['fwd_bwd_ms']:9.1f} {t['fwd_bwd_ms']:9.1f} {t['fwd_bwd_ms'] / o['fwd_bwd_ms']:6.2f} | "
                  f"{o['peak_mb']:8.1f} {t['peak_mb']:8.1f} {m['peak_mb']:8.1f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
