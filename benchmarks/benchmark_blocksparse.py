"""GPU benchmark of block-sparse attention: ours dense, ours block-sparse and FlexAttention
(torch.compile'd flex_attention with the same 128 x 128 BlockMask), side by side in one run.

Grid (issue 4): head dim 128, 16 heads, batch * seqlen = 16384 tokens, seqlen 4096 and 16384,
random layouts with the diagonal kept at densities 1.0, 0.5, 0.25, 0.1; then a long sequence:
batch 1, 16 heads, head dim 64, seqlen 65536, butterfly layout. Effective TFLOP/s counts the kept
blocks' FLOPs only (density x 4 b h s^2 d forward, 2.5x that backward). Times are medians of
CUDA-event timings (benchmark_attention.time_fwd_bwd); bwd = (fwd+bwd) - fwd. Writes JSON and a
PNG of time against density, and prints the issue's two ratios per point: time / (density + 0.05)
x dense time (target <= 1) and speed over FlexAttention (target >= 1.2).
"""

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.benchmark_attention import finish_axis, save_results, time_fwd_bwd  # noqa: E402
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


_flex = None


def flex(b, s, h, d, dtype, layout):
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
    global _flex
    if _flex is None:
        _flex = torch.compile(flex_attention)
    # The same kept blocks, all marked full (no mask_mod inside them): FlexAttention's fastest form.
    lists = BlockSparseMask.from_layout(layout, s, s).q_lists.to("cuda")
    counts, indices = lists[..., 0].contiguous(), lists[..., 1:].clamp(min=0).contiguous()
    block_mask = BlockMask.from_kv_blocks(torch.zeros_like(counts), torch.zeros_like(indices), counts, indices,
                                          BLOCK_SIZE=BLOCK, seq_lengths=(s, s))
    q, k, v = inputs(b, s, h, d, dtype, heads_first=True)
    return (lambda: _flex(q, k, v, block_mask=block_mask)), (q, k, v)


IMPLS = {"ours": ours, "flex": flex}


def run_point(impl, b, s, h, d, dtype, layout, density, pattern):
    flops = density * 4 * b * h * s * s * d
    row = dict(impl=impl, pattern=pattern, density=density, seqlen=s, batch=b, nheads=h, headdim=d)
    try:
        t_fwd, t_fb, peak = time_fwd_bwd(*IMPLS[impl.split("_")[0]](b, s, h, d, dtype, layout))
        row.update(fwd_ms=t_fwd, bwd_ms=t_fb - t_fwd, peak_mb=peak / 2**20, fwd_tflops=flops / t_fwd / 1e9,
                   bwd_tflops=2.5 * flops / (t_fb - t_fwd) / 1e9)
    except (RuntimeError, torch.OutOfMemoryError) as e:
        row.update(fwd_ms=None, bwd_ms=None, peak_mb=None, fwd_tflops=None, bwd_tflops=None,
                   error=str(e).splitlines()[0][:200])
    torch.cuda.empty_cache()
    return row


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
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "blocksparse.json"))
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    dtype, d, h = torch.bfloat16, 128, 16
    impls = args.impls.split(",")
    rows = []
    for s in map(int, args.seqlens.split(",")):
        b, nb = max(1, 16384 // s), s // BLOCK
        rows.append(run_point("ours_dense", b, s, h, d, dtype, None, 1.0, "dense"))
        for target in map(float, args.densities.split(",")):
            layout = random_layout(nb, nb, target, seed=0, keep_diagonal=True)
            density = layout.float().mean().item()
            for impl in impls:
                rows.append(run_point(impl, b, s, h, d, dtype, layout, density, "random"))
    if args.long_seqlen:
        s = args.long_seqlen
        layout = butterfly_layout(s // BLOCK)
        density = layout.float().mean().item()
        for impl in impls:
            rows.append(run_point(impl, 1, s, 16, 64, dtype, layout, density, "butterfly"))

    save_results(rows, args.out, plot, args.plot, dtype="bf16")

    print(f"{'impl':>10} {'pattern':>9} {'seqlen':>6} {'density':>7} {'fwd ms':>8} {'bwd ms':>8} "
          f"{'fwd TF':>7} {'bwd TF':>7} {'peak MB':>8} {'fwd/(d+.05)dense':>17} {'bwd/(d+.05)dense':>17} "
          f"{'fwd xflex':>9} {'bwd xflex':>9}")
    for r in rows:
        if r["fwd_ms"] is None:
            print(f"{r['impl']:>10} {r['pattern']:>9} {r['seqlen']:>6} {r['density']:7.3f}  error: {r['error']}")
            continue
        dense = next((x for x in rows if x["impl"] == "ours_dense" and x["seqlen"] == r["seqlen"]), None)
        fl = next((x for x in rows if x["impl"] == "flex" and x["seqlen"] == r["seqlen"]
                   and x["pattern"] == r["pattern"] and x["density"] == r["density"] and x["fwd_ms"]), None)
        cells = []
        for key in ("fwd_ms", "bwd_ms"):
            ok = r["impl"] == "ours" and dense and r["pattern"] == "random"
            cells.append(f"{r[key] / ((r['density'] + 0.05) * dense[key]):17.2f}" if ok else f"{'':>17}")
        for key in ("fwd_ms", "bwd_ms"):
            cells.append(f"{fl[key] / r[key]:9.2f}" if r["impl"] == "ours" and fl else f"{'':>9}")
        print(f"{r['impl']:>10} {r['pattern']:>9} {r['seqlen']:>6} {r['density']:7.3f} {r['fwd_ms']:8.3f} "
              f"{r['bwd_ms']:8.3f} {r['fwd_tflops']:7.0f} {r['bwd_tflops']:7.0f} {r['peak_mb']:8.0f} " + " ".join(cells))


if __name__ == "__main__":
    main()
