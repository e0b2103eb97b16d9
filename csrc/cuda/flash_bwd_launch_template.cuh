// Backward launcher: the D pre-pass, the main kernel (the sm90 one where it applies; with atomic
// dQ, or deterministic with ordered dQ on sm90 or the dQ kernel elsewhere) and the dQ conversion. Instantiated once per
// (dtype, head dim) by the generated files in instantiations/.
#pragma once

#include "flash_bwd_dkdv_kernel.cuh"
#include "flash_bwd_kernel.cuh"
#include "flash_launch.h"
#include "launch_utils.cuh"

namespace flash::cuda {

// Backward tiles (flash_bwd_dkdv_kernel.cuh): 8 warps; 128 queries per step up to head dim 64, 64
// above; 128 keys per CTA up to head dim 128 and 64 above, where the dK and dV accumulators
// (kBlockN x d each, spread over the 8 warps) would not fit in registers. The warp grids keep
// every warp tile's columns a multiple of 16; the second Q buffer is dropped where shared memory
// would exceed sm_80's 163 KB.
template <typename Elem, int kHeadDim, bool kDoDQ>
using BwdConfig =
    BwdTraits<Elem, kHeadDim, (kHeadDim <= 64 ? 128 : 64), (kHeadDim <= 128 ? 128 : 64), 8, 2,
              (kHeadDim == 160 || kHeadDim == 224 ? 4 : kHeadDim <= 128 ? 4 : 2),
              (kHeadDim == 128 || kHeadDim == 192 || kHeadDim == 256 ? 2 : 4), (kHeadDim <= 192 ? 2 : 1), kDoDQ>;

// GPUs that grant less (sm_86 / sm_89: 99 KB) run head dims up to 128 on 64 x 64 tiles with one
// Q buffer (88 KB at head dim 128) and the dQ kernel; larger head dims need more than they have.
template <typename Elem, int kHeadDim>
using BwdSmallConfig = BwdTraits<Elem, kHeadDim, 64, 64, 8, 2, 4, 4, 1, false>;

// The sm90 main kernel where it applies (a build with FLASH_ATTN_WITH_SM90; see csrc/hopper/).
template <typename Elem, int kHeadDim>
bool try_sm90_bwd(BwdParams& p, cudaStream_t stream) {
#ifdef FLASH_ATTN_WITH_SM90
  if constexpr (hopper::has_sm90_bwd<kHeadDim>) return hopper::run_mha_bwd_sm90_<Elem, kHeadDim>(p, stream);
#endif
  return false;
}

// Ordered (deterministic) dQ additions are the sm90 kernel's alone: elsewhere the dQ kernel runs,
// and the pre-pass need not zero the accumulator.
template <typename Elem, int kHeadDim>
void drop_ordered_dq_unless_sm90(BwdParams& p) {
  if (p.dq_semaphore_ptr == nullptr) return;
#ifdef FLASH_ATTN_WITH_SM90
  if constexpr (hopper::has_sm90_bwd<kHeadDim>)
    if (hopper::sm90_bwd_applies<Elem, kHeadDim>(p)) return;
#endif
  p.dq_semaphore_ptr = nullptr;
  p.dq_accum_ptr = nullptr;
}

template <typename Elem, int kHeadDim>
void run_mha_bwd_(BwdParams& p, cudaStream_t stream) {
  if (p.b == 0 || p.seqlen_q == 0 || p.seqlen_k == 0) return;  // the op layer zero-fills
  drop_ordered_dq_unless_sm90<Elem, kHeadDim>(p);
  constexpr int kThreads = kBwdRowKernelThreads;
  flash_bwd_dot_do_o_kernel<Elem, kHeadDim>
      <<<dim3(unsigned(padded_query_rows(p.seqlen_q) / kDotDoORows), p.h, p.b), kThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const auto main_grid = [&](int block_n) { return dim3((p.seqlen_k + block_n - 1) / block_n, p.h, p.b); };
  const int smem = smem_per_block_optin();
  if (p.dq_accum_ptr != nullptr) {
    // dQ by atomics into the zeroed accumulator (dq_accum_row_stride()): the sm90 kernel where it
    // applies, else the portable one where it fits; then the conversion.
    using T = BwdConfig<Elem, kHeadDim, true>;
    static_assert(kDqAccumRowPad % T::kBlockM == 0, "padded_query_rows() pads rows to the main kernel's query block");
    bool ran = try_sm90_bwd<Elem, kHeadDim>(p, stream);
    if (!ran && p.dq_semaphore_ptr == nullptr && T::kSmemBytes <= smem) {
      if (p.p_dropout > 0.f) launch<T>(&flash_bwd_dkdv_kernel<T, true>, main_grid(T::kBlockN), p, stream);
      else launch<T>(&flash_bwd_dkdv_kernel<T, false>, main_grid(T::kBlockN), p, stream);
      ran = true;
    }
    if (ran) {
      flash_bwd_convert_dq_kernel<Elem, kHeadDim>
          <<<dim3(unsigned((p.seqlen_q + kConvertDqRows - 1) / kConvertDqRows), p.h, p.b), kThreads, 0, stream>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return;
    }
  }
  // Deterministic (or a GPU short of shared memory): dQ from its own kernel, forward-shaped (two
  // 16-row tiles per warp up to 128). One main-kernel instantiation for both dropout settings
  // keeps the build shorter.
  using T = BwdConfig<Elem, kHeadDim, false>;
  if constexpr (kHeadDim <= 128) {
    using TS = BwdSmallConfig<Elem, kHeadDim>;
    if (T::kSmemBytes > smem) launch<TS>(&flash_bwd_dkdv_kernel<TS, true>, main_grid(TS::kBlockN), p, stream);
    else launch<T>(&flash_bwd_dkdv_kernel<T, true>, main_grid(T::kBlockN), p, stream);
  } else {
    launch<T>(&flash_bwd_dkdv_kernel<T, true>, main_grid(T::kBlockN), p, stream);
  }
  using TQ = BwdQTraits<Elem, kHeadDim, (kHeadDim <= 128 ? 128 : 64), 32, (kHeadDim <= 128 ? 2 : 1)>;
  const dim3 grid_q((p.seqlen_q + TQ::kBlockM - 1) / TQ::kBlockM, p.h, p.b);
  launch<TQ>(&flash_bwd_dq_kernel<TQ>, grid_q, p, stream);
}

}  // namespace flash::cuda
