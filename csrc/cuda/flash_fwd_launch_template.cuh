// Forward launcher: the sm90 kernel where it applies (csrc/hopper/), else picks the portable
// tile configuration for (head dim, dtype); then the probabilities for return_attn_probs.
// Instantiated once per (dtype, head dim) by the generated files in instantiations/.
#pragma once

#include "../env_switch.h"
#include "flash_fwd_combine.cuh"
#include "flash_fwd_decode_kernel.cuh"
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

// Decoding over a KV cache (fwd_decode_tiles): up to 16 query rows (one query per head, or a GQA
// group's query heads as rows), one 16-row tile per CTA whose four warps split each 64-key tile
// (flash_fwd_decode_kernel.cuh); else tiles of 64 rows. Small tiles put more CTAs, hence more
// loads in flight, on each SM and spend less MMA and softmax work on rows that do not exist. GPUs
// with less shared memory than the split-key tiles need (sm_86 / sm_89 at head dims 192 and up)
// run one warp's 16 rows by 64 keys (NOTES, eighteenth and twenty-first sessions).
template <typename Elem, int kHeadDim, int kRows>
using FwdDecodeConfig = FwdTraits<Elem, kHeadDim, kRows, kFwdBlockN, 1, (kHeadDim <= 128 ? 2 : 1)>;
template <typename Elem, int kHeadDim>
using FwdSplitKeysConfig = FwdSplitKeysTraits<Elem, kHeadDim, kFwdBlockN, 4>;
static_assert(fwd_block_m(256) == kDecodeRows, "above head dim 128 FwdConfig's tiles are the 64-row decoding ones");

// Decoding over keys that are not paged, split or not, may run the sm90 kernel instead (where it
// applies: sm_90, the head dims and strides it takes), whose TMA loads and persistent grid read
// long key ranges faster than the decoding tiles' cp.async: on the H100 1.005-1.09x from 8192
// keys, 0.74-0.99x below (NOTES, twenty-fourth session). The longest sequence decides, so a cache
// whose counts were not read on the host (CUDA graph capture) keeps the decoding tiles: its rows
// may be mostly empty. FLASH_ATTN_DECODE_SM90=0 / 1 forces either (tests, A/B).
inline constexpr int kDecodeSm90MinKeys = 8192;
inline bool fwd_decode_on_sm90(const FwdParams& p) {
  if (p.block_table != nullptr) return false;
  if (const auto force = env_switch("FLASH_ATTN_DECODE_SM90")) return *force;
  const int keys = p.seqused_k == nullptr ? p.seqlen_k : p.longest_keys;
  return keys >= kDecodeSm90MinKeys;
}

template <typename TD, typename Kernel>
void run_decode(FwdParams& p, cudaStream_t stream, Kernel kernel) {
  const dim3 grid((p.seqlen_q + TD::kBlockM - 1) / TD::kBlockM, p.h, p.b * p.num_splits);
  if (grid.x == 0 || p.b == 0) return;
  launch<TD>(kernel, grid, p, stream);
  if (p.num_splits > 1) launch_fwd_combine<typename TD::Elem>(p, stream);
}

template <typename Elem, int kHeadDim>
void run_mha_fwd_(FwdParams& p, cudaStream_t stream) {
  if (fwd_decode_tiles(p)) {
    if (fwd_decode_on_sm90(p) && try_sm90_fwd<Elem, kHeadDim>(p, stream)) {
      if (p.num_splits > 1) launch_fwd_combine<Elem>(p, stream);
      return;
    }
    using TK = FwdSplitKeysConfig<Elem, kHeadDim>;
    using T16 = FwdDecodeConfig<Elem, kHeadDim, 16>;
    using T64 = FwdDecodeConfig<Elem, kHeadDim, kDecodeRows>;
    if (p.seqlen_q <= 16 && TK::kSmemBytes <= smem_per_block_optin())
      return run_decode<TK>(p, stream, &flash_fwd_decode_kernel<TK>);
    if (p.seqlen_q <= 16) return run_decode<T16>(p, stream, &flash_fwd_kernel<T16, false>);
    if constexpr (kHeadDim <= 128) return run_decode<T64>(p, stream, &flash_fwd_kernel<T64, false>);
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
