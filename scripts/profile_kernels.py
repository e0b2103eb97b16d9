"""Per-kernel CUDA time of one forward+backward (torch.profiler), to see where the time goes."""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from flash_attn import flash_attn_func

d = int(sys.argv[1]) if len(sys.argv) > 1 else 128
s, causal = 8192, False
b, h = 16384 // s, 2048 // d
q, k, v = [torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
for _ in range(3):
    flash_attn_func(q, k, v, causal=causal).sum().backward()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(5):
        flash_attn_func(q, k, v, causal=causal).sum().backward()
    torch.cuda.synchronize()
print(f"d={d} s={s} b={b} h={h}: per-kernel CUDA time over 5 fwd+bwd")
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60))
