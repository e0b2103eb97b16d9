// Entry points of the CUDA kernels, called by the op layer with a filled params struct.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../flash_params.h"

namespace flash::cuda {

// Head dims with compiled kernels; other sizes run on the next larger one (zero-padded).
inline constexpr int kHeadDims[] = {32, 64, 96, 128, 160, 192, 224, 256};

// The backward's float32 dQ accumulator (atomic mode) per (batch, head): rows padded to a
// multiple of every main kernel's query block and a row stride of the kernel's head dim, so its
// atomic adds need no bounds checks. Layout (batch, h, rows, row_stride).
inline constexpr int kDqAccumRowPad = 128;
struct DqAccumShape {
  int64_t rows, row_stride;
};
inline DqAccumShape dq_accum_shape(int64_t seqlen_q, int64_t d) {
  int64_t stride = d;
  for (int hd : kHeadDims)
    if (hd >= d) {
      stride = hd;
      break;
    }
  return DqAccumShape{(seqlen_q + kDqAccumRowPad - 1) / kDqAccumRowPad * kDqAccumRowPad, stride};
}

void run_fwd(FwdParams& params, cudaStream_t stream);
void run_bwd(BwdParams& params, cudaStream_t stream);

// One (dtype, head dim) instantiation each, in instantiations/ (generated).
template <typename Elem, int kHeadDim>
void run_mha_fwd_(FwdParams& params, cudaStream_t stream);
template <typename Elem, int kHeadDim>
void run_mha_bwd_(BwdParams& params, cudaStream_t stream);

}  // namespace flash::cuda

namespace flash::hopper {
// The sm90 kernels (csrc/hopper/, built when FLASH_ATTN_WITH_SM90 is defined): each runs and
// returns true where it applies, else returns false and the portable kernel runs.
template <typename Elem, int kHeadDim>
bool run_mha_fwd_sm90_(FwdParams& params, cudaStream_t stream);
template <typename Elem, int kHeadDim>
bool run_mha_bwd_sm90_(BwdParams& params, cudaStream_t stream);  // head dims with has_sm90_bwd only
template <int kHeadDim>
inline constexpr bool has_sm90_bwd = kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 192 || kHeadDim == 256;
}  // namespace flash::hopper
