"""nn.Module layers built on the functional API."""

from .block_sparse_attention import BlockSparseMultiheadAttention
from .mha import MHA, FlashCrossAttention, FlashSelfAttention
from .multihead_attention import MultiheadAttention, replace_attention

__all__ = ["BlockSparseMultiheadAttention", "FlashCrossAttention", "FlashSelfAttention", "MHA", "MultiheadAttention",
           "replace_attention"]
