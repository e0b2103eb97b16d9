// What every launcher shares: raising a kernel's shared-memory limit (with a clear error where
// the GPU has too little) and a checked launch.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

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

}  // namespace flash::cuda
