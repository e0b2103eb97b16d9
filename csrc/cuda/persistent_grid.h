// The grid of a persistent kernel and the counter its CTAs claim tiles from.
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "../env_switch.h"
#include "launch_utils.cuh"

namespace flash::cuda {

// One CTA per SM over num_tiles tiles, each CTA taking tiles until none are left: the first
// gridDim.x in CTA order, the rest claimed from `counter` (zeroed here on the stream; none when
// every tile has its CTA). The environment variable cap_env (A/B runs, tests) changes the CTA
// count: 0 launches a CTA per tile, n > 0 at most n CTAs. claim_all (tiles that wait for earlier
// ones): every tile is claimed from the counter, by at most a CTA per SM, so that a tile is only
// ever waited for by one claimed after it, never by a CTA that runs while its own has not started.
struct PersistentGrid {
  dim3 grid;
  c10::DataPtr counter;
  int* counter_ptr() const { return static_cast<int*>(counter.get()); }
};

inline PersistentGrid persistent_grid(int64_t num_tiles, const char* cap_env, cudaStream_t stream,
                                     bool claim_all = false) {
  TORCH_CHECK(num_tiles < INT32_MAX, "flash_attn: too many tiles (blocks x heads x batch = ", num_tiles, ")");
  int n = env_int(cap_env).value_or(sm_count());
  if (claim_all) n = n > 0 ? std::min(n, sm_count()) : sm_count();
  const int64_t ctas = std::max<int64_t>(1, std::min<int64_t>(num_tiles, n > 0 ? n : num_tiles));
  PersistentGrid g{dim3(unsigned(ctas)), {}};
  if (num_tiles > ctas || claim_all) {
    g.counter = c10::cuda::CUDACachingAllocator::get()->allocate(sizeof(int));
    C10_CUDA_CHECK(cudaMemsetAsync(g.counter.get(), 0, sizeof(int), stream));
  }
  return g;
}

}  // namespace flash::cuda
