// Row-wise pieces of the attention kernels on query-major accumulator fragments: masking,
// the online softmax update, and quad (4-lane) reductions across a row.
#pragma once

#include <cmath>
#include <type_traits>

#include "../mask.h"
#include "../score_mod.h"
#include "warp_tiles.cuh"

namespace flash::cuda {

constexpr float kNegInf = -INFINITY;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

template <int kN>
__device__ __forceinline__ void scale_acc(float (&s)[kN / 8][4], float scale) {
#pragma unroll
  for (int n = 0; n < kN / 8; ++n)
#pragma unroll
    for (int r = 0; r < 4; ++r) s[n][r] *= scale;
}

// Query-major: the thread's rows have visible key ranges rows[0] (row g) and rows[1] (row g+8);
// columns j0 + 8n + 2t + {0,1}. Invisible scores become -inf.
template <int kN>
__device__ __forceinline__ void mask_qmajor(float (&s)[kN / 8][4], int j0, const ColRange (&rows)[2], int lane) {
#pragma unroll
  for (int n = 0; n < kN / 8; ++n)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int col = j0 + n * 8 + 2 * (lane % 4) + (r & 1);
      const ColRange& cr = rows[r >> 1];
      if (col < cr.lo || col >= cr.hi) s[n][r] = kNegInf;
    }
}

// Mask a query-major (16 x kN) score tile at rows i16.., keys j0..; rows past seqlen_q see
// nothing. Row ranges are computed here, only for tiles that need masking, rather than held in
// registers across the loop.
template <int kN>
__device__ __forceinline__ void mask_tile_qmajor(float (&s)[kN / 8][4], const FwdParams& p, int i16, int j0,
                                                 int lane) {
  ColRange rows[2];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int row = i16 + lane / 4 + 8 * hr;
    rows[hr] = row < p.seqlen_q
                   ? visible_cols(row, p.seqlen_q, p.seqlen_k, p.window_size_left, p.window_size_right)
                   : ColRange{0, 0};
  }
  mask_qmajor<kN>(s, j0, rows, lane);
}

// The score modifiers (score_mod.h) on a query-major (16 x kN) tile of raw scores at rows i16..
// (the thread's rows g and g + 8), keys j0..: the modified scores in log2 units, ready for a
// softmax with scale 1. One straight pass per term keeps the per-element cost to a few
// instructions (the softmax already bounds these kernels): cap (MUFU tanh) or scale; ALiBi from a
// float distance whose per-element offsets are constants; the bias as 32-bit pairs (the op layer
// gives it even strides and alignment) where the tile lies within seqlen_k. Rows past seqlen_q
// read the last row and keys past seqlen_k the last key: those scores are masked or never stored.
template <int kN, typename Bias>
__device__ __forceinline__ void modify_scores_qmajor(float (&s)[kN / 8][4], const FwdParams& p, int b, int h, int i16,
                                                     int j0, int lane) {
  const int row0 = i16 + lane / 4, t2 = 2 * (lane % 4);
  if (p.softcap > 0.f) {
    const float in = p.scale_softmax / p.softcap, out = p.softcap * kLog2e;
#pragma unroll
    for (int n = 0; n < kN / 8; ++n)
#pragma unroll
      for (int r = 0; r < 4; ++r) s[n][r] = cap_tanh(s[n][r] * in) * out;
  } else {
    scale_acc<kN>(s, p.scale_softmax_log2);
  }
  if (p.alibi_slopes_ptr != nullptr) {
    const float neg_slope = -p.alibi_slopes_ptr[b * p.alibi_batch_stride + h] * kLog2e;
    const float d0 = float(row0 + p.seqlen_k - p.seqlen_q - j0 - t2);  // i - j + shift at n = 0, r = 0
#pragma unroll
    for (int n = 0; n < kN / 8; ++n)
#pragma unroll
      for (int r = 0; r < 4; ++r) s[n][r] = fmaf(fabsf(d0 + float(8 * (r >> 1) - 8 * n - (r & 1))), neg_slope, s[n][r]);
  }
  if (p.bias_ptr != nullptr) {
    const Bias* head = static_cast<const Bias*>(p.bias_ptr) + b * p.bias_batch_stride + h * p.bias_head_stride;
    const Bias* rows[2] = {head + min(row0, p.seqlen_q - 1) * p.bias_row_stride,
                           head + min(row0 + 8, p.seqlen_q - 1) * p.bias_row_stride};
    if (j0 + kN <= p.seqlen_k) {
      using Pair = std::conditional_t<std::is_same_v<Bias, __half>, __half2, __nv_bfloat162>;
#pragma unroll
      for (int n = 0; n < kN / 8; ++n)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const Pair v = *reinterpret_cast<const Pair*>(rows[hr] + j0 + n * 8 + t2);
          s[n][2 * hr] = fmaf(to_float(v.x), kLog2e, s[n][2 * hr]);
          s[n][2 * hr + 1] = fmaf(to_float(v.y), kLog2e, s[n][2 * hr + 1]);
        }
    } else {
#pragma unroll
      for (int n = 0; n < kN / 8; ++n)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int col = min(j0 + n * 8 + t2 + (r & 1), p.seqlen_k - 1);
          s[n][r] = fmaf(to_float(rows[r >> 1][col]), kLog2e, s[n][r]);
        }
    }
  }
}

