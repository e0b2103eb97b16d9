"""Block masks for block-sparse FlashAttention (the paper's second algorithm).

A block layout says which (query block, key block) tiles of the attention matrix are computed; the
kernels skip every other tile, forward and backward. `BlockSparseMask` is built once from a boolean
layout and shared across layers and steps: per query block the count and the indices of its kept
key blocks (what the forward and the dQ pass walk), and the transpose, per key block its query
blocks (what the dK/dV pass walks). The builders below make the usual layouts.

Semantics: attention over a block mask equals dense attention with the element-wise mask that
expands every kept block to all its (query, key) entries (`expand_layout`), cut to the sequence
lengths; a query row with no kept block gets output 0.
"""

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

# The granularity of the mask: every tile the kernels use divides it, so each kernel tile lies in
# exactly one mask block. A coarser layout (a multiple of it) is converted exactly.
BLOCK_SIZE = 128


def _num_blocks(seqlen: int, block: int = BLOCK_SIZE) -> int:
    return (seqlen + block - 1) // block


def _as_4d(layout: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(layout, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(layout).__name__}")
    if layout.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor (True = block kept), got dtype {layout.dtype}")
    if not 2 <= layout.dim() <= 4:
        raise ValueError(f"{name} must have shape ([batch or 1,] [heads or 1,] q_blocks, k_blocks), got "
                         f"{tuple(layout.shape)}")
    while layout.dim() < 4:
        layout = layout.unsqueeze(0)
    return layout


def _index_lists(kept: torch.Tensor) -> torch.Tensor:
    """Per row of the last dim: the count of True entries, then their indices ascending, padded
    with -1 (int32, one more column than kept); the form the kernels read."""
    counts = kept.sum(-1, dtype=torch.int32)
    order = torch.argsort((~kept).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    pos = torch.arange(kept.shape[-1], device=kept.device, dtype=torch.int32)
    indices = torch.where(pos < counts.unsqueeze(-1), order, torch.full_like(order, -1))
    return torch.cat([counts.unsqueeze(-1), indices], dim=-1).contiguous()


@dataclass(frozen=True)
class BlockSparseMask:
    """A block layout in the kernels' granularity (BLOCK_SIZE x BLOCK_SIZE) with its index lists.

    layout: bool (B, H, q_blocks, k_blocks), B = batch or 1, H = heads or 1 (broadcast).
    q_lists: int32 (B, H, q_blocks, 1 + k_blocks): per query block, the count of kept key blocks,
        then their indices ascending, padded with -1 (q_counts / q_indices are views of it).
    k_lists: int32 (B, H, k_blocks, 1 + q_blocks): the same per key block over query blocks.
    full: every block is kept (from_layout sets it), so the kernels may run as dense attention.
    """

    layout: torch.Tensor
    seqlen_q: int
    seqlen_k: int
    q_lists: torch.Tensor
    k_lists: torch.Tensor
    full: bool = False

    @property
    def q_counts(self) -> torch.Tensor:
        return self.q_lists[..., 0]

    @property
    def q_indices(self) -> torch.Tensor:
        return self.q_lists[..., 1:]

    @property
    def k_counts(self) -> torch.Tensor:
        return self.k_lists[..., 0]

    @property
    def k_indices(self) -> torch.Tensor:
        return self.k_lists[..., 1:]

    @staticmethod
    def from_layout(layout: torch.Tensor, seqlen_q: int, seqlen_k: int,
                    block_size: Union[int, Sequence[int]] = BLOCK_SIZE) -> "BlockSparseMask":
        """Build from a bool layout of shape ([B,] [H,] ceil(seqlen_q / bm), ceil(seqlen_k / bn)) at
        block size (bm, bn); block sizes that are multiples of BLOCK_SIZE are converted exactly."""
        bm, bn = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
        for name, bs in (("block_size[0]", bm), ("block_size[1]", bn)):
            if bs <= 0 or bs % BLOCK_SIZE != 0:
                raise ValueError(f"{name} must be a positive multiple of {BLOCK_SIZE} (the kernels' mask "
                                 f"granularity), got {bs}; finer layouts cannot be converted exactly")
        if seqlen_q < 0 or seqlen_k < 0:
            raise ValueError(f"seqlen_q and seqlen_k must be >= 0, got {seqlen_q} and {seqlen_k}")
        layout = _as_4d(layout, "layout")
        want = (_num_blocks(seqlen_q, bm), _num_blocks(seqlen_k, bn))
        if tuple(layout.shape[-2:]) != want:
            raise ValueError(f"layout must have {want[0]} x {want[1]} blocks for seqlen_q={seqlen_q}, "
                             f"seqlen_k={seqlen_k} at block size {bm} x {bn}, got {tuple(layout.shape[-2:])}")
        fine = layout.repeat_interleave(bm // BLOCK_SIZE, dim=-2).repeat_interleave(bn // BLOCK_SIZE, dim=-1)
        fine = fine[..., :_num_blocks(seqlen_q), :_num_blocks(seqlen_k)].contiguous()
        return BlockSparseMask(fine, seqlen_q, seqlen_k, _index_lists(fine), _index_lists(fine.transpose(-1, -2)),
                               bool(fine.all()))

    def to(self, device: Union[str, torch.device]) -> "BlockSparseMask":
        return BlockSparseMask(self.layout.to(device), self.seqlen_q, self.seqlen_k, self.q_lists.to(device),
                               self.k_lists.to(device), self.full)

    @property
    def device(self) -> torch.device:
        return self.layout.device

    @property
    def density(self) -> float:
        """The fraction of kept blocks (over the broadcast batch and head dims of the layout)."""
        return self.layout.float().mean().item() if self.layout.numel() else 0.0

    def check_broadcast(self, batch: int, nheads: int) -> None:
        """A clear error unless the layout's batch and head dims broadcast to (batch, nheads)."""
        b, h = self.layout.shape[:2]
        if b not in (1, batch) or h not in (1, nheads):
            raise ValueError(f"block mask of batch x heads {b} x {h} does not broadcast to {batch} x {nheads} "
                             f"(each must be 1 or equal)")

    def dense(self) -> torch.Tensor:
        """The element-wise mask this block mask stands for: bool (B, H, seqlen_q, seqlen_k)."""
        return expand_layout(self.layout, self.seqlen_q, self.seqlen_k)


def expand_layout(layout: torch.Tensor, seqlen_q: int, seqlen_k: int,
                  block_size: Union[int, Sequence[int]] = BLOCK_SIZE) -> torch.Tensor:
    """Every kept block expanded to its entries, cut to (seqlen_q, seqlen_k)."""
    bm, bn = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
    return layout.repeat_interleave(bm, dim=-2).repeat_interleave(bn, dim=-1)[..., :seqlen_q, :seqlen_k]


def coarsen_mask(mask: torch.Tensor, block_size: Union[int, Sequence[int]] = BLOCK_SIZE) -> torch.Tensor:
    """The block layout of an element-wise bool mask (..., seqlen_q, seqlen_k): a block is kept when
    any of its entries is. Attention over it covers a superset of the mask's entries; the kernels
    mask element-wise only for causal/windows, so pass those as arguments, not through this."""
    if mask.dtype != torch.bool or mask.dim() < 2:
        raise TypeError(f"mask must be a bool tensor (..., seqlen_q, seqlen_k), got {mask.dtype} "
                        f"of shape {tuple(mask.shape)}")
    bm, bn = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
    sq, sk = mask.shape[-2:]
    nq, nk = _num_blocks(sq, bm), _num_blocks(sk, bn)
    padded = torch.nn.functional.pad(mask, (0, nk * bn - sk, 0, nq * bm - sq))
    return padded.reshape(*mask.shape[:-2], nq, bm, nk, bn).any(-1).any(-2)


def _diagonal_offset(q_blocks: int, k_blocks: int) -> int:
    # Bottom-right alignment, as for causal: the last query block sits on the last key block.
    return k_blocks - q_blocks


def local_layout(q_blocks: int, k_blocks: int, window_blocks: int, causal: bool = False,
                 device: Optional[torch.device] = None) -> torch.Tensor:
    """A band: query block i keeps key blocks within window_blocks of its diagonal (only those at
    or before it with causal=True)."""
    if window_blocks < 0:
        raise ValueError(f"window_blocks must be >= 0, got {window_blocks}")
    i = torch.arange(q_blocks, device=device)[:, None] + _diagonal_offset(q_blocks, k_blocks)
    j = torch.arange(k_blocks, device=device)[None, :]
    return (j >= i - window_blocks) & (j <= i + (0 if causal else window_blocks))


def global_local_layout(q_blocks: int, k_blocks: int, window_blocks: int, global_blocks: int,
                        causal: bool = False, device: Optional[torch.device] = None) -> torch.Tensor:
    """Longformer/BigBird style: the band of local_layout, plus the first global_blocks key blocks
    seen by every query block and the first global_blocks query blocks seeing every key block."""
    if global_blocks < 0:
        raise ValueError(f"global_blocks must be >= 0, got {global_blocks}")
    layout = local_layout(q_blocks, k_blocks, window_blocks, causal, device)
    layout[:, :global_blocks] = True
    layout[:global_blocks, :] = True
    return layout


def random_layout(q_blocks: int, k_blocks: int, density: float, seed: int = 0, keep_diagonal: bool = True,
                  device: Optional[torch.device] = None) -> torch.Tensor:
    """Each query block keeps round(density * k_blocks) key blocks (at least 1) drawn with a fixed
    seed, its diagonal block among them when keep_diagonal."""
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density}")
    gen = torch.Generator().manual_seed(seed)
    per_row = max(1, round(density * k_blocks))
    scores = torch.rand(q_blocks, k_blocks, generator=gen)
    if keep_diagonal:
        diag = torch.arange(q_blocks) + _diagonal_offset(q_blocks, k_blocks)
        rows = (diag >= 0) & (diag < k_blocks)
        scores[torch.arange(q_blocks)[rows], diag[rows]] = 2.0  # ranks first
    keep = scores.topk(per_row, dim=-1).indices
    layout = torch.zeros(q_blocks, k_blocks, dtype=torch.bool)
    layout.scatter_(1, keep, True)
    return layout.to(device) if device is not None else layout


def butterfly_layout(q_blocks: int, k_blocks: Optional[int] = None,
                     device: Optional[torch.device] = None) -> torch.Tensor:
    """The flat block butterfly: block (i, j) is kept when i == j or i and j differ in one bit, the
    union of the supports of a butterfly matrix's factors (log2(n) + 1 blocks per row)."""
    k_blocks = q_blocks if k_blocks is None else k_blocks
    x = torch.arange(q_blocks, device=device)[:, None] ^ torch.arange(k_blocks, device=device)[None, :]
    return (x & (x - 1)) == 0
