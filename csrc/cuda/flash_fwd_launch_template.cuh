// Forward launcher: the sm90 kernel where it applies (csrc/hopper/), else picks the portable
// tile configuration for (head dim, dtype); then the probabilities for return_attn_probs.
// Instantiated once per (dtype, head dim) by the generated files in instantiations/.
#pragma once

#include "flash_fwd_combine.cuh"
#include "flash_fwd_kernel.cuh"
#include "flash_launch.h"
#include "launch_utils.cuh"

namespace flash::cuda {

// Forward tiles: 64 keys per step; up to head dim 128, 128 query rows on 4 warps of two 16-row
// tiles each; above that 64 rows on 4 warps of one tile (the output accumulator alone takes 128
// registers at head dim 256). kKVStages = 2 (double-buffered K/V) where two CTAs still fit on
// an SM: up to head dim 128, without dropout, on sm_90.
template <typename Elem, int kHeadDim, int kKVStages = 1>
using FwdConfig = FwdTraits<Elem, kHeadDim, fwd_block_m(kHeadDim), kFwdBlockN, (kHeadDim <= 128 ? 2 : 1), kKVStages>;

// The sm90 kernel where it applies (a build with FLASH_ATTN_WITH_SM90; see csrc/hopper/).
template <typename Elem, int kHeadDim>
bool try_sm90_fwd(FwdParams& p, cudaStream_t stream) {
#ifdef FLASH_ATTN_WITH_SM90
  return hopper::run_mha_fwd_sm90_<Elem, kHeadDim>(p, stream);
#else
  return false;
#endif
}

// Decoding over a KV cache (fwd_decode_tiles): tiles of one warp's 16 rows for up to 16 query rows
// (one query per head, or a GQA group's query heads as rows), else 64 rows. Small tiles put more
// CTAs, hence more loads in flight, on each SM and spend less MMA and softmax work on rows that do
// not exist: on the H200, 16-row tiles read the cache 1.05-1.9x as fast as 64-row ones, and
// 1.1-1.35x as fast as 64 rows by 128 keys (NOTES, eighteenth session).
template <typename Elem, int kHeadDim, int kRows>
using FwdDecodeConfig = FwdTraits<Elem, kHeadDim, kRows, kFwdBlockN, 1, (kHeadDim <= 128 ? 2 : 1)>;
static_assert(fwd_block_m(256) == kDecodeRows, "above head dim 128 FwdConfig's tiles are the 64-row decoding ones");

template <typename TD>
void run_decode(FwdParams& p, cudaStream_t stream) {
  const dim3 grid((p.seqlen_q + TD::kBlockM - 1) / TD::kBlockM, p.h, p.b * p.num_splits);
  if (grid.x == 0 || p.b == 0) return;
  launch<TD>(&flash_fwd_kernel<TD, false>, grid, p, stream);
  if (p.num_splits > 1) launch_fwd_combine<typename TD::Elem>(p, stream);
}

template <typename Elem, int kHeadDim>
void run_mha_fwd_(FwdParams& p, cudaStream_t stream) {
  if (fwd_decode_tiles(p)) {
    if (p.seqlen_q <= 16) return run_decode<FwdDecodeConfig<Elem, kHeadDim, 16>>(p, stream);
    if constexpr (kHeadDim <= 128) return run_decode<FwdDecodeConfig<Elem, kHeadDim, kDecodeRows>>(p, stream);
  }
  using T = FwdConfig<Elem, kHeadDim>;
  // (Split-KV: the portable kernel, num_splits CTAs per query block along z, then the combine.)
  const dim3 grid((p.seqlen_q + T::kBlockM - 1) / T::kBlockM, p.h, p.b * p.num_splits);
  if (grid.x == 0 || p.b == 0) return;
  if (p.num_splits == 1 && try_sm90_fwd<Elem, kHeadDim>(p, stream)) {
    // done
  } else if (p.p_dropout > 0.f) {
    launch<T>(&flash_fwd_kernel<T, true>, grid, p, stream);
  } else if constexpr (kHeadDim <= 128) {
    using T2 = FwdConfig<Elem, kHeadDim, 2>;
    if (two_ctas_per_sm_fit(T2::kSmemBytes)) launch<T2>(&flash_fwd_kernel<T2, false>, grid, p, stream);
    else launch<T>(&flash_fwd_kernel<T, false>, grid, p, stream);
  } else {
    launch<T>(&flash_fwd_kernel<T, false>, grid, p, stream);
  }
  if (p.num_splits > 1) launch_fwd_combine<Elem>(p, stream);
  if (p.p_ptr != nullptr) launch<T>(&flash_fwd_probs_kernel<T>, grid, p, stream);
}

}  // namespace flash::cuda
