"""A small forward+backward of each kernel family, for compute-sanitizer (memcheck, racecheck):
on a Hopper GPU the sm90 kernels (the warp-specialized TMA ones and, at head dims 64 and 128, with
FLASH_ATTN_SM90_FWD_SYNC=1, the cp.async forward; at head dim 64 also with the forward's 192-row
tiles forced, FLASH_ATTN_SM90_FWD_ROWS=192) and (FLASH_ATTN_DISABLE_SM90=1) the portable ones;
dense,
block-sparse (a random 128 x 128 layout with an empty query block), varlen (packed sequences of
lengths 0 to 200, the last one ending at the tensor's end) and score modifiers (a broadcast bias
with its gradient, ALiBi, softcap), atomic and deterministic dQ (dense and varlen); KV-cache reads (flash_attn_with_kvcache
with an append, cache_batch_idx and cache_leftpad, the last entry's keys ending at the cache's end;
decoding tiles with and without split-KV, the GQA fold, a prefill; a paged cache, also under
flash_attn_varlen_func).
Dense also runs a decoding shape (few queries over many keys: split-KV).
The persistent sm90 forward and backward run on two CTAs (FLASH_ATTN_SM90_FWD_PERSISTENT=2,
FLASH_ATTN_SM90_BWD_PERSISTENT=2), so that each walks many tiles and claims them from the counter.
Usage: sanitize_kernels.py [all|dense|blocksparse|varlen|mods|kvcache] (racecheck of "all" takes several minutes)."""

import os
import sys

import torch

from flash_attn import (BlockSparseMask, flash_attn_blocksparse_func, flash_attn_func, flash_attn_varlen_func,
                        flash_attn_with_kvcache)

layout = torch.tensor([[True, False, True], [False, False, False], [True, True, False]])
mask = BlockSparseMask.from_layout(layout, 300, 300).to("cuda")
lens_q, lens_k = [70, 0, 1, 200, 129], [65, 3, 0, 150, 200]
cu_q, cu_k = (torch.tensor([0] + list(torch.tensor(x).cumsum(0)), dtype=torch.int32, device="cuda")
              for x in (lens_q, lens_k))
cache_index = dict(cache_seqlens=torch.tensor([0, 77, 148], dtype=torch.int32, device="cuda"),
                   cache_batch_idx=torch.tensor([1, 0, 2], dtype=torch.int32, device="cuda"),
                   cache_leftpad=torch.tensor([0, 10, 3], dtype=torch.int32, device="cuda"))
offsets = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(),  # noqa: E731
                                   dtype=torch.int32, device="cuda")
page_table = torch.tensor([[4, 0], [1, 3], [2, 4]], dtype=torch.int32, device="cuda")
paged_seqlens = torch.tensor([0, 300, 510], dtype=torch.int32, device="cuda")
which = sys.argv[1] if len(sys.argv) > 1 else "all"
os.environ["FLASH_ATTN_SM90_FWD_PERSISTENT"] = "2"
os.environ["FLASH_ATTN_SM90_BWD_PERSISTENT"] = "2"
for portable, sync, rows in (("0", "0", ""), ("0", "0", "192"), ("0", "1", ""), ("1", "0", "")):
    os.environ["FLASH_ATTN_DISABLE_SM90"] = portable
    os.environ["FLASH_ATTN_SM90_FWD_SYNC"] = sync
    os.environ["FLASH_ATTN_SM90_FWD_ROWS"] = rows
    for dtype in (torch.bfloat16, torch.float16):
        for d in (64,) if rows else (32, 64, 96, 128, 192, 256) if sync == "0" else (64, 128):
            for causal, dropout_p in ((False, 0.0), (True, 0.0), (True, 0.1)):
                if which in ("all", "dense"):
                    q, k, v = [torch.randn(1, 150, 2, d, device="cuda", dtype=dtype, requires_grad=True)
                               for _ in range(3)]
                    out, _, _ = flash_attn_func(q, k, v, dropout_p=dropout_p, causal=causal, return_attn_probs=True)
                    out.sum().backward()
                    flash_attn_func(q, k, v, dropout_p=dropout_p, causal=causal, deterministic=True).sum().backward()
                    # A decoding shape (3 queries over 2000 keys, 2 heads): the split forward and the merge.
                    q, k, v = [torch.randn(1, n, 2, d, device="cuda", dtype=dtype, requires_grad=True)
                               for n in (3, 2000, 2000)]
                    flash_attn_func(q, k, v, dropout_p=dropout_p, causal=causal).sum().backward()
                for deterministic in (False, True) if which in ("all", "varlen") else ():
                    q = torch.randn(sum(lens_q), 2, d, device="cuda", dtype=dtype, requires_grad=True)
                    k, v = [torch.randn(sum(lens_k), 1, d, device="cuda", dtype=dtype, requires_grad=True)
                            for _ in range(2)]
                    out, _, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                                       dropout_p=dropout_p, causal=causal,
                                                       deterministic=deterministic, return_attn_probs=True)
                    out.sum().backward()
                for deterministic in (False, True) if which in ("all", "mods") and sync == "0" else ():
                    q, k, v = [torch.randn(2, s, 2, d, device="cuda", dtype=dtype, requires_grad=True)
                               for s in (130, 200, 200)]
                    for shape in ((2, 2, 130, 200), (2, 1, 1, 200)):
                        bias = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
                        out, _, _ = flash_attn_func(q, k, v, dropout_p=dropout_p, causal=causal, softcap=5.0,
                                                    alibi_slopes=torch.rand(2, device="cuda"), attn_bias=bias,
                                                    deterministic=deterministic, return_attn_probs=True)
                        out.sum().backward()
                if which in ("all", "kvcache") and dropout_p == 0.0:
                    kc, vc = [torch.randn(3, 150, 1, d, device="cuda", dtype=dtype) for _ in range(2)]
                    kn, vn = [torch.randn(3, 2, 1, d, device="cuda", dtype=dtype) for _ in range(2)]
                    for sq, splits in ((5, 0), (5, 3), (1, 2), (100, 0)):  # decoding, split-KV, GQA fold, prefill
                        flash_attn_with_kvcache(torch.randn(3, sq, 2, d, device="cuda", dtype=dtype), kc, vc, kn, vn,
                                                causal=causal, num_splits=splits, **cache_index)
                    # A paged cache: 5 pages of 256 rows, entry 2's keys ending at its last page's end.
                    kp, vp = [torch.randn(5, 256, 1, d, device="cuda", dtype=dtype) for _ in range(2)]
                    for sq, splits in ((1, 0), (5, 3), (100, 1)):
                        flash_attn_with_kvcache(torch.randn(3, sq, 2, d, device="cuda", dtype=dtype), kp, vp, kn, vn,
                                                causal=causal, num_splits=splits, block_table=page_table,
                                                cache_seqlens=paged_seqlens)
                    for lq in ([1, 1, 1], [0, 70, 3]):  # packed queries over the pages (decoding, mixed)
                        flash_attn_varlen_func(torch.randn(sum(lq), 2, d, device="cuda", dtype=dtype), kp, vp,
                                               offsets(lq), offsets([0, 300, 512]), max(lq), 512, causal=causal,
                                               block_table=page_table)
                q, k, v = [torch.randn(1, 300, 2, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3)]
                for deterministic in (False, True) if which in ("all", "blocksparse") else ():
                    out, _, _ = flash_attn_blocksparse_func(q, k, v, mask, dropout_p=dropout_p, causal=causal,
                                                            deterministic=deterministic, return_attn_probs=True)
                    out.sum().backward()
torch.cuda.synchronize()
print("sanitize run done")
