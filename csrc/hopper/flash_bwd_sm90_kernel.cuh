// The sm90 backward kernel: the portable backward's algorithm (flash_bwd_dkdv_kernel.cuh) on
// warpgroup MMAs. One CTA per block of keys; for each block of queries that can see them it
// recomputes S^T = K Q^T, P^T = exp(S^T - lse) and dP^T = V dO^T (keys as the MMA rows, so P^T
// and dS^T = P^T (dP^T - D) stay in registers as the A operands of dV += P^T dO and dK += dS^T Q),
// and adds its share of dQ = dS K (dS through shared memory) into the float32 accumulator with
// atomics. dS is unscaled: softmax_scale goes to dK in the epilogue and to dQ in the conversion.
#pragma once

#include "../cuda/flash_bwd_dkdv_kernel.cuh"
#include "flash_bwd_sm90_traits.cuh"

namespace flash::hopper {

// Mask a key-major (16 keys x kM queries) score tile: keys j16 + g, j16 + g + 8; queries i0 + 8 n +
// 2 t + {0, 1}. Keys past seqlen_k and queries outside each key's visible rows become -inf.
template <int kM>
__device__ __forceinline__ void mask_tile_kmajor(float (&s)[kM / 8][4], const FwdParams& p, int j16, int i0,
                                                 int lane) {
  int begin[2], end[2];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int j = j16 + lane / 4 + 8 * hr;
    begin[hr] = end[hr] = 0;
    if (j < p.seqlen_k) cuda::query_row_range(p, j, j + 1, begin[hr], end[hr]);
  }
#pragma unroll
  for (int n = 0; n < kM / 8; ++n)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int i = i0 + n * 8 + 2 * (lane % 4) + (r & 1);
      if (i < begin[r >> 1] || i >= end[r >> 1]) s[n][r] = cuda::kNegInf;
    }
}

template <typename T>
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
  const cuda::HeadPtrs<Elem> hp = cuda::head_ptrs<Elem>(p, b, h);
  const Elem* dout = static_cast<const Elem*>(p.do_ptr) + b * p.do_batch_stride + h * p.do_head_stride;
  const float* lse = p.softmax_lse_ptr + int64_t(hp.bh) * p.seqlen_q;
  const float* dsum = p.dsoftmax_sum_ptr + int64_t(hp.bh) * p.seqlen_q;
  constexpr int kPad = cuda::kDqAccumRowPad;
  static_assert(kPad % kM == 0, "dq_accum_shape() pads rows to the query block");
  float* dq_accum = p.dq_accum_ptr + int64_t(hp.bh) * ((p.seqlen_q + kPad - 1) / kPad * kPad) * kD;
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

  int i_begin, i_end;
  cuda::query_row_range(p, j0, min(j0 + kN, p.seqlen_k), i_begin, i_end);
  const int mb_begin = i_begin / kM, mb_end = i_begin < i_end ? (i_end + kM - 1) / kM : mb_begin;
  static_assert(T::kNThreads >= 2 * kM, "one thread per row statistic");
  const auto load_q = [&](int mb, int stage) {  // Q and dO with their rows' logsumexp and D
    const int i0 = mb * kM;
    load_tile_swizzled<kM, kD, T::kNThreads>(sQ(_, _, stage), hp.q + int64_t(i0) * p.q_row_stride, p.q_row_stride,
                                             p.seqlen_q - i0, p.d, tid);
    load_tile_swizzled<kM, kD, T::kNThreads>(sdO(_, _, stage), dout + int64_t(i0) * p.do_row_stride,
                                             p.do_row_stride, p.seqlen_q - i0, p.d, tid);
    const int r = tid % kM, i = i0 + r;
    if (tid < 2 * kM)
      cuda::cp_async_4((tid < kM ? sLse : sDsum) + stage * kM + r, (tid < kM ? lse : dsum) + (i < p.seqlen_q ? i : 0),
                       i < p.seqlen_q);
  };
  load_tile_swizzled<kN, kD, T::kNThreads>(sK, hp.k + int64_t(j0) * p.k_row_stride, p.k_row_stride, p.seqlen_k - j0,
                                           p.d, tid);
  load_tile_swizzled<kN, kD, T::kNThreads>(sV, hp.v + int64_t(j0) * p.v_row_stride, p.v_row_stride, p.seqlen_k - j0,
                                           p.d, tid);
  if (mb_begin < mb_end) load_q(mb_begin, 0);
  cp_async_commit();
  cuda::zero<kD>(dk);
  cuda::zero<kD>(dv);

  for (int mb = mb_begin; mb < mb_end; ++mb) {
    const int i0 = mb * kM, stage = (mb - mb_begin) & 1;
    cp_async_wait<0>();
    fence_proxy_async_smem();
    __syncthreads();  // this step's tiles are in; every warpgroup is done with the other stage and dS
    if (mb + 1 < mb_end) {
      load_q(mb + 1, stage ^ 1);
      cp_async_commit();
    }
    wgmma_gemm<true, -1>(mma_sdp, tSrK, tSrQ(_, _, _, stage), tSrS);
    wgmma_gemm<true, -1>(mma_sdp, tSrV, tSrdO(_, _, _, stage), tSrdP);

    // P^T = exp2(S^T scale_log2 - lse2) per query column. A query row that sees no key has
    // lse = -inf and every score masked: use 0 so exp2 gives 0, not NaN.
    wgmma_wait<1>(tSrS);
    if (!(cuda::tile_fully_visible(p, i0, i0 + kM, j0, j0 + kN) && i0 + kM <= p.seqlen_q))
      mask_tile_kmajor<kM>(s, p, j0 + key16, i0, lane);
    const float* lse_st = sLse + stage * kM + 2 * t;
    const float* dsum_st = sDsum + stage * kM + 2 * t;
#pragma unroll
    for (int n = 0; n < kM / 8; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float l = lse_st[n * 8 + e];
        const float lse2 = l == cuda::kNegInf ? 0.f : l * cuda::kLog2e;
#pragma unroll
        for (int hr = 0; hr < 2; ++hr)
          s[n][2 * hr + e] = cuda::fast_exp2(fmaf(s[n][2 * hr + e], p.scale_softmax_log2, -lse2));
      }
    wgmma_wait<0>(tSrdP);
#pragma unroll
    for (int n = 0; n < kM / 8; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float dsm = dsum_st[n * 8 + e];
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) dp[n][2 * hr + e] = s[n][2 * hr + e] * (dp[n][2 * hr + e] - dsm);
      }
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

    // Padded rows and columns receive exact zeros (their dS rows and K rows are zero), so the
    // adds need no bounds checks.
    float* dst = dq_accum + int64_t(i0 + dq_row16 + g) * kD + dq_col0 + 2 * t;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr)
#pragma unroll
      for (int nt = 0; nt < T::kDqN / 8; ++nt)
        cuda::atomic_add2(dst + 8 * hr * kD + nt * 8, dq[nt][2 * hr], dq[nt][2 * hr + 1]);
  }
  cp_async_wait<0>();

  cuda::write_dk_dv_tile<Elem, kD>(p, b, h, hp.bh, j0 + key16, 0, dk, dv, lane);
#endif
}

}  // namespace flash::hopper
