// Block-sparse attention: which tiles a block of queries (or keys) visits. Shared by the CPU and
// the CUDA kernels, so the two walk exactly the same tiles.
#pragma once

#include <cstdint>

#include "flash_params.h"
#include "host_device.h"

namespace flash {

// The mask's granularity; every kernel tile divides it, so a tile lies in exactly one mask block.
constexpr int kMaskBlock = 128;

FLASH_HOST_DEVICE int64_t mask_head(const FwdParams& p, int b, int h) {
  return int64_t(p.mask_b == 1 ? 0 : b) * p.mask_h + (p.mask_h == 1 ? 0 : h);
}

// The list row (count, then ascending blocks) of query block qb's kept key blocks; nullptr
// without a mask.
FLASH_HOST_DEVICE const int32_t* kept_key_blocks(const FwdParams& p, int b, int h, int qb) {
  if (p.q_block_lists == nullptr) return nullptr;
  return p.q_block_lists + (mask_head(p, b, h) * p.mask_q_blocks + qb) * (1 + p.mask_k_blocks);
}

// The same for key block kb's kept query blocks (the transpose, for the dK/dV pass).
FLASH_HOST_DEVICE const int32_t* kept_query_blocks(const FwdParams& p, int b, int h, int kb) {
  if (p.k_block_lists == nullptr) return nullptr;
  return p.k_block_lists + (mask_head(p, b, h) * p.mask_k_blocks + kb) * (1 + p.mask_q_blocks);
}

// Whether mask block (qb, kb) is kept (always, without a mask).
FLASH_HOST_DEVICE bool block_kept(const FwdParams& p, int b, int h, int qb, int kb) {
  if (p.block_layout == nullptr) return true;
  return p.block_layout[(mask_head(p, b, h) * p.mask_q_blocks + qb) * p.mask_k_blocks + kb];
}

// The ascending sequence of tiles (of kMaskBlock / per_block rows each) that one block of the
// other dimension visits: the range [begin, end) the causal/window geometry allows, or, with a
// mask, only the tiles of kept mask blocks inside it. seq[i] is the i-th tile's index.
struct TileSeq {
  const int32_t* blocks;  // kept mask blocks, ascending; nullptr: every tile of the range
  int log2_per_block;     // tiles per mask block: 1, 2, 4, ...
  int first;              // position of seq[0] among the kept blocks' tiles (mask), or the range's begin
  int count;

  FLASH_HOST_DEVICE int operator[](int i) const {
    if (blocks == nullptr) return first + i;
    const int k = first + i;
    return (blocks[k >> log2_per_block] << log2_per_block) + (k & ((1 << log2_per_block) - 1));
  }
};

// Over the kept blocks (ascending; kPer tiles each), how many of their tiles lie below tile `begin`
// and below tile `end` (the sum over kept blocks b of clamp(bound - b kPer, 0, kPer)), and whether
// the blocks are consecutive: block i - i is the same for every i (then it is the first block).
// One pass over the list; on the GPU the lanes of a warp (which must all be active) split it, so
// its loads go out together.
template <int kPer>
struct KeptTiles {
  int below_begin = 0, below_end = 0;
  int run_lo = 0x7fffffff, run_hi = -0x7fffffff;  // min and max of block i - i

  FLASH_HOST_DEVICE KeptTiles(const int32_t* blocks, int n, int begin, int end) {
#ifdef __CUDA_ARCH__
    for (int i = threadIdx.x % 32; i < n; i += 32) add(blocks[i], i, begin, end);
    below_begin = __reduce_add_sync(0xffffffffu, below_begin);
    below_end = __reduce_add_sync(0xffffffffu, below_end);
    run_lo = __reduce_min_sync(0xffffffffu, run_lo);
    run_hi = __reduce_max_sync(0xffffffffu, run_hi);
#else
    for (int i = 0; i < n; ++i) add(blocks[i], i, begin, end);
#endif
  }
  FLASH_HOST_DEVICE bool consecutive() const { return run_lo >= run_hi; }  // (empty lists too)
  FLASH_HOST_DEVICE void add(int block, int i, int begin, int end) {
    const int t = block * kPer;
    below_begin += begin <= t ? 0 : begin >= t + kPer ? kPer : begin - t;
    below_end += end <= t ? 0 : end >= t + kPer ? kPer : end - t;
    run_lo = run_lo < block - i ? run_lo : block - i;
    run_hi = run_hi > block - i ? run_hi : block - i;
  }
};

// list: a row from kept_key_blocks / kept_query_blocks, or nullptr.
template <int kTile>
FLASH_HOST_DEVICE TileSeq tile_seq(const int32_t* list, int begin, int end) {
  static_assert(kMaskBlock % kTile == 0, "kernel tiles must divide the mask block");
  if (end < begin) end = begin;
  if (list == nullptr) return TileSeq{nullptr, 0, begin, end - begin};
  constexpr int kPer = kMaskBlock / kTile, kLog2Per = kPer == 1 ? 0 : kPer == 2 ? 1 : kPer == 4 ? 2 : 3;
  static_assert((1 << kLog2Per) == kPer, "tiles per mask block: 1, 2, 4 or 8");
  const KeptTiles<kPer> kept(list + 1, list[0], begin, end);
  const int count = kept.below_end - kept.below_begin;
  // Consecutive kept blocks (a full row, a band) are walked as a plain range: no list reads per tile.
  if (kept.consecutive()) return TileSeq{nullptr, 0, count > 0 ? kept.run_lo * kPer + kept.below_begin : begin, count};
  return TileSeq{list + 1, kLog2Per, kept.below_begin, count};
}

// Walks a TileSeq with the current and the next tile in registers and the one after already
// requested: a step needs the next tile's index at its top to queue that tile's loads, and a list
// read there would stall the step on memory.
struct TileWalk {
  TileSeq seq;
  int step = 0, tile = 0, next = 0, after = 0;

  FLASH_HOST_DEVICE explicit TileWalk(const TileSeq& s) : seq(s) {
    tile = s.count > 0 ? s[0] : 0;
    next = s.count > 1 ? s[1] : 0;
    after = s.count > 2 ? s[2] : 0;
  }
  FLASH_HOST_DEVICE bool more() const { return step < seq.count; }
  FLASH_HOST_DEVICE bool has_next() const { return step + 1 < seq.count; }
  FLASH_HOST_DEVICE void advance() {
    ++step;
    tile = next;
    next = after;
    after = step + 2 < seq.count ? seq[step + 2] : 0;
  }
};

}  // namespace flash
