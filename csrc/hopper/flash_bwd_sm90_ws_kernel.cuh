// The warp-specialized sm90 backward (FlashAttention-3's schedule) for head dims up to 128: the
// portable backward's algorithm (flash_bwd_dkdv_kernel.cuh) on warpgroup MMAs. A tile is 128 keys;
// for each block of 64 queries that can see them it recomputes S^T = K Q^T, P^T = exp(S^T - lse)
// and dP^T = V dO^T (keys as the MMA rows, so P^T and dS^T = P^T (dP^T - D) stay in registers as
// the A operands of dV += P^T dO and dK += dS^T Q), and dQ = dS K goes through shared memory.
// dS is unscaled: softmax_scale goes to dK in the epilogue and to dQ in the conversion. The data
// movement is off the MMA warpgroups:
// - a producer warp streams each step's Q, dO (TMA) and their rows' base-2 logsumexp and D (bulk
//   copies) into two mbarrier-guarded stages; K and V arrive once per tile, also by TMA;
// - the MMA warpgroups leave dQ = dS K in shared memory (float32, in dq_accum_col's swizzled
//   layout) and a second producer warp adds the whole tile into the accumulator with one bulk
//   reduction (cp.reduce.async.bulk), instead of one float2 atomic per pair of values (ordered
//   dQ: two buffers of tiles and two warps, taking alternate steps);
// - dK and dV leave through shared memory too, a bulk copy per row (store_dk_dv_staged).
// Deterministic (BwdParams::dq_semaphore_ptr: ordered dQ), the key blocks that visit a query block
// add into it one after another (dq_turn), and the two warpgroups' partial sums, where the keys
// split dQ, are added in shared memory first.
#pragma once

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "flash_bwd_sm90_common.cuh"
#include "flash_bwd_sm90_traits.cuh"
#include "persistent_tiles.cuh"
#include "tma_view.cuh"

namespace flash::hopper {

// The kernel's parameters: the op's, the TMA descriptors the launcher built, and the tile
// schedule: num_tiles (key block, head, batch) tiles, the first gridDim.x taken in CTA order and the
// rest claimed from tile_counter (zeroed by the launcher; unused, and may be null, when there are
// no more tiles than CTAs).
template <typename T>
struct BwdSm90WsParams {
  BwdParams p;
  typename T::TmaQ tma_q, tma_do;
  typename T::TmaK tma_k, tma_v;
  int num_tiles;
  int* tile_counter;
};

// What the scheduling warp hands the other roles for each tile: its index (num_tiles or more:
// none left) and the query blocks it visits, counted once for all of them.
struct BwdSchedSlot {
  TileSeq tiles;
  int t;
};

// bytes of shared memory at src -> float32 adds into global memory at dst, as one bulk operation
// of this thread's bulk group.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, const float* src, int bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
               "r"(cuda::smem_addr(src)), "r"(bytes)
               : "memory");
}

// bytes of shared memory at the 32-bit shared address src -> global memory at dst, as one bulk
// operation of this thread's bulk group (cute::SM90_BULK_COPY_S2G takes a generic pointer, whose
// conversion the callers' shared addresses would only undo).
__device__ __forceinline__ void bulk_store(void* dst, uint32_t src, int bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(src), "r"(bytes)
               : "memory");
}

// Wait until this thread's bulk operations are complete (their shared-memory reads and global
// writes), before the CTA's shared memory goes away.
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// Ordered dQ: the key blocks that visit query block m take turns at adding into its rows, last key
// block first. Under a causal mask (or a window) that is the order they reach it in (the later a
// key block, the later the first query block it visits), so a turn is rarely waited for. The
// geometry's key blocks for m are a contiguous run (the visible region is a band) and n is in it;
// key block n's turn is the number of them after n, counting only the kept ones under a block
// mask (a key block is a mask block). Every lane of the warp calls it (they split the mask row).
template <int kM, int kN>
__device__ __forceinline__ int dq_turn(const FwdParams& p, int b, int h, int n, int m) {
  static_assert(kN == kMaskBlock, "a key block is one mask block");
  int lo = n, hi = (p.seqlen_k + kN - 1) / kN - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    int mb_begin, mb_end;
    cuda::query_block_range<kM, kN>(p, mid * kN, mb_begin, mb_end);
    if (mb_begin <= m && m < mb_end) lo = mid;
    else hi = mid - 1;
  }
  const int32_t* kept = kept_key_blocks(p, b, h, m * kM / kMaskBlock);
  if (kept == nullptr) return lo - n;
  int after = 0;
  for (int i = threadIdx.x % 32; i < kept[0]; i += 32) after += n < kept[1 + i] && kept[1 + i] <= lo;
  return __reduce_add_sync(0xffffffffu, after);
}

