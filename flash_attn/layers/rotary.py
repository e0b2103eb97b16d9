"""Rotary position embeddings (RoPE) with flash-attn 2.x's names and arguments, in plain PyTorch
(element-wise, so torch.compile fuses it into its neighbours)."""

from typing import Optional, Tuple, Union

import torch
from torch import nn


def _rotate(x1: torch.Tensor, x2: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                     inplace: bool = False, seqlen_offsets: Union[int, torch.Tensor] = 0,
                     cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None) -> torch.Tensor:
    """Rotate the first rotary_dim = 2 * cos.shape[-1] features of each head.

    x: (batch, seqlen, nheads, headdim), or (total, nheads, headdim) packed with cu_seqlens
    (batch + 1,), each sequence's positions counted from 0. cos, sin: (seqlen_ro, rotary_dim / 2)
    covering every position. Not interleaved (GPT-NeoX): feature i pairs with i + rotary_dim / 2;
    interleaved (GPT-J): 2 i with 2 i + 1. seqlen_offsets: an int, or (batch,) per sequence (KV-cache
    decoding), added to the positions. The rest of headdim passes through. inplace writes the
    result into x. max_seqlen is accepted for flash-attn 2.x's signature and not needed.
    """
    rot = 2 * cos.shape[-1]
    if rot > x.shape[-1]:
        raise ValueError(f"apply_rotary_emb: rotary_dim {rot} exceeds the head dim {x.shape[-1]}")
    if cu_seqlens is not None:  # per token: its position within its sequence
        seqlens = cu_seqlens[1:] - cu_seqlens[:-1]
        starts = torch.repeat_interleave(cu_seqlens[:-1], seqlens, output_size=x.shape[0])
        pos = torch.arange(x.shape[0], device=x.device) - starts
        if isinstance(seqlen_offsets, torch.Tensor):
            pos = pos + torch.repeat_interleave(seqlen_offsets, seqlens, output_size=x.shape[0])
        else:
            pos = pos + seqlen_offsets
        cos, sin = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)  # (total, 1, rot / 2)
    elif isinstance(seqlen_offsets, torch.Tensor):
        pos = seqlen_offsets.view(-1, 1) + torch.arange(x.shape[1], device=x.device)  # (batch, seqlen)
        cos, sin = cos[pos].unsqueeze(2), sin[pos].unsqueeze(2)  # (batch, seqlen, 1, rot / 2)
    else:
        seqlen = x.shape[1]
        if seqlen + seqlen_offsets > cos.shape[0]:
            raise ValueError(f"apply_rotary_emb: cos/sin cover {cos.shape[0]} positions, need {seqlen + seqlen_offsets}")
        cos, sin = cos[seqlen_offsets:seqlen_offsets + seqlen, None], sin[seqlen_offsets:seqlen_offsets + seqlen, None]
    cos, sin = cos.float(), sin.float()
    xr = x[..., :rot].float()  # rotated in float32, rounded once to x's dtype
    if interleaved:
        pairs = xr.unflatten(-1, (-1, 2))
        y1, y2 = _rotate(pairs[..., 0], pairs[..., 1], cos, sin)
        rotated = torch.stack((y1, y2), dim=-1).flatten(-2)
    else:
        y1, y2 = _rotate(xr[..., :rot // 2], xr[..., rot // 2:], cos, sin)
        rotated = torch.cat((y1, y2), dim=-1)
    rotated = rotated.to(x.dtype)
    if inplace:
        x[..., :rot] = rotated
        return x
    return torch.cat((rotated, x[..., rot:]), dim=-1) if rot < x.shape[-1] else rotated


apply_rotary_emb_func = apply_rotary_emb  # flash-attn 2.x's other name for it


def apply_rotary_emb_qkv_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          cos_k: Optional[torch.Tensor] = None, sin_k: Optional[torch.Tensor] = None,
                          interleaved: bool = False, seqlen_offsets: Union[int, torch.Tensor] = 0,
                          num_heads_q: Optional[int] = None) -> torch.Tensor:
    """Rotate q and k of a packed qkv in place and return it.

    qkv: (batch, seqlen, 3, nheads, headdim), or (batch, seqlen, num_heads_q + 2 * nheads_k,
    headdim) under GQA/MQA with num_heads_q given. cos, sin: (seqlen_ro, rotary_dim / 2) for q, and
    for k unless cos_k, sin_k are given. interleaved and seqlen_offsets as in apply_rotary_emb.
    """
    cos_k = cos if cos_k is None else cos_k
    sin_k = sin if sin_k is None else sin_k
    rope = dict(interleaved=interleaved, inplace=True, seqlen_offsets=seqlen_offsets)
    if qkv.dim() == 5:
        if qkv.shape[2] != 3:
            raise ValueError(f"apply_rotary_emb_qkv_: qkv must be (batch, seqlen, 3, nheads, headdim), got "
                             f"{tuple(qkv.shape)}")
        q, k = qkv[:, :, 0], qkv[:, :, 1]
    else:
        if num_heads_q is None or qkv.dim() != 4 or (qkv.shape[2] - num_heads_q) % 2 != 0:
            raise ValueError(f"apply_rotary_emb_qkv_: a (batch, seqlen, num_heads_q + 2 * nheads_k, headdim) qkv "
                             f"needs num_heads_q, got shape {tuple(qkv.shape)} and num_heads_q={num_heads_q}")
        hk = (qkv.shape[2] - num_heads_q) // 2
        q, k = qkv[:, :, :num_heads_q], qkv[:, :, num_heads_q:num_heads_q + hk]
    apply_rotary_emb(q, cos, sin, **rope)
    apply_rotary_emb(k, cos_k, sin_k, **rope)
    return qkv


def apply_rotary_emb_kv_(kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                         seqlen_offsets: Union[int, torch.Tensor] = 0) -> torch.Tensor:
    """Rotate k of a packed kv (batch, seqlen, 2, nheads_k, headdim) in place and return kv."""
    if kv.dim() != 5 or kv.shape[2] != 2:
        raise ValueError(f"apply_rotary_emb_kv_: kv must be (batch, seqlen, 2, nheads_k, headdim), got {tuple(kv.shape)}")
    apply_rotary_emb(kv[:, :, 0], cos, sin, interleaved=interleaved, inplace=True, seqlen_offsets=seqlen_offsets)
    return kv


class RotaryEmbedding(nn.Module):
    """The cos/sin tables of RoPE for rotary_dim = dim features, applied to q and k (or a packed
    qkv). base: the frequency base; interleaved: GPT-J pairing. pos_idx_in_fp32=False computes the
    angles in the inv_freq buffer's dtype (after .half(): float16), as flash-attn does for models
    trained that way; the default computes them in float32. The tables are recomputed per call
    (seqlen x dim / 2 values; under torch.compile they fuse with their use).

    scale_base (XPos, Sun et al. 2022): each frequency pair i of q at position m is also scaled by
    zeta_i ** ((m - c) / scale_base), and of k by its inverse, zeta_i = (2 i + 0.4 dim) / (1.4 dim),
    so a score q_m . k_n decays as zeta_i ** ((m - n) / scale_base). c is half the longest table
    built so far (as flash-attn's cached tables have it); it cancels in the scores."""

    def __init__(self, dim: int, base: float = 10000.0, interleaved: bool = False,
                 scale_base: Optional[float] = None, pos_idx_in_fp32: bool = True, device=None):
        super().__init__()
        if dim % 2 != 0:
            raise ValueError(f"RotaryEmbedding: dim must be even, got {dim}")
        if scale_base is not None and not scale_base > 0:
            raise ValueError(f"RotaryEmbedding: scale_base must be positive (or None: no XPos), got {scale_base}")
        self.dim, self.base, self.interleaved = dim, float(base), interleaved
        self.scale_base = None if scale_base is None else float(scale_base)
        self.pos_idx_in_fp32 = pos_idx_in_fp32
        self.register_buffer("inv_freq", self._inv_freq(device), persistent=False)
        # (flash-attn's buffer names; `scale is None` says there is no XPos)
        self.register_buffer("scale", None if scale_base is None else self._xpos_zeta(device), persistent=False)
        self._seq_len_cached = 0

    def _inv_freq(self, device) -> torch.Tensor:
        return 1.0 / (self.base ** (torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim))

    def _xpos_zeta(self, device) -> torch.Tensor:
        return (torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) + 0.4 * self.dim) / (1.4 * self.dim)

    def xpos_cos_sin(self, seqlen: int, device) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """XPos: (cos, sin) for q and (cos_k, sin_k) for k, float32, (n, dim / 2) for the n =
        max(seqlen, longest so far) positions 0 .. n - 1, centred on n // 2. (zeta is recomputed
        in float32: the scale buffer follows a module's .to(dtype), and its powers at late
        positions would be far off in 16 bits.)"""
        n = self._seq_len_cached = max(self._seq_len_cached, int(seqlen))
        cos, sin = self.cos_sin(n, device)
        power = (torch.arange(n, device=device, dtype=torch.float32) - n // 2) / self.scale_base
        scale = self._xpos_zeta(device) ** power[:, None]
        return cos * scale, sin * scale, cos / scale, sin / scale

    def cos_sin(self, seqlen: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
        """(seqlen, dim / 2) float32 tables for positions 0 .. seqlen - 1. With pos_idx_in_fp32 the
        frequencies are recomputed in float32 (the inv_freq buffer follows a module's .to(dtype),
        and in 16 bits the angles of late positions would be off by tenths of a radian)."""
        if self.pos_idx_in_fp32:
            inv_freq = self._inv_freq(device)
        else:
            inv_freq = self.inv_freq.to(device)
        freqs = torch.outer(torch.arange(seqlen, device=device, dtype=inv_freq.dtype), inv_freq).float()
        return torch.cos(freqs), torch.sin(freqs)

    def forward(self, qkv: torch.Tensor, kv: Optional[torch.Tensor] = None,
                seqlen_offset: Union[int, torch.Tensor] = 0, max_seqlen: Optional[int] = None,
                num_heads_q: Optional[int] = None, cu_seqlens: Optional[torch.Tensor] = None
                ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """flash-attn's arguments, in its order, then cu_seqlens. Rotates q and k of:
        qkv (batch, seqlen, 3, nheads, headdim), or (batch, seqlen, num_heads_q + 2 * nheads_k,
        headdim) with num_heads_q (GQA / MQA); or, with kv, q = qkv (batch, seqlen, nheads,
        headdim) and kv (batch, seqlen_k, 2, nheads_k, headdim). Packed (with cu_seqlens and
        max_seqlen): the same without the batch dim, self-attention only (q and kv the same
        sequences). seqlen_offset: an int or (batch,) per sequence, added to the positions;
        max_seqlen without cu_seqlens: the tables cover at least that many positions (with
        per-sequence offsets, all of them must fit, and finding their largest is then not needed).
        Returns qkv, or (q, kv)."""
        seq_dim = 0 if cu_seqlens is not None else 1
        heads_dim = seq_dim + 1
        if kv is not None:
            q, k = qkv, kv.select(heads_dim, 0)
        elif num_heads_q is not None:
            hk = (qkv.shape[heads_dim] - num_heads_q) // 2
            if qkv.dim() != seq_dim + 3 or hk < 1 or qkv.shape[heads_dim] != num_heads_q + 2 * hk:
                raise ValueError(f"RotaryEmbedding: with num_heads_q={num_heads_q}, qkv must have num_heads_q + 2 * "
                                 f"nheads_k heads, got shape {tuple(qkv.shape)}")
            q, k, v = qkv.split([num_heads_q, hk, hk], dim=heads_dim)
        else:
            q, k = qkv.select(heads_dim, 0), qkv.select(heads_dim, 1)
        if cu_seqlens is not None:
            if kv is not None and kv.shape[0] != q.shape[0]:
                raise ValueError(f"RotaryEmbedding: with cu_seqlens, q and kv are the same packed sequences "
                                 f"(self-attention), got {q.shape[0]} and {kv.shape[0]} rows")
            if max_seqlen is None:
                raise ValueError("RotaryEmbedding: cu_seqlens needs max_seqlen")
            positions = max_seqlen
        else:
            positions = max(q.shape[1], k.shape[1])
        if not (isinstance(seqlen_offset, torch.Tensor) and cu_seqlens is None and max_seqlen is not None):
            positions += int(seqlen_offset.max()) if isinstance(seqlen_offset, torch.Tensor) else seqlen_offset
        if cu_seqlens is None and max_seqlen is not None:  # (per-sequence offsets within it: no sync to find them)
            positions = max(positions, max_seqlen)
        if self.scale is None:
            cos, sin = cos_k, sin_k = self.cos_sin(positions, q.device)
        else:
            cos, sin, cos_k, sin_k = self.xpos_cos_sin(positions, q.device)
        rope = dict(interleaved=self.interleaved, seqlen_offsets=seqlen_offset, cu_seqlens=cu_seqlens)
        q, k = apply_rotary_emb(q, cos, sin, **rope), apply_rotary_emb(k, cos_k, sin_k, **rope)
        if kv is not None:
            return q, torch.stack((k, kv.select(heads_dim, 1)), dim=heads_dim)
        if num_heads_q is not None:
            return torch.cat((q, k, v), dim=heads_dim)
        return torch.stack((q, k, qkv.select(heads_dim, 2)), dim=heads_dim)
