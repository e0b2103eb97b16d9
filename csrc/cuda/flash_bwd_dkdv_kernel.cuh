// The backward's main kernel: one CTA per block of keys. For each block of queries that can see
// those keys it recomputes S = Q K^T and P = exp(S - lse) and dP = dO V^T, forms
// dS = P (dP - D) scaled by softmax_scale, passes P and dS through shared memory, and
// accumulates dV += P^T dO and dK += dS^T Q in registers. With T::kDoDQ it also adds this key
// block's share of dQ = dS K into a float32 buffer with atomics (the fast, non-deterministic
// mode); without, the dQ kernel recomputes it in a fixed order. dS is kept unscaled here:
// softmax_scale is applied once to dK in the epilogue and to dQ in the conversion kernel.
#pragma once

#include "flash_fwd_kernel.cuh"
#include "flash_launch.h"

namespace flash::cuda {

// Query rows [begin, end) that can see any key of [j0, j1): the visible ranges' ends grow with
// the row, so these rows are contiguous.
__device__ __forceinline__ void query_row_range(const FwdParams& p, int j0, int j1, int& begin, int& end) {
  const int shift = p.seqlen_k - p.seqlen_q;
  begin = p.window_size_right < 0 ? 0 : max(0, j0 - shift - p.window_size_right);
  end = p.window_size_left < 0 ? p.seqlen_q : min(p.seqlen_q, j1 - shift + p.window_size_left);
}

// The query blocks [mb_begin, mb_end) of kM rows that can see some key of [j0, j0 + kN).
template <int kM, int kN>
__device__ __forceinline__ void query_block_range(const FwdParams& p, int j0, int& mb_begin, int& mb_end) {
  int i_begin, i_end;
  query_row_range(p, j0, min(j0 + kN, p.seqlen_k), i_begin, i_end);
  mb_begin = i_begin / kM;
  mb_end = i_begin < i_end ? (i_end + kM - 1) / kM : mb_begin;
}

// The query blocks of kM rows that keys [j0, j0 + kN) of head (b, h) visit, ascending: the range
// above, cut to the block mask's kept blocks when there is one (the keys lie in one mask block).
// kMaybeMasked = false: as in key_tiles.
template <int kM, int kN, bool kMaybeMasked = true>
__device__ __forceinline__ TileSeq query_tiles(const FwdParams& p, int b, int h, int j0) {
  int mb_begin, mb_end;
  query_block_range<kM, kN>(p, j0, mb_begin, mb_end);
  return tile_seq<kM>(kMaybeMasked ? kept_query_blocks(p, b, h, j0 / kMaskBlock) : nullptr, mb_begin, mb_end);
}

// Store a (16 kMT x kN) accumulator at (row0, col0) of a shared-memory tile as 16-bit values.
template <typename Elem, int kMT, int kN, int kStride>
__device__ __forceinline__ void store_acc_smem(Elem* s, const float (&acc)[kMT][kN / 8][4], int lane) {
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int nt = 0; nt < kN / 8; ++nt)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr)
        *reinterpret_cast<uint32_t*>(s + (mt * 16 + lane / 4 + 8 * hr) * kStride + nt * 8 + 2 * (lane % 4)) =
            pack2<Elem>(acc[mt][nt][2 * hr], acc[mt][nt][2 * hr + 1]);
}

// Element (row, col) of head (b, h) of the bias gradient (score_mod.h), dS before the cap's
// derivative; rows and keys past the sequence are skipped.
template <typename Elem>
__device__ __forceinline__ void write_dbias(const BwdParams& p, int b, int h, int row, int col, float ds) {
  if (row >= p.seqlen_q || col >= p.seqlen_k) return;
  const int64_t at = dbias_index(p, b, h, row, col);
  if (p.dbias_atomic) atomicAdd(static_cast<float*>(p.dbias_ptr) + at, ds);
  else if (p.dbias_elem) static_cast<Elem*>(p.dbias_ptr)[at] = from_float<Elem>(ds);
  else static_cast<float*>(p.dbias_ptr)[at] = ds;
}

// dst[0..1] += (x, y) in global memory.
__device__ __forceinline__ void atomic_add2(float* dst, float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(dst), make_float2(x, y));
#else
  atomicAdd(dst, x);
  atomicAdd(dst + 1, y);
#endif
}

