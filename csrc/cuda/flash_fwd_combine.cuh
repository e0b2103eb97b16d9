// Split-KV's second step (FwdParams::num_splits): each output row is the splits' rows weighted by
// exp(lse_s - lse), lse = log sum_s exp(lse_s), since split s normalised its row over its own keys.
#pragma once

#include <c10/cuda/CUDAException.h>

#include "../flash_params.h"
#include "../seq_view.h"
#include "softmax_frag.cuh"

namespace flash::cuda {

inline constexpr int kCombineRows = 4;  // one warp per row

template <typename Elem>
__global__ void __launch_bounds__(32 * kCombineRows) flash_fwd_combine_kernel(const FwdParams params) {
  const int h = blockIdx.y, b = blockIdx.z, lane = threadIdx.x % 32;
  const FwdParams p = seq_view(params, b);
  const int row = blockIdx.x * kCombineRows + threadIdx.x / 32;
  if (row >= p.seqlen_q) return;
  const int64_t i = b * p.lse_batch_stride + h * p.lse_head_stride + p.q_row0 + row, step = p.lse_accum_split_stride;
  float top = kNegInf;
  for (int s = 0; s < p.num_splits; ++s) top = fmaxf(top, p.lse_accum_ptr[s * step + i]);
  float sum = 0.f;
  if (top != kNegInf)
    for (int s = 0; s < p.num_splits; ++s) sum += __expf(p.lse_accum_ptr[s * step + i] - top);
  const float lse = sum > 0.f ? top + __logf(sum) : kNegInf;  // -inf: no split saw a key; the row is 0
  if (lane == 0) p.softmax_lse_ptr[i] = lse;
  Elem* o = rows_of<Elem>(p.o_ptr, b, h, p.q_row0, p.o_batch_stride, p.o_row_stride, p.o_head_stride) +
            int64_t(row) * p.o_row_stride;
  // The splits walked once, each lane adding its columns (lane, lane + 32, ...; p.d <= kMaxD).
  constexpr int kMaxD = 256, kCols = kMaxD / 32;
  float acc[kCols] = {};
  for (int s = 0; s < p.num_splits; ++s) {
    const float l = p.lse_accum_ptr[s * step + i];
    if (l == kNegInf) continue;
    const float w = __expf(l - lse);
    const float* part = p.o_accum_ptr + (s * step + i) * p.d;
#pragma unroll
    for (int c = 0; c < kCols; ++c)
      if (lane + 32 * c < p.d) acc[c] += w * part[lane + 32 * c];
  }
#pragma unroll
  for (int c = 0; c < kCols; ++c)
    if (lane + 32 * c < p.d) o[lane + 32 * c] = Elem(acc[c]);
}

template <typename Elem>
void launch_fwd_combine(const FwdParams& p, cudaStream_t stream) {
  const dim3 grid((p.seqlen_q + kCombineRows - 1) / kCombineRows, p.h, p.b);
  flash_fwd_combine_kernel<Elem><<<grid, 32 * kCombineRows, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace flash::cuda
