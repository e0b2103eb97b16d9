// Placeholder launchers: the CUDA build compiles and links, and a CUDA call says clearly that
// the fused kernels are not there yet (issue 3 fills these in).
#include <c10/util/Exception.h>

#include "flash_launch.h"

namespace flash::cuda {

void run_fwd(FwdParams&, cudaStream_t) {
  TORCH_CHECK(false, "flash_attn: the CUDA forward kernel is not implemented yet; use CPU tensors");
}

void run_bwd(BwdParams&, cudaStream_t) {
  TORCH_CHECK(false, "flash_attn: the CUDA backward kernel is not implemented yet; use CPU tensors");
}

}  // namespace flash::cuda
