// Tile shapes, shared-memory layouts and GMMA tilings of the sm90 backward kernels.
#pragma once

#include "wgmma_utils.cuh"

#include <cute/atom/copy_traits_sm90_tma.hpp>

namespace flash::hopper {

// The warp-specialized backward (flash_bwd_sm90_ws_kernel.cuh), head dims up to 128: one CTA per
// block of kBlockN = 128 keys, stepping over blocks of kBlockM = 64 queries (Q, dO and their rows'
// logsumexp and D in kStages stages). A producer warpgroup (TMA loads; dQ bulk reductions) gives its
// registers to two MMA warpgroups, each owning 64 keys:
//  S^T = K Q^T and dP^T = V dO^T (64 keys x kBlockM queries, both operands K-major in shared
//    memory), so P^T and dS^T come out in registers as the A operands of
//  dV += P^T dO and dK += dS^T Q (64 keys x d; B = MN-major views of the dO and Q tiles);
//  dQ = dS K (kBlockM x d) reads dS^T through shared memory (an MN-major A operand, two buffers)
//    and K^T as an MN-major view of the K tile, into float32 tiles in shared memory (one or two
//    buffers of them). The warpgroups split it along d where each half is whole 64-column swizzle
//    atoms (kDqSplitN), else (head dims 32, 64, 96) along the keys: each warpgroup its own 64
//    keys' partial sum in its own tile (both tiles are reduced into the accumulator).
template <typename Elem_, int kHeadDim_>
struct BwdSm90WsTraits {
  using Elem = Elem_;
  using CElem = CuteElem<Elem>;
  // Three Q/dO stages up to head dim 64 (backward 6-9% faster than with two, NOTES seventeenth
  // session); at 128 a third would need ~230 KB of shared memory.
  static constexpr int kHeadDim = kHeadDim_, kBlockM = 64, kBlockN = 128, kStages = kHeadDim_ <= 64 ? 3 : 2;
  static constexpr int kNWarpGroups = kBlockN / 64, kNConsumerThreads = 128 * kNWarpGroups;
  static constexpr int kNThreads = kNConsumerThreads + 128;
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;  // 128 x 24 + 256 x 240 <= 64K
  static constexpr bool kDqSplitN = (kHeadDim / kNWarpGroups) % 64 == 0, kDqSplitK = !kDqSplitN;
  static constexpr int kDqN = kDqSplitN ? kHeadDim / kNWarpGroups : kHeadDim, kDqTiles = kDqSplitK ? 2 : 1;
  static_assert(kHeadDim % 32 == 0 && kHeadDim <= 128, "tile shapes");
  // Named barriers (ids past those CUTLASS reserves): dS complete (per warpgroup when dQ is split
  // along the keys: ids 1 and 2); the last tile's dK and dV read out of shared memory.
  static constexpr int kBarDsReady = 1, kBarStagedRead = 5;
  // dQ goes through kDqBuffers sets of tiles in shared memory (ordered dQ uses both, atomic dQ
  // one; flash_bwd_sm90_ws_kernel.cuh says why). Per buffer, hardware barrier ids
  // (below CUTLASS's named-barrier range, which starts at 8): its tiles written; read; warpgroup 1's
  // partial sum written (ordered dQ split along the keys).
  static constexpr int kDqBuffers = 2;
  static constexpr int kHwBarDqFull = 1, kHwBarDqEmpty = 1 + kDqBuffers, kHwBarDqPair = 1 + 2 * kDqBuffers;
  static constexpr int kDqBarThreads = kNConsumerThreads + 32;  // a buffer's Full/Empty: MMA warps and its dQ warp
  static_assert(kHwBarDqPair + kDqBuffers <= 8, "hardware barrier ids below CUTLASS's named barriers");

