// sm90 forward launcher: the tile configuration per head dim. Instantiated once per (dtype, head
// dim) by the generated files in instantiations/; compiled for sm_90a only (elsewhere the kernel
// body is empty and run_fwd never dispatches here).
#pragma once

#include "../cuda/flash_launch.h"
#include "../cuda/launch_utils.cuh"
#include "../cuda/persistent_grid.h"
#include "flash_fwd_sm90_kernel.cuh"
#include "flash_fwd_sm90_ws_kernel.cuh"
#include "tma_view.cuh"

namespace flash::hopper {

// 128 query rows on two warpgroups; 128 keys per step up to head dim 128, 64 above (where the
// output accumulator alone is 128 registers per thread and the tiles would exceed shared memory).
// Up to head dim 64 the registers are capped so that two CTAs share an SM (81 KB of shared
// memory each): one's exponentials overlap the other's MMAs and prologue. Measured at d=64
// against one CTA per SM, 128 x 64 tiles and 192-row CTAs: benchmarks/NOTES.md.
template <typename Elem, int kHeadDim>
using FwdSm90Config = FwdSm90Traits<Elem, kHeadDim, 128, (kHeadDim <= 128 ? 128 : 64), (kHeadDim <= 64 ? 2 : 1)>;

// The warp-specialized kernel (every head dim): the cp.async kernel's key tiles, K and V in as many
// stages as 227 KB leave beside two Q buffers (one at 256): three of each up to head dim 96 and at
// 160, three V and two K at 128, 192 and 256, two of each at 224. The third stage lets the next
// tile's first loads go out before this tile's last ones are read: measured against two stages,
// forward 6-12% faster at 512 keys a row and 4-10% at 16384 for head dims 32-96; at 128, 8% at
// 512, 4% at 1024, equal at 16384; at 160 6-10%, at 192 1-6% (equal at 16384), at 256 1-2%. At
// 128, three K stages with two V, and three of each with one Q buffer, were slower (NOTES,
// sixteenth and seventeenth sessions).
template <int kHeadDim>
constexpr int kFwdKStages = kHeadDim <= 96 || kHeadDim == 160 ? 3 : 2;
template <int kHeadDim>
constexpr int kFwdVStages = kHeadDim <= 192 || kHeadDim == 256 ? 3 : 2;
template <typename Elem, int kHeadDim, int kRows = 128>
using FwdSm90WsConfig = FwdSm90WsTraits<Elem, kHeadDim, (kHeadDim <= 128 ? 128 : 64), kFwdKStages<kHeadDim>,
                                        kFwdVStages<kHeadDim>, kRows>;

// Up to head dim 64 a step's MMAs take about half as long as its softmax; with 192 query rows on
// three consumer warpgroups, two warpgroups' MMAs cover the third one's softmax. Measured against
// 128 rows (NOTES, seventeenth session): forward 6-8% faster at 2048-16384 rows without a mask,
// but slower at 512-1024 rows (up to a third of the last tile wasted) and under causal (22% at
// 1024), so 192 rows only for long unmasked rows. (A block mask's 128-row blocks need 128.)
// FLASH_ATTN_SM90_FWD_ROWS=128 or 192 overrides the choice (tests, A/B).
inline bool fwd_rows_192(const FwdParams& p) {
  if (const auto rows = env_int("FLASH_ATTN_SM90_FWD_ROWS")) return *rows == 192;
  return !p.is_causal && p.window_size_left < 0 && p.window_size_right < 0 && p.seqlen_q >= 2048;
}

template <typename T>
FwdSm90WsParams<T> ws_params(const FwdParams& p, int num_tiles, int* tile_counter) {
  using CElem = typename T::CElem;
  const bool o_tma = T::kTmaO && o_view(p).compatible();
  return FwdSm90WsParams<T>{
      p,
      make_tma_copy(cute::SM90_TMA_LOAD{}, q_view(p).tensor<CElem>(), typename T::SmemLayoutQ{}),
      make_tma_copy(cute::SM90_TMA_LOAD{}, k_view(p).tensor<CElem>(), typename T::SmemLayoutKVStage{}),
      make_tma_copy(cute::SM90_TMA_LOAD{}, v_view(p).tensor<CElem>(), typename T::SmemLayoutKVStage{}),
      // (Where o does not suit TMA, a descriptor of q of the same type stands in, never used.)
      make_tma_copy(cute::SM90_TMA_STORE{}, (o_tma ? o_view(p) : q_view(p)).tensor<CElem>(), typename T::SmemLayoutOWg{}),
      o_tma,
      num_tiles,
      tile_counter};
}

// Runs the warp-specialized kernel where it applies; FLASH_ATTN_SM90_FWD_SYNC=1 turns it off (A/B).
template <typename Elem, int kHeadDim, bool kBlockSparse, int kRows>
bool run_mha_fwd_sm90_ws_(const FwdParams& p, cudaStream_t stream) {
  using T = FwdSm90WsConfig<Elem, kHeadDim, kRows>;
  // (No keys: a descriptor cannot describe an empty tensor; the other kernel writes the zeros. A
  // paged cache's tiles are not rows of one tensor.)
  if (env_switch("FLASH_ATTN_SM90_FWD_SYNC").value_or(false) || p.seqlen_k == 0 || p.block_table != nullptr ||
      T::kSmemBytes > cuda::smem_per_block_optin() ||
      !q_view(p).compatible() || !k_view(p).compatible() || !v_view(p).compatible())
    return false;
  // Persistent (cuda::persistent_grid): FLASH_ATTN_SM90_FWD_PERSISTENT=0 launches a CTA per tile
  // instead (A/B); =n caps the CTAs at n (tests: many tiles per CTA on small problems).
  const int64_t num_tiles = int64_t((p.seqlen_q + T::kBlockM - 1) / T::kBlockM) * p.h * p.b * p.num_splits;
  const cuda::PersistentGrid pg = cuda::persistent_grid(num_tiles, "FLASH_ATTN_SM90_FWD_PERSISTENT", stream);
  const FwdSm90WsParams<T> args = ws_params<T>(p, int(num_tiles), pg.counter_ptr());
  cuda::launch<T>(&flash_fwd_sm90_ws_kernel<T, kBlockSparse>, pg.grid, args, stream);
  return true;
}

template <typename Elem, int kHeadDim>
bool run_mha_fwd_sm90_ws(const FwdParams& p, cudaStream_t stream) {
  if (p.q_block_lists != nullptr) return run_mha_fwd_sm90_ws_<Elem, kHeadDim, true, 128>(p, stream);
  if constexpr (kHeadDim <= 64) {
    if (fwd_rows_192(p)) return run_mha_fwd_sm90_ws_<Elem, kHeadDim, false, 192>(p, stream);
  }
  return run_mha_fwd_sm90_ws_<Elem, kHeadDim, false, 128>(p, stream);
}

// Runs the forward kernel here and returns true where this path applies: an sm_90 GPU, no
// dropout, enough shared memory, and FLASH_ATTN_DISABLE_SM90 unset (which tests and benchmarks
// use to run the portable kernels on the same GPU). Otherwise returns false. The portable
// launcher calls this first and writes return_attn_probs' probabilities either way.
template <typename Elem, int kHeadDim>
bool run_mha_fwd_sm90_(FwdParams& p, cudaStream_t stream) {
  using T = FwdSm90Config<Elem, kHeadDim>;
  if (!cuda::sm90_path_enabled() || p.p_dropout > 0.f || T::kSmemBytes > cuda::smem_per_block_optin())
    return false;
  if (run_mha_fwd_sm90_ws<Elem, kHeadDim>(p, stream)) return true;
  if (cuda::fwd_decode_tiles(p)) return false;  // (the decoding kernels serve these better)
  const dim3 grid((p.seqlen_q + T::kBlockM - 1) / T::kBlockM, p.h, p.b);
  if (p.q_block_lists != nullptr) cuda::launch<T>(&flash_fwd_sm90_kernel<T, true>, grid, p, stream);
  else cuda::launch<T>(&flash_fwd_sm90_kernel<T, false>, grid, p, stream);
  return true;
}

}  // namespace flash::hopper