// Wait until the counter at turns reaches turn (acquire: the adds of earlier turns are visible);
// pass_turn hands it to the next key block (release, after this one's adds are complete).
// Each poll is an acquire load, an L1 invalidation each time. Relaxed polls with one fence after
// them were 1-11% slower at every ordered point timed (NOTES 2026-12-07, thirty-third session).
__device__ __forceinline__ void wait_turn(const int* turns, int turn) {
  int v;
  do {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(turns) : "memory");
  } while (v != turn);
}
__device__ __forceinline__ void pass_turn(int* turns) {
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(turns) : "memory");
}

// Hardware barriers by id (the traits' kHwBarDq*, below the ids CUTLASS's NamedBarrier hands out).
__device__ __forceinline__ void hw_bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void hw_bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Orders this thread's generic-proxy accesses to global memory with its bulk (async-proxy) ones.
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;\n" ::: "memory"); }

// A 32-bit store to a shared-memory address (st.shared: no generic-address arithmetic).
__device__ __forceinline__ void st_shared_u32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

// One warp's 16 keys (key16.. of the tile at j0) of dK (scaled) and dV, out through shared memory:
// the accumulator fragments go into rows of the staging area at `staged` (dK's kBlockN rows, then
// dV's; T::kStagedRowBytes apart), then lanes 0-15 store the dK rows and lanes 16-31 the dV rows
// with one bulk copy each (whole rows instead of the fragments' scattered 4-byte pieces; keys
// past seqlen_k are not stored). The caller waits for the copies to have read shared memory
// before writing there again. Not for GQA, whose float32 partials take write_dk_dv_tile.
template <typename T>
__device__ __forceinline__ void store_dk_dv_staged(const BwdParams& p, int b, int h, int j0, int key16,
                                                   const float (&dk)[T::kHeadDim / 8][4],
                                                   const float (&dv)[T::kHeadDim / 8][4], uint32_t staged, int lane) {
  using Elem = typename T::Elem;
  constexpr int kRow = T::kStagedRowBytes, kTensor = T::kBlockN * kRow;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const uint32_t row = staged + (key16 + lane / 4 + 8 * hr) * kRow + 4 * (lane % 4);
#pragma unroll
    for (int nt = 0; nt < T::kHeadDim / 8; ++nt) {
      st_shared_u32(row + nt * 16,
                    cuda::pack2<Elem>(dk[nt][2 * hr] * p.scale_softmax, dk[nt][2 * hr + 1] * p.scale_softmax));
      st_shared_u32(row + kTensor + nt * 16, cuda::pack2<Elem>(dv[nt][2 * hr], dv[nt][2 * hr + 1]));
    }
  }
  fence_proxy_async_smem();
  __syncwarp();
  const int r = key16 + lane % 16, key = j0 + r;
  if (key < p.seqlen_k) {
    Elem* dst = lane < 16 ? rows_of<Elem>(p.dk_ptr, b, h, p.k_row0, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride) +
                                key * p.dk_row_stride
                          : rows_of<Elem>(p.dv_ptr, b, h, p.k_row0, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride) +
                                key * p.dv_row_stride;
    bulk_store(dst, staged + (lane < 16 ? 0 : kTensor) + r * kRow, p.d * int(sizeof(Elem)));
  }
  cute::tma_store_arrive();
}

