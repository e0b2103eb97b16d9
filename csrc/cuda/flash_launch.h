// Entry points of the CUDA kernels, called by the op layer with a filled params struct.
#pragma once

#include <cuda_runtime_api.h>

#include "../flash_params.h"

namespace flash::cuda {

// Head dims with compiled kernels; other sizes run on the next larger one (zero-padded).
inline constexpr int kHeadDims[] = {32, 64, 96, 128, 160, 192, 224, 256};

void run_fwd(FwdParams& params, cudaStream_t stream);
void run_bwd(BwdParams& params, cudaStream_t stream);

// One (dtype, head dim) instantiation each, in instantiations/ (generated).
template <typename Elem, int kHeadDim>
void run_mha_fwd_(FwdParams& params, cudaStream_t stream);
template <typename Elem, int kHeadDim>
void run_mha_bwd_(BwdParams& params, cudaStream_t stream);

}  // namespace flash::cuda
