"""Moving between a padded batch with a padding mask and the packed ("varlen") layout that
flash_attn_varlen_func takes, with flash-attn 2.x's names, arguments and return values.

Padded: (batch, seqlen, ...) plus a (batch, seqlen) mask, nonzero / True = a real token. Packed:
(total_tokens, ...) holding the real tokens of every sequence back to back, plus cu_seqlens
(batch + 1,) int32, the offset of each sequence's first token (cu_seqlens[-1] == total_tokens).
All functions are differentiable in the tensor they move.
"""

from typing import Optional, Tuple

import torch


def index_first_axis(input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The rows input[indices] of a tensor whose first axis is (batch * seqlen)."""
    return torch.index_select(input, 0, indices)


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
    """A zero tensor of first_axis_dim rows with values[i] placed at row indices[i]: the inverse
    of index_first_axis for unique indices."""
    out = values.new_zeros((first_axis_dim, *values.shape[1:]))
    return out.index_copy(0, indices, values)


def _cu_seqlens(seqlens: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor,
                unused_mask: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """Pack the real tokens of a padded batch.

    hidden_states: (batch, seqlen, ...). attention_mask: (batch, seqlen), nonzero / True where the
    token is real. unused_mask: optional (batch, seqlen) mask of tokens that are allocated but not
    attended to; they are packed too (counted in cu_seqlens) but not in seqused.

    Returns (hidden_states (total, ...), indices (total,) of the packed tokens in the flattened
    (batch * seqlen) axis, cu_seqlens (batch + 1,) int32, max_seqlen_in_batch (int), seqused
    (batch,) int32: the tokens of each sequence that attention_mask marks).
    """
    kept = attention_mask.bool()
    packed = kept if unused_mask is None else kept | unused_mask.bool()
    seqlens = packed.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(packed.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() > 0 else 0
    rows = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(rows, indices), indices, _cu_seqlens(seqlens), max_seqlen, kept.sum(-1, dtype=torch.int32)


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """The inverse of unpad_input: packed (total, ...) back to (batch, seqlen, ...), zeros at the
    padding."""
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.view(batch, seqlen, *hidden_states.shape[1:])


def unpad_input_for_concatenated_sequences(hidden_states: torch.Tensor, attention_mask_in_length: torch.Tensor
                                           ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Pack rows that each hold several sequences back to back (sequence packing).

    attention_mask_in_length: (batch, seqlen) integers; row b lists the lengths of the sequences
    concatenated at the start of row b, then zeros. E.g. [[2, 3, 0, 0, 0, 0], [3, 2, 0, 0, 0, 0]]
    describes four sequences in two rows of six tokens, the last token of each row padding.

    Returns (hidden_states (total, ...), indices, cu_seqlens (num_sequences + 1,) int32,
    max_seqlen_in_batch): each concatenated sequence is its own sequence in the packed form.
    """
    lengths = attention_mask_in_length.to(torch.int32)
    seqlens = lengths.flatten()
    seqlens = seqlens[seqlens > 0]
    # The tokens of row b are its first sum(lengths[b]) positions.
    used = torch.arange(lengths.shape[1], device=lengths.device) < lengths.sum(dim=-1, keepdim=True)
    indices = torch.nonzero(used.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() > 0 else 0
    rows = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(rows, indices), indices, _cu_seqlens(seqlens), max_seqlen
