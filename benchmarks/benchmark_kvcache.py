"""GPU benchmark of flash_attn_with_kvcache: one decoding step (seqlen_q 1, one new key appended)
over caches of seqlen_cache keys, against PyTorch's SDPA (its default backend choice, enable_gqa)
on the same keys sliced from the cache after the same append. Decoding reads the whole cache once,
so the figure of merit is the bandwidth: K and V bytes read per second (the H200 copies at about
4.2 TB/s, ANCHORS.md). bf16, d=128, h=32 query heads over h_k key heads. `ours` lets the op pick
split-KV, `ours_nosplit` passes num_splits=1, `ours_paged` reads a paged cache (block_table;
--page rows a page, the pages in shuffled order; 0 leaves it out), `ours_func` appends as SDPA's
step does and calls flash_attn_func on the same rows (the dense forward's own split-KV).
Two timings per point: the median of CUDA-event timings of one step (METHOD.md; the GPU's time),
and wall-clock time per step over a loop of back-to-back steps (what an eager decoding loop sees,
launches and host work included). The host-side check of cache_seqlens (a device sync) is off
unless --checks (FLASH_ATTN_SKIP_VARLEN_CHECKS is read once per process; CUDA-graph capture skips
it too); with it on, only the wall-clock figures mean anything. Writes JSON (--out) and a PNG
(--plot).
"""

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
if "--checks" not in sys.argv:
    os.environ["FLASH_ATTN_SKIP_VARLEN_CHECKS"] = "1"
from benchmarks.benchmark_attention import finish_axis, median_ms, save_results  # noqa: E402
from flash_attn import flash_attn_func, flash_attn_with_kvcache  # noqa: E402

H, D = 32, 128


def wall_ms(fn, steps=200):
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / steps


def point(b, hk, n, page):
    """The steps at batch b, h_k key heads, n keys already cached; returns {impl: (ms, wall ms)}."""
    rows = n + 1
    kc, vc = (torch.randn(b, rows, hk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(b, 1, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, 1, hk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seqlens = torch.full((b,), n, dtype=torch.int32, device="cuda")

    def ours():
        flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, causal=True)

    def ours_nosplit():
        flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, causal=True, num_splits=1)

    def ours_func():  # the same append as sdpa's, then flash_attn_func over the same rows
        kc[:, n:n + 1] = k
        vc[:, n:n + 1] = v
        flash_attn_func(q, kc[:, :rows], vc[:, :rows])

    def sdpa():  # the same append, then attention over the first n + 1 rows
        kc[:, n:n + 1] = k
        vc[:, n:n + 1] = v
        F.scaled_dot_product_attention(q.transpose(1, 2), kc[:, :rows].transpose(1, 2), vc[:, :rows].transpose(1, 2),
                                       enable_gqa=True)

    runs = [("ours", ours), ("ours_nosplit", ours_nosplit), ("ours_func", ours_func), ("sdpa", sdpa)]
    if page:
        per_entry = (rows + page - 1) // page
        table = torch.randperm(b * per_entry, device="cuda").view(b, per_entry).to(torch.int32)
        kp, vp = (torch.randn(b * per_entry, page, hk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))

        def ours_paged():
            flash_attn_with_kvcache(q, kp, vp, k, v, cache_seqlens=seqlens, causal=True, block_table=table)
        runs.insert(2, ("ours_paged", ours_paged))
    return {name: (median_ms(fn, 20), wall_ms(fn)) for name, fn in runs}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--hk", default="8,32", help="key/value heads (32 = no GQA)")
    ap.add_argument("--seqlens", default="1024,8192,32768")
    ap.add_argument("--out", default="kvcache.json")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--checks", action="store_true", help="keep the host-side check of cache_seqlens")
    ap.add_argument("--page", type=int, default=256, help="rows a page of ours_paged's cache (0: no paged run)")
    a = ap.parse_args()
    rows = []
    for b in map(int, a.batches.split(",")):
        for hk in map(int, a.hk.split(",")):
            for n in map(int, a.seqlens.split(",")):
                kv_bytes = 2 * b * (n + 1) * hk * D * 2
                line = f"b={b:3d} hk={hk:2d} n={n:6d}"
                for impl, (t, wall) in point(b, hk, n, a.page).items():
                    rows.append(dict(impl=impl, batch=b, hk=hk, seqlen_cache=n, ms=t, wall_ms=wall,
                                     tb_per_s=kv_bytes / t / 1e9))
                    line += f"  {impl} {t * 1e3:7.1f} us {rows[-1]['tb_per_s']:4.2f} TB/s (wall {wall * 1e3:6.1f})"
                print(line, flush=True)
    save_results(rows, a.out, plot, a.plot, heads=H, headdim=D, dtype="bf16", checks=a.checks, page=a.page)


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = sorted({(r["batch"], r["hk"]) for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(3.6 * len(keys), 3.2), squeeze=False)
    for ax, (b, hk) in zip(axes[0], keys):
        for impl in ("ours", "ours_nosplit", "ours_paged", "ours_func", "sdpa"):
            pts = sorted((r["seqlen_cache"], r["tb_per_s"]) for r in rows
                         if (r["batch"], r["hk"], r["impl"]) == (b, hk, impl))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=impl)
        ax.set_xscale("log", base=2)
        finish_axis(ax, f"decode b={b} h_k={hk}", "cached keys", "K+V TB/s")
    fig.tight_layout()
    fig.savefig(path, dpi=80)


if __name__ == "__main__":
    main()
