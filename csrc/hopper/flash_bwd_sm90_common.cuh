// Pieces both sm90 backward kernels share: per-head pointers, the per-step loads of Q, dO and
// their rows' statistics, and the key-major (keys as MMA rows) masking, probabilities, score
// gradients and dQ accumulation.
#pragma once

#include "../cuda/flash_bwd_dkdv_kernel.cuh"
#include "wgmma_utils.cuh"

namespace flash::hopper {

// The backward's inputs for one (batch, head) and that head's rows of the dQ accumulator (kD
// columns, rows padded as padded_query_rows() pads them). p: a seq_view.
template <typename Elem>
struct BwdHeadPtrs {
  cuda::HeadPtrs<Elem> in;  // q, k, v and bh
  const Elem* dout;
  const float *lse2, *dsum;  // base-2 logsumexp and D (padded rows)
  float* dq_accum;
};

template <typename Elem, int kD, int kM>
__device__ __forceinline__ BwdHeadPtrs<Elem> bwd_head_ptrs(const BwdParams& p, int b, int h) {
  static_assert(cuda::kDqAccumRowPad % kM == 0, "padded_query_rows() pads rows to the query block");
  const int64_t stat = stat_row(p, b, h);
  BwdHeadPtrs<Elem> r;
  r.in = cuda::head_ptrs<Elem>(p, b, h);
  r.dout = rows_of<const Elem>(p.do_ptr, b, h, p.q_row0, p.do_batch_stride, p.do_row_stride, p.do_head_stride);
  r.lse2 = p.softmax_lse_log2_ptr + stat;
  r.dsum = p.dsoftmax_sum_ptr + stat;
  r.dq_accum = p.dq_accum_ptr + stat * kD;
  return r;
}

// Queue the cp.async loads of query block i0 (kM rows): Q and dO into one stage of their
// swizzled (kM x kD) tiles, the rows' base-2 logsumexp and D into sLse / sDsum.
template <int kM, int kD, int kThreads, typename Elem, typename SmemTile>
__device__ __forceinline__ void load_q_do_stats(SmemTile&& sQ, SmemTile&& sdO, float* sLse, float* sDsum,
                                                const BwdHeadPtrs<Elem>& hp, const BwdParams& p, int i0, int tid) {
  static_assert(kThreads >= 2 * kM, "one thread per row statistic");
  load_tile_swizzled<kM, kD, kThreads>(sQ, hp.in.q + int64_t(i0) * p.q_row_stride, p.q_row_stride, p.seqlen_q - i0,
                                       p.d, tid);
  load_tile_swizzled<kM, kD, kThreads>(sdO, hp.dout + int64_t(i0) * p.do_row_stride, p.do_row_stride,
                                       p.seqlen_q - i0, p.d, tid);
  const int r = tid % kM, i = i0 + r;
  if (tid < 2 * kM)
    cuda::cp_async_4((tid < kM ? sLse : sDsum) + r, (tid < kM ? hp.lse2 : hp.dsum) + i, true);
}

// Queue the cp.async loads of the CTA's K and V tiles (keys [j0, j0 + kN); rows past seqlen_k
// and columns past d are zero-filled).
template <int kN, int kD, int kThreads, typename Elem, typename SmemTile>
__device__ __forceinline__ void load_k_v(SmemTile& sK, SmemTile& sV, const BwdHeadPtrs<Elem>& hp, const BwdParams& p,
                                         int j0, int tid) {
  load_tile_swizzled<kN, kD, kThreads>(sK, hp.in.k + int64_t(j0) * p.k_row_stride, p.k_row_stride, p.seqlen_k - j0,
                                       p.d, tid);
  load_tile_swizzled<kN, kD, kThreads>(sV, hp.in.v + int64_t(j0) * p.v_row_stride, p.v_row_stride, p.seqlen_k - j0,
                                       p.d, tid);
}

// The double-buffered stream of the query blocks a key block visits (walk over query_tiles):
// step s's block of Q, dO, logsumexp and D lands in stage s % 2 of the (kM x kD x 2) tiles sQ,
// sdO and of sLse, sDsum.
template <int kM, int kD, int kThreads, typename Elem, typename SmemQ>
struct QueryBlockStream {
  SmemQ sQ, sdO;
  float *sLse, *sDsum;
  const BwdHeadPtrs<Elem>& hp;
  const BwdParams& p;
  int tid;
  TileWalk walk;

