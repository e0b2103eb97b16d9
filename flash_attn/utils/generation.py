"""State for incremental decoding with flash_attn.modules.mha.MHA, under flash-attn 2.x's names."""

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class InferenceParams:
    """What a model passes to its MHA layers (forward(..., inference_params=...)) while decoding.

    max_seqlen, max_batch_size: the size of each layer's KV cache, allocated on first use as
    (max_batch_size, max_seqlen, 2, nheads_kv, headdim) under key_value_memory_dict[layer_idx]
    (or put there beforehand, e.g. from MHA.allocate_inference_cache). seqlen_offset: tokens
    already in the caches (the caller advances it after each step); lengths_per_sample: (batch,)
    int32, the same per sequence, used instead of seqlen_offset where given. batch_size_offset:
    the first cache entry the batch uses.
    """

    max_seqlen: int
    max_batch_size: int
    seqlen_offset: int = 0
    batch_size_offset: int = 0
    key_value_memory_dict: dict = field(default_factory=dict)
    lengths_per_sample: Optional[torch.Tensor] = None

    def reset(self, max_seqlen: int, max_batch_size: int):
        """Start over (new prompts) with caches of this size; the caches already allocated are kept."""
        self.max_seqlen, self.max_batch_size, self.seqlen_offset = max_seqlen, max_batch_size, 0
        if self.lengths_per_sample is not None:
            self.lengths_per_sample.zero_()
