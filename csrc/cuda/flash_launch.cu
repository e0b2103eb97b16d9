// Run-time (dtype, head dim) to compile-time instantiation. A reduced build (setup.py's
// FLASH_ATTN_CUDA_HDIMS / FLASH_ATTN_CUDA_DTYPES) compiles a subset; asking for a missing one
// is a clear error, never a link failure.
#include <c10/util/Exception.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "flash_launch.h"
#include "launch_utils.cuh"

#ifndef FLASH_ATTN_HDIM_MASK
#define FLASH_ATTN_HDIM_MASK 0xFF  // bit i: kHeadDims[i]
#endif
#ifndef FLASH_ATTN_DTYPE_MASK
#define FLASH_ATTN_DTYPE_MASK 0x3  // bit 0: fp16, bit 1: bf16
#endif

namespace flash::cuda {
namespace {

struct Fwd {
  template <typename Elem, int D>
  static void run(FwdParams& p, cudaStream_t s) { run_mha_fwd_<Elem, D>(p, s); }
};
struct Bwd {
  template <typename Elem, int D>
  static void run(BwdParams& p, cudaStream_t s) { run_mha_bwd_<Elem, D>(p, s); }
};

template <typename Dir, typename Elem, int kDtypeBit, int I = 0, typename Params>
void dispatch_hdim(Params& p, cudaStream_t s) {
  if constexpr (I < int(sizeof(kHeadDims) / sizeof(int))) {
    constexpr int kD = kHeadDims[I];
    if (p.d <= kD) {
      if constexpr (((FLASH_ATTN_HDIM_MASK >> I) & 1) && ((FLASH_ATTN_DTYPE_MASK >> kDtypeBit) & 1)) {
        Dir::template run<Elem, kD>(p, s);
      } else {
        TORCH_CHECK(false, "flash_attn: this build has no CUDA kernel for head dim ", kD, " in ",
                    kDtypeBit == 0 ? "float16" : "bfloat16",
                    "; rebuild with FLASH_ATTN_CUDA_HDIMS / FLASH_ATTN_CUDA_DTYPES including it");
      }
      return;
    }
    dispatch_hdim<Dir, Elem, kDtypeBit, I + 1>(p, s);
  } else {
    TORCH_CHECK(false, "flash_attn: head dim ", p.d, " is larger than the largest CUDA kernel (256)");
  }
}

template <typename Dir, typename Params>
void dispatch(Params& p, cudaStream_t s) {
  if (p.dtype == DType::kFloat16) dispatch_hdim<Dir, __half, 0>(p, s);
  else if (p.dtype == DType::kBFloat16) dispatch_hdim<Dir, __nv_bfloat16, 1>(p, s);
  else TORCH_CHECK(false, "flash_attn: the CUDA kernels take float16 or bfloat16");
}

}  // namespace

void run_fwd(FwdParams& p, cudaStream_t stream) {
  require_kernel_image();
  dispatch<Fwd>(p, stream);
}
void run_bwd(BwdParams& p, cudaStream_t stream) {
  require_kernel_image();
  dispatch<Bwd>(p, stream);
}

}  // namespace flash::cuda
