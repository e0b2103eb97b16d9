"""GPU benchmark of block-sparse attention: ours dense, ours block-sparse and FlexAttention
(torch.compile'd flex_attention with the same 128 x 128 BlockMask), side by side in one run.

Grid (issue 4): head dim 128, 16 heads, batch * seqlen = 16384 tokens, seqlen 4096 and 16384,
random layouts with the diagonal kept at densities 1.0, 0.5, 0.25, 0.1; then a long sequence:
batch 1, 16 heads, head dim 64, seqlen 65536, butterfly layout. Effective TFLOP/s counts the kept
blocks' FLOPs only (density x 4 b h s^2 d forward, 2.5x that backward). Times are medians of
CUDA-event timings, the backward timed on its own, every point of a seqlen once per round over
several rounds (benchmark_attention.interleaved_times). Writes JSON and a PNG of time against
density, and prints the issue's two ratios per point, each the median over rounds of the ratio
within a round: time / (density + 0.05) x dense time (target <= 1) and speed over FlexAttention
(target >= 1.2).
"""

import argparse
import os
import sys
from statistics import median

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.benchmark_attention import (compiled_flex, finish_axis, interleaved_times, median_ratio,  # noqa: E402
                                            peak_fwd_bwd_bytes, save_results)
from flash_attn import BlockSparseMask, flash_attn_blocksparse_func, flash_attn_func  # noqa: E402
from flash_attn.block_sparse import butterfly_layout, random_layout  # noqa: E402

BLOCK = 128


def inputs(b, s, h, d, dtype, heads_first=False):
    shape = (b, h, s, d) if heads_first else (b, s, h, d)
    return [torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3)]


def ours(b, s, h, d, dtype, layout):
    q, k, v = inputs(b, s, h, d, dtype)
    if layout is None:
        return (lambda: flash_attn_func(q, k, v)), (q, k, v)
    mask = BlockSparseMask.from_layout(layout, s, s).to("cuda")  # built once, outside the timed step
    return (lambda: flash_attn_blocksparse_func(q, k, v, mask)), (q, k, v)


def flex(b, s, h, d, dtype, layout):
    from torch.nn.attention.flex_attention import BlockMask
    flex_attention = compiled_flex()
    # The same kept blocks, all marked full (no mask_mod inside them): FlexAttention's fastest form.
    lists = BlockSparseMask.from_layout(layout, s, s).q_lists.to("cuda")
    counts, indices = lists[..., 0].contiguous(), lists[..., 1:].clamp(min=0).contiguous()
    block_mask = BlockMask.from_kv_blocks(torch.zeros_like(counts), torch.zeros_like(indices), counts, indices,
                                          BLOCK_SIZE=BLOCK, seq_lengths=(s, s))
    q, k, v = inputs(b, s, h, d, dtype, heads_first=True)
    return (lambda: flex_attention(q, k, v, block_mask=block_mask)), (q, k, v)


IMPLS = {"ours": ours, "flex": flex}


def grid_rows(impls, b, s, h, d, dtype, layouts, rounds, with_dense=True):
    """Ours dense and every impl at every layout of one seqlen, timed in interleaved rounds
    (benchmark_attention.interleaved_times), with each point's ratios to the issue's targets taken
    within each round: time / ((density + 0.05) x dense time), and FlexAttention's time / ours."""
    points, meta = {}, {}
    if with_dense:
        points["ours_dense"] = ours(b, s, h, d, dtype, None)
        meta["ours_dense"] = dict(impl="ours_dense", pattern="dense", density=1.0)
    for pattern, layout in layouts:
        density = layout.float().mean().item()
        for impl in impls:
            name = f"{impl}@{pattern}:{density:.4f}"
            points[name] = IMPLS[impl](b, s, h, d, dtype, layout)
            meta[name] = dict(impl=impl, pattern=pattern, density=density)
    times = interleaved_times(points, rounds)
    dense = times.get("ours_dense")
    rows = []
    for name, m in meta.items():
        t = times[name]
        flops = m["density"] * 4 * b * h * s * s * d
        row = dict(m, seqlen=s, batch=b, nheads=h, headdim=d, rounds=rounds, fwd_ms=median(t["fwd"]),
                   bwd_ms=median(t["bwd"]), fwd_ms_rounds=t["fwd"], bwd_ms_rounds=t["bwd"])
        row.update(fwd_tflops=flops / row["fwd_ms"] / 1e9, bwd_tflops=2.5 * flops / row["bwd_ms"] / 1e9,
                   peak_mb=peak_fwd_bwd_bytes(*points[name]) / 2**20)
        if m["impl"] == "ours":
            for key in ("fwd", "bwd"):
                if dense and m["pattern"] == "random":
                    row[f"{key}_vs_target"] = median_ratio(t[key], dense[key], m["density"] + 0.05)
                flex_name = name.replace("ours@", "flex@")
                if flex_name in times:
                    row[f"{key}_x_flex"] = median_ratio(times[flex_name][key], t[key])
        rows.append(row)
    return rows


