"""GPU benchmark of variable-length batches (issue 5): flash_attn_varlen_func on random lengths
between 128 and 4096 tokens (16384 in all) against our dense kernels on the same token count at
the average length (batch = number of sequences), and against padding every sequence to the
longest. 16 heads, bf16. TFLOP/s counts each sequence's own pairs (4 d per pair forward, halved
for causal; 2.5x that backward). The issue's target: varlen >= 0.9x the dense TFLOP/s. Writes
JSON (--out) and a PNG (--plot).
"""

import argparse
import os
import random
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.benchmark_attention import finish_axis, save_results, time_fwd_bwd  # noqa: E402
from flash_attn import flash_attn_func, flash_attn_varlen_func  # noqa: E402

TOTAL = 16384


def random_lengths(seed, lo=128, hi=4096, total=TOTAL):
    """Lengths drawn uniformly from [lo, hi] until they fill total tokens; the last one is cut to fit
    (and merged into its neighbour when that would leave it below lo)."""
    rng, lengths = random.Random(seed), []
    while sum(lengths) < total:
        lengths.append(min(rng.randint(lo, hi), total - sum(lengths)))
    if len(lengths) > 1 and lengths[-1] < lo:
        lengths[-2] += lengths.pop()
    return lengths


def bf16(*shape):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)


def varlen_point(lengths, h, d, causal):
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), device="cuda", dtype=torch.int32)
    q, k, v = bf16(TOTAL, h, d), bf16(TOTAL, h, d), bf16(TOTAL, h, d)
    m = max(lengths)
    return time_fwd_bwd(lambda: flash_attn_varlen_func(q, k, v, cu, cu, m, m, causal=causal), (q, k, v))


def dense_point(b, s, h, d, causal):
    q, k, v = bf16(b, s, h, d), bf16(b, s, h, d), bf16(b, s, h, d)
    return time_fwd_bwd(lambda: flash_attn_func(q, k, v, causal=causal), (q, k, v))


def row(kind, seed, lengths, h, d, causal, pairs, timing):
    t_fwd, t_fb, peak = timing
    flops = 4 * h * d * pairs * (0.5 if causal else 1.0)
    return dict(kind=kind, seed=seed, lengths=lengths, nheads=h, headdim=d, causal=causal, fwd_ms=t_fwd,
                bwd_ms=t_fb - t_fwd, peak_mb=peak / 2**20, fwd_tflops=flops / t_fwd / 1e9,
                bwd_tflops=2.5 * flops / (t_fb - t_fwd) / 1e9)


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    configs = sorted({(r["headdim"], r["causal"], r["seed"]) for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, metric in zip(axes, ("fwd_tflops", "bwd_tflops")):
        for i, kind in enumerate(("varlen", "dense", "padded")):
            vals = [next(r[metric] for r in rows if (r["headdim"], r["causal"], r["seed"]) == c and r["kind"] == kind)
                    for c in configs]
            ax.bar([j + 0.27 * (i - 1) for j in range(len(configs))], vals, width=0.27, label=kind)
        ax.set_xticks(range(len(configs)), [f"d{d}{' c' if c else ''} s{s}" for d, c, s in configs], fontsize=7)
        finish_axis(ax, f"16384 tokens, lengths 128-4096, h=16: {metric.split('_')[0]}", "config", "TFLOP/s")
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--headdims", default="64,128")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "varlen.json"))
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    h, rows = 16, []
    print(f"{'d':>3} {'causal':>6} {'seed':>4} {'n':>3} {'kind':>7} {'fwd ms':>8} {'bwd ms':>8} {'fwd TF':>7} "
          f"{'bwd TF':>7} {'fwd/dense':>9} {'bwd/dense':>9}")
    for d in map(int, args.headdims.split(",")):
        for causal in (False, True):
            for seed in map(int, args.seeds.split(",")):
                lengths = random_lengths(seed)
                n, avg, longest = len(lengths), round(TOTAL / len(lengths)), max(lengths)
                points = [row("varlen", seed, lengths, h, d, causal, sum(s * s for s in lengths),
                              varlen_point(lengths, h, d, causal)),
                          row("dense", seed, [avg] * n, h, d, causal, n * avg * avg, dense_point(n, avg, h, d, causal)),
                          # padding to the longest computes the padded rows too: count only the real pairs
                          row("padded", seed, lengths, h, d, causal, sum(s * s for s in lengths),
                              dense_point(n, longest, h, d, causal))]
                for r in points:
                    r["fwd_vs_dense"] = r["fwd_tflops"] / points[1]["fwd_tflops"]
                    r["bwd_vs_dense"] = r["bwd_tflops"] / points[1]["bwd_tflops"]
                    rows.append(r)
                    print(f"{d:>3} {str(causal):>6} {seed:>4} {n:>3} {r['kind']:>7} {r['fwd_ms']:>8.3f} "
                          f"{r['bwd_ms']:>8.3f} {r['fwd_tflops']:>7.0f} {r['bwd_tflops']:>7.0f} "
                          f"{r['fwd_vs_dense']:>9.2f} {r['bwd_vs_dense']:>9.2f}")
                torch.cuda.empty_cache()
    save_results(rows, args.out, plot, args.plot, dtype="bf16", total_tokens=TOTAL)


if __name__ == "__main__":
    main()
