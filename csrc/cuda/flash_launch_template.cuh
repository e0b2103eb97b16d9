// Launchers: pick the tile configuration for (head dim, dtype), set the shared-memory limit and
// launch. Instantiated once per (dtype, head dim) by the generated files in instantiations/.
#pragma once

#include <c10/cuda/CUDAException.h>

#include "flash_bwd_dkdv_kernel.cuh"
#include "flash_bwd_kernel.cuh"
#include "flash_launch.h"

namespace flash::cuda {

template <typename Kernel>
void set_smem_limit(Kernel kernel, int bytes) {
  if (bytes <= 48 * 1024) return;
  int device = 0, optin = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  TORCH_CHECK(bytes <= optin, "flash_attn: this kernel needs ", bytes, " bytes of shared memory per block; the GPU ",
              "allows ", optin, " (head dim too large for this GPU)");
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
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

// Backward tiles (flash_bwd_dkdv_kernel.cuh): 8 warps; 64 queries per step; 128 keys per CTA up
// to head dim 128 and 64 above, where the dK and dV accumulators (kBlockN x d each, spread over
// the 8 warps) would not fit in registers. The warp grids keep every warp tile's columns a
// multiple of 16; the second Q buffer is dropped where shared memory would exceed sm_80's limit.
template <typename Elem, int kHeadDim, bool kDoDQ>
using BwdConfig =
    BwdTraits<Elem, kHeadDim, 64, (kHeadDim <= 128 ? 128 : 64), 8, 2,
              (kHeadDim == 160 || kHeadDim == 224 ? 4 : kHeadDim <= 128 ? 4 : 2),
              (kHeadDim == 128 || kHeadDim == 192 || kHeadDim == 256 ? 2 : 4), (kHeadDim <= 192 ? 2 : 1), kDoDQ>;

template <typename Elem, int kHeadDim>
void run_mha_bwd_(BwdParams& p, cudaStream_t stream) {
  if (p.b == 0 || p.seqlen_q == 0 || p.seqlen_k == 0) return;  // the op layer zero-fills
  const int64_t rows = int64_t(p.b) * p.seqlen_q * p.h;
  flash_bwd_dot_do_o_kernel<Elem><<<unsigned((rows * 32 + 255) / 256), 256, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const auto main_grid = [&](int block_n) { return dim3((p.seqlen_k + block_n - 1) / block_n, p.h, p.b); };
  if (p.dq_accum_ptr != nullptr) {  // dQ by atomics into the accumulator the pre-pass cleared
    using T = BwdConfig<Elem, kHeadDim, true>;
    launch<T>(&flash_bwd_dkdv_kernel<T>, main_grid(T::kBlockN), p, stream);
    const int64_t quads = rows * p.d / 4;
    flash_bwd_convert_dq_kernel<Elem><<<unsigned((quads + 255) / 256), 256, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  // Deterministic: dQ from its own kernel, forward-shaped (two 16-row tiles per warp up to 128).
  using T = BwdConfig<Elem, kHeadDim, false>;
  launch<T>(&flash_bwd_dkdv_kernel<T>, main_grid(T::kBlockN), p, stream);
  using TQ = BwdQTraits<Elem, kHeadDim, (kHeadDim <= 128 ? 128 : 64), 32, (kHeadDim <= 128 ? 2 : 1)>;
  const dim3 grid_q((p.seqlen_q + TQ::kBlockM - 1) / TQ::kBlockM, p.h, p.b);
  launch<TQ>(&flash_bwd_dq_kernel<TQ>, grid_q, p, stream);
}

}  // namespace flash::cuda
