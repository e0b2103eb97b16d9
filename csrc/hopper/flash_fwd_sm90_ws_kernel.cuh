// The warp-specialized sm90 forward (FlashAttention-3's schedule): a producer warpgroup streams Q
// and K, V tiles through shared memory with TMA, each buffer guarded by full/empty mbarriers; two
// or three consumer warpgroups (64 query rows each) run the MMAs and the softmax. The kernel is
// persistent: each CTA takes (query block, head, batch) tiles until none are left, and the Q
// buffers and the K/V ring carry on from tile to tile, so one tile's loads and start overlap the
// last one's end.
// Two overlaps hide the softmax behind the tensor cores:
// - within a warpgroup, S_j = Q K_j^T is issued together with O += P_{j-1} V_{j-1}, and the
//   softmax of S_j runs while the latter is in flight;
// - between the warpgroups, named barriers make them take turns issuing their MMAs, so one's
//   softmax overlaps the others' MMAs (ping-pong, round robin);
// - across tiles, a tile's last P V goes out with the next tile's S_0, and its output is stored
//   while the other warpgroup's MMAs run; from head dim 128 on it is written into the tile's Q
//   buffer (stmatrix) and sent to global memory by a TMA store, so no warp waits on its writes.
#pragma once

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "../cuda/flash_fwd_kernel.cuh"
#include "flash_fwd_sm90_traits.cuh"
#include "persistent_tiles.cuh"
#include "tma_view.cuh"

