// Tile shapes of each kernel family, one type per configuration. Each warp owns 16 rows of the
// block it iterates over (queries in the forward and dQ kernels, keys in the dK/dV kernel).
#pragma once

#include "warp_tiles.cuh"

namespace flash::cuda {

// Forward: each warp owns kMTiles row tiles of 16 queries, so each K/V fragment it loads from
// shared memory feeds kMTiles mma instructions.
template <typename Elem_, int kHeadDim_, int kBlockM_, int kBlockN_, int kMTiles_ = 1>
struct FwdTraits {
  using Elem = Elem_;
  static constexpr int kHeadDim = kHeadDim_, kBlockM = kBlockM_, kBlockN = kBlockN_, kMTiles = kMTiles_;
  static constexpr int kNWarps = kBlockM / (16 * kMTiles), kNThreads = kNWarps * 32;
  static constexpr int kStride = Tile<kHeadDim>::kStride;
  static constexpr int kSmemQ = kBlockM * kStride, kSmemKV = kBlockN * kStride;
  static constexpr int kSmemBytes = (kSmemQ + 2 * kSmemKV) * int(sizeof(Elem));
  static_assert(kHeadDim % 32 == 0 && kBlockM % 16 == 0 && kBlockN % 16 == 0, "tile shapes");
};

// dQ: the forward's shape plus a dO tile beside Q.
template <typename Elem_, int kHeadDim_, int kBlockM_, int kBlockN_, int kMTiles_ = 1>
struct BwdQTraits : FwdTraits<Elem_, kHeadDim_, kBlockM_, kBlockN_, kMTiles_> {
  using Base = FwdTraits<Elem_, kHeadDim_, kBlockM_, kBlockN_, kMTiles_>;
  static constexpr int kSmemBytes = (2 * Base::kSmemQ + 2 * Base::kSmemKV) * int(sizeof(Elem_));
};

// dK/dV: kBlockN keys per CTA (16 per warp), stepping over kBlockM queries at a time.
// kDoDK / kDoDV split the two accumulators over two launches where registers are short.
template <typename Elem_, int kHeadDim_, int kBlockM_, int kBlockN_, bool kDoDK_, bool kDoDV_>
struct BwdKVTraits {
  using Elem = Elem_;
  static constexpr int kHeadDim = kHeadDim_, kBlockM = kBlockM_, kBlockN = kBlockN_;
  static constexpr bool kDoDK = kDoDK_, kDoDV = kDoDV_;
  static constexpr int kNWarps = kBlockN / 16, kNThreads = kNWarps * 32;
  static constexpr int kStride = Tile<kHeadDim>::kStride;
  static constexpr int kSmemKV = kBlockN * kStride, kSmemQ = kBlockM * kStride;
  static constexpr int kSmemBytes = (2 * kSmemKV + 2 * kSmemQ) * int(sizeof(Elem)) + 2 * kBlockM * int(sizeof(float));
  static_assert(kHeadDim % 32 == 0 && kBlockM % 16 == 0 && kBlockN % 16 == 0, "tile shapes");
};

}  // namespace flash::cuda
