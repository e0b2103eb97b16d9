// The backward's helper kernels: the pre-pass D = rowsum(dO * O), the conversion of the atomic
// mode's float32 dQ accumulator to dQ, and the deterministic dQ kernel (one CTA per query block,
// no atomics: it recomputes P and dS and accumulates dQ = dS K in a fixed order). The main kernel
// is in flash_bwd_dkdv_kernel.cuh.
#pragma once

#include "flash_fwd_kernel.cuh"
#include "flash_launch.h"

namespace flash::cuda {

// The two element-wise kernels below run on (row blocks, h, batch) grids, so that a thread finds
// its head and row without 64-bit divisions (both are bound by memory bandwidth, and the index
// arithmetic of a flat grid cost a large share of their issue slots).
inline constexpr int kBwdRowKernelThreads = 256;
inline constexpr int kDotDoOLanes = 8;  // the pre-pass's lanes per row
inline constexpr int kDotDoORows = kBwdRowKernelThreads / kDotDoOLanes;
inline constexpr int kConvertDqRows = 64;

// D[b, h, i] = sum_d dO[b, i, h, d] * O[b, i, h, d], eight lanes per row, 16-byte loads (d is a
// multiple of 8), over each sequence's padded rows of padded_query_rows (their D is 0). Where set,
// it also writes the row's base-2 logsumexp and zeroes the row's dQ accumulator (kHeadDim floats).
// Grid: (padded_query_rows(seqlen_q) / kDotDoORows, h, batch); with varlen, the longest sequence's rows.
template <typename Elem, int kHeadDim>
__global__ void __launch_bounds__(kBwdRowKernelThreads) flash_bwd_dot_do_o_kernel(const BwdParams params) {
  constexpr int kLanes = kDotDoOLanes, kRows = kDotDoORows;
  static_assert(kDqAccumRowPad % kRows == 0, "blocks of rows tile the padded rows, so whole warps return together");
  const int h = blockIdx.y, b = blockIdx.z;
  const int i = blockIdx.x * kRows + threadIdx.x / kLanes, lane = threadIdx.x % kLanes;
  const BwdParams p = seq_view(params, b);
  if (i >= padded_query_rows(p.seqlen_q)) return;  // varlen: past this sequence's padded rows (whole blocks)
  float sum = 0.f;
  if (i < p.seqlen_q) {
    const Elem* o = rows_of<const Elem>(p.o_ptr, b, h, p.q_row0 + i, p.o_batch_stride, p.o_row_stride, p.o_head_stride);
    const Elem* dout =
        rows_of<const Elem>(p.do_ptr, b, h, p.q_row0 + i, p.do_batch_stride, p.do_row_stride, p.do_head_stride);
    for (int c = lane * 8; c < p.d; c += kLanes * 8) {
      const uint4 ov = *reinterpret_cast<const uint4*>(o + c), dv = *reinterpret_cast<const uint4*>(dout + c);
      const Elem* oe = reinterpret_cast<const Elem*>(&ov);
      const Elem* de = reinterpret_cast<const Elem*>(&dv);
#pragma unroll
      for (int e = 0; e < 8; ++e) sum += to_float(oe[e]) * to_float(de[e]);
    }
  }
  const int64_t at = stat_row(p, b, h) + i;
  if (p.dq_accum_ptr != nullptr) {
    float* acc = p.dq_accum_ptr + at * kHeadDim;
#pragma unroll
    for (int c = lane * 4; c < kHeadDim; c += kLanes * 4) *reinterpret_cast<float4*>(acc + c) = float4{0.f, 0.f, 0.f, 0.f};
  }
#pragma unroll
  for (int off = kLanes / 2; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (lane == 0) {
    p.dsoftmax_sum_ptr[at] = sum;
    if (p.softmax_lse_log2_ptr != nullptr) {
      const float l = i < p.seqlen_q ? lse_rows(p, b, h)[i] : kNegInf;
      p.softmax_lse_log2_ptr[at] = l == kNegInf ? 0.f : l * kLog2e;
    }
  }
}

// dQ (batch, seqlen_q, h, d) in the input dtype from the float32 accumulator of the atomic mode
// (rows as stat_row() places them, columns as dq_accum_col places them), times softmax_scale; four
// elements per step of a thread (d is a multiple of 8). Grid: (blocks of kConvertDqRows rows of
// seqlen_q, h, batch); with varlen, the longest sequence's rows.
template <typename Elem, int kHeadDim>
__global__ void __launch_bounds__(kBwdRowKernelThreads) flash_bwd_convert_dq_kernel(const BwdParams params) {
  constexpr int kRows = kConvertDqRows, kQuads = kHeadDim / 4;
  const int h = blockIdx.y, b = blockIdx.z, i0 = blockIdx.x * kRows;
  const BwdParams p = seq_view(params, b);
  if (i0 >= p.seqlen_q) return;  // varlen: past this sequence's rows
  const float* acc = p.dq_accum_ptr + (stat_row(p, b, h) + i0) * kHeadDim;
  Elem* dq = rows_of<Elem>(p.dq_ptr, b, h, p.q_row0 + i0, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride);
  const int rows = min(kRows, p.seqlen_q - i0);
  const float sc = p.scale_softmax;
#pragma unroll 4
  for (int e = threadIdx.x; e < kRows * kQuads; e += kBwdRowKernelThreads) {
    const int r = e / kQuads, c = e % kQuads * 4;  // constant divisor
    if (r >= rows || c >= p.d) continue;
    const float4 x = *reinterpret_cast<const float4*>(acc + r * kHeadDim + dq_accum_col(p.dq_accum_swizzled, i0 + r, c, kHeadDim));
    uint2 packed;
    packed.x = pack2<Elem>(x.x * sc, x.y * sc);
    packed.y = pack2<Elem>(x.z * sc, x.w * sc);
    *reinterpret_cast<uint2*>(dq + r * p.dq_row_stride + c) = packed;
  }
}

template <typename T>
__global__ void __launch_bounds__(T::kNThreads) flash_bwd_dq_kernel(const BwdParams params) {
  using Elem = typename T::Elem;
  constexpr int kD = T::kHeadDim, kM = T::kBlockM, kN = T::kBlockN, kS = T::kStride, kMT = T::kMTiles;
  extern __shared__ __align__(16) char smem_raw[];
  Elem* sQ = reinterpret_cast<Elem*>(smem_raw);
  Elem* sK = sQ + T::kSmemQ;
  Elem* sV = sK + T::kSmemKV;
  Elem* sdO = sV + T::kSmemKV;

  const int m0 = blockIdx.x * kM, h = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4;
  const BwdParams p = seq_view(params, b);
  if (m0 >= p.seqlen_q) return;  // varlen: past this sequence's rows
  const HeadPtrs<Elem> hp = head_ptrs<Elem>(p, b, h);
  const Elem* dout = rows_of<const Elem>(p.do_ptr, b, h, p.q_row0, p.do_batch_stride, p.do_row_stride, p.do_head_stride);
  const float* lse_h = lse_rows(p, b, h);
  const float* dsum_h = p.dsoftmax_sum_ptr + stat_row(p, b, h);
  const bool dropout = p.p_dropout > 0.f;
  const DropoutState ds = dropout ? dropout_state_bwd(p) : DropoutState{};
  const ScoreModHead<Elem> mod(p, b, h);
  const int warp_row = warp * 16 * kMT;  // first query of this warp, relative to m0
  float lse2[kMT][2], dsum[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int row = m0 + warp_row + mt * 16 + g + 8 * hr;
      const bool ok = row < p.seqlen_q;
      lse2[mt][hr] = ok ? lse_h[row] * kLog2e : 0.f;
      dsum[mt][hr] = ok ? dsum_h[row] : 0.f;
    }

  const TileSeq tiles = key_tiles<kN>(p, b, h, m0, kM);
  load_tile_async<kM, kD, T::kNThreads>(sQ, hp.q + m0 * p.q_row_stride, p.q_row_stride, p.seqlen_q - m0, p.d, tid);
  load_tile_async<kM, kD, T::kNThreads>(sdO, dout + m0 * p.do_row_stride, p.do_row_stride, p.seqlen_q - m0, p.d, tid);

  float dq[kMT][kD / 8][4];
  zero<kD>(dq);
  for (int it = 0; it < tiles.count; ++it) {
    const int j0 = tiles[it] * kN;
    load_tile_async<kN, kD, T::kNThreads>(sK, hp.k + j0 * p.k_row_stride, p.k_row_stride, p.seqlen_k - j0, p.d, tid);
    load_tile_async<kN, kD, T::kNThreads>(sV, hp.v + j0 * p.v_row_stride, p.v_row_stride, p.seqlen_k - j0, p.d, tid);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    float s[kMT][kN / 8][4], dp[kMT][kN / 8][4];
    zero<kN>(s);
    zero<kN>(dp);
    // S = Q K^T and dP = dO V^T
    gemm_smem_pair<Elem, kMT, kN, kD, kS, kS, false, false>(s, sQ + warp_row * kS, sK, dp, sdO + warp_row * kS, sV,
                                                            lane);
    const bool masked = !tile_fully_visible(p, m0, m0 + kM, j0, j0 + kN);
    uint32_t a[kMT][kN / 16][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      if (masked) mask_tile_qmajor<kN>(s[mt], p, m0 + warp_row + mt * 16, j0, lane);
      const bool mod_in_place = p.score_mod && p.softcap == 0.f;  // as in flash_bwd_dkdv_kernel
      if (mod_in_place) modify_scores_qmajor<kN, Elem>(s[mt], p, b, h, m0 + warp_row + mt * 16, j0, lane);
#pragma unroll
      for (int c = 0; c < kN / 16; ++c) {
        bool keep[2][4];
        if (dropout) dropout_keep_qmajor(keep, ds, hp.bh, m0 + warp_row + mt * 16, j0 + c * 16, lane);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const int row = m0 + warp_row + mt * 16 + g + 8 * (r >> 1);
            const int col = j0 + (2 * c + hh) * 8 + 2 * (lane % 4) + (r & 1);
            float dcap = 1.f;
            const float sv = mod_in_place ? s[mt][2 * c + hh][r] : score_log2(p, mod, row, col, s[mt][2 * c + hh][r], dcap);
            const float pv = sv == kNegInf ? 0.f : fast_exp2(sv - lse2[mt][r >> 1]);
            float x = dp[mt][2 * c + hh][r];
            if (dropout) x = keep[hh][r] ? x * p.rp_dropout : 0.f;
            dp[mt][2 * c + hh][r] = pv * (x - dsum[mt][r >> 1]) * p.scale_softmax * dcap;  // dS
          }
      }
      acc_to_a<Elem, kN>(a[mt], dp[mt]);
    }
    gemm_rs<Elem, kMT, kN, kD, kS>(dq, a, sK, lane);  // dQ += dS K
    __syncthreads();  // every warp is done with sK, sV
  }

  Elem* dqp = rows_of<Elem>(p.dq_ptr, b, h, p.q_row0, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride);
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int row = m0 + warp_row + mt * 16 + g + 8 * hr;
      if (row < p.seqlen_q) store_acc_row<Elem, kD>(dqp + row * p.dq_row_stride, dq[mt], hr, 1.f, p.d, lane);
    }
}

}  // namespace flash::cuda
