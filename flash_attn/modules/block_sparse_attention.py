"""A multi-head self-attention layer over a block-sparse pattern."""

from typing import Callable, Dict, Optional, Tuple, Union

import torch
from torch import nn

from .. import block_sparse
from ..block_sparse import BLOCK_SIZE, BlockSparseMask
from ..interface import flash_attn_blocksparse_func

# name -> builder(q_blocks, k_blocks, **options) -> bool layout
PATTERNS: Dict[str, Callable[..., torch.Tensor]] = {
    "butterfly": lambda nq, nk: block_sparse.butterfly_layout(nq, nk),
    "local": lambda nq, nk, window_blocks=1, causal=False: block_sparse.local_layout(nq, nk, window_blocks, causal),
    "global_local": lambda nq, nk, window_blocks=1, global_blocks=1, causal=False: block_sparse.global_local_layout(
        nq, nk, window_blocks, global_blocks, causal),
    "random": lambda nq, nk, density=0.25, seed=0: block_sparse.random_layout(nq, nk, density, seed),
}


class BlockSparseMultiheadAttention(nn.Module):
    """Self-attention whose (query block, key block) tiles follow a block-sparse pattern.

    x (batch, seqlen, embed_dim) -> (batch, seqlen, embed_dim): a fused QKV projection,
    flash_attn_blocksparse_func over the pattern's kept 128 x 128 tiles, an output projection.

    pattern: a name in PATTERNS ("butterfly", "local", "global_local", "random") with its options
    in pattern_options, a callable (q_blocks, k_blocks) -> bool layout, or a fixed bool layout
    ([batch or 1,] [heads or 1,] q_blocks, k_blocks) for the one sequence length it fits. The mask
    for each (sequence length, device) is built once and cached.
    """

    def __init__(self, embed_dim: int, num_heads: int,
                 pattern: Union[str, Callable[[int, int], torch.Tensor], torch.Tensor] = "butterfly",
                 causal: bool = False, dropout: float = 0.0, bias: bool = True,
                 pattern_options: Optional[dict] = None, device=None, dtype=None):
        super().__init__()
        if embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if isinstance(pattern, str) and pattern not in PATTERNS:
            raise ValueError(f"unknown pattern {pattern!r}; choose one of {sorted(PATTERNS)}, a callable or a layout")
        self.embed_dim, self.num_heads, self.causal, self.dropout = embed_dim, num_heads, causal, dropout
        self.pattern, self.pattern_options = pattern, dict(pattern_options or {})
        factory = dict(device=device, dtype=dtype)
        self.Wqkv = nn.Linear(embed_dim, 3 * embed_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self._masks: Dict[Tuple[int, str], BlockSparseMask] = {}

    def layout_for(self, seqlen: int) -> torch.Tensor:
        n = (seqlen + BLOCK_SIZE - 1) // BLOCK_SIZE
        if isinstance(self.pattern, torch.Tensor):
            return self.pattern
        if isinstance(self.pattern, str):
            return PATTERNS[self.pattern](n, n, **self.pattern_options)
        return self.pattern(n, n)

    def mask_for(self, seqlen: int, device: torch.device) -> BlockSparseMask:
        key = (seqlen, str(device))
        if key not in self._masks:
            self._masks[key] = BlockSparseMask.from_layout(self.layout_for(seqlen).cpu(), seqlen, seqlen).to(device)
        return self._masks[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.Wqkv(x).view(b, s, 3, self.num_heads, self.embed_dim // self.num_heads)
        out = flash_attn_blocksparse_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], self.mask_for(s, x.device),
                                          dropout_p=self.dropout if self.training else 0.0, causal=self.causal)
        return self.out_proj(out.reshape(b, s, self.embed_dim))

    def extra_repr(self) -> str:
        name = self.pattern if isinstance(self.pattern, str) else type(self.pattern).__name__
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, pattern={name}, causal={self.causal}"
