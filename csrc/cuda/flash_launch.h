// Entry points of the CUDA kernels, called by the op layer with a filled params struct.
#pragma once

#include <cuda_runtime_api.h>

#include "../flash_params.h"

namespace flash::cuda {

void run_fwd(FwdParams& params, cudaStream_t stream);
void run_bwd(BwdParams& params, cudaStream_t stream);

}  // namespace flash::cuda
