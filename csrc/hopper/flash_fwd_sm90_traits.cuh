// Tile shapes, shared-memory layouts and GMMA tilings of the sm90 forward kernel.
#pragma once

#include "wgmma_utils.cuh"

#include <cute/atom/copy_traits_sm90_tma.hpp>

namespace flash::hopper {

// kBlockM query rows on kBlockM / 64 warpgroups (64 rows each) and kBlockN keys per step, K in
// kStages buffers and V in kStagesV. S = Q K^T reads both operands from shared memory (K-major);
// O += P V takes P from registers and V^T as an MN-major view of the same V tile.
template <typename Elem_, int kHeadDim_, int kBlockM_, int kBlockN_, int kMinBlocks_ = 1, int kStages_ = 2,
          int kStagesV_ = kStages_>
struct FwdSm90Traits {
  using Elem = Elem_;
  using CElem = CuteElem<Elem>;
  static constexpr int kHeadDim = kHeadDim_, kBlockM = kBlockM_, kBlockN = kBlockN_;
  static constexpr int kStages = kStages_, kStagesV = kStagesV_;
  static constexpr int kMinBlocks = kMinBlocks_;  // CTAs per SM the registers must allow
  static constexpr int kNWarpGroups = kBlockM / 64, kNThreads = 128 * kNWarpGroups;
  static_assert(kBlockM % 64 == 0 && kBlockN % 16 == 0 && kHeadDim % 32 == 0, "tile shapes");

  using Atom = SmemAtomK<CElem, kHeadDim>;
  using SmemLayoutQ = decltype(cute::tile_to_shape(Atom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using SmemLayoutK = decltype(cute::tile_to_shape(
      Atom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>, cute::Int<kStages>>{}));
  using SmemLayoutV = decltype(cute::tile_to_shape(
      Atom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>, cute::Int<kStagesV>>{}));
  // V^T(d, key, stage) = V(key, d, stage): same bytes, coordinates swapped.
  using SmemLayoutVt = decltype(cute::composition(
      SmemLayoutV{}, cute::make_ordered_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>, cute::Int<kStagesV>>{},
                                                cute::Step<cute::_2, cute::_1, cute::_3>{})));

  using WarpGroups = cute::Layout<cute::Shape<cute::Int<kNWarpGroups>, cute::_1, cute::_1>>;
  using TiledMmaS = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<CElem, CElem, float, cute::Shape<cute::_64, cute::Int<kBlockN>, cute::Int<kHeadDim>>>(),
      WarpGroups{}));
  using TiledMmaO = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<CElem, CElem, float, cute::Shape<cute::_64, cute::Int<kHeadDim>, cute::Int<kBlockN>>,
                                 cute::GMMA::Major::K, cute::GMMA::Major::MN>(),
      WarpGroups{}));

  static constexpr int kSmemQ = int(cute::cosize_v<SmemLayoutQ>), kSmemK = int(cute::cosize_v<SmemLayoutK>);
  static constexpr int kSmemV = int(cute::cosize_v<SmemLayoutV>);
  static constexpr int kSmemAlign = 1024;  // the 128-byte swizzle repeats every 1024 bytes
  static constexpr int kSmemBytes = (kSmemQ + kSmemK + kSmemV) * int(sizeof(Elem)) + kSmemAlign;
};

// The warp-specialized forward (flash_fwd_sm90_ws_kernel.cuh): the same tiles and MMAs on two or
// three consumer warpgroups (128 or 192 query rows), plus a producer warpgroup that streams Q, K
// and V in with TMA. The producer gives its registers to the consumers (setmaxnreg).
template <typename Elem_, int kHeadDim_, int kBlockN_, int kStages_, int kStagesV_, int kBlockM_ = 128>
struct FwdSm90WsTraits : FwdSm90Traits<Elem_, kHeadDim_, kBlockM_, kBlockN_, 1, kStages_, kStagesV_> {
  using Base = FwdSm90Traits<Elem_, kHeadDim_, kBlockM_, kBlockN_, 1, kStages_, kStagesV_>;
  using typename Base::CElem;
  static_assert(Base::kNWarpGroups == 2 || Base::kNWarpGroups == 3, "two or three consumer warpgroups");
  static constexpr int kNConsumerThreads = Base::kNThreads, kNThreads = Base::kNThreads + 128;
  // The register file (64K) split: 128 x 24 + 256 x 240, or 128 x 32 + 384 x 160.
  static constexpr int kProducerRegs = Base::kNWarpGroups == 2 ? 24 : 32;
  static constexpr int kConsumerRegs = Base::kNWarpGroups == 2 ? 240 : 160;

