// sm90 backward launcher: the kernel and tile configuration per head dim. Instantiated once per
// (dtype, head dim) by the generated files in instantiations/; compiled for sm_90a only (elsewhere
// the kernel bodies are empty and the portable launcher never gets true from here).
#pragma once

#include "../cuda/flash_launch.h"
#include "../cuda/launch_utils.cuh"
#include "../cuda/persistent_grid.h"
#include "flash_bwd_sm90_split_d_kernel.cuh"
#include "flash_bwd_sm90_ws_kernel.cuh"
#include "tma_view.cuh"

namespace flash::hopper {

// Up to head dim 128: the warp-specialized kernel, 128 keys per CTA on two MMA warpgroups (one per
// 64 keys), 64 queries per step.
template <typename Elem, int kHeadDim>
using BwdSm90WsConfig = BwdSm90WsTraits<Elem, kHeadDim>;

// Above: 64 keys per CTA, the head dim split into 128-column slices (256: two warpgroups) or
// 64-column ones (192: three).
template <typename Elem, int kHeadDim>
using BwdSm90SplitDConfig = BwdSm90SplitDTraits<Elem, kHeadDim, kHeadDim % 128 == 0 ? 128 : 64>;

template <typename Elem, int kHeadDim>
using BwdSm90Config =
    std::conditional_t<(kHeadDim <= 128), BwdSm90WsConfig<Elem, kHeadDim>, BwdSm90SplitDConfig<Elem, kHeadDim>>;

template <typename T>
BwdSm90WsParams<T> bwd_ws_params(const BwdParams& p, int num_tiles, int* tile_counter) {
  using CElem = typename T::CElem;
  using cute::SM90_TMA_LOAD;
  return BwdSm90WsParams<T>{p,
                            make_tma_copy(SM90_TMA_LOAD{}, q_view(p).tensor<CElem>(), typename T::SmemLayoutQStage{}),
                            make_tma_copy(SM90_TMA_LOAD{}, do_view(p).tensor<CElem>(), typename T::SmemLayoutQStage{}),
                            make_tma_copy(SM90_TMA_LOAD{}, k_view(p).tensor<CElem>(), typename T::SmemLayoutK{}),
                            make_tma_copy(SM90_TMA_LOAD{}, v_view(p).tensor<CElem>(), typename T::SmemLayoutK{}),
                            num_tiles,
                            tile_counter};
}

// Whether the backward's main kernel runs here: an sm_90 GPU, a head dim of has_sm90_bwd, a dQ
// accumulator (atomic adds; with dq_semaphore_ptr, deterministic, ordered ones, up to head dim
// 128), no dropout, enough shared memory and FLASH_ATTN_DISABLE_SM90 unset; up to head dim 128
// also operands TMA can address (the op layer's cuda_operand makes them so) and the pre-pass's
// base-2 logsumexp.
template <typename Elem, int kHeadDim>
bool sm90_bwd_applies(const BwdParams& p) {
  static_assert(has_sm90_bwd<kHeadDim>, "instantiated for the head dims of has_sm90_bwd only");
  using T = BwdSm90Config<Elem, kHeadDim>;
  // Score modifiers (score_mod.h): the warp-specialized kernel takes a bias and ALiBi; a cap (whose
  // derivative the dS step needs) and the split-d kernel's head dims run on the portable kernels.
  const bool mods_here = !p.score_mod || (kHeadDim <= 128 && p.softcap == 0.f && p.k_block_lists == nullptr);
  const bool ordered = p.dq_semaphore_ptr != nullptr;
  if (!cuda::sm90_path_enabled() || p.dq_accum_ptr == nullptr || p.p_dropout > 0.f || !mods_here ||
      T::kSmemBytes > cuda::smem_per_block_optin() || (ordered && kHeadDim > 128))
    return false;
  if constexpr (kHeadDim <= 128)
    return p.softmax_lse_log2_ptr != nullptr && q_view(p).compatible() && do_view(p).compatible() &&
           k_view(p).compatible() && v_view(p).compatible();
  return true;
}

// Runs the backward's main kernel where sm90_bwd_applies and returns whether it did. The portable
// launcher runs the D pre-pass before and the dQ conversion after; the warp-specialized kernel
// leaves dQ in the accumulator's swizzled layout, which p then records for the conversion.
template <typename Elem, int kHeadDim>
bool run_mha_bwd_sm90_(BwdParams& p, cudaStream_t stream) {
  using T = BwdSm90Config<Elem, kHeadDim>;
  if (!sm90_bwd_applies<Elem, kHeadDim>(p)) return false;
  const dim3 grid((p.seqlen_k + T::kBlockN - 1) / T::kBlockN, p.h, p.b);
  const bool sparse = p.k_block_lists != nullptr;
  if constexpr (kHeadDim <= 128) {
    // Persistent over (key block, head, batch) tiles (cuda::persistent_grid);
    // FLASH_ATTN_SM90_BWD_PERSISTENT=0 launches a CTA per tile instead, =n at most n CTAs. Ordered
    // dQ claims every tile from the counter, on at most a CTA per SM (see the kernel).
    const int64_t num_tiles = int64_t(grid.x) * grid.y * grid.z;
    const bool ordered = p.dq_semaphore_ptr != nullptr;
    const cuda::PersistentGrid pg = cuda::persistent_grid(num_tiles, "FLASH_ATTN_SM90_BWD_PERSISTENT", stream, ordered);
    const BwdSm90WsParams<T> args = bwd_ws_params<T>(p, int(num_tiles), pg.counter_ptr());
    // dK and dV rows leave by bulk copies (16-byte aligned; the op layer allocates them so).
    const auto aligned = [](const void* ptr, int64_t batch, int64_t row, int64_t head) {
      return (reinterpret_cast<uintptr_t>(ptr) | ((batch | row | head) * int64_t(sizeof(Elem)))) % 16 == 0;
    };
    TORCH_CHECK(p.dk_accum_ptr != nullptr ||
                    (aligned(p.dk_ptr, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride) &&
                     aligned(p.dv_ptr, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride) && p.d % 8 == 0),
                "flash_attn (internal): dk and dv need 16-byte aligned rows");
    cuda::launch<T>(p.score_mod ? &flash_bwd_sm90_ws_kernel<T, false, true>
                    : sparse    ? &flash_bwd_sm90_ws_kernel<T, true>
                                : &flash_bwd_sm90_ws_kernel<T, false>,
                    pg.grid, args, stream);
    p.dq_accum_swizzled = true;
  } else {
    cuda::launch<T>(sparse ? &flash_bwd_sm90_split_d_kernel<T, true> : &flash_bwd_sm90_split_d_kernel<T, false>, grid,
                    p, stream);
  }
  return true;
}

}  // namespace flash::hopper