// kScoreMod: a bias and ALiBi (score_mod.h; no cap) and the bias gradient, in a separate
// instantiation so that the common path keeps its registers.
//
// The kernel is persistent: each CTA takes (key block, head, batch) tiles until none are left. A
// key block under a window or a sparse mask visits only a few query blocks, so a CTA per tile
// would spend a large share of its time starting (K, V and the first query block in flight) and
// draining (the dK/dV stores); here the next tile's K and V load while this one's dK and dV are
// written, and its first query blocks while this one's last steps run. Every role walks the same
// tiles through two schedule slots; step, K/V and slot counts carry over from tile to tile, so
// every barrier's phase follows from them (a fresh barrier passes a wait on parity 1 at once).
// Ordered dQ walks each head's key blocks last first and claims every tile from the counter
// (cuda::persistent_grid's claim_all), so a turn is only ever waited for from a tile claimed later.
template <typename T, bool kBlockSparse, bool kScoreMod = false>
__global__ void __launch_bounds__(T::kNThreads, 1) flash_bwd_sm90_ws_kernel(const __grid_constant__ BwdSm90WsParams<T> args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace cute;
  using Elem = typename T::Elem;
  using CElem = typename T::CElem;
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  using cutlass::arch::NamedBarrier;
  constexpr int kD = T::kHeadDim, kM = T::kBlockM, kN = T::kBlockN, kStages = T::kStages;
  constexpr int kConsumerWarps = T::kNConsumerThreads / 32;
  extern __shared__ char smem_raw[];
  CElem* sq_ptr = aligned_smem<T::kSmemAlign, CElem>(smem_raw);
  CElem* sdo_ptr = sq_ptr + T::kSmemQ;
  CElem* sk_ptr = sdo_ptr + T::kSmemQ;
  CElem* sv_ptr = sk_ptr + T::kSmemK;
  CElem* sds_ptr = sv_ptr + T::kSmemK;
  float* sdQ = reinterpret_cast<float*>(sds_ptr + T::kSmemdS2);
  float* sLse = reinterpret_cast<float*>(reinterpret_cast<char*>(sdQ) + T::kDqRegionBytes);  // per stage, per query
  float* sDsum = sLse + kStages * kM;
  uint64_t* kv_full = reinterpret_cast<uint64_t*>(sDsum + kStages * kM);
  uint64_t* kv_empty = kv_full + 1;
  uint64_t* full = kv_empty + 1;  // per stage: Q, dO, logsumexp, D
  uint64_t* empty = full + kStages;
  uint64_t* sched_full = empty + kStages;
  uint64_t* sched_empty = sched_full + 2;
  BwdSchedSlot* sched = reinterpret_cast<BwdSchedSlot*>(sched_empty + 2);
  static_assert(sizeof(BwdSchedSlot) <= T::kSchedSlotBytes, "schedule slot size");
  Tensor sQ = make_tensor(make_smem_ptr(sq_ptr), typename T::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(sdo_ptr), typename T::SmemLayoutQ{});
  Tensor sQt = make_tensor(make_smem_ptr(sq_ptr), typename T::SmemLayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(sdo_ptr), typename T::SmemLayoutQt{});
  Tensor sK = make_tensor(make_smem_ptr(sk_ptr), typename T::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(sv_ptr), typename T::SmemLayoutK{});
  Tensor sKt = make_tensor(make_smem_ptr(sk_ptr), typename T::SmemLayoutKt{});
  Tensor sdS = make_tensor(make_smem_ptr(sds_ptr), typename T::SmemLayoutdS2{});  // (queries, keys, buffer)

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int num_n_blocks = (args.p.seqlen_k + kN - 1) / kN;
  const bool ordered = args.p.dq_semaphore_ptr != nullptr;
  // dQ tile buffers, each added by its own producer warp (steps alternate between them). Ordered
  // dQ takes both: one warp's wait for its turn and for its add to complete overlaps the other's
  // step (NOTES 2026-12-07: 1.05-1.13x atomic dQ's time dense, against 1.16-1.48x with one).
  // Atomic dQ, whose warp waits for neither, keeps one.
  const int dq_buffers = ordered ? T::kDqBuffers : 1;
  if (tid == 0) {
    cute::prefetch_tma_descriptor(args.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_v.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_do.get_tma_descriptor());
    Barrier::init(kv_full, 1);
    Barrier::init(kv_empty, kConsumerWarps);
    for (int s = 0; s < kStages; ++s) {
      Barrier::init(full + s, 1);
      Barrier::init(empty + s, kConsumerWarps);
    }
    for (int i = 0; i < 2; ++i) {
      Barrier::init(sched_full + i, 1);
      Barrier::init(sched_empty + i, kConsumerWarps + dq_buffers);  // and the dQ warps
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  // Slot j of the schedule: wait for it, copy it out, hand it back (one lane for the warp, after
  // the warp barrier that orders every lane's read before it).
  const auto take_slot = [&](int j) {
    Barrier::wait(sched_full + (j & 1), (j >> 1) & 1);
    const BwdSchedSlot slot = sched[j & 1];
    __syncwarp();
    if (lane == 0) Barrier::arrive(sched_empty + (j & 1));
    return slot;
  };

  if (warp < 4) {  // producer warpgroup
    cutlass::arch::warpgroup_reg_dealloc<T::kProducerRegs>();
    if (warp == 0) {  // schedule and loads: lane 0 issues every copy (the lanes count tile lists together)
      int t = ordered ? claim_tile(args.tile_counter) : int(blockIdx.x), kv_count = 0;
      cutlass::PipelineState<kStages> qst;  // the next step's stage (Q, dO and their statistics)
      for (int j = 0;; ++j) {
        const bool last = t >= args.num_tiles;
        const GridTile tile = grid_tile(last ? 0 : t, num_n_blocks, args.p.h, ordered);
        const int j0 = tile.block * kN, h = tile.h, b = tile.b;
        const BwdParams p = seq_view(args.p, b);
        const bool has_keys = !last && j0 < p.seqlen_k;  // (varlen: past this sequence's keys)
        // K and V: for the first tile before its query blocks are counted (nothing else is in
        // flight yet); later, once the last tile's MMAs are done with them.
        const auto load_k_v = [&] {
          if (lane != 0) return;
          Barrier::wait(kv_empty, (kv_count & 1) ^ 1);
          const int hk = h / p.h_h_k_ratio;
          Tensor gK = local_tile(tma_rows(args.tma_k, k_view(p), p.k_row0, hk, b), Shape<Int<kN>, Int<kD>>{},
                                 make_coord(tile.block, 0));
          Tensor gV = local_tile(tma_rows(args.tma_v, v_view(p), p.k_row0, hk, b), Shape<Int<kN>, Int<kD>>{},
                                 make_coord(tile.block, 0));
          auto [tKg, tKs] = tma_partition(args.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
          auto [tVg, tVs] = tma_partition(args.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
          Barrier::arrive_and_expect_tx(kv_full, 2 * T::kKBytes);
          copy(args.tma_k.with(*kv_full), tKg, tKs);
          copy(args.tma_v.with(*kv_full), tVg, tVs);
        };
        if (has_keys && j == 0) load_k_v();
        const TileSeq tiles = has_keys ? cuda::query_tiles<kM, kN, kBlockSparse>(p, b, h, j0) : TileSeq{};
        if (lane == 0) {
          Barrier::wait(sched_empty + (j & 1), ((j >> 1) & 1) ^ 1);
          sched[j & 1] = BwdSchedSlot{tiles, t};
          Barrier::arrive(sched_full + (j & 1));  // (release: the slot is visible to its waiters)
        }
        if (last) break;
        if (has_keys) {
          if (j > 0) load_k_v();
          ++kv_count;
          if (lane == 0) {
            const BwdHeadPtrs<Elem> hp = bwd_head_ptrs<Elem, kD, kM>(p, b, h);
            Tensor gQ = local_tile(tma_rows(args.tma_q, q_view(p), p.q_row0, h, b), Shape<Int<kM>, Int<kD>>{},
                                   make_coord(_, 0));  // (kM, kD, block)
            Tensor gdO = local_tile(tma_rows(args.tma_do, do_view(p), p.q_row0, h, b), Shape<Int<kM>, Int<kD>>{},
                                    make_coord(_, 0));
            auto [tQg, tQs] = tma_partition(args.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
            auto [tdOg, tdOs] =
                tma_partition(args.tma_do, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
            for (int it = 0; it < tiles.count; ++it) {
              const int stage = qst.index(), mb = tiles[it];
              Barrier::wait(empty + stage, qst.phase() ^ 1);
              ++qst;
              Barrier::arrive_and_expect_tx(full + stage, T::kStageBytes);
              copy(args.tma_q.with(full[stage]), tQg(_, mb), tQs(_, stage));
              copy(args.tma_do.with(full[stage]), tdOg(_, mb), tdOs(_, stage));
              SM90_BULK_COPY_G2S::copy(hp.lse2 + mb * kM, full + stage, sLse + stage * kM, kM * int(sizeof(float)));
              SM90_BULK_COPY_G2S::copy(hp.dsum + mb * kM, full + stage, sDsum + stage * kM, kM * int(sizeof(float)));
            }
          }
        }
        // once this tile's loads are queued
        t = ordered ? claim_tile(args.tile_counter) : claim_next_tile(args.num_tiles, args.tile_counter);
      }
    } else if (warp <= dq_buffers) {  // dQ: each step's tile from shared memory into the accumulator
      int step = 0;  // as the MMA warpgroups count them; this warp takes those of its buffer
      for (int j = 0;; ++j) {
        const BwdSchedSlot slot = take_slot(j);
        if (slot.t >= args.num_tiles) break;
        const GridTile tile = grid_tile(slot.t, num_n_blocks, args.p.h, ordered);
        const BwdParams p = seq_view(args.p, tile.b);
        if (tile.block * kN >= p.seqlen_k) continue;
        float* dq_accum = bwd_head_ptrs<Elem, kD, kM>(p, tile.b, tile.h).dq_accum;
        int* turns = ordered ? p.dq_semaphore_ptr + stat_row(p, tile.b, tile.h) / kM : nullptr;
        for (int it = 0; it < slot.tiles.count; ++it, ++step) {
          const int dqb = step & (dq_buffers - 1);
          if (dqb != warp - 1) continue;
          const int mb = slot.tiles[it];
          if (ordered) {  // while the MMAs run
            const int turn = dq_turn<kM, kN>(p, tile.b, tile.h, tile.block, mb);
            if (lane == 0) wait_turn(turns + mb, turn);
            __syncwarp();
          }
          hw_bar_sync(T::kHwBarDqFull + dqb, T::kDqBarThreads);
          if (lane == 0) {
            if (ordered) fence_proxy_async_global();  // the earlier turns' adds before this one's
            const float* src = sdQ + dqb * T::kDqBufferFloats;
            for (int q = 0; q < (ordered ? 1 : T::kDqTiles); ++q)  // (ordered: one tile, see the MMA warpgroups)
              bulk_reduce_add_f32(dq_accum + int64_t(mb) * kM * kD, src + q * kM * kD, kM * kD * int(sizeof(float)));
            tma_store_arrive();
            tma_store_wait<0>();  // the tile has been read
          }
          __syncwarp();
          hw_bar_arrive(T::kHwBarDqEmpty + dqb, T::kDqBarThreads);
          if (ordered && lane == 0) {  // the next turn, once the adds are complete
            bulk_wait_all();
            fence_proxy_async_global();
            pass_turn(turns + mb);
          }
        }
      }
      if (lane == 0) bulk_wait_all();
    }
    return;
  }

  // MMA warpgroups 0 and 1 (threads 128..383), 64 keys each.
  cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegs>();
  const int ctid = tid - 128, cwarp = ctid / 32, wg = cwarp / 4, g = lane / 4, t = lane % 4;
  const int key16 = cwarp * 16;  // this warp's 16 keys, relative to j0
  // This thread's share of dQ (see BwdSm90WsTraits): rows, columns and tile.
  const int dq_row16 = (cwarp % 4) * 16, dq_col0 = T::kDqSplitN ? wg * T::kDqN : 0;
  float* dq_tiles = sdQ + (T::kDqSplitK ? wg * kM * kD : 0);  // (in buffer 0)

  typename T::TiledMmaSdP mma_sdp;
  typename T::TiledMmadKV mma_dkv;
  typename T::TiledMmadQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(ctid);
  auto thr_dkv = mma_dkv.get_thread_slice(ctid);
  auto thr_dq = mma_dq.get_thread_slice(ctid % size(mma_dq));
  Tensor tSrK = thr_sdp.partition_fragment_A(sK);
  Tensor tSrV = thr_sdp.partition_fragment_A(sV);
  Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);  // (MMA, MMA_N, MMA_K, stage)
  Tensor tSrdO = thr_sdp.partition_fragment_B(sdO);
  Tensor tSrS = partition_fragment_C(mma_sdp, Shape<Int<kN>, Int<kM>>{});
  Tensor tSrdP = partition_fragment_C(mma_sdp, Shape<Int<kN>, Int<kM>>{});
  Tensor tKVrdO = thr_dkv.partition_fragment_B(sdOt);  // (MMA, MMA_N, MMA_K, stage)
  Tensor tKVrQ = thr_dkv.partition_fragment_B(sQt);
  const auto keys_by_queries = make_tensor(make_smem_ptr(sds_ptr), Layout<Shape<Int<kN>, Int<kM>>>{});
  Tensor tKVrP = thr_dkv.partition_fragment_A(keys_by_queries);  // registers
  Tensor tKVrdS = thr_dkv.partition_fragment_A(keys_by_queries);
  Tensor tdVrdV = partition_fragment_C(mma_dkv, Shape<Int<kN>, Int<kD>>{});
  Tensor tdKrdK = partition_fragment_C(mma_dkv, Shape<Int<kN>, Int<kD>>{});
  // dQ's operands: dS (queries x keys, per buffer) and K^T, or this warpgroup's 64 keys of them.
  const auto dq_a = [&] {
    if constexpr (T::kDqSplitK) return flat_divide(sdS, Shape<Int<kM>, _64>{})(_, _, 0, wg, _);
    else return sdS;
  }();
  const auto dq_b = [&] {
    if constexpr (T::kDqSplitK) return flat_divide(sKt, Shape<Int<kD>, _64>{})(_, _, 0, wg);
    else return sKt;
  }();
  Tensor tQrdS = thr_dq.partition_fragment_A(dq_a);  // (MMA, MMA_M, MMA_K, buffer)
  Tensor tQrKt = thr_dq.partition_fragment_B(dq_b);
  Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<Int<kM>, Int<kD>>{});
  float(&s)[kM / 8][4] = as_rows16<kM>(tSrS);
  float(&dp)[kM / 8][4] = as_rows16<kM>(tSrdP);
  float(&dv)[kD / 8][4] = as_rows16<kD>(tdVrdV);
  float(&dk)[kD / 8][4] = as_rows16<kD>(tdKrdK);
  float(&dq)[T::kDqN / 8][4] = as_rows16<T::kDqN>(tdQrdQ);
  // Shared-memory byte address of this thread's dS^T values: (query 8 n + 2 t, key key16 + g + 8 hr,
  // buffer) sits at ds_thread + buffer * kDsBufBytes + hr * kDsKeyAtomBytes + ((n ^ g) << 4) in
  // SmemLayoutdS2 (MN-major 64 x 8 atoms of 1024 bytes, 128-byte swizzle), written out here
  // because CuTe's generic pointers cost several integer instructions per store.
  static_assert(kM == 64, "one swizzle atom along the queries");
  constexpr uint32_t kDsKeyAtomBytes = 1024, kDsBufBytes = kM * kN * sizeof(CElem);
  const uint32_t ds_thread = cuda::smem_addr(sds_ptr) + (key16 / 8) * kDsKeyAtomBytes + g * 128 + 4 * t;

  int step = 0, kv_count = 0;  // steps and K/V tiles so far, over all of this CTA's tiles
  cutlass::PipelineState<kStages> qst;  // this step's stage
  // The staging area of store_dk_dv_staged covers dS's buffers and the dQ tiles. Before the next
  // write there, every warp's copies must have read it.
  const uint32_t staged = cuda::smem_addr(sds_ptr);
  bool staged_unread = false;
  const auto await_staged_read = [&] {
    if (!staged_unread) return;
    tma_store_wait<0>();
    NamedBarrier::sync(T::kNConsumerThreads, T::kBarStagedRead);
    staged_unread = false;
  };
  for (int j = 0;; ++j) {
    const BwdSchedSlot slot = take_slot(j);
    if (slot.t >= args.num_tiles) break;
    const TileSeq& tiles = slot.tiles;
    const GridTile tile = grid_tile(slot.t, num_n_blocks, args.p.h, ordered);
    const int j0 = tile.block * kN, h = tile.h, b = tile.b;
    const BwdParams p = seq_view(args.p, b);
    if (j0 >= p.seqlen_k) continue;  // varlen: past this sequence's keys
    cuda::zero<kD>(dk);
    cuda::zero<kD>(dv);
    Barrier::wait(kv_full, kv_count & 1);
    for (int it = 0; it < tiles.count; ++it, ++step) {
      const int stage = qst.index(), buf = step & 1, i0 = tiles[it] * kM;
      Barrier::wait(full + stage, qst.phase());
      ++qst;
      wgmma_gemm<true, -1>(mma_sdp, tSrK, tSrQ(_, _, _, stage), tSrS);
      wgmma_gemm<true, -1>(mma_sdp, tSrV, tSrdO(_, _, _, stage), tSrdP);

      // The rows' logsumexp, then their D, read while the MMAs run (with score modifiers, whose
      // registers are live until the probabilities, the logsumexp after them).
      float2 stats[kM / 8];
      if constexpr (!kScoreMod) load_stat_pairs<kM>(stats, sLse + stage * kM + 2 * t);
      wgmma_wait<1>(tSrS);
      if (!(cuda::tile_fully_visible(p, i0, i0 + kM, j0, j0 + kN) && i0 + kM <= p.seqlen_q))
        mask_tile_kmajor<kM>(s, p, j0 + key16, i0, lane);
      if constexpr (kScoreMod) {
        modify_scores_kmajor<kM, Elem>(s, p, b, h, j0 + key16, i0, lane);
        load_stat_pairs<kM>(stats, sLse + stage * kM + 2 * t);
      }
      probs_kmajor<kM>(s, stats, kScoreMod ? 1.f : p.scale_softmax_log2);
      load_stat_pairs<kM>(stats, sDsum + stage * kM + 2 * t);
      wgmma_wait<0>(tSrdP);
      dscores_kmajor<kM>(dp, s, stats);
      if constexpr (kScoreMod)
        if (p.dbias_ptr != nullptr) write_dbias_kmajor<Elem, kM>(p, b, h, dp, j0 + key16, i0, lane);
      to_a_operand<Elem, kM>(tKVrP, s);
      wgmma_gemm<false, -1>(mma_dkv, tKVrP, tKVrdO(_, _, _, stage), tdVrdV);
      to_a_operand<Elem, kM>(tKVrdS, dp);
      // dS^T to shared memory (queries contiguous) for dQ = dS K, from its packed A operand (value
      // 2 n + hr: keys g + 8 hr, queries 8 n + 2 t + {0, 1}). Two buffers, so this step's write
      // cannot race the other warpgroup's dQ of the step before.
      const auto ds_packed = recast<uint32_t>(tKVrdS);
      const uint32_t ds_buf = ds_thread + buf * kDsBufBytes;
      if (it == 0) await_staged_read();
#pragma unroll
      for (int n = 0; n < kM / 8; ++n)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr)
          st_shared_u32(ds_buf + hr * kDsKeyAtomBytes + ((n ^ g) << 4), ds_packed(2 * n + hr));
      fence_proxy_async_smem();
      if constexpr (T::kDqSplitK) NamedBarrier::sync(128, T::kBarDsReady + wg);  // only this warpgroup's dS is read
      else NamedBarrier::sync(T::kNConsumerThreads, T::kBarDsReady);
      // dQ before dK, so that storing the dQ tile overlaps the dK MMA.
      wgmma_gemm<true, -1>(mma_dq, tQrdS(_, _, _, buf), tQrKt, tdQrdQ);
      wgmma_gemm<false, -1>(mma_dkv, tKVrdS, tKVrQ(_, _, _, stage), tdKrdK);
      wgmma_wait<1>(tdVrdV, tKVrP, tdQrdQ);

      const int dqb = step & (dq_buffers - 1);
      float* dq_tile = dq_tiles + dqb * T::kDqBufferFloats;
      if (it >= dq_buffers) hw_bar_sync(T::kHwBarDqEmpty + dqb, T::kDqBarThreads);  // this buffer's last tiles read
      // Ordered dQ with the keys split: warpgroup 1 leaves its partial sum in its tile, and
      // warpgroup 0 (whose threads hold the same elements) adds it to its own, leaving one tile.
      const bool pair_sum = T::kDqSplitK && ordered;
      if (pair_sum && wg == 0) {
        hw_bar_sync(T::kHwBarDqPair + dqb, T::kNConsumerThreads);
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const float* row = dq_tile + kM * kD + (dq_row16 + g + 8 * hr) * kD;
#pragma unroll
          for (int nt = 0; nt < T::kDqN / 8; ++nt) {
            const float2 other = *reinterpret_cast<const float2*>(row + cuda::dq_accum_col(true, g, nt * 8 + 2 * t, kD));
            dq[nt][2 * hr] += other.x;
            dq[nt][2 * hr + 1] += other.y;
          }
        }
      }
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        float* row = dq_tile + (dq_row16 + g + 8 * hr) * kD;
#pragma unroll
        for (int nt = 0; nt < T::kDqN / 8; ++nt)
          *reinterpret_cast<float2*>(row + cuda::dq_accum_col(true, g, dq_col0 + nt * 8 + 2 * t, kD)) =
              make_float2(dq[nt][2 * hr], dq[nt][2 * hr + 1]);
      }
      if (pair_sum && wg == 1) hw_bar_arrive(T::kHwBarDqPair + dqb, T::kNConsumerThreads);
      fence_proxy_async_smem();
      hw_bar_arrive(T::kHwBarDqFull + dqb, T::kDqBarThreads);
      // This stage's Q, dO and statistics are no longer read once dK is done. One lane arrives for
      // the warp; the warp barrier orders the other lanes' reads of the statistics before that arrive.
      wgmma_wait<0>(tdKrdK, tKVrdS);
      __syncwarp();
      if (lane == 0) Barrier::arrive(empty + stage);
    }
    // The MMAs are done with K and V: the next tile's load into them overlaps this one's stores.
    __syncwarp();
    if (lane == 0) Barrier::arrive(kv_empty);
    ++kv_count;
    // Once the dQ warps have read the last dQ tiles of every buffer (the barriers also wait for both
    // warpgroups, so no dQ MMA still reads dS), the staging area is free.
    for (int done = step - (tiles.count < dq_buffers ? tiles.count : dq_buffers); done < step; ++done)
      hw_bar_sync(T::kHwBarDqEmpty + (done & (dq_buffers - 1)), T::kDqBarThreads);
    if (p.dk_accum_ptr != nullptr) {
      cuda::write_dk_dv_tile<Elem, kD>(p, b, h, j0 + key16, 0, dk, dv, lane);
    } else {
      await_staged_read();  // (a tile without query blocks right after another)
      store_dk_dv_staged<T>(p, b, h, j0, key16, dk, dv, staged, lane);
      staged_unread = true;
    }
  }
  bulk_wait_all();  // shared memory must outlive the copies
#endif
}

}  // namespace flash::hopper