  using _D = cute::Int<kHeadDim>;
  using _M = cute::Int<kBlockM>;
  using _N = cute::Int<kBlockN>;
  using _S = cute::Int<kStages>;
  using Atom = SmemAtomK<CElem, kHeadDim>;
  using SmemLayoutQ = decltype(cute::tile_to_shape(Atom{}, cute::Shape<_M, _D, _S>{}));  // Q and dO
  using SmemLayoutQStage = decltype(cute::tile_to_shape(Atom{}, cute::Shape<_M, _D>{}));
  using SmemLayoutK = decltype(cute::tile_to_shape(Atom{}, cute::Shape<_N, _D>{}));  // K and V
  // Transposed views of the same bytes (MN-major B operands).
  using SmemLayoutQt = decltype(cute::composition(
      SmemLayoutQ{}, cute::make_ordered_layout(cute::Shape<_D, _M, _S>{}, cute::Step<cute::_2, cute::_1, cute::_3>{})));
  using SmemLayoutKt = decltype(cute::composition(
      SmemLayoutK{}, cute::make_ordered_layout(cute::Shape<_D, _N>{}, cute::Step<cute::_2, cute::_1>{})));
  // dS as the (queries x keys) A operand of dQ = dS K, queries contiguous; two buffers.
  using SmemLayoutdS2 = decltype(cute::tile_to_shape(cute::GMMA::Layout_MN_SW128_Atom<CElem>{},
                                                     cute::Shape<_M, _N, cute::_2>{}));

  using WarpGroups = cute::Layout<cute::Shape<cute::Int<kNWarpGroups>, cute::_1, cute::_1>>;
  using TiledMmaSdP = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<CElem, CElem, float, cute::Shape<cute::_64, _M, _D>>(), WarpGroups{}));
  using TiledMmadKV = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<CElem, CElem, float, cute::Shape<cute::_64, _D, _M>, cute::GMMA::Major::K,
                                 cute::GMMA::Major::MN>(),
      WarpGroups{}));
  // dQ per warpgroup: (kBlockM x kDqN) over all keys, or (kBlockM x d) over its 64 keys.
  using TiledMmadQ = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<CElem, CElem, float,
                                 cute::Shape<cute::_64, cute::Int<kDqN>, cute::Int<kDqSplitN ? kBlockN : 64>>,
                                 cute::GMMA::Major::MN, cute::GMMA::Major::MN>(),
      cute::Layout<cute::Shape<cute::_1, cute::Int<kDqSplitN ? kNWarpGroups : 1>, cute::_1>>{}));

  // TMA views of q, dO, k and v: (seqlen, head dim, heads, batch), the head dim contiguous.
  using GmemTensor = decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<const CElem*>(nullptr)),
                                                cute::Shape<int32_t, int32_t, int32_t, int32_t>{},
                                                cute::Stride<int64_t, cute::_1, int64_t, int64_t>{}));
  using TmaQ = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutQStage{}));
  using TmaK = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutK{}));

  static constexpr int kSmemQ = int(cute::cosize_v<SmemLayoutQ>), kSmemK = int(cute::cosize_v<SmemLayoutK>);
  static constexpr int kSmemdS2 = int(cute::cosize_v<SmemLayoutdS2>);
  static constexpr uint32_t kKBytes = kSmemK * sizeof(CElem);
  // Per stage: Q and dO tiles, and their rows' logsumexp and D.
  static constexpr uint32_t kStageBytes = 2 * kBlockM * kHeadDim * sizeof(CElem) + 2 * kBlockM * sizeof(float);
  // K and V full, empty; per stage full, empty; two schedule slots' full, empty. Then the two
  // slots (a tile and its query blocks; 32 bytes each).
  static constexpr int kNBarriers = 2 + 2 * kStages + 4, kSchedSlotBytes = 32;
  static constexpr int kSmemAlign = 1024;  // the 128-byte swizzle repeats every 1024 bytes
  // A tile's dK and dV leave through shared memory, where dS and the dQ tiles were (and a little
  // more): rows of kHeadDim 16-bit values padded by 16 bytes, so that the accumulator fragments'
  // 4-byte writes (8 rows x 4 columns per warp) hit 32 different banks.
  static constexpr int kStagedRowBytes = kHeadDim * 2 + 16, kStagedBytes = 2 * kBlockN * kStagedRowBytes;
  static constexpr int kDqBufferFloats = kDqTiles * kBlockM * kHeadDim;
  static constexpr int kDqRegionBytes = cute::max(kDqBuffers * kDqBufferFloats * int(sizeof(float)),
                                                  kStagedBytes - kSmemdS2 * int(sizeof(CElem)));
  static constexpr int kSmemBytes = (2 * kSmemQ + 2 * kSmemK + kSmemdS2) * int(sizeof(CElem)) + kDqRegionBytes +
                                    2 * kStages * kBlockM * int(sizeof(float)) + kNBarriers * 8 +
                                    2 * kSchedSlotBytes + kSmemAlign;
  static_assert(kSmemBytes <= 227 * 1024, "an sm90 CTA's shared memory");
};

