"""One small sm90 case for compute-sanitizer racecheck: argv kind (dense|sparse|full|kvcache) causal (0/1)
deterministic (0/1) [head dim, default 64] [dropout, default 0]. The persistent kernels run on two CTAs
so each walks several tiles through its schedule slots."""
import os
import sys

import torch

os.environ["FLASH_ATTN_SM90_FWD_PERSISTENT"] = "2"
os.environ["FLASH_ATTN_SM90_BWD_PERSISTENT"] = "2"
from flash_attn import BlockSparseMask, flash_attn_blocksparse_func, flash_attn_func, flash_attn_with_kvcache  # noqa: E402

kind, causal, det = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1"
d = int(sys.argv[4]) if len(sys.argv) > 4 else 64
drop = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
q, k, v = [torch.randn(1, 300, 2, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
if kind == "kvcache":  # a prefill over a cache read in place: partial last key tiles (the V tail slots)
    kc, vc = [torch.randn(3, 300, 1, d, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    kn, vn = [torch.randn(3, 4, 1, d, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    seqlens = torch.tensor([0, 77, 148], dtype=torch.int32, device="cuda")
    flash_attn_with_kvcache(torch.randn(3, 100, 2, d, device="cuda", dtype=torch.bfloat16), kc, vc, kn, vn,
                            cache_seqlens=seqlens, causal=causal)
elif kind == "dense":
    flash_attn_func(q, k, v, causal=causal, deterministic=det, dropout_p=drop).sum().backward()
else:
    layout = torch.tensor([[True, False, True], [False, False, False], [True, True, False]])
    if kind == "full":
        layout = torch.ones(3, 3, dtype=torch.bool)
    mask = BlockSparseMask.from_layout(layout, 300, 300).to("cuda")
    flash_attn_blocksparse_func(q, k, v, mask, causal=causal, deterministic=det, dropout_p=drop).sum().backward()
torch.cuda.synchronize()
