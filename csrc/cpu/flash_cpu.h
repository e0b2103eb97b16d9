// The CPU implementation of the FlashAttention algorithm: the executable specification that the
// GPU kernels are tested against. Works on float32 tensors; the op layer converts fp16/bf16.
#pragma once

#include "../flash_params.h"

namespace flash::cpu {

// Writes o, softmax_lse and (if p_ptr) the probabilities.
void run_fwd(const FwdParams& params);

// Writes dq (float32, params' dq strides) and the per-query-head dk_accum / dv_accum.
void run_bwd(const BwdParams& params);

}  // namespace flash::cpu