  __device__ __forceinline__ void load(int mb, int st) {
    load_q_do_stats<kM, kD, kThreads>(sQ(cute::_, cute::_, st), sdO(cute::_, cute::_, st), sLse + st * kM,
                                      sDsum + st * kM, hp, p, mb * kM, tid);
  }
  __device__ __forceinline__ void load_first() {
    if (walk.more()) load(walk.tile, 0);
  }
  // The current step begins: its tiles are waited for and published to the CTA and the tensor
  // cores (the barrier also means every thread is done with the previous step), then the next
  // step's block is queued into the other stage. Returns the current step's stage.
  __device__ __forceinline__ int begin_step() {
    cuda::cp_async_wait<0>();
    fence_proxy_async_smem();
    __syncthreads();
    const int st = walk.step & 1;
    if (walk.has_next()) {
      load(walk.next, st ^ 1);
      cuda::cp_async_commit();
    }
    return st;
  }
};

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

// The score modifiers except the cap (its derivative would need the raw scores at dS time) on a
// key-major tile of raw scores (keys j16 + g, j16 + g + 8; queries i0 + 8 n + 2 t + {0, 1}): the
// modified scores in log2 units, as cuda::modify_scores_qmajor does query-major. Masked scores stay
// -inf; rows past seqlen_q and keys past seqlen_k read the last ones (their scores are masked).
template <int kM, typename Bias>
__device__ __forceinline__ void modify_scores_kmajor(float (&s)[kM / 8][4], const FwdParams& p, int b, int h, int j16,
                                                     int i0, int lane) {
  const int key0 = j16 + lane / 4, t2 = 2 * (lane % 4);
  cuda::scale_acc<kM>(s, p.scale_softmax_log2);
  if (p.alibi_slopes_ptr != nullptr) {
    const float neg_slope = -p.alibi_slopes_ptr[b * p.alibi_batch_stride + h] * cuda::kLog2e;
    const float d0 = float(i0 + t2 + p.seqlen_k - p.seqlen_q - key0);  // i - j + shift at n = 0, r = 0
#pragma unroll
    for (int n = 0; n < kM / 8; ++n)
#pragma unroll
      for (int r = 0; r < 4; ++r) s[n][r] = fmaf(fabsf(d0 + float(8 * n + (r & 1) - 8 * (r >> 1))), neg_slope, s[n][r]);
  }
  if (p.bias_ptr != nullptr) {
    const Bias* head = static_cast<const Bias*>(p.bias_ptr) + b * p.bias_batch_stride + h * p.bias_head_stride;
    const int keys[2] = {min(key0, p.seqlen_k - 1), min(key0 + 8, p.seqlen_k - 1)};
#pragma unroll
    for (int n = 0; n < kM / 8; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const Bias* row = head + min(i0 + 8 * n + t2 + e, p.seqlen_q - 1) * p.bias_row_stride;
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) s[n][2 * hr + e] = fmaf(cuda::to_float(row[keys[hr]]), cuda::kLog2e, s[n][2 * hr + e]);
      }
  }
}

// The bias gradient from a key-major dS tile (dL/dscore, laid out as in modify_scores_kmajor). A
// bias broadcast over the query rows (a key-padding bias) takes one atomic add per key and quad:
// the thread's queries and then the quad's are summed first (rows past seqlen_q hold dS = 0).
template <typename Elem, int kM>
__device__ __forceinline__ void write_dbias_kmajor(const BwdParams& p, int b, int h, const float (&ds)[kM / 8][4],
                                                   int j16, int i0, int lane) {
  if (p.dbias_row_stride == 0) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < kM / 8; ++n) sum += ds[n][2 * hr] + ds[n][2 * hr + 1];
      sum = cuda::quad_sum(sum);
      if (lane % 4 == 0) cuda::write_dbias<Elem>(p, b, h, 0, j16 + lane / 4 + 8 * hr, sum);
    }
    return;
  }
#pragma unroll
  for (int n = 0; n < kM / 8; ++n)
#pragma unroll
    for (int r = 0; r < 4; ++r)
      cuda::write_dbias<Elem>(p, b, h, i0 + 8 * n + 2 * (lane % 4) + (r & 1), j16 + lane / 4 + 8 * (r >> 1), ds[n][r]);
}

// A stage's row statistic (base-2 logsumexp or D) at this thread's query columns 8 n + 2 t and
// 8 n + 2 t + 1 of a key-major tile, read as pairs from stat_t = the stage's statistics + 2 t
// (8-byte aligned). The kernels read them before waiting for the MMA that needs them, so the
// shared-memory latency hides behind it.
template <int kM>
__device__ __forceinline__ void load_stat_pairs(float2 (&pairs)[kM / 8], const float* stat_t) {
#pragma unroll
  for (int n = 0; n < kM / 8; ++n) pairs[n] = *reinterpret_cast<const float2*>(stat_t + n * 8);
}

// P^T = exp2(S^T scale_log2 - lse log2 e) in place on a key-major tile, from the base-2 logsumexp
// pairs of load_stat_pairs. The pre-pass stores 0 for a query row that sees no key, whose scores
// are all masked, so exp2 gives 0, not NaN.
template <int kM>
__device__ __forceinline__ void probs_kmajor(float (&s)[kM / 8][4], const float2 (&lse2)[kM / 8], float scale_log2) {
#pragma unroll
  for (int n = 0; n < kM / 8; ++n)
#pragma unroll
    for (int r = 0; r < 4; ++r)
      s[n][r] = cuda::fast_exp2(fmaf(s[n][r], scale_log2, -((r & 1) ? lse2[n].y : lse2[n].x)));
}

// dS^T = P^T (dP^T - D) in place on dp, from the D pairs of load_stat_pairs.
template <int kM>
__device__ __forceinline__ void dscores_kmajor(float (&dp)[kM / 8][4], const float (&pr)[kM / 8][4],
                                               const float2 (&dsum)[kM / 8]) {
#pragma unroll
  for (int n = 0; n < kM / 8; ++n)
#pragma unroll
    for (int r = 0; r < 4; ++r) dp[n][r] = pr[n][r] * (dp[n][r] - ((r & 1) ? dsum[n].y : dsum[n].x));
}

// Add one warp's (16 queries x kN columns) slice of dQ into the accumulator (row stride kD) at
// dst = row g, column 2 t of the slice. Padded rows and columns receive exact zeros (their dS rows
// and K rows are zero), so the adds need no bounds checks.
template <int kN, int kD>
__device__ __forceinline__ void add_dq_slice(float* dst, const float (&dq)[kN / 8][4]) {
#pragma unroll
  for (int hr = 0; hr < 2; ++hr)
#pragma unroll
    for (int nt = 0; nt < kN / 8; ++nt) cuda::atomic_add2(dst + 8 * hr * kD + nt * 8, dq[nt][2 * hr], dq[nt][2 * hr + 1]);
}

}  // namespace flash::hopper
