"""Building blocks of the attention layers (flash-attn 2.x's flash_attn.layers)."""

from .rotary import RotaryEmbedding, apply_rotary_emb

__all__ = ["RotaryEmbedding", "apply_rotary_emb"]