// Write one 16-key tile of the dK and dV accumulators (keys key16 + g and key16 + g + 8, columns
// d0 + [0, kDK)), dK times softmax_scale. Without GQA they are final and written in the input
// dtype; with GQA as float32 per-query-head partials, which the op layer sums over each group.
// p: a seq_view.
template <typename Elem, int kDK>
__device__ __forceinline__ void write_dk_dv_tile(const BwdParams& p, int b, int h, int key16, int d0,
                                                 const float (&dk)[kDK / 8][4], const float (&dv)[kDK / 8][4],
                                                 int lane) {
  const int g = lane / 4, t = lane % 4;
  Elem* dk_out = rows_of<Elem>(p.dk_ptr, b, h, p.k_row0, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride);
  Elem* dv_out = rows_of<Elem>(p.dv_ptr, b, h, p.k_row0, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride);
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int key = key16 + g + 8 * hr;
    if (key >= p.seqlen_k) continue;
    if (p.dk_accum_ptr == nullptr) {
      store_acc_row<Elem, kDK>(dk_out + key * p.dk_row_stride + d0, dk, hr, p.scale_softmax, p.d - d0, lane);
      store_acc_row<Elem, kDK>(dv_out + key * p.dv_row_stride + d0, dv, hr, 1.f, p.d - d0, lane);
      continue;
    }
    const int64_t row_off = (kv_accum_row(p, b, h) + key) * p.d;
#pragma unroll
    for (int nt = 0; nt < kDK / 8; ++nt) {
      const int col = d0 + nt * 8 + 2 * t;
      if (col >= p.d) continue;
      *reinterpret_cast<float2*>(p.dk_accum_ptr + row_off + col) =
          make_float2(dk[nt][2 * hr] * p.scale_softmax, dk[nt][2 * hr + 1] * p.scale_softmax);
      *reinterpret_cast<float2*>(p.dv_accum_ptr + row_off + col) = make_float2(dv[nt][2 * hr], dv[nt][2 * hr + 1]);
    }
  }
}

