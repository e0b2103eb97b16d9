// The sm90 backward kernel for head dims above 128 (BwdSm90SplitDTraits): one CTA per 64 keys,
// whose warpgroups share the score work (S^T on one, dP^T on another) and then split the head dim
// for dV, dK and dQ. Same dQ accumulator, pre-pass and conversion as the other kernels; dS is
// unscaled (softmax_scale goes to dK in the epilogue and to dQ in the conversion).
#pragma once

#include "flash_bwd_sm90_common.cuh"
#include "flash_bwd_sm90_traits.cuh"

namespace flash::hopper {

// kBlockSparse: whether a block mask may be set; without, the tile walk folds to counting.
template <typename T, bool kBlockSparse>
__global__ void __launch_bounds__(T::kNThreads, 1) flash_bwd_sm90_split_d_kernel(const BwdParams params) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace cute;
  using Elem = typename T::Elem;
  using CElem = typename T::CElem;
  using cuda::cp_async_commit;
  using cuda::cp_async_wait;
  constexpr int kD = T::kHeadDim, kM = T::kBlockM, kN = T::kBlockN, kDS = T::kDSlice, kNWG = T::kNWarpGroups;
  extern __shared__ char smem_raw[];
  CElem* sq_ptr = aligned_smem<T::kSmemAlign, CElem>(smem_raw);
  CElem* sdo_ptr = sq_ptr + T::kSmemQ;
  CElem* sk_ptr = sdo_ptr + T::kSmemQ;
  CElem* sv_ptr = sk_ptr + T::kSmemK;
  CElem* spt_ptr = sv_ptr + T::kSmemK;
  CElem* sdst_ptr = spt_ptr + T::kSmemPt;
  float* sXchg = reinterpret_cast<float*>(sdst_ptr + T::kSmemPt);  // score halves, see below
  float* sLse = sXchg + kN * kM;                                    // per stage, per query
  float* sDsum = sLse + T::kStages * kM;
  Tensor sQ = make_tensor(make_smem_ptr(sq_ptr), typename T::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(sdo_ptr), typename T::SmemLayoutQ{});
  Tensor sQt = make_tensor(make_smem_ptr(sq_ptr), typename T::SmemLayoutQtSlices{});
  Tensor sdOt = make_tensor(make_smem_ptr(sdo_ptr), typename T::SmemLayoutQtSlices{});
  Tensor sK = make_tensor(make_smem_ptr(sk_ptr), typename T::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(sv_ptr), typename T::SmemLayoutK{});
  Tensor sKt = make_tensor(make_smem_ptr(sk_ptr), typename T::SmemLayoutKtSlices{});
  Tensor sPt = make_tensor(make_smem_ptr(spt_ptr), typename T::SmemLayoutPt{});
  Tensor sdSt = make_tensor(make_smem_ptr(sdst_ptr), typename T::SmemLayoutPt{});
  Tensor sdS = make_tensor(make_smem_ptr(sdst_ptr), typename T::SmemLayoutdS{});

  const int j0 = blockIdx.x * kN, h = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, wg = tid / 128, wg_tid = tid % 128, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int row16 = (wg_tid / 32) * 16;  // this warp's 16 rows of every 64-row accumulator
  const BwdParams p = seq_view(params, b);
  if (j0 >= p.seqlen_k) return;  // varlen: past this sequence's keys
  const BwdHeadPtrs<Elem> hp = bwd_head_ptrs<Elem, kD, kM>(p, b, h);

