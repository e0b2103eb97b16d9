"""Backward time of the deterministic modes on a GPU, dense and block-sparse (random layouts at
density 0.25, diagonal kept), causal or not: the default (atomic dQ), deterministic=True (on
Hopper the sm90 kernel's ordered dQ) and deterministic=True with FLASH_ATTN_DISABLE_SM90=1 (the
portable kernels: dK/dV, then the dQ kernel). Medians of 12 CUDA-event timings of the backward."""

import os

import torch

from flash_attn import BlockSparseMask, flash_attn_blocksparse_func, flash_attn_func
from flash_attn.block_sparse import random_layout


def bwd_ms(fn, q, k, v, disable_sm90="0"):
    os.environ["FLASH_ATTN_DISABLE_SM90"] = disable_sm90  # read by the forward and the backward at each call
    try:
        dout = torch.randn_like(fn(q, k, v))
        times = []
        for _ in range(12):
            out = fn(q, k, v)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.autograd.grad(out, (q, k, v), dout)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]
    finally:
        os.environ["FLASH_ATTN_DISABLE_SM90"] = "0"


def main():
    torch.manual_seed(0)
    for seqlen, batch, d in ((16384, 1, 128), (4096, 4, 128), (16384, 1, 64)):
        q, k, v = [torch.randn(batch, seqlen, 16, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3)]
        for density in (1.0, 0.25):
            mask = None
            if density < 1.0:
                layout = random_layout(seqlen // 128, seqlen // 128, density)
                mask = BlockSparseMask.from_layout(layout, seqlen, seqlen).to("cuda")
            for causal in (False, True):
                def fn(det):
                    if mask is None:
                        return lambda q, k, v: flash_attn_func(q, k, v, causal=causal, deterministic=det)
                    return lambda q, k, v: flash_attn_blocksparse_func(q, k, v, mask, causal=causal,
                                                                       deterministic=det)
                atomic, ordered, portable = (bwd_ms(fn(False), q, k, v), bwd_ms(fn(True), q, k, v),
                                             bwd_ms(fn(True), q, k, v, "1"))
                print(f"b{batch} s{seqlen} d{d} density {density} causal {int(causal)}: bwd ms default {atomic:.3f}, "
                      f"deterministic {ordered:.3f} ({ordered / atomic:.2f}x), dQ-kernel path {portable:.3f} "
                      f"({portable / atomic:.2f}x)")


if __name__ == "__main__":
    main()
