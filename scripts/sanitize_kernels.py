"""A small forward+backward of each kernel family, for compute-sanitizer (memcheck, racecheck):
on a Hopper GPU both the sm90 forward and (FLASH_ATTN_DISABLE_SM90=1) the portable one."""

import os

import torch

from flash_attn import flash_attn_func

for portable in ("0", "1"):
    os.environ["FLASH_ATTN_DISABLE_SM90"] = portable
    for dtype in (torch.bfloat16, torch.float16):
        for d in (64, 96, 128, 192, 256):
            for causal, dropout_p in ((False, 0.0), (True, 0.0), (True, 0.1)):
                q, k, v = [torch.randn(1, 150, 2, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3)]
                out, _, _ = flash_attn_func(q, k, v, dropout_p=dropout_p, causal=causal, return_attn_probs=True)
                out.sum().backward()
torch.cuda.synchronize()
print("sanitize run done")
