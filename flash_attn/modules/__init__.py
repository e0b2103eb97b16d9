"""nn.Module layers built on the functional API."""

from .block_sparse_attention import BlockSparseMultiheadAttention

__all__ = ["BlockSparseMultiheadAttention"]
