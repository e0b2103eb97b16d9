// Whether this library holds code the current GPU can run, and compiled for which architecture,
// asked once per device before the first launch. A library built for other architectures (say
// 90a alone on a Blackwell GPU) would otherwise fail at its first launch with the runtime's "no
// kernel image is available", which does not say what to rebuild with.
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <sstream>

#include "launch_utils.cuh"

namespace flash::cuda {
namespace {

// Compiled with the same -gencode flags as every kernel, so it has an image wherever they do.
__global__ void kernel_image_probe() {}

// The compute capabilities the -gencode flags named (nvcc's __CUDA_ARCH_LIST__: 800,900, ...).
std::string built_archs() {
  std::ostringstream s;
#ifdef __CUDA_ARCH_LIST__
  const int archs[] = {__CUDA_ARCH_LIST__};
  for (int a : archs) s << (s.tellp() > 0 ? ", " : "") << a / 100 << "." << a % 100 / 10;
#endif
  return s.str();
}

bool jit_failure(cudaError_t e) {
  return e == cudaErrorInvalidPtx || e == cudaErrorUnsupportedPtxVersion || e == cudaErrorJitCompilerNotFound ||
         e == cudaErrorJitCompilationDisabled;
}

constexpr int kCheckedDevices = 64;
std::atomic<int> image_arch[kCheckedDevices];  // 0: not asked yet

}  // namespace

int require_kernel_image() {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  if (device < kCheckedDevices) {
    const int known = image_arch[device].load(std::memory_order_relaxed);
    if (known != 0) return known;
  }
  cudaFuncAttributes attr;
  const cudaError_t e = cudaFuncGetAttributes(&attr, kernel_image_probe);
  if (e == cudaSuccess) {
    // The virtual arch it was compiled from (a binary's too; 0 only for pre-CUDA-3 cubins).
    const int arch = attr.ptxVersion > 0 ? attr.ptxVersion : attr.binaryVersion;
    if (device < kCheckedDevices) image_arch[device].store(arch, std::memory_order_relaxed);
    return arch;
  }
  (void)cudaGetLastError();  // not sticky: clear it, so that no later launch check reports it again
  if (e != cudaErrorNoKernelImageForDevice && e != cudaErrorInvalidDeviceFunction && !jit_failure(e))
    C10_CUDA_CHECK(e);
  cudaDeviceProp props;
  C10_CUDA_CHECK(cudaGetDeviceProperties(&props, device));
  const int cc = props.major * 10 + props.minor;
  TORCH_CHECK(!jit_failure(e), "flash_attn: this build has no CUDA binary for ", props.name, " (sm_", cc,
              ") and the driver could not compile its PTX (", cudaGetErrorString(e), "); rebuild with "
              "FLASH_ATTN_CUDA_ARCHS including ", cc);
  TORCH_CHECK(false, "flash_attn: this build has no CUDA code that runs on ", props.name, " (sm_", cc,
              "): it was compiled for compute capability ", built_archs(), " without PTX for a lower one; rebuild "
              "with FLASH_ATTN_CUDA_ARCHS including ", cc, " (or ending in +PTX)");
}

}  // namespace flash::cuda
