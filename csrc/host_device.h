// Marks small helpers shared by the host (CPU kernels) and the device (CUDA kernels).
#pragma once

#if defined(__CUDACC__)
#define FLASH_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FLASH_HOST_DEVICE inline
#endif