  typename T::TiledMmaSdP mma_sdp;
  typename T::TiledMmadKV mma_dkv;
  typename T::TiledMmadQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(wg_tid);
  auto thr_dkv = mma_dkv.get_thread_slice(wg_tid);
  auto thr_dq = mma_dq.get_thread_slice(wg_tid);
  // Scores: S^T = K Q^T on warpgroup 0, dP^T = V dO^T on warpgroup 1 (the rest skip this GEMM).
  Tensor tSrA = thr_sdp.partition_fragment_A(wg == 0 ? sK : sV);
  Tensor tSrB = thr_sdp.partition_fragment_B(wg == 0 ? sQ : sdO);  // (MMA, MMA_N, MMA_K, stage)
  Tensor tSrX = partition_fragment_C(mma_sdp, Shape<Int<kN>, Int<kM>>{});
  Tensor tKVrPt = thr_dkv.partition_fragment_A(sPt);
  Tensor tKVrdSt = thr_dkv.partition_fragment_A(sdSt);
  Tensor tKVrdO = thr_dkv.partition_fragment_B(sdOt);  // (MMA, MMA_N, MMA_K, slice + kNWG stage)
  Tensor tKVrQ = thr_dkv.partition_fragment_B(sQt);
  Tensor tdVrdV = partition_fragment_C(mma_dkv, Shape<Int<kN>, Int<kDS>>{});
  Tensor tdKrdK = partition_fragment_C(mma_dkv, Shape<Int<kN>, Int<kDS>>{});
  Tensor tQrdS = thr_dq.partition_fragment_A(sdS);
  Tensor tQrKt = thr_dq.partition_fragment_B(sKt);  // (MMA, MMA_N, MMA_K, slice)
  Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<Int<kM>, Int<kDS>>{});
  float(&x)[kM / 8][4] = as_rows16<kM>(tSrX);
  float(&dv)[kDS / 8][4] = as_rows16<kDS>(tdVrdV);
  float(&dk)[kDS / 8][4] = as_rows16<kDS>(tdKrdK);
  float(&dq)[kDS / 8][4] = as_rows16<kDS>(tdQrdQ);

  const TileWalk query_walk(cuda::query_tiles<kM, kN, kBlockSparse>(p, b, h, j0));
  QueryBlockStream<kM, kD, T::kNThreads, Elem, decltype(sQ)> qblocks{sQ, sdO, sLse, sDsum, hp, p, tid, query_walk};
  load_k_v<kN, kD, T::kNThreads>(sK, sV, hp, p, j0, tid);
  qblocks.load_first();
  cp_async_commit();
  cuda::zero<kDS>(dk);
  cuda::zero<kDS>(dv);

  for (; qblocks.walk.more(); qblocks.walk.advance()) {
    const int i0 = qblocks.walk.tile * kM, stage = qblocks.begin_step();  // all done with P^T, dS^T too
    if (wg < 2) wgmma_gemm<true, 0>(mma_sdp, tSrA, tSrB(_, _, _, stage), tSrX);

    // Warpgroup 0 finishes query columns [0, kM / 2) of P^T and dS^T, warpgroup 1 the rest: each
    // hands the other half of its scores (S^T or dP^T) over through shared memory.
    constexpr int kH = kM / 16;  // 8-query column blocks per half
    if (wg < 2) {
#pragma unroll
      for (int i = 0; i < kH; ++i)
#pragma unroll
        for (int r = 0; r < 4; ++r) sXchg[wg * kH * 512 + (i * 4 + r) * 128 + wg_tid] = wg == 0 ? x[kH + i][r] : x[i][r];
    }
    __syncthreads();  // the halves are exchanged
    if (wg < 2) {
      float s[kH][4], dp[kH][4];
#pragma unroll
      for (int i = 0; i < kH; ++i)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const float other = sXchg[(1 - wg) * kH * 512 + (i * 4 + r) * 128 + wg_tid];
          s[i][r] = wg == 0 ? x[i][r] : other;
          dp[i][r] = wg == 0 ? other : x[kH + i][r];
        }
      const int q0 = wg * (kM / 2);
      if (!(cuda::tile_fully_visible(p, i0, i0 + kM, j0, j0 + kN) && i0 + kM <= p.seqlen_q))
        mask_tile_kmajor<kM / 2>(s, p, j0 + row16, i0 + q0, lane);
      float2 stats[kM / 16];
      load_stat_pairs<kM / 2>(stats, sLse + stage * kM + q0 + 2 * t);
      probs_kmajor<kM / 2>(s, stats, p.scale_softmax_log2);
      load_stat_pairs<kM / 2>(stats, sDsum + stage * kM + q0 + 2 * t);
      dscores_kmajor<kM / 2>(dp, s, stats);
#pragma unroll
      for (int n = 0; n < kH; ++n)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int key = row16 + g + 8 * hr, q = q0 + n * 8 + 2 * t;
          *reinterpret_cast<uint32_t*>(&sPt(key, q)) = cuda::pack2<Elem>(s[n][2 * hr], s[n][2 * hr + 1]);
          *reinterpret_cast<uint32_t*>(&sdSt(key, q)) = cuda::pack2<Elem>(dp[n][2 * hr], dp[n][2 * hr + 1]);
        }
      fence_proxy_async_smem();
    }
    __syncthreads();  // P^T and dS^T are complete

    // dQ first, so that its atomics overlap the dV and dK GEMMs (measured: benchmarks/NOTES.md).
    const int slice = wg + kNWG * stage;
    wgmma_gemm<true, -1>(mma_dq, tQrdS, tQrKt(_, _, _, wg), tdQrdQ);
    wgmma_gemm<false, -1>(mma_dkv, tKVrPt, tKVrdO(_, _, _, slice), tdVrdV);
    wgmma_gemm<false, -1>(mma_dkv, tKVrdSt, tKVrQ(_, _, _, slice), tdKrdK);
    wgmma_wait<2>(tdQrdQ);
    add_dq_slice<kDS, kD>(hp.dq_accum + int64_t(i0 + row16 + g) * kD + wg * kDS + 2 * t, dq);
    wgmma_wait<0>(tdVrdV, tdKrdK);
  }
  cp_async_wait<0>();

  cuda::write_dk_dv_tile<Elem, kDS>(p, b, h, j0 + row16, wg * kDS, dk, dv, lane);
#endif
}

}  // namespace flash::hopper
