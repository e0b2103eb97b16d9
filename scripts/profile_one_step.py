"""One forward+backward of ours and (unless told 'ours') SDPA's FlashAttention-2, for profilers."""

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flash_attn import flash_attn_func

d = int(sys.argv[1]) if len(sys.argv) > 1 else 128
only_ours = len(sys.argv) > 2 and sys.argv[2] == "ours"
b, s, h = 2, 4096, 2048 // d
q, k, v = [torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
flash_attn_func(q, k, v).sum().backward()
if not only_ours:
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).sum().backward()
torch.cuda.synchronize()
