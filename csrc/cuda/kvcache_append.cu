// flash_attn_with_kvcache's append of new keys and values (KvAppendParams): one launch for both,
// with no index tensors built on the host side.
#include <c10/cuda/CUDAException.h>

#include <cstdint>

#include "flash_launch.h"
#include "launch_utils.cuh"

namespace flash::cuda {
namespace {

__device__ __forceinline__ int64_t offset(const int64_t (&st)[3], int64_t b, int64_t row, int64_t head) {
  return b * st[0] + row * st[1] + head * st[2];
}

// Thread i copies element i of the new rows, k and v, (batch, row, head, col) order.
__global__ void kvcache_append_kernel(const KvAppendParams a) {
  const int64_t n = int64_t(a.b) * a.seqlen_new * a.h_k * a.d;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int col = int(i % a.d), head = int(i / a.d % a.h_k);
    const int64_t br = i / (int64_t(a.d) * a.h_k);
    const int j = int(br % a.seqlen_new), b = int(br / a.seqlen_new);
    int e = a.batch_idx != nullptr ? a.batch_idx[b] : b;
    int64_t row = int64_t(a.seqlens[b]) + j;
    if (row < 0 || row >= a.rows) continue;
    if (a.block_table != nullptr) {  // the row's page, and its row there
      e = a.block_table[b * a.block_table_stride + row / a.page_block_size];
      row %= a.page_block_size;
    }
    if (e < 0 || e >= a.entries) continue;
    const uint16_t* kn = static_cast<const uint16_t*>(a.k_new) + offset(a.k_new_strides, b, j, head);
    const uint16_t* vn = static_cast<const uint16_t*>(a.v_new) + offset(a.v_new_strides, b, j, head);
    static_cast<uint16_t*>(a.k_cache)[offset(a.k_cache_strides, e, row, head) + col] = kn[col];
    static_cast<uint16_t*>(a.v_cache)[offset(a.v_cache_strides, e, row, head) + col] = vn[col];
  }
}

}  // namespace

void kvcache_append(const KvAppendParams& a, cudaStream_t stream) {
  const int64_t n = int64_t(a.b) * a.seqlen_new * a.h_k * a.d;
  if (n == 0) return;
  require_kernel_image();
  const int threads = 256, blocks = int((n + threads - 1) / threads < 4096 ? (n + threads - 1) / threads : 4096);
  kvcache_append_kernel<<<blocks, threads, 0, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace flash::cuda
