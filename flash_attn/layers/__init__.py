"""Building blocks of the attention layers (flash-attn 2.x's flash_attn.layers)."""

from .rotary import (RotaryEmbedding, apply_rotary_emb, apply_rotary_emb_func, apply_rotary_emb_kv_,
                     apply_rotary_emb_qkv_)

__all__ = ["RotaryEmbedding", "apply_rotary_emb", "apply_rotary_emb_func", "apply_rotary_emb_kv_",
           "apply_rotary_emb_qkv_"]
