"""GPU benchmark of sliding-window attention (issue 5): ours with window_size against ours dense,
and FlexAttention (torch.compile'd flex_attention, the window as a mask_mod over 128 x 128 blocks)
against FlexAttention dense, in one run. batch * seqlen = 16384 tokens, 16 heads, bf16. TFLOP/s
counts only the (query, key) pairs the window lets through (4 d per pair forward, 2.5x that
backward), and, as the issue's target counts them, the pairs of the tiles each implementation
computes: ours, whole tiles along the band's edges (the sm90 tiles at head dim <= 128: forward 128
queries x 128 keys, backward 128 keys x 64-query steps); Flex, the blocks of its BlockMask. The
target: a window of 1024 at seqlen 16384 runs at >= 0.9x the dense TFLOP/s on the computed tiles
(Flex's own ratio is the peer figure for it). Every window of a seqlen is timed once per round
over several rounds, the backward on its own (benchmark_attention.interleaved_times), and each
ratio is the median of the ratios within a round. Writes JSON (--out) and a PNG of TFLOP/s
against window width (--plot).
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
from benchmarks.benchmark_blocksparse import BLOCK, inputs  # noqa: E402
from flash_attn import flash_attn_func  # noqa: E402


def visible_pairs(s, left, right):
    """Number of (i, j) with 0 <= i, j < s and i - left <= j <= i + right (-1: unbounded)."""
    i = torch.arange(s, dtype=torch.int64)
    lo = torch.zeros_like(i) if left < 0 else (i - left).clamp(min=0)
    hi = torch.full_like(i, s - 1) if right < 0 else (i + right).clamp(max=s - 1)
    return int((hi - lo + 1).clamp(min=0).sum())


def _cols(i, s, left, right):
    """Visible keys [lo, hi) of query row i (bottom-right aligned with seqlen_q = seqlen_k = s)."""
    return (0 if left < 0 else max(0, i - left)), (s if right < 0 else min(s, i + right + 1))


def computed_pairs(s, left, right, rows_per_tile, keys_per_tile, keys_major=False):
    """Pairs inside the tiles a kernel walks: per block of rows_per_tile queries the key tiles from
    the first row's first visible key to the last row's last (keys_major: per block of
    keys_per_tile keys, the query tiles of the rows that see any of them)."""
    total = 0
    if not keys_major:
        for m0 in range(0, s, rows_per_tile):
            m1 = min(s, m0 + rows_per_tile)
            lo, hi = _cols(m0, s, left, right)[0], _cols(m1 - 1, s, left, right)[1]
            t0, t1 = lo // keys_per_tile * keys_per_tile, min(s, -(-hi // keys_per_tile) * keys_per_tile)
            total += (m1 - m0) * max(0, t1 - t0)
        return total
    for j0 in range(0, s, keys_per_tile):  # the same walk with keys and queries swapped (the band is symmetric)
        j1 = min(s, j0 + keys_per_tile)
        lo, hi = _cols(j0, s, right, left)[0], _cols(j1 - 1, s, right, left)[1]
        t0, t1 = lo // rows_per_tile * rows_per_tile, min(s, -(-hi // rows_per_tile) * rows_per_tile)
        total += (j1 - j0) * max(0, t1 - t0)
    return total


def flex_window_point(b, s, h, d, window):
    """FlexAttention at one window: (fwd, inputs) and the (query, key) pairs of its mask's blocks
    per batch and head (dense: no block mask, every pair)."""
    from torch.nn.attention.flex_attention import create_block_mask
    flex_attention = compiled_flex()
    q, k, v = inputs(b, s, h, d, torch.bfloat16, heads_first=True)
    if window == (-1, -1):
        return (lambda: flex_attention(q, k, v)), (q, k, v), s * s
    left, right = window

    def in_window(b_, h_, i, j):
        return ((j >= i - left) if left >= 0 else (j >= 0)) & ((j <= i + right) if right >= 0 else (j >= 0))
    block_mask = create_block_mask(in_window, None, None, s, s, device="cuda", BLOCK_SIZE=BLOCK)
    full = block_mask.full_kv_num_blocks
    blocks = int(block_mask.kv_num_blocks.sum()) + (0 if full is None else int(full.sum()))
    return (lambda: flex_attention(q, k, v, block_mask=block_mask)), (q, k, v), blocks * BLOCK * BLOCK


def window_point(impl, b, s, h, d, window):
    """(fwd, inputs) of one implementation at one window, and the pairs per batch and head of the
    tiles it computes, forward and backward."""
    if impl == "flex":
        fwd, args, pairs = flex_window_point(b, s, h, d, window)
        return fwd, args, {"fwd": pairs, "bwd": pairs}
    q, k, v = inputs(b, s, h, d, torch.bfloat16)
    pairs = {"fwd": computed_pairs(s, *window, 128, 128), "bwd": computed_pairs(s, *window, 64, 128, keys_major=True)}
    return (lambda: flash_attn_func(q, k, v, window_size=window)), (q, k, v), pairs


def seqlen_rows(impls, b, s, h, d, windows, rounds):
    """Every window of one seqlen (the first: dense) for every implementation, timed in interleaved
    rounds (benchmark_attention.interleaved_times); each ratio to an implementation's own dense is
    the median over rounds of the ratio within a round."""
    points, tile_pairs = {}, {}
    for impl in impls:
        for window in windows:
            fwd, args, tile_pairs[impl, window] = window_point(impl, b, s, h, d, window)
            points[impl, window] = (fwd, args)
    times = interleaved_times(points, rounds)
    rows = []
    for (impl, window), t in times.items():
        flops = 4 * b * h * d * visible_pairs(s, *window)
        row = dict(impl=impl, seqlen=s, batch=b, nheads=h, headdim=d, window=list(window), rounds=rounds,
                   fwd_ms=median(t["fwd"]), bwd_ms=median(t["bwd"]), fwd_ms_rounds=t["fwd"], bwd_ms_rounds=t["bwd"],
                   peak_mb=peak_fwd_bwd_bytes(*points[impl, window]) / 2**20)
        for key, mult in (("fwd", 1.0), ("bwd", 2.5)):
            dense = times[impl, windows[0]][key]
            tile_flops = mult * 4 * b * h * d * tile_pairs[impl, window][key]
            dense_flops = mult * 4 * b * h * d * s * s
            row[f"{key}_tflops"] = mult * flops / row[f"{key}_ms"] / 1e9
            row[f"{key}_tile_tflops"] = tile_flops / row[f"{key}_ms"] / 1e9
            # (flops / t) / (dense flops / dense t), per round
            row[f"{key}_vs_dense"] = median_ratio(dense, t[key], dense_flops / (mult * flops))
            row[f"{key}_tiles_vs_dense"] = median_ratio(dense, t[key], dense_flops / tile_flops)
            if impl != "flex" and ("flex", window) in times:
                row[f"{key}_x_flex"] = median_ratio(times["flex", window][key], t[key])
        rows.append(row)
    return rows


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, metric in zip(axes, ("fwd_tflops", "bwd_tflops")):
        for impl in sorted({r["impl"] for r in rows}, key=lambda i: i != "ours"):
            for s in sorted({r["seqlen"] for r in rows}):
                for kind, pick in (("(w, 0)", lambda w: w[1] == 0), ("(w, w)", lambda w: w[1] == w[0])):
                    pts = sorted((r["window"][0], r[metric]) for r in rows
                                 if r["impl"] == impl and r["seqlen"] == s and r["window"][0] > 0 and pick(r["window"]))
                    if pts:
                        ax.plot(*zip(*pts), marker="o", linestyle="-" if impl == "ours" else ":",
                                label=f"{impl}, seqlen {s}, window {kind}")
                dense = next(r for r in rows if r["impl"] == impl and r["seqlen"] == s and r["window"] == [-1, -1])
                ax.axhline(dense[metric], linestyle="--" if impl == "ours" else ":", linewidth=1, color="k")
        ax.set_xscale("log", base=2)
        finish_axis(ax, f"sliding window, d=128, h=16 (black: dense): {metric.split('_')[0]}", "window w",
                    "TFLOP/s (visible pairs)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seqlens", default="4096,16384")
    ap.add_argument("--windows", default="256,1024,4096", help="w: runs window_size (w, 0) and (w, w)")
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--impls", default="ours,flex", help="ours and/or flex (FlexAttention)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds per seqlen")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "window.json"))
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    h, d, rows = 16, args.headdim, []
    impls = args.impls.split(",")
    print(f"{'impl':>5} {'seqlen':>6} {'window':>12} {'fwd ms':>8} {'bwd ms':>8} {'fwd TF':>7} {'bwd TF':>7} {'fwd/dense':>9} "
          f"{'bwd/dense':>9} {'fwd tiles/dense':>15} {'bwd tiles/dense':>15} {'fwd xflex':>9} {'bwd xflex':>9}")
    for s in (int(x) for x in args.seqlens.split(",")):
        b = max(1, 16384 // s)
        windows = [(-1, -1)] + [(w, r) for w in map(int, args.windows.split(",")) if w < s for r in (0, w)]
        for row in seqlen_rows(impls, b, s, h, d, windows, args.rounds):
            rows.append(row)
            xflex = "".join(f" {row[k]:>9.2f}" if k in row else f" {'':>9}" for k in ("fwd_x_flex", "bwd_x_flex"))
            print(f"{row['impl']:>5} {s:>6} {str(tuple(row['window'])):>12} {row['fwd_ms']:>8.3f} {row['bwd_ms']:>8.3f} "
                  f"{row['fwd_tflops']:>7.0f} {row['bwd_tflops']:>7.0f} {row['fwd_vs_dense']:>9.2f} "
                  f"{row['bwd_vs_dense']:>9.2f} {row['fwd_tiles_vs_dense']:>15.2f} {row['bwd_tiles_vs_dense']:>15.2f}{xflex}")
        torch.cuda.empty_cache()
    save_results(rows, args.out, plot, args.plot, dtype="bf16")


if __name__ == "__main__":
    main()
