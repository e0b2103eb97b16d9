// Tile shapes, shared-memory layouts and GMMA tilings of the sm90 backward kernel.
#pragma once

#include "wgmma_utils.cuh"

namespace flash::hopper {

// One CTA per block of kBlockN keys on kBlockN / 64 warpgroups, stepping over blocks of kBlockM
// queries (Q, dO and their rows' logsumexp and D double-buffered). Each warpgroup owns 64 keys:
//  S^T = K Q^T and dP^T = V dO^T (64 keys x kBlockM queries, both operands K-major in shared
//    memory), so P^T and dS^T come out in registers as the A operands of
//  dV += P^T dO and dK += dS^T Q (64 keys x d; B = MN-major views of the dO and Q tiles);
//  dQ = dS K (kBlockM x d) reads dS^T through shared memory (an MN-major A operand) and K^T as
//    an MN-major view of the K tile; the warpgroups split it along d where each slice is a whole
//    number of 64-column swizzle atoms (kDqSplitN), else warpgroup 0 computes it alone (one
//    warpgroup's GMMAs keep all four tensor cores busy, so this costs little).
template <typename Elem_, int kHeadDim_, int kBlockM_, int kBlockN_>
struct BwdSm90Traits {
  using Elem = Elem_;
  using CElem = CuteElem<Elem>;
  static constexpr int kHeadDim = kHeadDim_, kBlockM = kBlockM_, kBlockN = kBlockN_, kStages = 2;
  static constexpr int kNWarpGroups = kBlockN / 64, kNThreads = 128 * kNWarpGroups;
  static constexpr bool kDqSplitN = (kHeadDim / kNWarpGroups) % 64 == 0;
  static_assert(kBlockN % 64 == 0 && kHeadDim % 64 == 0 && kBlockM == 64, "tile shapes");

  using _D = cute::Int<kHeadDim>;
  using _M = cute::Int<kBlockM>;
  using _N = cute::Int<kBlockN>;
  using _S = cute::Int<kStages>;
  using Atom = SmemAtomK<CElem, kHeadDim>;
  using SmemLayoutQ = decltype(cute::tile_to_shape(Atom{}, cute::Shape<_M, _D, _S>{}));  // Q and dO
  using SmemLayoutK = decltype(cute::tile_to_shape(Atom{}, cute::Shape<_N, _D>{}));      // K and V
  // Transposed views of the same bytes (MN-major B operands).
  using SmemLayoutQt = decltype(cute::composition(
      SmemLayoutQ{}, cute::make_ordered_layout(cute::Shape<_D, _M, _S>{}, cute::Step<cute::_2, cute::_1, cute::_3>{})));
  using SmemLayoutKt = decltype(cute::composition(
      SmemLayoutK{}, cute::make_ordered_layout(cute::Shape<_D, _N>{}, cute::Step<cute::_2, cute::_1>{})));
  // dS as the (queries x keys) A operand of dQ = dS K, queries contiguous.
  using SmemLayoutdS =
      decltype(cute::tile_to_shape(cute::GMMA::Layout_MN_SW128_Atom<CElem>{}, cute::Shape<_M, _N>{}));

  using TiledMmaSdP = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<CElem, CElem, float, cute::Shape<cute::_64, _M, _D>>(),
      cute::Layout<cute::Shape<cute::Int<kNWarpGroups>, cute::_1, cute::_1>>{}));
  using TiledMmadKV = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<CElem, CElem, float, cute::Shape<cute::_64, _D, _M>, cute::GMMA::Major::K,
                                 cute::GMMA::Major::MN>(),
      cute::Layout<cute::Shape<cute::Int<kNWarpGroups>, cute::_1, cute::_1>>{}));
  static constexpr int kDqN = kDqSplitN ? kHeadDim / kNWarpGroups : kHeadDim;
  using DqWarpGroups = cute::Layout<cute::Shape<cute::_1, cute::Int<kDqSplitN ? kNWarpGroups : 1>, cute::_1>>;
  using TiledMmadQ = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<CElem, CElem, float, cute::Shape<cute::_64, cute::Int<kDqN>, _N>,
                                 cute::GMMA::Major::MN, cute::GMMA::Major::MN>(),
      DqWarpGroups{}));

  static constexpr int kSmemQ = int(cute::cosize_v<SmemLayoutQ>), kSmemK = int(cute::cosize_v<SmemLayoutK>);
  static constexpr int kSmemdS = int(cute::cosize_v<SmemLayoutdS>);
  static constexpr int kSmemAlign = 1024;  // the 128-byte swizzle repeats every 1024 bytes
  static constexpr int kSmemBytes = (2 * kSmemQ + 2 * kSmemK + kSmemdS) * int(sizeof(Elem)) +
                                    2 * kStages * kBlockM * int(sizeof(float)) + kSmemAlign;
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
