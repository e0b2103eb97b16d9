"""Helpers with flash-attn 2.x's module paths (flash_attn.utils.generation)."""
