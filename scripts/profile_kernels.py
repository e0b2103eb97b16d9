"""Per-kernel CUDA time of forward+backward (torch.profiler), to see where the time goes: the main
kernels against the fixed passes around them (the backward's D pre-pass, dQ accumulator zeroing and
conversion), dense, block-sparse (--density: a random layout with the diagonal kept) or windowed.
Usage: python scripts/profile_kernels.py [--headdim 128] [--seqlen 8192] [--density 0.5] [--window 1024,0]"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from flash_attn import BlockSparseMask, flash_attn_blocksparse_func, flash_attn_func
from flash_attn.block_sparse import random_layout

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--headdim", type=int, default=128)
ap.add_argument("--seqlen", type=int, default=8192)
ap.add_argument("--causal", action="store_true")
ap.add_argument("--density", type=float, default=None)
ap.add_argument("--window", default=None, help="left,right")
args = ap.parse_args()
d, s = args.headdim, args.seqlen
b, h = max(1, 16384 // s), 2048 // d
q, k, v = [torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
if args.density is not None:
    layout = random_layout(s // 128, s // 128, args.density, seed=0, keep_diagonal=True)
    mask = BlockSparseMask.from_layout(layout, s, s).to("cuda")
    run = lambda: flash_attn_blocksparse_func(q, k, v, mask, causal=args.causal)  # noqa: E731
else:
    window = tuple(map(int, args.window.split(","))) if args.window else (-1, -1)
    run = lambda: flash_attn_func(q, k, v, causal=args.causal, window_size=window)  # noqa: E731
dout = torch.randn_like(run())


def step():
    for t in (q, k, v):
        t.grad = None
    run().backward(dout)


for _ in range(3):
    step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(5):
        step()
    torch.cuda.synchronize()
print(f"d={d} s={s} b={b} h={h} causal={args.causal} density={args.density} window={args.window}: "
      "per-kernel CUDA time over 5 fwd+bwd")
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10, max_name_column_width=70))
