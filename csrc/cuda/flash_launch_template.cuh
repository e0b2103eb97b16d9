// Launchers: pick the tile configuration for (head dim, dtype), set the shared-memory limit and
// launch. Instantiated once per (dtype, head dim) by the generated files in instantiations/.
#pragma once

#include <c10/cuda/CUDAException.h>

#include "flash_bwd_kernel.cuh"
#include "flash_launch.h"

namespace flash::cuda {

template <typename Kernel>
void set_smem_limit(Kernel kernel, int bytes) {
  if (bytes > 48 * 1024) C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

template <typename T, typename Params>
void launch(void (*kernel)(Params), dim3 grid, const Params& p, cudaStream_t stream) {
  set_smem_limit(kernel, T::kSmemBytes);
  kernel<<<grid, T::kNThreads, T::kSmemBytes, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Forward tiles: up to head dim 128, 128 query rows on 4 warps of two 16-row tiles each; above
// that 64 rows on 4 warps of one tile. Keys per step shrink with the head dim to keep the score
// and output accumulators in registers.
template <typename Elem, int kHeadDim>
using FwdConfig = FwdTraits<Elem, kHeadDim, (kHeadDim <= 128 ? 128 : 64), (kHeadDim <= 128 ? 64 : 32),
                            (kHeadDim <= 128 ? 2 : 1)>;

template <typename Elem, int kHeadDim>
void run_mha_fwd_(FwdParams& p, cudaStream_t stream) {
  using T = FwdConfig<Elem, kHeadDim>;
  const dim3 grid((p.seqlen_q + T::kBlockM - 1) / T::kBlockM, p.h, p.b);
  if (grid.x == 0 || p.b == 0) return;
  launch<T>(&flash_fwd_kernel<T>, grid, p, stream);
  if (p.p_ptr != nullptr) launch<T>(&flash_fwd_probs_kernel<T>, grid, p, stream);
}

template <typename Elem, int kHeadDim>
void run_mha_bwd_(BwdParams& p, cudaStream_t stream) {
  if (p.b == 0 || p.seqlen_q == 0 || p.seqlen_k == 0) return;  // the op layer zero-fills
  {
    const int64_t rows = int64_t(p.b) * p.seqlen_q * p.h;
    flash_bwd_dot_do_o_kernel<Elem><<<unsigned((rows * 32 + 255) / 256), 256, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  constexpr int kBlockMKV = kHeadDim <= 64 ? 64 : 32;
  const dim3 grid_kv((p.seqlen_k + 63) / 64, p.h, p.b);
  if constexpr (kHeadDim <= 128) {
    using T = BwdKVTraits<Elem, kHeadDim, kBlockMKV, 64, true, true>;
    launch<T>(&flash_bwd_dkdv_kernel<T>, grid_kv, p, stream);
  } else {  // registers: one launch for dK, one for dV
    using TK = BwdKVTraits<Elem, kHeadDim, kBlockMKV, 64, true, false>;
    using TV = BwdKVTraits<Elem, kHeadDim, kBlockMKV, 64, false, true>;
    launch<TK>(&flash_bwd_dkdv_kernel<TK>, grid_kv, p, stream);
    launch<TV>(&flash_bwd_dkdv_kernel<TV>, grid_kv, p, stream);
  }
  // dQ: like the forward, two 16-row tiles per warp up to head dim 128.
  using TQ = BwdQTraits<Elem, kHeadDim, (kHeadDim <= 128 ? 128 : 64), 32,
                        (kHeadDim <= 128 ? 2 : 1)>;
  const dim3 grid_q((p.seqlen_q + TQ::kBlockM - 1) / TQ::kBlockM, p.h, p.b);
  launch<TQ>(&flash_bwd_dq_kernel<TQ>, grid_q, p, stream);
}

}  // namespace flash::cuda
