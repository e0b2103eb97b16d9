"""flash-attn 2.x's module path for its functions (code written as `from
flash_attn.flash_attn_interface import flash_attn_func` runs unchanged): the same objects as the
package's own (flash_attn.interface, flash_attn.kvcache)."""

from .interface import (flash_attn_blocksparse_func, flash_attn_blocksparse_qkvpacked_func, flash_attn_func,
                        flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_func,
                        flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func)
from .kvcache import flash_attn_with_kvcache

__all__ = ["flash_attn_blocksparse_func", "flash_attn_blocksparse_qkvpacked_func", "flash_attn_func",
           "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]
