"""A small forward+backward of each kernel family, for compute-sanitizer (memcheck, racecheck):
on a Hopper GPU the sm90 kernels (the warp-specialized TMA ones and, at head dims 64 and 128, with
FLASH_ATTN_SM90_FWD_SYNC=1, the cp.async forward) and (FLASH_ATTN_DISABLE_SM90=1) the portable ones;
dense and
block-sparse (a random 128 x 128 layout with an empty query block), atomic and deterministic dQ.
Usage: sanitize_kernels.py [all|dense|blocksparse] (racecheck of "all" takes several minutes)."""

import os
import sys

import torch

from flash_attn import BlockSparseMask, flash_attn_blocksparse_func, flash_attn_func

layout = torch.tensor([[True, False, True], [False, False, False], [True, True, False]])
mask = BlockSparseMask.from_layout(layout, 300, 300).to("cuda")
which = sys.argv[1] if len(sys.argv) > 1 else "all"
for portable, sync in (("0", "0"), ("0", "1"), ("1", "0")):
    os.environ["FLASH_ATTN_DISABLE_SM90"] = portable
    os.environ["FLASH_ATTN_SM90_FWD_SYNC"] = sync
    for dtype in (torch.bfloat16, torch.float16):
        for d in (64, 96, 128, 192, 256) if sync == "0" else (64, 128):
            for causal, dropout_p in ((False, 0.0), (True, 0.0), (True, 0.1)):
                if which in ("all", "dense"):
                    q, k, v = [torch.randn(1, 150, 2, d, device="cuda", dtype=dtype, requires_grad=True)
                               for _ in range(3)]
                    out, _, _ = flash_attn_func(q, k, v, dropout_p=dropout_p, causal=causal, return_attn_probs=True)
                    out.sum().backward()
                q, k, v = [torch.randn(1, 300, 2, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3)]
                for deterministic in (False, True) if which in ("all", "blocksparse") else ():
                    out, _, _ = flash_attn_blocksparse_func(q, k, v, mask, dropout_p=dropout_p, causal=causal,
                                                            deterministic=deterministic, return_attn_probs=True)
                    out.sum().backward()
torch.cuda.synchronize()
print("sanitize run done")
