// The backward, deterministic by construction (no atomics): a pre-pass computes
// D = rowsum(dO * O); the dK/dV kernel (one CTA per key block) recomputes P^T tile by tile from
// K, Q and the logsumexp and accumulates dV = P^T dO and dK = dS^T Q in registers; the dQ kernel
// (one CTA per query block) recomputes P and dS and accumulates dQ = dS K. dS is pre-scaled by
// softmax_scale, so neither output needs a final rescale.
#pragma once

#include "flash_fwd_kernel.cuh"

namespace flash::cuda {

// D[b, h, i] = sum_d dO[b, i, h, d] * O[b, i, h, d]; one warp per row.
template <typename Elem>
__global__ void flash_bwd_dot_do_o_kernel(const BwdParams p) {
  const int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= int64_t(p.b) * p.seqlen_q * p.h) return;
  const int h = int(row % p.h), i = int((row / p.h) % p.seqlen_q), b = int(row / (int64_t(p.h) * p.seqlen_q));
  const Elem* o = static_cast<const Elem*>(p.o_ptr) + b * p.o_batch_stride + i * p.o_row_stride + h * p.o_head_stride;
  const Elem* dout =
      static_cast<const Elem*>(p.do_ptr) + b * p.do_batch_stride + i * p.do_row_stride + h * p.do_head_stride;
  float sum = 0.f;
  for (int c = lane; c < p.d; c += 32) sum += to_float(o[c]) * to_float(dout[c]);
#pragma unroll
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffff, sum, off);
  if (lane == 0) p.dsoftmax_sum_ptr[(int64_t(b) * p.h + h) * p.seqlen_q + i] = sum;
}

// Query rows [begin, end) that can see any key of [j0, j1): the visible ranges' ends grow with
// the row, so these rows are contiguous.
__device__ __forceinline__ void query_row_range(const FwdParams& p, int j0, int j1, int& begin, int& end) {
  const int shift = p.seqlen_k - p.seqlen_q;
  begin = p.window_size_right < 0 ? 0 : max(0, j0 - shift - p.window_size_right);
  end = p.window_size_left < 0 ? p.seqlen_q : min(p.seqlen_q, j1 - shift + p.window_size_left);
}