// kDropout = false compiles the dropout code out (p.p_dropout must be 0); true checks p.p_dropout.
template <typename T, bool kDropout>
__global__ void __launch_bounds__(T::kNThreads, 1) flash_bwd_dkdv_kernel(const BwdParams params) {
  using Elem = typename T::Elem;
  constexpr int kD = T::kHeadDim, kM = T::kBlockM, kN = T::kBlockN, kS = T::kStride, kSP = T::kStrideP;
  constexpr int kMTS = T::kMTS, kNS = T::kNS, kMTKV = T::kMTKV, kDKV = T::kDKV, kMTQ = T::kMTQ, kDQ = T::kDQ;
  extern __shared__ __align__(16) char smem_raw[];
  Elem* sK = reinterpret_cast<Elem*>(smem_raw);
  Elem* sV = sK + T::kSmemKV;
  Elem* sdO = sV + T::kSmemKV;
  Elem* sP = sdO + T::kSmemQ;
  Elem* sdS = sP + T::kSmemP;
  Elem* sQ = sdS + T::kSmemP;                                           // kQStages buffers
  float* sLse = reinterpret_cast<float*>(sQ + T::kQStages * T::kSmemQ);  // per stage, per query
  float* sDsum = sLse + T::kQStages * kM;

  const int j0 = blockIdx.x * kN, h = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const BwdParams p = seq_view(params, b);
  if (j0 >= p.seqlen_k) return;  // varlen: past this sequence's keys
  const HeadPtrs<Elem> hp = head_ptrs<Elem>(p, b, h);
  const Elem* dout = rows_of<const Elem>(p.do_ptr, b, h, p.q_row0, p.do_batch_stride, p.do_row_stride, p.do_head_stride);
  const float* lse = lse_rows(p, b, h);
  const float* dsum = p.dsoftmax_sum_ptr + stat_row(p, b, h);
  // dQ accumulator of this (batch, head): kD floats per row, rows as stat_row() places them.
  float* dq_accum = T::kDoDQ ? p.dq_accum_ptr + stat_row(p, b, h) * kD : nullptr;
  const bool dropout = kDropout && p.p_dropout > 0.f;
  const DropoutState ds = dropout ? dropout_state_bwd(p) : DropoutState{};
  const ScoreModHead<Elem> mod(p, b, h);

  // This warp's place in each GEMM's warp grid (rows and columns relative to the block).
  const int s_m0 = (warp % T::kWarpsMS) * kMTS * 16, s_n0 = (warp / T::kWarpsMS) * kNS;
  const int kv_n0 = (warp % T::kWarpsNKV) * kMTKV * 16, kv_d0 = (warp / T::kWarpsNKV) * kDKV;
  const int q_m0 = (warp % T::kWarpsMQ) * kMTQ * 16, q_d0 = (warp / T::kWarpsMQ) * kDQ;

  const TileSeq qtiles = query_tiles<kM, kN>(p, b, h, j0);
  static_assert(T::kNThreads >= 2 * kM, "one thread per row statistic");
  const auto load_q = [&](int mb, int stage) {  // Q with its rows' logsumexp and D
    const int i0 = mb * kM;
    load_tile_async<kM, kD, T::kNThreads>(sQ + stage * T::kSmemQ, hp.q + i0 * p.q_row_stride, p.q_row_stride,
                                          p.seqlen_q - i0, p.d, tid);
    const int r = tid % kM, i = i0 + r;
    if (tid < 2 * kM)
      cp_async_4((tid < kM ? sLse : sDsum) + stage * kM + r, (tid < kM ? lse : dsum) + (i < p.seqlen_q ? i : 0),
                 i < p.seqlen_q);
  };
  const auto load_do = [&](int mb) {
    const int i0 = mb * kM;
    load_tile_async<kM, kD, T::kNThreads>(sdO, dout + i0 * p.do_row_stride, p.do_row_stride, p.seqlen_q - i0, p.d,
                                          tid);
  };

  load_tile_async<kN, kD, T::kNThreads>(sK, hp.k + j0 * p.k_row_stride, p.k_row_stride, p.seqlen_k - j0, p.d, tid);
  load_tile_async<kN, kD, T::kNThreads>(sV, hp.v + j0 * p.v_row_stride, p.v_row_stride, p.seqlen_k - j0, p.d, tid);
  TileWalk qw(qtiles);
  if (qw.more()) {
    load_q(qw.tile, 0);
    load_do(qw.tile);
  }
  cp_async_commit();

  float dk[kMTKV][kDKV / 8][4], dv[kMTKV][kDKV / 8][4];
  zero<kDKV>(dk);
  zero<kDKV>(dv);

  for (; qw.more(); qw.advance()) {
    const int i0 = qw.tile * kM, stage = T::kQStages == 2 ? qw.step & 1 : 0;
    const bool has_next = qw.has_next();
    const int next = qw.next;
    const Elem* sQc = sQ + stage * T::kSmemQ;
    cp_async_wait<0>();
    __syncthreads();  // Q and dO are in; every warp is done with the previous P, dS and Q buffer
    if (T::kQStages == 2 && has_next) {
      load_q(next, stage ^ 1);
      cp_async_commit();
    }

    float s[kMTS][kNS / 8][4], dp[kMTS][kNS / 8][4];
    zero<kNS>(s);
    zero<kNS>(dp);
    // S = Q K^T and dP = dO V^T
    gemm_smem_pair<Elem, kMTS, kNS, kD, kS, kS, false, false>(s, sQc + s_m0 * kS, sK + s_n0 * kS, dp, sdO + s_m0 * kS,
                                                             sV + s_n0 * kS, lane);

    // Row statistics of this warp's rows (thread rows g and g + 8 of each 16-row tile). A row
    // that sees no key has lse = -inf and every score masked: use 0 so exp2 gives 0, not NaN. A
    // row past seqlen_q gets +inf, so its P is 0 whatever a score modifier adds (a large bias
    // once made exp2 overflow there, and inf times its zero dO and Q rows made dK, dV NaN).
    float lse2[kMTS][2], dsm[kMTS][2];
#pragma unroll
    for (int mt = 0; mt < kMTS; ++mt)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int r = stage * kM + s_m0 + mt * 16 + g + 8 * hr;
        lse2[mt][hr] = i0 + s_m0 + mt * 16 + g + 8 * hr >= p.seqlen_q ? -kNegInf
                       : sLse[r] == kNegInf                          ? 0.f
                                                                     : sLse[r] * kLog2e;
        dsm[mt][hr] = sDsum[r];
      }
    if (!(tile_fully_visible(p, i0, i0 + kM, j0, j0 + kN) && i0 + kM <= p.seqlen_q)) {
#pragma unroll
      for (int mt = 0; mt < kMTS; ++mt) mask_tile_qmajor<kNS>(s[mt], p, i0 + s_m0 + mt * 16, j0 + s_n0, lane);
    }
    // Score modifiers without a cap (its derivative is needed below): whole-tile passes, masked
    // scores stay -inf.
    const bool mod_in_place = p.score_mod && p.softcap == 0.f;
    if (mod_in_place)
#pragma unroll
      for (int mt = 0; mt < kMTS; ++mt) modify_scores_qmajor<kNS, Elem>(s[mt], p, b, h, i0 + s_m0 + mt * 16, j0 + s_n0, lane);
#pragma unroll
    for (int mt = 0; mt < kMTS; ++mt) {
#pragma unroll
      for (int c = 0; c < kNS / 16; ++c) {
        bool keep[2][4];
        if (dropout) dropout_keep_qmajor(keep, ds, hp.bh, i0 + s_m0 + mt * 16, j0 + s_n0 + c * 16, lane);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            float& sv = s[mt][2 * c + hh][r];
            float& dsv = dp[mt][2 * c + hh][r];
            const int row = i0 + s_m0 + mt * 16 + g + 8 * (r >> 1), col = j0 + s_n0 + (2 * c + hh) * 8 + 2 * t + (r & 1);
            float dcap = 1.f;
            const float pv = !p.score_mod  ? fast_exp2(fmaf(sv, p.scale_softmax_log2, -lse2[mt][r >> 1]))
                             : mod_in_place ? fast_exp2(sv - lse2[mt][r >> 1])
                                            : fast_exp2(score_log2(p, mod, row, col, sv, dcap) - lse2[mt][r >> 1]);
            if (dropout) {
              dsv = keep[hh][r] ? pv * (dsv * p.rp_dropout - dsm[mt][r >> 1]) : -pv * dsm[mt][r >> 1];
              sv = keep[hh][r] ? pv * p.rp_dropout : 0.f;  // P with dropout applied
            } else {
              dsv = pv * (dsv - dsm[mt][r >> 1]);  // dS / softmax_scale = dL/dscore
              sv = pv;
            }
            if (p.dbias_ptr != nullptr) write_dbias<Elem>(p, b, h, row, col, dsv);
            dsv *= dcap;
          }
      }
    }
    store_acc_smem<Elem, kMTS, kNS, kSP>(sP + s_m0 * kSP + s_n0, s, lane);
    store_acc_smem<Elem, kMTS, kNS, kSP>(sdS + s_m0 * kSP + s_n0, dp, lane);
    __syncthreads();  // P and dS are complete

    gemm_smem<Elem, kMTKV, kDKV, kM, kSP, kS, true, true>(dv, sP + kv_n0, sdO + kv_d0, lane);  // dV += P^T dO
    if (has_next) {
      __syncthreads();  // every warp is done with dO
      load_do(next);
      cp_async_commit();
    }
    gemm_smem<Elem, kMTKV, kDKV, kM, kSP, kS, true, true>(dk, sdS + kv_n0, sQc + kv_d0, lane);  // dK += dS^T Q
    if (T::kQStages == 1 && has_next) {
      __syncthreads();  // every warp is done with Q
      load_q(next, 0);
      cp_async_commit();
    }
    if constexpr (T::kDoDQ) {
      float dq[kMTQ][kDQ / 8][4];
      zero<kDQ>(dq);
      gemm_smem<Elem, kMTQ, kDQ, kN, kSP, kS, false, true>(dq, sdS + q_m0 * kSP, sK + q_d0, lane);  // dQ = dS K
      // Padded rows and columns receive exact zeros (their dS rows and K columns are zero), so
      // the adds need no bounds checks and their offsets are compile-time constants.
      float* dst = dq_accum + int64_t(i0 + q_m0 + g) * kD + q_d0 + 2 * t;
#pragma unroll
      for (int mt = 0; mt < kMTQ; ++mt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr)
#pragma unroll
          for (int nt = 0; nt < kDQ / 8; ++nt)
            atomic_add2(dst + (mt * 16 + 8 * hr) * kD + nt * 8, dq[mt][nt][2 * hr], dq[mt][nt][2 * hr + 1]);
    }
  }

#pragma unroll
  for (int mt = 0; mt < kMTKV; ++mt)
    write_dk_dv_tile<Elem, kDKV>(p, b, h, j0 + kv_n0 + mt * 16, kv_d0, dk[mt], dv[mt], lane);
}

}  // namespace flash::cuda