// Head dims above 128, where 128 keys' dK and dV accumulators would not fit in registers: one CTA
// per block of 64 keys on kNWarpGroups = kHeadDim / kDSlice warpgroups, 64 queries per step (Q,
// dO and their statistics double-buffered). Per step
//  warpgroup 0 computes S^T = K Q^T and warpgroup 1 dP^T = V dO^T (64 x 64, keys as rows); they
//    swap halves in float32 through shared memory, and each forms P^T and dS^T for half of the
//    queries and stores them (16-bit, keys x queries, queries contiguous);
//  then every warpgroup w owns head-dim columns [w kDSlice, (w + 1) kDSlice) of dV += P^T dO,
//    dK += dS^T Q (A from shared memory) and dQ = dS K (dS as the MN-major view of dS^T).
template <typename Elem_, int kHeadDim_, int kDSlice_>
struct BwdSm90SplitDTraits {
  using Elem = Elem_;
  using CElem = CuteElem<Elem>;
  static constexpr int kHeadDim = kHeadDim_, kDSlice = kDSlice_, kBlockM = 64, kBlockN = 64, kStages = 2;
  static constexpr int kNWarpGroups = kHeadDim / kDSlice, kNThreads = 128 * kNWarpGroups;
  static_assert(kHeadDim % kDSlice == 0 && kDSlice % 64 == 0 && kNWarpGroups >= 2, "whole swizzle atoms per slice");

  using _D = cute::Int<kHeadDim>;
  using _DS = cute::Int<kDSlice>;
  using _M = cute::Int<kBlockM>;
  using _N = cute::Int<kBlockN>;
  using Atom = SmemAtomK<CElem, kHeadDim>;
  using SmemLayoutQ = decltype(cute::tile_to_shape(Atom{}, cute::Shape<_M, _D, cute::Int<kStages>>{}));  // Q, dO
  using SmemLayoutK = decltype(cute::tile_to_shape(Atom{}, cute::Shape<_N, _D>{}));                      // K, V
  // The same bytes as transposed column slices (MN-major B operands): a (rows x kHeadDim) tile is
  // its kNWarpGroups (rows x kDSlice) slices one after another. Slice w of stage s: w + kNWarpGroups s.
  template <int kRows, int kSlices>
  using SlicesT = decltype(cute::composition(
      cute::tile_to_shape(Atom{}, cute::Shape<cute::Int<kRows>, _DS, cute::Int<kSlices>>{}),
      cute::make_ordered_layout(cute::Shape<_DS, cute::Int<kRows>, cute::Int<kSlices>>{},
                                cute::Step<cute::_2, cute::_1, cute::_3>{})));
  using SmemLayoutQtSlices = SlicesT<kBlockM, kNWarpGroups * kStages>;
  using SmemLayoutKtSlices = SlicesT<kBlockN, kNWarpGroups>;
  // P^T and dS^T (keys x queries, queries contiguous), and dS (queries x keys) as a view of dS^T.
  using SmemLayoutPt = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<CElem>{}, cute::Shape<_N, _M>{}));
  using SmemLayoutdS = decltype(cute::composition(
      SmemLayoutPt{}, cute::make_ordered_layout(cute::Shape<_M, _N>{}, cute::Step<cute::_2, cute::_1>{})));

  using OneWarpGroup = cute::Layout<cute::Shape<cute::_1, cute::_1, cute::_1>>;
  using TiledMmaSdP = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<CElem, CElem, float, cute::Shape<_N, _M, _D>>(), OneWarpGroup{}));
  using TiledMmadKV = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<CElem, CElem, float, cute::Shape<_N, _DS, _M>, cute::GMMA::Major::K,
                                 cute::GMMA::Major::MN>(),
      OneWarpGroup{}));
  using TiledMmadQ = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<CElem, CElem, float, cute::Shape<_M, _DS, _N>, cute::GMMA::Major::MN,
                                 cute::GMMA::Major::MN>(),
      OneWarpGroup{}));

  static constexpr int kSmemQ = int(cute::cosize_v<SmemLayoutQ>), kSmemK = int(cute::cosize_v<SmemLayoutK>);
  static constexpr int kSmemPt = int(cute::cosize_v<SmemLayoutPt>);
  static constexpr int kSmemAlign = 1024;
  static constexpr int kSmemBytes = (2 * kSmemQ + 2 * kSmemK + 2 * kSmemPt) * int(sizeof(Elem)) +
                                    (kBlockN * kBlockM + 2 * kStages * kBlockM) * int(sizeof(float))  // score halves, lse, D
                                    + kSmemAlign;
};

}  // namespace flash::hopper
