// Forward launcher: the sm90 kernel where it applies (csrc/hopper/), else picks the portable
// tile configuration for (head dim, dtype); then the probabilities for return_attn_probs.
// Instantiated once per (dtype, head dim) by the generated files in instantiations/.
#pragma once

#include "flash_fwd_kernel.cuh"
#include "flash_launch.h"
#include "launch_utils.cuh"

namespace flash::cuda {

// Forward tiles: 64 keys per step; up to head dim 128, 128 query rows on 4 warps of two 16-row
// tiles each; above that 64 rows on 4 warps of one tile (the output accumulator alone takes 128
// registers at head dim 256). kKVStages = 2 (double-buffered K/V) where two CTAs still fit on
// an SM: up to head dim 128, without dropout, on sm_90.
template <typename Elem, int kHeadDim, int kKVStages = 1>
using FwdConfig = FwdTraits<Elem, kHeadDim, (kHeadDim <= 128 ? 128 : 64), 64, (kHeadDim <= 128 ? 2 : 1), kKVStages>;

// The sm90 kernel where it applies (a build with FLASH_ATTN_WITH_SM90; see csrc/hopper/).
template <typename Elem, int kHeadDim>
bool try_sm90_fwd(FwdParams& p, cudaStream_t stream) {
#ifdef FLASH_ATTN_WITH_SM90
  return hopper::run_mha_fwd_sm90_<Elem, kHeadDim>(p, stream);
#else
  return false;
#endif
}

template <typename Elem, int kHeadDim>
void run_mha_fwd_(FwdParams& p, cudaStream_t stream) {
  using T = FwdConfig<Elem, kHeadDim>;
  const dim3 grid((p.seqlen_q + T::kBlockM - 1) / T::kBlockM, p.h, p.b);
  if (grid.x == 0 || p.b == 0) return;
  if (try_sm90_fwd<Elem, kHeadDim>(p, stream)) {
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
  if (p.p_ptr != nullptr) launch<T>(&flash_fwd_probs_kernel<T>, grid, p, stream);
}

}  // namespace flash::cuda