def error_rows(impls, s, h, d, layouts, err):
    return [dict(impl=impl, pattern=pattern, density=layout.float().mean().item(), seqlen=s, nheads=h, headdim=d,
                 fwd_ms=None, bwd_ms=None, error=str(err).splitlines()[0][:200])
            for pattern, layout in layouts for impl in impls]


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    grid = [r for r in rows if r["pattern"] == "random"]
    seqlens = sorted({r["seqlen"] for r in grid})
    fig, axes = plt.subplots(len(seqlens), 2, figsize=(10, 3.4 * len(seqlens)), squeeze=False)
    for row_axes, s in zip(axes, seqlens):
        dense = next((r for r in rows if r["impl"] == "ours_dense" and r["seqlen"] == s), None)
        for ax, metric in zip(row_axes, ("fwd_ms", "bwd_ms")):
            for impl in ("ours", "flex"):
                pts = sorted((r["density"], r[metric]) for r in grid
                             if r["impl"] == impl and r["seqlen"] == s and r[metric] is not None)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=impl)
            if dense and dense[metric]:
                xs = [0.1, 1.0]
                ax.plot(xs, [(x + 0.05) * dense[metric] for x in xs], "k--", linewidth=1,
                        label="(density + 0.05) x ours dense")
            finish_axis(ax, f"seqlen {s}, d=128, h=16: {metric.split('_')[0]}", "block density", "ms")
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seqlens", default="4096,16384")
    ap.add_argument("--densities", default="1.0,0.5,0.25,0.1")
    ap.add_argument("--impls", default="ours,flex")
    ap.add_argument("--long-seqlen", type=int, default=65536, help="0 skips the long-sequence point")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds per seqlen")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "blocksparse.json"))
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    dtype, d, h = torch.bfloat16, 128, 16
    impls = args.impls.split(",")
    rows = []
    for s in map(int, args.seqlens.split(",")):
        b, nb = max(1, 16384 // s), s // BLOCK
        layouts = [("random", random_layout(nb, nb, target, seed=0, keep_diagonal=True))
                   for target in map(float, args.densities.split(","))]
        try:
            rows += grid_rows(impls, b, s, h, d, dtype, layouts, args.rounds)
        except (RuntimeError, torch.OutOfMemoryError) as e:  # a point that fails ends its seqlen's rounds
            rows += error_rows(impls, s, h, d, layouts, e)
        torch.cuda.empty_cache()
    if args.long_seqlen:
        s = args.long_seqlen
        for impl in impls:  # one at a time: FlexAttention may not fit
            layouts = [("butterfly", butterfly_layout(s // BLOCK))]
            try:
                rows += grid_rows([impl], 1, s, 16, 64, dtype, layouts, 1, with_dense=False)
            except (RuntimeError, torch.OutOfMemoryError) as e:
                rows += error_rows([impl], s, 16, 64, layouts, e)
            torch.cuda.empty_cache()
        ours_long, flex_long = (next((r for r in rows if r["impl"] == i and r["pattern"] == "butterfly"
                                      and r["fwd_ms"]), None) for i in ("ours", "flex"))
        if ours_long and flex_long:
            for key in ("fwd", "bwd"):
                ours_long[f"{key}_x_flex"] = flex_long[f"{key}_ms"] / ours_long[f"{key}_ms"]

    save_results(rows, args.out, plot, args.plot, dtype="bf16")

    print(f"{'impl':>10} {'pattern':>9} {'seqlen':>6} {'density':>7} {'fwd ms':>8} {'bwd ms':>8} "
          f"{'fwd TF':>7} {'bwd TF':>7} {'peak MB':>8} {'fwd/(d+.05)dense':>17} {'bwd/(d+.05)dense':>17} "
          f"{'fwd xflex':>9} {'bwd xflex':>9}")
    for r in rows:
        if r["fwd_ms"] is None:
            print(f"{r['impl']:>10} {r['pattern']:>9} {r['seqlen']:>6} {r['density']:7.3f}  error: {r['error']}")
            continue
        cells = [f"{r[k]:17.2f}" if k in r else f"{'':>17}" for k in ("fwd_vs_target", "bwd_vs_target")]
        cells += [f"{r[k]:9.2f}" if k in r else f"{'':>9}" for k in ("fwd_x_flex", "bwd_x_flex")]
        print(f"{r['impl']:>10} {r['pattern']:>9} {r['seqlen']:>6} {r['density']:7.3f} {r['fwd_ms']:8.3f} "
              f"{r['bwd_ms']:8.3f} {r['fwd_tflops']:7.0f} {r['bwd_tflops']:7.0f} {r['peak_mb']:8.0f} " + " ".join(cells))

if __name__ == "__main__":
    main()