  // TMA views of q, k and v: (seqlen, head dim, heads, batch), the head dim contiguous.
  using GmemShape = cute::Shape<int32_t, int32_t, int32_t, int32_t>;
  using GmemStride = cute::Stride<int64_t, cute::_1, int64_t, int64_t>;
  using SmemLayoutKVStage = decltype(cute::tile_to_shape(
      typename Base::Atom{}, cute::Shape<cute::Int<Base::kBlockN>, cute::Int<Base::kHeadDim>>{}));
  using TmaQ = decltype(cute::make_tma_copy(
      cute::SM90_TMA_LOAD{},
      cute::make_tensor(cute::make_gmem_ptr(static_cast<const CElem*>(nullptr)), GmemShape{}, GmemStride{}),
      typename Base::SmemLayoutQ{}));
  using TmaKV = decltype(cute::make_tma_copy(
      cute::SM90_TMA_LOAD{},
      cute::make_tensor(cute::make_gmem_ptr(static_cast<const CElem*>(nullptr)), GmemShape{}, GmemStride{}),
      SmemLayoutKVStage{}));
  static constexpr uint32_t kQBytes = Base::kSmemQ * sizeof(CElem), kKVBytes = Base::kSmemK / kStages_ * sizeof(CElem);
  // Full/empty mbarriers: per Q buffer, per K stage, per V stage, per slot of the two-slot tile
  // schedule and per slot of the two-slot queue of a KV cache's last V tiles; then the schedule's
  // two tile indices and the queue's two (stage, rows) pairs.
  static constexpr int kNBarriers(int q_bufs) { return 2 * q_bufs + 2 * kStages_ + 2 * kStagesV_ + 8; }
  static constexpr int bytes_with(int q_bufs) {
    return Base::kSmemBytes + (q_bufs - 1) * kQBytes + kNBarriers(q_bufs) * 8 + 6 * 4;
  }
  // Two Q buffers where sm_90's 227 KB allow (head dims up to 224), so a CTA loads its next tile's
  // Q while it computes this one; one above. From head dim 128 on, a tile's output leaves through
  // its Q buffer with a TMA store (kTmaO), which frees the buffer at the warpgroup's next MMA
  // turn: forward 2-8% faster with up to 16 key tiles a row, 2% slower at 128. Below head dim
  // 128 the register stores measured faster (d=32: 8%). A third Q buffer changed nothing
  // measurable (NOTES 2026-12-03, thirteenth session).
  static constexpr int kQBufs = bytes_with(2) <= 227 * 1024 ? 2 : 1;
  static_assert(kHeadDim_ > 224 || kQBufs == 2, "the barriers and queues must leave room for two Q buffers");
  static constexpr bool kTmaO = kQBufs >= 2 && kHeadDim_ >= 128;
  static constexpr int kSmemBytes = bytes_with(kQBufs);
  using SmemLayoutQs = decltype(cute::tile_to_shape(
      typename Base::Atom{}, cute::Shape<cute::Int<Base::kBlockM>, cute::Int<Base::kHeadDim>, cute::Int<kQBufs>>{}));
  // One warpgroup's 64 output rows: the TMA store's box (a slab of a Q buffer, same swizzle).
  using SmemLayoutOWg = decltype(cute::tile_to_shape(typename Base::Atom{}, cute::Shape<cute::_64, cute::Int<Base::kHeadDim>>{}));
  using TmaO = decltype(cute::make_tma_copy(
      cute::SM90_TMA_STORE{},
      cute::make_tensor(cute::make_gmem_ptr(static_cast<const CElem*>(nullptr)), GmemShape{}, GmemStride{}),
      SmemLayoutOWg{}));
};

}  // namespace flash::hopper
