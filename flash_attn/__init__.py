"""flash_attn: exact FlashAttention as PyTorch custom ops (torch.ops.flash_attn.fwd / .bwd)."""

from .version import __version__
from . import ops  # loads the library, registers fake kernels and autograd
from .block_sparse import BlockSparseMask
from .interface import (flash_attn_blocksparse_func, flash_attn_blocksparse_qkvpacked_func, flash_attn_func,
                        flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_func,
                        flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func)
from .kvcache import flash_attn_with_kvcache
from .modules.multihead_attention import replace_attention

__all__ = [
    "__version__",
    "BlockSparseMask",
    "flash_attn_blocksparse_func",
    "flash_attn_blocksparse_qkvpacked_func",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "replace_attention",
]