template <typename T>
__global__ void __launch_bounds__(T::kNThreads) flash_bwd_dkdv_kernel(const BwdParams p) {
  using Elem = typename T::Elem;
  constexpr int kD = T::kHeadDim, kM = T::kBlockM, kN = T::kBlockN, kS = T::kStride;
  extern __shared__ __align__(16) char smem_raw[];
  Elem* sK = reinterpret_cast<Elem*>(smem_raw);
  Elem* sV = sK + T::kSmemKV;
  Elem* sQ = sV + T::kSmemKV;
  Elem* sdO = sQ + T::kSmemQ;
  float* s_lse2 = reinterpret_cast<float*>(sdO + T::kSmemQ);  // logsumexp * log2(e), per query
  float* s_dsum = s_lse2 + kM;                                 // D, per query

  const int j0 = blockIdx.x * kN, h = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const HeadPtrs<Elem> hp = head_ptrs<Elem>(p, b, h);
  const Elem* dout = static_cast<const Elem*>(p.do_ptr) + b * p.do_batch_stride + h * p.do_head_stride;
  const float* lse = p.softmax_lse_ptr + int64_t(hp.bh) * p.seqlen_q;
  const float* dsum = p.dsoftmax_sum_ptr + int64_t(hp.bh) * p.seqlen_q;
  const bool dropout = p.p_dropout > 0.f;
  const DropoutState ds = dropout ? dropout_state_bwd(p) : DropoutState{};
  const int kw = j0 + warp * 16;  // this warp's first key

  int i_begin, i_end;
  query_row_range(p, j0, min(j0 + kN, p.seqlen_k), i_begin, i_end);
  const int mb_begin = i_begin / kM, mb_end = i_begin < i_end ? (i_end + kM - 1) / kM : mb_begin;

  load_tile_async<kN, kD, T::kNThreads>(sK, hp.k + j0 * p.k_row_stride, p.k_row_stride, p.seqlen_k - j0, p.d, tid);
  load_tile_async<kN, kD, T::kNThreads>(sV, hp.v + j0 * p.v_row_stride, p.v_row_stride, p.seqlen_k - j0, p.d, tid);
  cp_async_commit();

  float dk[kD / 8][4], dv[kD / 8][4];
  zero<kD>(dk);
  zero<kD>(dv);

  for (int mb = mb_begin; mb < mb_end; ++mb) {
    const int i0 = mb * kM;
    load_tile_async<kM, kD, T::kNThreads>(sQ, hp.q + i0 * p.q_row_stride, p.q_row_stride, p.seqlen_q - i0, p.d, tid);
    load_tile_async<kM, kD, T::kNThreads>(sdO, dout + i0 * p.do_row_stride, p.do_row_stride, p.seqlen_q - i0, p.d,
                                          tid);
    cp_async_commit();
    for (int r = tid; r < kM; r += T::kNThreads) {
      const int i = i0 + r;
      s_lse2[r] = i < p.seqlen_q ? lse[i] * kLog2e : 0.f;
      s_dsum[r] = i < p.seqlen_q ? dsum[i] : 0.f;
    }
    cp_async_wait<0>();
    __syncthreads();

    // S^T = K Q^T for this warp's 16 keys, then P^T = exp2(S^T - lse) on visible entries.
    float pt[kM / 8][4];
    zero<kM>(pt);
    gemm_ss<Elem, kM, kD, kS>(pt, sK + warp * 16 * kS, sQ, lane);
    scale_acc<kM>(pt, p.scale_softmax_log2);
    const bool full = tile_fully_visible(p, i0, i0 + kM, j0, j0 + kN) && i0 + kM <= p.seqlen_q;
#pragma unroll
    for (int n = 0; n < kM / 8; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int qc = n * 8 + 2 * t + e;  // query, relative to i0
        bool vis[2] = {true, true};
        if (!full) {
          const ColRange cr = cols_of(p, i0 + qc);
          const bool q_ok = i0 + qc < p.seqlen_q;
#pragma unroll
          for (int hk = 0; hk < 2; ++hk) {
            const int key = kw + g + 8 * hk;
            vis[hk] = q_ok && key >= cr.lo && key < cr.hi;
          }
        }
#pragma unroll
        for (int hk = 0; hk < 2; ++hk) {
          float& x = pt[n][hk * 2 + e];
          x = vis[hk] ? fast_exp2(x - s_lse2[qc]) : 0.f;
        }
      }

    bool keep[kM / 8][4];
    if (dropout) {
#pragma unroll
      for (int c = 0; c < kM / 16; ++c) {
        bool kc[2][4];
        dropout_keep_kmajor(kc, ds, hp.bh, i0 + c * 16, kw, lane);
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          keep[2 * c][r] = kc[0][r];
          keep[2 * c + 1][r] = kc[1][r];
        }
      }
    }

    uint32_t a[kM / 16][4];
    if constexpr (T::kDoDV) {
      if (dropout) {
        float pd[kM / 8][4];
#pragma unroll
        for (int n = 0; n < kM / 8; ++n)
#pragma unroll
          for (int r = 0; r < 4; ++r) pd[n][r] = keep[n][r] ? pt[n][r] * p.rp_dropout : 0.f;
        acc_to_a<Elem, kM>(a, pd);
      } else {
        acc_to_a<Elem, kM>(a, pt);
      }
      gemm_rs<Elem, kM, kD, kS>(dv, a, sdO, lane);  // dV += P^T dO
    }
    if constexpr (T::kDoDK) {
      float dpt[kM / 8][4];
      zero<kM>(dpt);
      gemm_ss<Elem, kM, kD, kS>(dpt, sV + warp * 16 * kS, sdO, lane);  // dP^T = V dO^T
#pragma unroll
      for (int n = 0; n < kM / 8; ++n)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          float dp = dpt[n][r];
          if (dropout) dp = keep[n][r] ? dp * p.rp_dropout : 0.f;
          dpt[n][r] = pt[n][r] * (dp - s_dsum[n * 8 + 2 * t + (r & 1)]) * p.scale_softmax;  // dS^T
        }
      acc_to_a<Elem, kM>(a, dpt);
      gemm_rs<Elem, kM, kD, kS>(dk, a, sQ, lane);  // dK += dS^T Q
    }
    __syncthreads();  // every warp is done with sQ, sdO and the row stats
  }

  // Without GQA dK/dV are final: write them in the input dtype. With GQA write per-query-head
  // float32 partials; the op layer sums each group.
  const int64_t head_off = int64_t(hp.bh) * p.seqlen_k * p.d;
  Elem* dk_out = static_cast<Elem*>(p.dk_ptr) + b * p.dk_batch_stride + h * p.dk_head_stride;
  Elem* dv_out = static_cast<Elem*>(p.dv_ptr) + b * p.dv_batch_stride + h * p.dv_head_stride;
  const bool direct = p.dk_accum_ptr == nullptr;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int key = kw + g + 8 * hr;
    if (key >= p.seqlen_k) continue;
    if (direct) {
      if constexpr (T::kDoDK) store_acc_row<Elem, kD>(dk_out + key * p.dk_row_stride, dk, hr, 1.f, p.d, lane);
      if constexpr (T::kDoDV) store_acc_row<Elem, kD>(dv_out + key * p.dv_row_stride, dv, hr, 1.f, p.d, lane);
      continue;
    }
