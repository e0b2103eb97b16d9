"""Where short rows lose time (GPU): a sliding window (1024, 0) against a block-sparse band with the
same tiles (walked as a range, no element masks), a random layout with as many tiles per row
(scattered), wider bands and windows, and dense, at 16384 (b=1, h=16, d=128, bf16); then the 4096
block-sparse points where the backward's per-CTA cost shows. Every point is timed in interleaved
rounds (benchmarks/benchmark_attention.interleaved_times). Prints the path of the flash_attn it
ran, so that two builds can be compared by PYTHONPATH."""

from statistics import median

import flash_attn  # first: benchmarks.benchmark_attention puts this repository first on sys.path

import torch

from benchmarks.benchmark_attention import interleaved_times
from flash_attn import BlockSparseMask, flash_attn_blocksparse_func, flash_attn_func
from flash_attn.block_sparse import local_layout, random_layout

D, H = 128, 16


def qkv(b, s):
    return [torch.randn(b, s, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]


def sparse(b, s, layout):
    mask = BlockSparseMask.from_layout(layout, s, s).to("cuda")
    q, k, v = qkv(b, s)
    return (lambda: flash_attn_blocksparse_func(q, k, v, mask)), (q, k, v)


def dense(b, s, **kw):
    q, k, v = qkv(b, s)
    return (lambda: flash_attn_func(q, k, v, **kw)), (q, k, v)


def main():
    print(flash_attn.__file__)
    nb = 16384 // 128
    points = {"dense": dense(1, 16384), "window (1024, 0)": dense(1, 16384, window_size=(1024, 0)),
              "band of 9 blocks": sparse(1, 16384, local_layout(nb, nb, 8, causal=True)),
              "band of 17 blocks": sparse(1, 16384, local_layout(nb, nb, 8)),
              "random, 9 per row": sparse(1, 16384, random_layout(nb, nb, 9 / 128, seed=0, keep_diagonal=True)),
              "window (1024, 1024)": dense(1, 16384, window_size=(1024, 1024))}
    nb = 4096 // 128
    points.update({"4096 dense": dense(4, 4096),
                   "4096 random 0.25": sparse(4, 4096, random_layout(nb, nb, 0.25, seed=0, keep_diagonal=True)),
                   "4096 random 0.1": sparse(4, 4096, random_layout(nb, nb, 0.1, seed=0, keep_diagonal=True))})
    for name, t in interleaved_times(points, 3).items():
        print(f"{name:>20}: fwd {median(t['fwd']):.4f} ms  bwd {median(t['bwd']):.4f} ms")


if __name__ == "__main__":
    main()
