// The sm90 backward kernel: the portable backward's algorithm (flash_bwd_dkdv_kernel.cuh) on
// warpgroup MMAs. One CTA per block of keys; for each block of queries that can see them it
// recomputes S^T = K Q^T, P^T = exp(S^T - lse) and dP^T = V dO^T (keys as the MMA rows, so P^T
// and dS^T = P^T (dP^T - D) stay in registers as the A operands of dV += P^T dO and dK += dS^T Q),
// and adds its share of dQ = dS K (dS through shared memory) into the float32 accumulator with
// atomics. dS is unscaled: softmax_scale goes to dK in the epilogue and to dQ in the conversion.
#pragma once

#include "flash_bwd_sm90_common.cuh"
#include "flash_bwd_sm90_traits.cuh"

namespace flash::hopper {

// kBlockSparse: whether a block mask may be set; without, the tile walk folds to counting.
template <typename T, bool kBlockSparse>
__global__ void __launch_bounds__(T::kNThreads, 1) flash_bwd_sm90_kernel(const BwdParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace cute;
  using Elem = typename T::Elem;
  using CElem = typename T::CElem;
  using cuda::cp_async_commit;
  using cuda::cp_async_wait;
  constexpr int kD = T::kHeadDim, kM = T::kBlockM, kN = T::kBlockN;
  extern __shared__ char smem_raw[];
  CElem* sq_ptr = aligned_smem<T::kSmemAlign, CElem>(smem_raw);
  CElem* sdo_ptr = sq_ptr + T::kSmemQ;
  CElem* sk_ptr = sdo_ptr + T::kSmemQ;
  CElem* sv_ptr = sk_ptr + T::kSmemK;
  CElem* sds_ptr = sv_ptr + T::kSmemK;
  float* sLse = reinterpret_cast<float*>(sds_ptr + T::kSmemdS);  // per stage, per query
  float* sDsum = sLse + T::kStages * kM;
  Tensor sQ = make_tensor(make_smem_ptr(sq_ptr), typename T::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(sdo_ptr), typename T::SmemLayoutQ{});
  Tensor sQt = make_tensor(make_smem_ptr(sq_ptr), typename T::SmemLayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(sdo_ptr), typename T::SmemLayoutQt{});
  Tensor sK = make_tensor(make_smem_ptr(sk_ptr), typename T::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(sv_ptr), typename T::SmemLayoutK{});
  Tensor sKt = make_tensor(make_smem_ptr(sk_ptr), typename T::SmemLayoutKt{});
  Tensor sdS = make_tensor(make_smem_ptr(sds_ptr), typename T::SmemLayoutdS{});

  const int j0 = blockIdx.x * kN, h = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int key16 = warp * 16;  // this warp's 16 keys, relative to j0 (warpgroup w: keys 64 w ..)
  const BwdHeadPtrs<Elem> hp = bwd_head_ptrs<Elem, kD, kM>(p, b, h);
  // This thread's share of dQ (see BwdSm90Traits::kDqSplitN).
  const bool dq_warpgroup = T::kDqSplitN || warp < 4;
  const int dq_row16 = (warp % 4) * 16, dq_col0 = T::kDqSplitN ? (warp / 4) * T::kDqN : 0;

  typename T::TiledMmaSdP mma_sdp;
  typename T::TiledMmadKV mma_dkv;
  typename T::TiledMmadQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  auto thr_dkv = mma_dkv.get_thread_slice(tid);
  auto thr_dq = mma_dq.get_thread_slice(tid % size(mma_dq));
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
  Tensor tQrdS = thr_dq.partition_fragment_A(sdS);
  Tensor tQrKt = thr_dq.partition_fragment_B(sKt);
  Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<Int<kM>, Int<kD>>{});
  float(&s)[kM / 8][4] = as_rows16<kM>(tSrS);
  float(&dp)[kM / 8][4] = as_rows16<kM>(tSrdP);
  float(&dv)[kD / 8][4] = as_rows16<kD>(tdVrdV);
  float(&dk)[kD / 8][4] = as_rows16<kD>(tdKrdK);
  float(&dq)[T::kDqN / 8][4] = as_rows16<T::kDqN>(tdQrdQ);

  const TileWalk query_walk(cuda::query_tiles<kM, kN, kBlockSparse>(p, b, h, j0));
  QueryBlockStream<kM, kD, T::kNThreads, Elem, decltype(sQ)> qblocks{sQ, sdO, sLse, sDsum, hp, p, tid, query_walk};
  load_k_v<kN, kD, T::kNThreads>(sK, sV, hp, p, j0, tid);
  qblocks.load_first();
  cp_async_commit();
  cuda::zero<kD>(dk);
  cuda::zero<kD>(dv);

  for (; qblocks.walk.more(); qblocks.walk.advance()) {
    const int i0 = qblocks.walk.tile * kM, stage = qblocks.begin_step();  // all done with dS too
    wgmma_gemm<true, -1>(mma_sdp, tSrK, tSrQ(_, _, _, stage), tSrS);
    wgmma_gemm<true, -1>(mma_sdp, tSrV, tSrdO(_, _, _, stage), tSrdP);

    wgmma_wait<1>(tSrS);
    if (!(cuda::tile_fully_visible(p, i0, i0 + kM, j0, j0 + kN) && i0 + kM <= p.seqlen_q))
      mask_tile_kmajor<kM>(s, p, j0 + key16, i0, lane);
    probs_kmajor<kM>(s, sLse + stage * kM + 2 * t, p.scale_softmax_log2);
    wgmma_wait<0>(tSrdP);
    dscores_kmajor<kM>(dp, s, sDsum + stage * kM + 2 * t);
    to_a_operand<Elem, kM>(tKVrP, s);
    to_a_operand<Elem, kM>(tKVrdS, dp);
    wgmma_gemm<false, -1>(mma_dkv, tKVrP, tKVrdO(_, _, _, stage), tdVrdV);
    wgmma_gemm<false, -1>(mma_dkv, tKVrdS, tKVrQ(_, _, _, stage), tdKrdK);

    // dS^T to shared memory (queries contiguous) for dQ = dS K.
#pragma unroll
    for (int n = 0; n < kM / 8; ++n)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr)
        *reinterpret_cast<uint32_t*>(&sdS(n * 8 + 2 * t, key16 + g + 8 * hr)) =
            cuda::pack2<Elem>(dp[n][2 * hr], dp[n][2 * hr + 1]);
    fence_proxy_async_smem();
    __syncthreads();  // dS is complete
    if (!dq_warpgroup) {
      wgmma_wait<0>(tdVrdV, tdKrdK, tKVrP, tKVrdS);
      continue;
    }
    wgmma_gemm<true, -1>(mma_dq, tQrdS, tQrKt, tdQrdQ);
    wgmma_wait<0>(tdVrdV, tdKrdK, tKVrP, tKVrdS, tdQrdQ);

    add_dq_slice<T::kDqN, kD>(hp.dq_accum + int64_t(i0 + dq_row16 + g) * kD + dq_col0 + 2 * t, dq);
  }
  cp_async_wait<0>();

  cuda::write_dk_dv_tile<Elem, kD>(p, b, h, hp.in.bh, j0 + key16, 0, dk, dv, lane);
#endif
}

}  // namespace flash::hopper