#pragma unroll
    for (int dt = 0; dt < kD / 8; ++dt) {
      const int col = dt * 8 + 2 * t;
      if (col >= p.d) continue;
      const int64_t off = head_off + int64_t(key) * p.d + col;
      if constexpr (T::kDoDK) *reinterpret_cast<float2*>(p.dk_accum_ptr + off) = make_float2(dk[dt][2 * hr], dk[dt][2 * hr + 1]);
      if constexpr (T::kDoDV) *reinterpret_cast<float2*>(p.dv_accum_ptr + off) = make_float2(dv[dt][2 * hr], dv[dt][2 * hr + 1]);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(T::kNThreads) flash_bwd_dq_kernel(const BwdParams p) {
  using Elem = typename T::Elem;
  constexpr int kD = T::kHeadDim, kM = T::kBlockM, kN = T::kBlockN, kS = T::kStride, kMT = T::kMTiles;
  extern __shared__ __align__(16) char smem_raw[];
  Elem* sQ = reinterpret_cast<Elem*>(smem_raw);
  Elem* sK = sQ + T::kSmemQ;
  Elem* sV = sK + T::kSmemKV;
  Elem* sdO = sV + T::kSmemKV;

  const int m0 = blockIdx.x * kM, h = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4;
  const HeadPtrs<Elem> hp = head_ptrs<Elem>(p, b, h);
  const Elem* dout = static_cast<const Elem*>(p.do_ptr) + b * p.do_batch_stride + h * p.do_head_stride;
  const bool dropout = p.p_dropout > 0.f;
  const DropoutState ds = dropout ? dropout_state_bwd(p) : DropoutState{};
  const int warp_row = warp * 16 * kMT;  // first query of this warp, relative to m0
  ColRange rows[kMT][2];
  float lse2[kMT][2], dsum[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int row = m0 + warp_row + mt * 16 + g + 8 * hr;
      const bool ok = row < p.seqlen_q;
      rows[mt][hr] = cols_of(p, row);
      lse2[mt][hr] = ok ? p.softmax_lse_ptr[int64_t(hp.bh) * p.seqlen_q + row] * kLog2e : 0.f;
      dsum[mt][hr] = ok ? p.dsoftmax_sum_ptr[int64_t(hp.bh) * p.seqlen_q + row] : 0.f;
    }

  int n_begin, n_end;
  key_block_range<kN>(p, m0, kM, n_begin, n_end);
  load_tile_async<kM, kD, T::kNThreads>(sQ, hp.q + m0 * p.q_row_stride, p.q_row_stride, p.seqlen_q - m0, p.d, tid);
  load_tile_async<kM, kD, T::kNThreads>(sdO, dout + m0 * p.do_row_stride, p.do_row_stride, p.seqlen_q - m0, p.d, tid);

  float dq[kMT][kD / 8][4];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) zero<kD>(dq[mt]);
  for (int nb = n_begin; nb < n_end; ++nb) {
    const int j0 = nb * kN;
    load_tile_async<kN, kD, T::kNThreads>(sK, hp.k + j0 * p.k_row_stride, p.k_row_stride, p.seqlen_k - j0, p.d, tid);
    load_tile_async<kN, kD, T::kNThreads>(sV, hp.v + j0 * p.v_row_stride, p.v_row_stride, p.seqlen_k - j0, p.d, tid);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    float s[kMT][kN / 8][4], dp[kMT][kN / 8][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      zero<kN>(s[mt]);
      zero<kN>(dp[mt]);
    }
    gemm_ss<Elem, kMT, kN, kD, kS>(s, sQ + warp_row * kS, sK, lane);
    gemm_ss<Elem, kMT, kN, kD, kS>(dp, sdO + warp_row * kS, sV, lane);  // dP = dO V^T
    const bool masked = !tile_fully_visible(p, m0, m0 + kM, j0, j0 + kN);
    uint32_t a[kMT][kN / 16][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      scale_acc<kN>(s[mt], p.scale_softmax_log2);
      if (masked) mask_qmajor<kN>(s[mt], j0, rows[mt], lane);
#pragma unroll
      for (int c = 0; c < kN / 16; ++c) {
        bool keep[2][4];
        if (dropout) dropout_keep_qmajor(keep, ds, hp.bh, m0 + warp_row + mt * 16, j0 + c * 16, lane);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const float sv = s[mt][2 * c + hh][r];
            const float pv = sv == kNegInf ? 0.f : fast_exp2(sv - lse2[mt][r >> 1]);
            float x = dp[mt][2 * c + hh][r];
            if (dropout) x = keep[hh][r] ? x * p.rp_dropout : 0.f;
            dp[mt][2 * c + hh][r] = pv * (x - dsum[mt][r >> 1]) * p.scale_softmax;  // dS
          }
      }
      acc_to_a<Elem, kN>(a[mt], dp[mt]);
    }
    gemm_rs<Elem, kMT, kN, kD, kS>(dq, a, sK, lane);  // dQ += dS K
    __syncthreads();  // every warp is done with sK, sV
  }

  Elem* dqp = static_cast<Elem*>(p.dq_ptr) + b * p.dq_batch_stride + h * p.dq_head_stride;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int row = m0 + warp_row + mt * 16 + g + 8 * hr;
      if (row < p.seqlen_q) store_acc_row<Elem, kD>(dqp + row * p.dq_row_stride, dq[mt], hr, 1.f, p.d, lane);
    }
}

}  // namespace flash::cuda