// Scores in log2 units for a softmax with scale 1 where the call has score modifiers; returns the
// scale the softmax applies (scale_softmax_log2 without modifiers, the tile left raw).
template <int kN, typename Bias>
__device__ __forceinline__ float prepare_scores_qmajor(float (&s)[kN / 8][4], const FwdParams& p, int b, int h,
                                                       int i16, int j0, int lane) {
  if (!p.score_mod) return p.scale_softmax_log2;
  modify_scores_qmajor<kN, Bias>(s, p, b, h, i16, j0, lane);
  return 1.f;
}

// Element (row, col)'s score in log2 units from its raw score sv (-inf where masked), with dcap
// the cap's derivative (score_mod.h); without modifiers sv * scale_softmax_log2. A tile that is
// not masked may still hold rows past seqlen_q (never stored, and given no weight by the
// callers): as in modify_scores_qmajor they read the last row's bias, not past the bias's end.
template <typename Bias>
__device__ __forceinline__ float score_log2(const FwdParams& p, const ScoreModHead<Bias>& mod, int row, int col,
                                            float sv, float& dcap) {
  dcap = 1.f;
  if (!p.score_mod) return sv * p.scale_softmax_log2;
  return sv == kNegInf ? kNegInf : mod(min(row, p.seqlen_q - 1), min(col, p.seqlen_k - 1), sv, dcap) * kLog2e;
}

// Whether a whole (rows [i0, i1), keys [j0, j1)) tile is visible, so masking can be skipped.
__device__ __forceinline__ bool tile_fully_visible(const FwdParams& p, int i0, int i1, int j0, int j1) {
  const ColRange first = visible_cols(i0, p.seqlen_q, p.seqlen_k, p.window_size_left, p.window_size_right);
  const ColRange last = visible_cols(i1 - 1, p.seqlen_q, p.seqlen_k, p.window_size_left, p.window_size_right);
  return last.lo <= j0 && first.hi >= j1;
}

// Online softmax over one tile of raw scores s (masked entries -inf): update the running max m
// (log2 domain, i.e. times scale_log2, which the op layer makes positive) and the thread-partial
// sum l of both rows and turn s into unnormalised probabilities. Returns in alpha the factor the
// output accumulator's rows must be scaled by (kept separate so that a kernel can apply it once
// an in-flight MMA into the accumulator has finished). The scale is folded into each exponent's FFMA.
template <int kN>
__device__ __forceinline__ void online_softmax_probs(float (&s)[kN / 8][4], float (&m)[2], float (&l)[2],
                                                     float scale_log2, float (&alpha)[2]) {
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    float mx = kNegInf;
#pragma unroll
    for (int n = 0; n < kN / 8; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * hr], s[n][2 * hr + 1]));
    const float m_new = fmaxf(m[hr], quad_max(mx) * scale_log2);
    const float m_use = m_new == kNegInf ? 0.f : m_new;  // a row with nothing visible yet stays 0
    alpha[hr] = fast_exp2(m[hr] - m_use);
    m[hr] = m_new;
    float sum = 0.f;
#pragma unroll
    for (int n = 0; n < kN / 8; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float pv = fast_exp2(fmaf(s[n][2 * hr + e], scale_log2, -m_use));
        s[n][2 * hr + e] = pv;
        sum += pv;
      }
    l[hr] = l[hr] * alpha[hr] + sum;
  }
}

// Scale the rows (g, g + 8) of a query-major accumulator by alpha[0], alpha[1].
template <int kD>
__device__ __forceinline__ void scale_rows(float (&acc)[kD / 8][4], const float (&alpha)[2]) {
#pragma unroll
  for (int d = 0; d < kD / 8; ++d) {
    acc[d][0] *= alpha[0];
    acc[d][1] *= alpha[0];
    acc[d][2] *= alpha[1];
    acc[d][3] *= alpha[1];
  }
}

// Both at once: the step of kernels whose accumulator is not in flight.
template <int kN, int kD>
__device__ __forceinline__ void online_softmax(float (&s)[kN / 8][4], float (&acc)[kD / 8][4], float (&m)[2],
                                               float (&l)[2], float scale_log2) {
  float alpha[2];
  online_softmax_probs<kN>(s, m, l, scale_log2, alpha);
  scale_rows<kD>(acc, alpha);
}

}  // namespace flash::cuda
