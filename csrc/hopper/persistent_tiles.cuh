// The tile schedule the persistent sm90 kernels share (the host side: cuda::persistent_grid).
#pragma once

#include <cstdint>
#include <type_traits>

namespace flash::hopper {

// Tile t of a (block, head, batch) schedule, in the order a grid of CTAs with blockIdx.x = block
// would run; kLastBlockFirst reverses the blocks (under causal the forward's last query block and
// the backward's first key block are the longest, and start first either way).
struct GridTile {
  int block, h, b;
};
__device__ __forceinline__ GridTile grid_tile(int t, int num_blocks, int heads, bool last_block_first) {
  const int bh = t / num_blocks, block = t - bh * num_blocks;
  return GridTile{last_block_first ? num_blocks - 1 - block : block, bh % heads, bh / heads};
}
template <bool kLastBlockFirst>
__device__ __forceinline__ GridTile grid_tile(int t, int num_blocks, int heads) {
  return grid_tile(t, num_blocks, heads, kLastBlockFirst);
}

// The next tile of a warp's CTA: the CTA that gets there first claims it from the counter
// (tiles gridDim.x and up; the first gridDim.x go in CTA order), so long and short tiles spread
// over the SMs as a grid's blocks would. num_tiles or more: none left. Every lane calls it.
__device__ __forceinline__ int claim_next_tile(int num_tiles, int* counter) {
  int t = num_tiles;
  if (threadIdx.x % 32 == 0 && num_tiles > int(gridDim.x)) t = atomicAdd(counter, 1) + int(gridDim.x);
  return __shfl_sync(0xffffffffu, t, 0);
}

// The same where every tile, the first included, is claimed from the counter (claim_all in
// cuda::persistent_grid): tiles are then claimed in order by CTAs that are running.
__device__ __forceinline__ int claim_tile(int* counter) {
  int t = 0;
  if (threadIdx.x % 32 == 0) t = atomicAdd(counter, 1);
  return __shfl_sync(0xffffffffu, t, 0);
}

// A schedule slot (shared memory) as every lane of the warp sees it: lane 0 reads it and passes it
// on by shuffles. Lane 0 is also the lane whose mbarrier arrive hands the slot back, so its read
// comes before that arrive in program order; when every lane read it, the other lanes' reads were
// ordered only by a __syncwarp, which compute-sanitizer's racecheck does not count as ordering
// them before another lane's arrive (it reported those reads against the next write of the slot).
// Every lane calls it.
template <typename T>
__device__ __forceinline__ T read_slot_lane0(const T& slot) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) % 4 == 0 && alignof(T) >= 4, "a slot of 32-bit words");
  constexpr int kWords = sizeof(T) / 4;
  // Word loads and a union, not memcpy: memcpy from the slot compiled to byte loads and a stack copy.
  const uint32_t* words = reinterpret_cast<const uint32_t*>(&slot);
  union {
    T value;
    uint32_t w[kWords];
  } out;
#pragma unroll
  for (int i = 0; i < kWords; ++i) out.w[i] = __shfl_sync(0xffffffffu, threadIdx.x % 32 == 0 ? words[i] : 0u, 0);
  return out.value;
}

}  // namespace flash::hopper
