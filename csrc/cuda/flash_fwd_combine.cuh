// Split-KV's second step (FwdParams::num_splits): each output row is the splits' rows weighted by
// exp(lse_s - lse), lse = log sum_s exp(lse_s), since split s normalised its row over its own keys.
#pragma once

#include <c10/cuda/CUDAException.h>

#include "../flash_params.h"
#include "../seq_view.h"
#include "flash_launch.h"
#include "softmax_frag.cuh"

namespace flash::cuda {

// One CTA per output row; warp w takes splits w, w + kCombineWarps, ... (lane j: split w +
// kCombineWarps j), so every load of a row's partials goes out at once: a row's splits walked one
// after another by one warp put a dependent L2 round trip per split on the critical path, and the
// combine took 12-18 us of a 50-60 us decoding step on the H200 (NOTES, twenty-first session).
inline constexpr int kCombineWarps = 4;
static_assert(kMaxSplits <= 32 * kCombineWarps, "a lane holds one split's logsumexp");

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// The CTA's reduction of one value per warp (op over the warps' lane-0 values), seen by every thread.
template <typename Op>
__device__ __forceinline__ float cta_reduce(float x, float* slots, int warp, int lane, Op op) {
  if (lane == 0) slots[warp] = x;
  __syncthreads();
  x = slots[0];
#pragma unroll
  for (int w = 1; w < kCombineWarps; ++w) x = op(x, slots[w]);
  return x;
}

template <typename Elem>
__global__ void __launch_bounds__(32 * kCombineWarps) flash_fwd_combine_kernel(const FwdParams params) {
  constexpr int kMaxD = 256, kGroups = kMaxD / 128;  // a lane's float4 columns: 4 lane + 128 g
  __shared__ float slots[2][kCombineWarps];
  __shared__ float4 partial[kCombineWarps - 1][kGroups][32];
  const int row = blockIdx.x, h = blockIdx.y, b = blockIdx.z, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const FwdParams p = seq_view(params, b);
  if (row >= p.seqlen_q) return;  // (the whole CTA)
  const int64_t i = b * p.lse_batch_stride + h * p.lse_head_stride + p.q_row0 + row, step = p.lse_accum_split_stride;
  const int split = warp + kCombineWarps * lane;
  const float ls = split < p.num_splits ? p.lse_accum_ptr[split * step + i] : kNegInf;
  const float top = cta_reduce(warp_max(ls), slots[0], warp, lane, [](float a, float c) { return fmaxf(a, c); });
  const float e = top == kNegInf ? 0.f : __expf(ls - top);
  const float sum = cta_reduce(warp_sum(e), slots[1], warp, lane, [](float a, float c) { return a + c; });
  if (threadIdx.x == 0) p.softmax_lse_ptr[i] = sum > 0.f ? top + __logf(sum) : kNegInf;  // -inf: no key; row 0
  const float weight = sum > 0.f ? e / sum : 0.f;  // exp(lse_s - lse)

  float4 acc[kGroups] = {};
  const int splits = (p.num_splits - warp + kCombineWarps - 1) / kCombineWarps;  // this warp's
#pragma unroll 8
  for (int j = 0; j < splits; ++j) {
    const float w = __shfl_sync(0xffffffffu, weight, j);
    const float* part = p.o_accum_ptr + ((warp + kCombineWarps * j) * step + i) * p.d;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      const int c = 4 * lane + 128 * g;
      if (c >= p.d) continue;
      const float4 x = *reinterpret_cast<const float4*>(part + c);
      acc[g] = make_float4(fmaf(w, x.x, acc[g].x), fmaf(w, x.y, acc[g].y), fmaf(w, x.z, acc[g].z),
                           fmaf(w, x.w, acc[g].w));
    }
  }
  if (warp > 0)
#pragma unroll
    for (int g = 0; g < kGroups; ++g) partial[warp - 1][g][lane] = acc[g];
  __syncthreads();
  if (warp > 0) return;
  Elem* o = rows_of<Elem>(p.o_ptr, b, h, p.q_row0, p.o_batch_stride, p.o_row_stride, p.o_head_stride) +
            int64_t(row) * p.o_row_stride;
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
    const int c = 4 * lane + 128 * g;
    if (c >= p.d) continue;
    float4 x = acc[g];
#pragma unroll
    for (int w = 0; w < kCombineWarps - 1; ++w) {
      const float4 y = partial[w][g][lane];
      x = make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w);
    }
    o[c] = Elem(x.x);
    o[c + 1] = Elem(x.y);
    o[c + 2] = Elem(x.z);
    o[c + 3] = Elem(x.w);
  }
}

template <typename Elem>
void launch_fwd_combine(const FwdParams& p, cudaStream_t stream) {
  flash_fwd_combine_kernel<Elem><<<dim3(p.seqlen_q, p.h, p.b), 32 * kCombineWarps, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace flash::cuda
