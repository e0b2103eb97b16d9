// Entry points of the CUDA kernels, called by the op layer with a filled params struct.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../flash_params.h"
#include "../host_device.h"
#include "../seq_view.h"

namespace flash::cuda {

// Head dims with compiled kernels; other sizes run on the next larger one (zero-padded).
inline constexpr int kHeadDims[] = {32, 64, 96, 128, 160, 192, 224, 256};

using flash::kDqAccumRowPad;
using flash::padded_query_rows;

// The dQ accumulator: rows as BwdParams::stat_batch_stride lays them out (padded batches:
// (batch, h, padded_query_rows(seqlen_q))), each dq_accum_row_stride(d) floats: the head dim of
// the kernel that runs d.
inline int64_t dq_accum_row_stride(int64_t d) {
  for (int hd : kHeadDims)
    if (hd >= d) return hd;
  return d;
}

// Where column `col` of accumulator row `row` (of `d` columns) lives when
// BwdParams::dq_accum_swizzled: groups of 8 columns XOR-ed with the row's low 3 bits (2 where d is
// not a multiple of 64, so that a column stays within its row), the layout the warp-specialized
// sm90 backward keeps its dQ tile in shared memory (few bank conflicts) and reduces into the
// accumulator as one block.
FLASH_HOST_DEVICE int dq_accum_col(bool swizzled, int row, int col, int d) {
  return swizzled ? col ^ ((row & (d % 64 == 0 ? 7 : 3)) << 3) : col;
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
inline constexpr bool has_sm90_bwd = kHeadDim <= 128 || kHeadDim == 192 || kHeadDim == 256;
}  // namespace flash::hopper
