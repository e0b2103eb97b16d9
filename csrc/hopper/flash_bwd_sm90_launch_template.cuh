// sm90 backward launcher: the tile configuration per head dim. Instantiated once per (dtype, head
// dim) by the generated files in instantiations/; compiled for sm_90a only (elsewhere the kernel
// body is empty and the portable launcher never gets true from here).
#pragma once

#include "../cuda/flash_launch.h"
#include "../cuda/launch_utils.cuh"
#include "flash_bwd_sm90_kernel.cuh"

namespace flash::hopper {

// 128 keys per CTA on two warpgroups, 64 queries per step.
template <typename Elem, int kHeadDim>
using BwdSm90Config = BwdSm90Traits<Elem, kHeadDim, 64, 128>;

// Runs the backward's main kernel here and returns true where this path applies: an sm_90 GPU,
// head dim 64 or 128, the atomic dQ mode (dq_accum_ptr set, i.e. not deterministic), no dropout,
// enough shared memory and FLASH_ATTN_DISABLE_SM90 unset. Otherwise returns false. The portable
// launcher runs the D pre-pass before and the dQ conversion after.
template <typename Elem, int kHeadDim>
bool run_mha_bwd_sm90_(BwdParams& p, cudaStream_t stream) {
  static_assert(has_sm90_bwd<kHeadDim>, "instantiated for the head dims of has_sm90_bwd only");
  using T = BwdSm90Config<Elem, kHeadDim>;
  if (!cuda::sm90_path_enabled() || p.dq_accum_ptr == nullptr || p.p_dropout > 0.f ||
      T::kSmemBytes > cuda::smem_per_block_optin())
    return false;
  const dim3 grid((p.seqlen_k + T::kBlockN - 1) / T::kBlockN, p.h, p.b);
  cuda::launch<T>(&flash_bwd_sm90_kernel<T>, grid, p, stream);
  return true;
}

}  // namespace flash::hopper
