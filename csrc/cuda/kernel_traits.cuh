// Tile shapes of each kernel family, one type per configuration.
#pragma once

#include "warp_tiles.cuh"

namespace flash::cuda {

// Forward: each warp owns kMTiles row tiles of 16 queries, so each K/V fragment it loads from
// shared memory feeds kMTiles mma instructions. kKVStages = 2 double-buffers K and V: the next
// pair loads during the whole of this step, with one barrier per step.
template <typename Elem_, int kHeadDim_, int kBlockM_, int kBlockN_, int kMTiles_ = 1, int kKVStages_ = 1>
struct FwdTraits {
  using Elem = Elem_;
  static constexpr int kHeadDim = kHeadDim_, kBlockM = kBlockM_, kBlockN = kBlockN_, kMTiles = kMTiles_;
  static constexpr int kKVStages = kKVStages_;
  static constexpr int kNWarps = kBlockM / (16 * kMTiles), kNThreads = kNWarps * 32;
  static constexpr int kStride = Tile<kHeadDim>::kStride;
  static constexpr int kSmemQ = kBlockM * kStride, kSmemKV = kBlockN * kStride;
  static constexpr int kSmemBytes = (kSmemQ + 2 * kKVStages * kSmemKV) * int(sizeof(Elem));
  static_assert(kHeadDim % 32 == 0 && kBlockM % 16 == 0 && kBlockN % 16 == 0, "tile shapes");
};

// dQ: the forward's shape plus a dO tile beside Q.
template <typename Elem_, int kHeadDim_, int kBlockM_, int kBlockN_, int kMTiles_ = 1>
struct BwdQTraits : FwdTraits<Elem_, kHeadDim_, kBlockM_, kBlockN_, kMTiles_> {
  using Base = FwdTraits<Elem_, kHeadDim_, kBlockM_, kBlockN_, kMTiles_>;
  static constexpr int kSmemBytes = (2 * Base::kSmemQ + 2 * Base::kSmemKV) * int(sizeof(Elem_));
};

// Backward main kernel (flash_bwd_dkdv_kernel.cuh): one CTA of kNWarps warps per block of kBlockN
// keys, stepping over blocks of kBlockM queries. Each GEMM has its own warp grid:
//  S = Q K^T and dP = dO V^T (kBlockM x kBlockN): kWarpsMS warps along the queries;
//  dV += P^T dO and dK += dS^T Q (kBlockN x d): kWarpsNKV warps along the keys;
//  dQ = dS K (kBlockM x d, float32 atomics): kWarpsMQ warps along the queries;
// the rest of each grid runs along the other dimension. P and dS travel through shared memory
// between the grids. kQStages = 2 double-buffers the Q tile (with its rows' logsumexp and D); dO
// has one buffer, refilled as soon as dV is done with it (measured: interleaving the dV and dK
// GEMMs and refilling after both was no faster). kDoDQ = false leaves dQ to the dQ kernel.
template <typename Elem_, int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kWarpsMS_, int kWarpsNKV_,
          int kWarpsMQ_, int kQStages_, bool kDoDQ_>
struct BwdTraits {
  using Elem = Elem_;
  static constexpr int kHeadDim = kHeadDim_, kBlockM = kBlockM_, kBlockN = kBlockN_, kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32, kQStages = kQStages_;
  static constexpr bool kDoDQ = kDoDQ_;
  static constexpr int kStride = Tile<kHeadDim>::kStride;  // Q, K, V, dO rows
  static constexpr int kStrideP = kBlockN + 8;             // P, dS rows (same padding rule)
  // Warp tiles: kMT* 16-row tiles by kN* columns.
  static constexpr int kWarpsMS = kWarpsMS_, kMTS = kBlockM / kWarpsMS / 16, kNS = kBlockN / (kNWarps / kWarpsMS);
  static constexpr int kWarpsNKV = kWarpsNKV_, kMTKV = kBlockN / kWarpsNKV / 16, kDKV = kHeadDim / (kNWarps / kWarpsNKV);
  static constexpr int kWarpsMQ = kWarpsMQ_, kMTQ = kBlockM / kWarpsMQ / 16, kDQ = kHeadDim / (kNWarps / kWarpsMQ);
  static constexpr int kSmemKV = kBlockN * kStride, kSmemQ = kBlockM * kStride, kSmemP = kBlockM * kStrideP;
  static constexpr int kSmemBytes = (2 * kSmemKV + (kQStages + 1) * kSmemQ + 2 * kSmemP) * int(sizeof(Elem)) +
                                    2 * kQStages * kBlockM * int(sizeof(float));  // + logsumexp and D rows
  static_assert(kMTS >= 1 && kMTKV >= 1 && kMTQ >= 1, "warp grids: at least one 16-row tile per warp");
  static_assert(kNS % 16 == 0 && kDKV % 16 == 0 && kDQ % 16 == 0, "warp tiles: columns in steps of 16");
  static_assert(kMTS * 16 * kWarpsMS == kBlockM && kMTKV * 16 * kWarpsNKV == kBlockN && kMTQ * 16 * kWarpsMQ == kBlockM,
                "warp grids must cover the block");
  static_assert(kQStages == 1 || kQStages == 2, "Q buffers");
};

}  // namespace flash::cuda
