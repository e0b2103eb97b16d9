// The CPU implementation of the FlashAttention algorithm: the executable specification that the
// GPU kernels are tested against. Works on float32 tensors (the op layer converts fp16/bf16),
// except a 16-bit KV cache, which the forward reads in place and converts tile by tile.
#pragma once

#include "../flash_params.h"

namespace flash::cpu {

// Writes o, softmax_lse and (if p_ptr) the probabilities.
void run_fwd(const FwdParams& params);

// How many splits of the key blocks the backward uses (sizes params.dq_accum_ptr).
int bwd_num_splits(int batch, int heads, int seqlen_k);

// Writes the dq_accum partial sums and the per-query-head dk_accum / dv_accum.
void run_bwd(const BwdParams& params);

}  // namespace flash::cpu