namespace flash::hopper {

// The kernel's parameters: the op's, plus the TMA descriptors the launcher built for q, k and v,
// and the tile schedule: num_tiles (query block, head, batch) tiles, the first gridDim.x taken in
// CTA order and the rest claimed from tile_counter (zeroed by the launcher; unused, and may be
// null, when there are no more tiles than CTAs). tma_o: the output's TMA store, used where
// T::kTmaO and o_tma (o's view meets TMA's alignment).
template <typename T>
struct FwdSm90WsParams {
  FwdParams p;
  typename T::TmaQ tma_q;
  typename T::TmaKV tma_k, tma_v;
  typename T::TmaO tma_o;
  bool o_tma;
  int num_tiles;
  int* tile_counter;
};

// kBlockSparse: as in flash_fwd_sm90_kernel.
template <typename T, bool kBlockSparse>
__global__ void __launch_bounds__(T::kNThreads, 1) flash_fwd_sm90_ws_kernel(const __grid_constant__ FwdSm90WsParams<T> args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace cute;
  using Elem = typename T::Elem;
  using CElem = typename T::CElem;
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  constexpr int kD = T::kHeadDim, kM = T::kBlockM, kN = T::kBlockN, kQBufs = T::kQBufs;
  constexpr int kStagesK = T::kStages, kStagesV = T::kStagesV, kNWG = T::kNWarpGroups;
  extern __shared__ char smem_raw[];
  CElem* sq_ptr = aligned_smem<T::kSmemAlign, CElem>(smem_raw);
  CElem* sk_ptr = sq_ptr + kQBufs * T::kSmemQ;
  CElem* sv_ptr = sk_ptr + T::kSmemK;
  uint64_t* q_full = reinterpret_cast<uint64_t*>(sv_ptr + T::kSmemV);
  uint64_t* q_empty = q_full + kQBufs;
  uint64_t* k_full = q_empty + kQBufs;
  uint64_t* k_empty = k_full + kStagesK;
  uint64_t* v_full = k_empty + kStagesK;
  uint64_t* v_empty = v_full + kStagesV;
  uint64_t* sched_full = v_empty + kStagesV;
  uint64_t* sched_empty = sched_full + 2;
  uint64_t* tail_full = sched_empty + 2;
  uint64_t* tail_empty = tail_full + 2;
  int* sched_tile = reinterpret_cast<int*>(tail_empty + 2);
  int2* tail_job = reinterpret_cast<int2*>(sched_tile + 2);  // per slot: V stage, valid rows (-1: no more)
  Tensor sQ = make_tensor(make_smem_ptr(sq_ptr), typename T::SmemLayoutQs{});
  Tensor sK = make_tensor(make_smem_ptr(sk_ptr), typename T::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(sv_ptr), typename T::SmemLayoutV{});
  Tensor sVt = make_tensor(make_smem_ptr(sv_ptr), typename T::SmemLayoutVt{});

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  constexpr int kConsumerWarps = T::kNConsumerThreads / 32;
  const int num_m_blocks = (args.p.seqlen_q + kM - 1) / kM;
  const int splits = args.p.num_splits;  // split-KV: tile t is split t % splits of tile t / splits
  if (tid == 0) {
    for (int i = 0; i < kQBufs; ++i) {
      Barrier::init(q_full + i, 1);
      Barrier::init(q_empty + i, T::kTmaO ? kNWG : kConsumerWarps);  // kTmaO: once per warpgroup's store
    }
    for (int s = 0; s < kStagesK; ++s) {
      Barrier::init(k_full + s, 1);
      Barrier::init(k_empty + s, kConsumerWarps);
    }
    for (int s = 0; s < kStagesV; ++s) {
      Barrier::init(v_full + s, 1);
      Barrier::init(v_empty + s, kConsumerWarps);
    }
    for (int i = 0; i < 2; ++i) {
      Barrier::init(sched_full + i, 1);
      Barrier::init(sched_empty + i, kConsumerWarps);
      Barrier::init(tail_full + i, 1);
      Barrier::init(tail_empty + i, 1);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  // Both roles walk the same tiles and count the same Q loads (q_count) and K and V loads (the
  // pipeline states kst, vst: stage and phase of the next one), so every barrier's phase follows
  // from the counts; the j-th tile goes through schedule slot j % 2.
  // A fresh barrier passes a wait on parity 1 at once, so the first waits on "empty" pass.
  // A KV cache's slots past a sequence's keys may hold anything, NaN included, and a masked key's
  // zero probability times a NaN value is NaN: so where a sequence's last key tile is partial, its
  // V lands on a tail_full barrier instead, warp 1 zeroes the rows past the keys and then
  // completes v_full (K needs nothing: masked scores are replaced by -inf).
  if (warp < 4) {  // producer warpgroup: warp 0 schedules (lane 0 issues every copy); warp 1 zeroes tails
    cutlass::arch::warpgroup_reg_dealloc<T::kProducerRegs>();
    if (warp == 1) {
      for (int c = 0;; ++c) {
        Barrier::wait(tail_full + (c & 1), (c >> 1) & 1);
        const int2 job = read_slot_lane0(tail_job[c & 1]);
        const int stage = job.x, rows = job.y;
        if (rows < 0) break;
        for (int i = lane; i < (kN - rows) * (kD / 8); i += 32)  // 16-byte chunks (swizzling keeps them whole)
          *reinterpret_cast<uint4*>(&sV(rows + i / (kD / 8), i % (kD / 8) * 8, stage)) = make_uint4(0, 0, 0, 0);
        cutlass::arch::fence_view_async_shared();  // the zeros are visible to the MMAs' reads
        __syncwarp();
        if (lane == 0) {
          Barrier::arrive(v_full + stage);
          Barrier::arrive(tail_empty + (c & 1));
        }
      }
      return;
    }
    if (warp != 0) return;
    int t = blockIdx.x, q_count = 0, tail_count = 0;
    const auto send_tail = [&](int stage, int rows) {  // lane 0: the next tail slot's job
      const int slot = tail_count & 1;
      Barrier::wait(tail_empty + slot, ((tail_count >> 1) & 1) ^ 1);
      tail_job[slot] = make_int2(stage, rows);
      ++tail_count;
      return tail_full + slot;
    };
    cutlass::PipelineState<kStagesK> kst;
    cutlass::PipelineState<kStagesV> vst;
    for (int j = 0;; ++j) {
      if (lane == 0) {
        Barrier::wait(sched_empty + (j & 1), ((j >> 1) & 1) ^ 1);
        sched_tile[j & 1] = t;
        Barrier::arrive(sched_full + (j & 1));  // (release: the index is visible to its waiters)
      }
      if (t >= args.num_tiles) {
        if (lane == 0) Barrier::arrive(send_tail(0, -1));  // warp 1 stops
        break;
      }
      const GridTile tile = grid_tile<true>(t / splits, num_m_blocks, args.p.h);
      const int m0 = tile.block * kM, h = tile.h, b = tile.b;
      const FwdParams p = seq_view(args.p, b);
      // (With a mask, the warp's lanes count the tile list together.)
      const TileSeq tiles =
          m0 < p.seqlen_q ? cuda::split_share(cuda::key_tiles<kN, kBlockSparse>(p, b, h, m0, kM), splits, t % splits)
                          : TileSeq{};
      if (m0 < p.seqlen_q && tiles.count > 0) {
        if (lane == 0) {
          const int hk = h / p.h_h_k_ratio;
          Tensor gQ = local_tile(tma_rows(args.tma_q, q_view(p), p.q_row0, h, b), Shape<Int<kM>, Int<kD>>{},
                                 make_coord(tile.block, 0));
          Tensor gK = local_tile(tma_rows(args.tma_k, k_view(p), p.k_row0, hk, b), Shape<Int<kN>, Int<kD>>{},
                                 make_coord(_, 0));  // (kN, kD, tile)
          Tensor gV = local_tile(tma_rows(args.tma_v, v_view(p), p.k_row0, hk, b), Shape<Int<kN>, Int<kD>>{},
                                 make_coord(_, 0));
          auto [tQg, tQs] =
              tma_partition(args.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
          auto [tKg, tKs] =
              tma_partition(args.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
          auto [tVg, tVs] =
              tma_partition(args.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
          const int qbuf = q_count % kQBufs;
          Barrier::wait(q_empty + qbuf, ((q_count / kQBufs) & 1) ^ 1);  // its last tile's S MMAs are done
          Barrier::arrive_and_expect_tx(q_full + qbuf, T::kQBytes);
          copy(args.tma_q.with(q_full[qbuf]), tQg, tQs(_, qbuf));
          for (int it = 0; it < tiles.count; ++it) {
            const int nb = tiles[it], sk = kst.index(), sv = vst.index();
            Barrier::wait(k_empty + sk, kst.phase() ^ 1);
            Barrier::arrive_and_expect_tx(k_full + sk, T::kKVBytes);
            copy(args.tma_k.with(k_full[sk]), tKg(_, nb), tKs(_, sk));
            ++kst;
            Barrier::wait(v_empty + sv, vst.phase() ^ 1);
            const int rows = p.seqlen_k - nb * kN;  // the tile's keys
            uint64_t* full = p.seqused_k != nullptr && rows < kN ? send_tail(sv, rows) : v_full + sv;
            Barrier::arrive_and_expect_tx(full, T::kKVBytes);
            copy(args.tma_v.with(*full), tVg(_, nb), tVs(_, sv));
            ++vst;
          }
        }
        ++q_count;
      }
      t = claim_next_tile(args.num_tiles, args.tile_counter);  // once this tile's loads are queued
    }
    return;
  }

  // Consumer warpgroups 0 .. kNWG - 1 (threads 128 and up).
  cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegs>();
  const int ctid = tid - 128, cwarp = ctid / 32, wg = ctid / 128;
  typename T::TiledMmaS mma_s;
  typename T::TiledMmaO mma_o;
  auto thr_s = mma_s.get_thread_slice(ctid);
  auto thr_o = mma_o.get_thread_slice(ctid);
  Tensor tSrQ = thr_s.partition_fragment_A(sQ);  // (MMA, M, K, Q buffer)
  Tensor tSrK = thr_s.partition_fragment_B(sK);
  Tensor tOrVt = thr_o.partition_fragment_B(sVt);
  Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<kM>, Int<kN>>{});
  Tensor tOrO = partition_fragment_C(mma_o, Shape<Int<kM>, Int<kD>>{});
  Tensor tOrP = thr_o.partition_fragment_A(make_tensor(make_smem_ptr(sq_ptr), Layout<Shape<Int<kM>, Int<kN>>>{}));
  float(&s)[kN / 8][4] = as_rows16<kN>(tSrS);
  float(&acc)[kD / 8][4] = as_rows16<kD>(tOrO);

  // Ping-pong: a warpgroup waits for its turn before issuing MMAs and hands the turn to the next
  // one after (named barrier 1 + w: warpgroup w's turn, 128 arriving and 128 waiting threads).
  // Every warpgroup takes one turn per key tile of the same tiles, so the turns go round from tile
  // to tile, and one warpgroup's output store and next tile's start overlap the others' MMAs.
  // Barriers 1 + kNWG + w: warpgroup w's own.
  using cutlass::arch::NamedBarrier;
  const auto my_turn = [&] { NamedBarrier::sync(2 * 128, 1 + wg); };
  const auto pass_turn = [&] { NamedBarrier::arrive(2 * 128, 1 + (wg + 1) % kNWG); };
  const auto release = [&](uint64_t* bar) {
    if (lane == 0) Barrier::arrive(bar);
  };
  if (wg == kNWG - 1) pass_turn();  // warpgroup 0 goes first

  // A tile's last P V is issued in the same turn as the next tile's S_0 (as every step pairs S_j
  // with P_{j-1} V_{j-1}), and its output is written once that P V is in, while the other
  // warpgroup has the tensor cores: the boundary takes no turn of its own (no measured gain on
  // the H200, NOTES 2026-12-03). Until then the tile is "pending": its P in tOrP, its rows'
  // statistics in m / l, and in pend_m / pend_l once the next tile has started.
  struct Pending {
    int stage = -1, b, h, block, split, i16, qbuf;  // V's stage; -1: none
    uint32_t phase;
  } pend;
  float m[2], l[2], alpha[2], pend_m[2], pend_l[2];
  cute::clear(tOrP);  // the probabilities of the first (dummy) pending P V
  // kTmaO: a tile's output goes out from its Q buffer (this warpgroup's 64 rows) with a TMA store
  // by the warpgroup's first thread, which frees the buffer once the store has read it, at the
  // warpgroup's next MMA turn or tile start. o_buf: the buffer of a store not yet waited for.
  int o_buf = -1;
  const auto release_o = [&] {
    if constexpr (T::kTmaO) {
      if (o_buf < 0) return;
      if (ctid % 128 == 0) {
        tma_store_wait<0>();
        Barrier::arrive(q_empty + o_buf);
      }
      o_buf = -1;
    }
  };
  // The output rows from registers (split-KV: split's float32 partials); ms, ls: their statistics.
  const auto store_rows = [&](const FwdParams& pp, int b, int h, int split, int row0, const float(&ms)[2],
                              const float(&ls)[2]) {
    if (splits > 1) cuda::write_split_partial<kD>(pp, b, h, split, row0, acc, ms, ls, lane);
    else cuda::write_o_lse<Elem, kD>(pp, b, h, row0, acc, ms, ls, lane);
  };
  // After the pending P V is waited for; mp, lp: the pending rows' statistics.
  const auto finish_pending = [&](const float(&mp)[2], const float(&lp)[2]) {
    release(v_empty + pend.stage);
    const FwdParams pp = seq_view(args.p, pend.b);
    if constexpr (T::kTmaO) {
      release_o();
      // (Split-KV partials are float32, and a varlen tile that runs past its sequence's rows is
      // stored from registers: TMA clips only at the packed tensor's end.)
      const bool tma =
          args.o_tma && splits == 1 && (pp.cu_seqlens_q == nullptr || (pend.block + 1) * kM <= pp.seqlen_q);
      if (tma) {
        float scale[2];
        cuda::write_lse(pp, pend.b, pend.h, pend.i16 + lane / 4, mp, lp, lane, scale);
        Tensor rO = make_tensor_like<CElem>(tOrO);
        auto rO32 = recast<uint32_t>(rO);
#pragma unroll
        for (int dt = 0; dt < kD / 8; ++dt) {
          rO32(2 * dt) = cuda::pack2<Elem>(acc[dt][0] * scale[0], acc[dt][1] * scale[0]);
          rO32(2 * dt + 1) = cuda::pack2<Elem>(acc[dt][2] * scale[1], acc[dt][3] * scale[1]);
        }
        const auto stsm = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, CElem>{}, mma_o);
        const auto thr_stsm = stsm.get_thread_slice(ctid);
        Tensor tOsO = thr_stsm.partition_D(sQ(_, _, pend.qbuf));
        copy(stsm, thr_stsm.retile_S(rO), tOsO);
        tma_store_fence();  // the rows are visible to the TMA unit
      } else {
        store_rows(pp, pend.b, pend.h, pend.split, pend.i16 + lane / 4, mp, lp);
      }
      NamedBarrier::sync(128, 1 + kNWG + wg);  // the warpgroup's rows are written and its MMAs done
      if (ctid % 128 == 0) {
        if (tma) {
          Tensor gO = local_tile(tma_rows(args.tma_o, o_view(args.p), pp.q_row0, pend.h, pend.b),
                                 Shape<_64, Int<kD>>{}, make_coord(kNWG * pend.block + wg, 0));
          Tensor sO = local_tile(sQ(_, _, pend.qbuf), Shape<_64, Int<kD>>{}, make_coord(wg, 0));
          auto [tOg, tOs] = tma_partition(args.tma_o, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sO), group_modes<0, 2>(gO));
          copy(args.tma_o, tOs, tOg);
          tma_store_arrive();
        } else {
          Barrier::arrive(q_empty + pend.qbuf);
        }
      }
      if (tma) o_buf = pend.qbuf;
    } else {
      store_rows(pp, pend.b, pend.h, pend.split, pend.i16 + lane / 4, mp, lp);
    }
    pend.stage = -1;
  };
  const auto flush_pending = [&] {
    if (pend.stage < 0) return;
    Barrier::wait(v_full + pend.stage, pend.phase);
    wgmma_gemm<false, 0>(mma_o, tOrP, tOrVt(_, _, _, pend.stage), tOrO);
    finish_pending(m, l);  // no tile has started since: m and l are still the pending rows'
  };

  int q_count = 0;
  cutlass::PipelineState<kStagesK> kst;  // the next K to be read
  cutlass::PipelineState<kStagesV> vst;  // the next V to be read
  for (int j = 0;; ++j) {
    release_o();
    Barrier::wait(sched_full + (j & 1), (j >> 1) & 1);
    const int t = read_slot_lane0(sched_tile[j & 1]);
    release(sched_empty + (j & 1));  // (lane 0, which read the slot)
    if (t >= args.num_tiles) break;
    const GridTile tile = grid_tile<true>(t / splits, num_m_blocks, args.p.h);
    const int m0 = tile.block * kM, h = tile.h, b = tile.b, split = t % splits;
    const FwdParams p = seq_view(args.p, b);
    if (m0 >= p.seqlen_q) continue;  // varlen: past this sequence's rows
    const TileSeq tiles = cuda::split_share(cuda::key_tiles<kN, kBlockSparse>(p, b, h, m0, kM), splits, split);
    const int i16 = m0 + cwarp * 16;  // this warp's 16 query rows
    const int n = tiles.count;
    if (n == 0) {  // no keys: zeros and an empty logsumexp
      flush_pending();
      cuda::zero<kD>(acc);
      m[0] = m[1] = cuda::kNegInf;
      l[0] = l[1] = 0.f;
      store_rows(p, b, h, split, i16 + lane / 4, m, l);
      continue;
    }
    // The tile indices come from a walk that reads the list ahead, off the softmax's critical path.
    TileWalk walk(tiles);
    const auto scores_to_probs = [&] {
      const int j0 = walk.tile * kN;
      const float scale_log2 = cuda::prepare_scores_qmajor<kN, Elem>(s, p, b, h, i16, j0, lane);
      if (!cuda::tile_fully_visible(p, m0, m0 + kM, j0, j0 + kN)) cuda::mask_tile_qmajor<kN>(s, p, i16, j0, lane);
      cuda::online_softmax_probs<kN>(s, m, l, scale_log2, alpha);
    };

    const int qbuf = q_count % kQBufs;
    const int k0 = kst.index();
    Barrier::wait(q_full + qbuf, (q_count / kQBufs) & 1);
    Barrier::wait(k_full + k0, kst.phase());
    ++kst;
    my_turn();
    wgmma_gemm<true, -1>(mma_s, tSrQ(_, _, _, qbuf), tSrK(_, _, _, k0), tSrS);
    // The pending P V goes out with S_0. With none pending (a warpgroup's first tile) a dummy one
    // of zero probabilities over V stage 0 goes out instead, its product discarded: ptxas
    // serializes every wgmma of the kernel when the groups in flight differ between branches.
    const bool fused = pend.stage >= 0;
    if (fused) Barrier::wait(v_full + pend.stage, pend.phase);
    wgmma_gemm<false, -1>(mma_o, tOrP, tOrVt(_, _, _, fused ? pend.stage : 0), tOrO);
    pass_turn();
    wgmma_wait<1>(tSrS);  // S_0 is in; the pending P V may still run
    release(k_empty + k0);
    if (!T::kTmaO && n == 1) release(q_empty + qbuf);  // this tile's last read of Q
    pend_m[0] = m[0], pend_m[1] = m[1], pend_l[0] = l[0], pend_l[1] = l[1];
    m[0] = m[1] = cuda::kNegInf;
    l[0] = l[1] = 0.f;
    scores_to_probs();  // fresh statistics: alpha is not needed
    wgmma_wait<0>(tOrO, tOrP);
    if (fused) finish_pending(pend_m, pend_l);
    cuda::zero<kD>(acc);
    to_a_operand<Elem, kN>(tOrP, s);
    for (int it = 1; it < n; ++it) {
      walk.advance();
      const int stage = kst.index(), prev = vst.index();  // K_it and V_{it-1}
      const uint32_t k_phase = kst.phase(), v_phase = vst.phase();
      ++kst;
      ++vst;
      Barrier::wait(k_full + stage, k_phase);
      my_turn();
      wgmma_gemm<true, -1>(mma_s, tSrQ(_, _, _, qbuf), tSrK(_, _, _, stage), tSrS);
      Barrier::wait(v_full + prev, v_phase);
      wgmma_gemm<false, -1>(mma_o, tOrP, tOrVt(_, _, _, prev), tOrO);
      pass_turn();
      release_o();
      wgmma_wait<1>(tSrS);  // S_j is in; P_{j-1} V_{j-1} may still run
      release(k_empty + stage);
      if (!T::kTmaO && it + 1 == n) release(q_empty + qbuf);
      scores_to_probs();
      wgmma_wait<0>(tOrO, tOrP);
      release(v_empty + prev);
      cuda::scale_rows<kD>(acc, alpha);
      to_a_operand<Elem, kN>(tOrP, s);
    }
    pend.stage = vst.index();  // V_{n-1}, read by the pending P V
    pend.phase = vst.phase();
    ++vst;
    pend.b = b, pend.h = h, pend.block = tile.block, pend.split = split, pend.i16 = i16, pend.qbuf = qbuf;
    ++q_count;
  }
  flush_pending();
  release_o();
  // The last warpgroup handed the turn over once more than warpgroup 0 took it (the first
  // hand-over): take that one too, so no arrival is left on a named barrier when the CTA exits.
  if (wg == 0) my_turn();
#endif
}

}  // namespace flash::hopper
