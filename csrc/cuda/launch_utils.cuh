// What every launcher shares: raising a kernel's shared-memory limit (with a clear error where
// the GPU has too little) and a checked launch.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <optional>

#include "../env_switch.h"

namespace flash::cuda {

// Shared memory per block the current GPU grants on request (sm_80: 163 KB, sm_86/sm_89: 99 KB,
// sm_90: 227 KB). FLASH_ATTN_SMEM_LIMIT (bytes) lowers it, so tests can run the configurations
// of smaller GPUs on a large one.
inline int smem_per_block_optin() {
  int device = 0, optin = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  static const std::optional<int> cap = env_int("FLASH_ATTN_SMEM_LIMIT");
  return cap ? std::min(optin, *cap) : optin;
}

// Whether two CTAs needing `bytes` of shared memory each fit on one SM (sm_90: yes up to about
// 113 KB; sm_80 and sm_86/sm_89 have 164 KB / 100 KB per SM).
inline bool two_ctas_per_sm_fit(int bytes) {
  int device = 0, per_sm = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
  constexpr int kReservedPerCta = 1024;  // what the driver keeps per block
  return bytes <= smem_per_block_optin() && 2 * (bytes + kReservedPerCta) <= per_sm;
}

// The virtual architecture (80, 90, ...) of the code the current GPU runs from this library, found
// once per device before the first launch (kernel_image_check.cu); where there is none, a clear
// error. Every module has the same images, so the one probe kernel speaks for all.
int require_kernel_image();

// Whether the sm90 (wgmma) kernels may run: the current GPU is compute capability 9.x, runs code
// compiled for it (not an older arch's PTX, in which the sm90 kernels are empty: CUDA_FORCE_PTX_JIT)
// and FLASH_ATTN_DISABLE_SM90 is unset or 0 (read on each call, so a process can compare both paths).
inline bool sm90_path_enabled() {
  if (env_switch("FLASH_ATTN_DISABLE_SM90").value_or(false)) return false;
  int device = 0, major = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  return major == 9 && require_kernel_image() >= 90;
}

// Streaming multiprocessors of the current GPU (a persistent kernel launches one CTA per SM).
inline int sm_count() {
  int device = 0, n = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  return n;
}

template <typename Kernel>
void set_smem_limit(Kernel kernel, int bytes) {
  if (bytes <= 48 * 1024) return;
  const int optin = smem_per_block_optin();
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
