// The forward kernel: one CTA per (query block, head, batch). Q is loaded once; K and V tiles
// stream through shared memory (V's copy overlaps S = QK^T, the next K's copy overlaps the
// softmax and PV); the online softmax runs in registers in the log2 domain; O and the float32
// logsumexp are written once.
#pragma once

#include "../block_mask.h"
#include "../flash_params.h"
#include "../seq_view.h"
#include "dropout_frag.cuh"
#include "kernel_traits.cuh"
#include "softmax_frag.cuh"

namespace flash::cuda {

template <typename Elem>
struct HeadPtrs {
  const Elem *q, *k, *v;
  uint32_t bh;  // batch * h + head: the dropout stream and the row of lse
};

// p: a seq_view (q, k and v start at the sequence's first rows).
template <typename Elem>
__device__ __forceinline__ HeadPtrs<Elem> head_ptrs(const FwdParams& p, int b, int h) {
  const int hk = h / p.h_h_k_ratio;
  return HeadPtrs<Elem>{rows_of<const Elem>(p.q_ptr, b, h, p.q_row0, p.q_batch_stride, p.q_row_stride, p.q_head_stride),
                        rows_of<const Elem>(p.k_ptr, b, hk, p.k_row0, p.k_batch_stride, p.k_row_stride, p.k_head_stride),
                        rows_of<const Elem>(p.v_ptr, b, hk, p.k_row0, p.v_batch_stride, p.v_row_stride, p.v_head_stride),
                        uint32_t(b) * uint32_t(p.h) + uint32_t(h)};
}

__device__ __forceinline__ ColRange cols_of(const FwdParams& p, int row) {
  return visible_cols(row, p.seqlen_q, p.seqlen_k, p.window_size_left, p.window_size_right);
}

// Key blocks [begin, end) that the query rows [m0, m0 + rows) can see.
template <int kBlockN>
__device__ __forceinline__ void key_block_range(const FwdParams& p, int m0, int rows, int& begin, int& end) {
  const int last = min(m0 + rows, p.seqlen_q) - 1;
  const ColRange first_r = cols_of(p, m0), last_r = cols_of(p, last);
  begin = first_r.lo / kBlockN;
  end = (max(first_r.lo, last_r.hi) + kBlockN - 1) / kBlockN;
}

// The key blocks the query rows [m0, m0 + rows) of head (b, h) visit, ascending: the range above,
// cut to the block mask's kept blocks when there is one (rows lie within one mask block).
// kMaybeMasked = false: the caller knows there is no mask, and the walk folds to counting.
template <int kBlockN, bool kMaybeMasked = true>
__device__ __forceinline__ TileSeq key_tiles(const FwdParams& p, int b, int h, int m0, int rows) {
  int begin, end;
  key_block_range<kBlockN>(p, m0, rows, begin, end);
  return tile_seq<kBlockN>(kMaybeMasked ? kept_key_blocks(p, b, h, m0 / kMaskBlock) : nullptr, begin, end);
}

// Split-KV (FwdParams::num_splits): split `split`'s share of a query block's key tiles, a
// contiguous run of the walk.
__device__ __forceinline__ TileSeq split_share(TileSeq tiles, int num_splits, int split) {
  if (num_splits > 1) {
    const int share = (tiles.count + num_splits - 1) / num_splits, first = min(tiles.count, split * share);
    tiles.first += first;
    tiles.count = min(share, tiles.count - first);
  }
  return tiles;
}

// Zero the dropped probabilities of a query-major (16 x kN) tile at (i16, j0).
template <int kN>
__device__ __forceinline__ void dropout_qmajor(float (&s)[kN / 8][4], const DropoutState& ds, uint32_t bh, int i16,
                                               int j0, int lane) {
#pragma unroll
  for (int c = 0; c < kN / 16; ++c) {
    bool keep[2][4];
    dropout_keep_qmajor(keep, ds, bh, i16, j0 + c * 16, lane);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
      for (int r = 0; r < 4; ++r)
        if (!keep[hh][r]) s[2 * c + hh][r] = 0.f;
  }
}

// Write the logsumexp of the thread's two rows of a 16-row output tile (row0 = the tile's first
// row + g, and row0 + 8) of head (b, h) (-inf where nothing was seen), and return through scale
// what their outputs are multiplied by: the dropout rescale over the softmax sum (0 where nothing
// was seen). p: a seq_view.
__device__ __forceinline__ void write_lse(const FwdParams& p, float* lse, int row0, const float (&m)[2],
                                          const float (&l)[2], int lane, float (&scale)[2]) {
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int row = row0 + 8 * hr;
    const float lsum = quad_sum(l[hr]);
    scale[hr] = lsum > 0.f ? p.rp_dropout / lsum : 0.f;
    if (row < p.seqlen_q && lane % 4 == 0) lse[row] = lsum > 0.f ? (m[hr] + __log2f(lsum)) * kLn2 : kNegInf;
  }
}

__device__ __forceinline__ void write_lse(const FwdParams& p, int b, int h, int row0, const float (&m)[2],
                                          const float (&l)[2], int lane, float (&scale)[2]) {
  write_lse(p, lse_rows(p, b, h), row0, m, l, lane, scale);
}

// Split-KV: the same rows' logsumexp and normalised outputs as split `split`'s float32 partials
// (FwdParams::num_splits).
template <int kD>
__device__ __forceinline__ void write_split_partial(const FwdParams& p, int b, int h, int split, int row0,
                                                    const float (&acc)[kD / 8][4], const float (&m)[2],
                                                    const float (&l)[2], int lane) {
  const int64_t base =
      split * p.lse_accum_split_stride + b * p.lse_batch_stride + h * p.lse_head_stride + p.q_row0;
  float scale[2];
  write_lse(p, p.lse_accum_ptr + base, row0, m, l, lane, scale);
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int row = row0 + 8 * hr;
    if (row >= p.seqlen_q) continue;
    float2* dst = reinterpret_cast<float2*>(p.o_accum_ptr + (base + row) * p.d + 2 * (lane % 4));
#pragma unroll
    for (int dt = 0; dt < kD / 8; ++dt)
      if (dt * 8 + 2 * (lane % 4) < p.d)
        dst[dt * 4] = make_float2(acc[dt][2 * hr] * scale[hr], acc[dt][2 * hr + 1] * scale[hr]);
  }
}

// The same rows' logsumexp, and their outputs normalised and stored.
template <typename Elem, int kD>
__device__ __forceinline__ void write_o_lse(const FwdParams& p, int b, int h, int row0, const float (&acc)[kD / 8][4],
                                            const float (&m)[2], const float (&l)[2], int lane) {
  float scale[2];
  write_lse(p, b, h, row0, m, l, lane, scale);
  Elem* o = rows_of<Elem>(p.o_ptr, b, h, p.q_row0, p.o_batch_stride, p.o_row_stride, p.o_head_stride);
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int row = row0 + 8 * hr;
    if (row < p.seqlen_q) store_acc_row<Elem, kD>(o + row * p.o_row_stride, acc, hr, scale[hr], p.d, lane);
  }
}

// kDropout: a separate instantiation, so the common path carries no Philox code or registers.
template <typename T, bool kDropout>
__global__ void __launch_bounds__(T::kNThreads) flash_fwd_kernel(const FwdParams params) {
  using Elem = typename T::Elem;
  constexpr int kD = T::kHeadDim, kM = T::kBlockM, kN = T::kBlockN, kS = T::kStride, kMT = T::kMTiles;
  extern __shared__ __align__(16) char smem_raw[];
  Elem* sQ = reinterpret_cast<Elem*>(smem_raw);
  Elem* sK = sQ + T::kSmemQ;                   // kKVStages buffers
  Elem* sV = sK + T::kKVStages * T::kSmemKV;  // kKVStages buffers

  // Last query block first: under a causal mask it has the most keys, so the long blocks start
  // early and the short ones fill the tail of the grid.
  const int m0 = (gridDim.x - 1 - blockIdx.x) * kM, h = blockIdx.y;
  const int b = blockIdx.z / params.num_splits, split = blockIdx.z % params.num_splits;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4;
  static_assert(kPageBlockMultiple % kN == 0, "a paged cache's pages must hold whole key tiles");
  constexpr bool dropout = kDropout;
  DropoutState ds{};
  if (dropout) {
    ds = dropout_state_fwd(params);
    if (params.rng_state_ptr != nullptr && blockIdx.x == 0 && h == 0 && b == 0 && tid == 0) {
      params.rng_state_ptr[0] = int64_t(ds.seed);
      params.rng_state_ptr[1] = int64_t(ds.offset);
    }
  }
  const FwdParams p = seq_view(params, b);
  if (m0 >= p.seqlen_q) return;  // varlen: past this sequence's rows
  const HeadPtrs<Elem> hp = head_ptrs<Elem>(p, b, h);

  const TileSeq tiles = split_share(key_tiles<kN>(p, b, h, m0, kM), p.num_splits, split);
  const int warp_row = warp * 16 * kMT;  // first query of this warp, relative to m0

  float acc[kMT][kD / 8][4];
  float m[kMT][2], l[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
    zero<kD>(acc[mt]);
    m[mt][0] = m[mt][1] = kNegInf;
    l[mt][0] = l[mt][1] = 0.f;
  }

  const auto load_k = [&](int nb, Elem* dst) {
    load_tile_async<kN, kD, T::kNThreads>(dst, hp.k + key_tile_row(p, b, nb * kN) * p.k_row_stride, p.k_row_stride,
                                          p.seqlen_k - nb * kN, p.d, tid);
  };
  const auto load_v = [&](int nb, Elem* dst) {
    load_tile_async<kN, kD, T::kNThreads>(dst, hp.v + key_tile_row(p, b, nb * kN) * p.v_row_stride, p.v_row_stride,
                                          p.seqlen_k - nb * kN, p.d, tid);
  };
  load_tile_async<kM, kD, T::kNThreads>(sQ, hp.q + m0 * p.q_row_stride, p.q_row_stride, p.seqlen_q - m0, p.d, tid);
  if (tiles.count > 0) {
    load_k(tiles[0], sK);
    if (T::kKVStages == 2) load_v(tiles[0], sV);
  }
  cp_async_commit();

  for (int it = 0; it < tiles.count; ++it) {
    const int nb = tiles[it], j0 = nb * kN, cur = T::kKVStages == 2 ? it & 1 : 0;
    const bool has_next = it + 1 < tiles.count;
    const int nb_next = has_next ? tiles[it + 1] : 0;
    Elem* sKc = sK + cur * T::kSmemKV;
    Elem* sVc = sV + cur * T::kSmemKV;
    cp_async_wait<0>();
    __syncthreads();  // K_j (and Q; V_j too with two stages) are in; every warp is done with the previous V
    if (T::kKVStages == 1) {
      load_v(nb, sV);
      cp_async_commit();
    } else if (has_next) {
      load_k(nb_next, sK + (cur ^ 1) * T::kSmemKV);
      load_v(nb_next, sV + (cur ^ 1) * T::kSmemKV);
      cp_async_commit();
    }

    float s[kMT][kN / 8][4];
    zero<kN>(s);
    gemm_ss<Elem, kMT, kN, kD, kS>(s, sQ + warp_row * kS, sKc, lane);
    float scale_log2 = p.scale_softmax_log2;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) scale_log2 = prepare_scores_qmajor<kN, Elem>(s[mt], p, b, h, m0 + warp_row + mt * 16, j0, lane);
    const bool masked = !tile_fully_visible(p, m0, m0 + kM, j0, j0 + kN);
    if (masked)
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) mask_tile_qmajor<kN>(s[mt], p, m0 + warp_row + mt * 16, j0, lane);

    if (T::kKVStages == 1) {
      cp_async_wait<0>();
      __syncthreads();  // V_j is in; every warp is done with K_j
      if (has_next) {
        load_k(nb_next, sK);
        cp_async_commit();
      }
    }

    uint32_t a[kMT][kN / 16][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      online_softmax<kN, kD>(s[mt], acc[mt], m[mt], l[mt], scale_log2);
      if (dropout) dropout_qmajor<kN>(s[mt], ds, hp.bh, m0 + warp_row + mt * 16, j0, lane);
      acc_to_a<Elem, kN>(a[mt], s[mt]);
    }
    gemm_rs<Elem, kMT, kN, kD, kS>(acc, a, sVc, lane);
  }

#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
    const int row0 = m0 + warp_row + mt * 16 + g;
    if (p.num_splits > 1) write_split_partial<kD>(p, b, h, split, row0, acc[mt], m[mt], l[mt], lane);
    else write_o_lse<Elem, kD>(p, b, h, row0, acc[mt], m[mt], l[mt], lane);
  }
}

// return_attn_probs: once the logsumexp is known, recompute each score tile and write the exact
// probabilities (negated where dropout drops) to p_ptr (FwdParams::p_batch_stride), float32.
template <typename T>
__global__ void __launch_bounds__(T::kNThreads) flash_fwd_probs_kernel(const FwdParams params) {
  using Elem = typename T::Elem;
  constexpr int kD = T::kHeadDim, kM = T::kBlockM, kN = T::kBlockN, kS = T::kStride;
  extern __shared__ __align__(16) char smem_raw[];
  Elem* sQ = reinterpret_cast<Elem*>(smem_raw);
  Elem* sK = sQ + T::kSmemQ;

  const int m0 = blockIdx.x * kM, h = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const FwdParams p = seq_view(params, b);
  if (m0 >= p.seqlen_q) return;  // varlen: past this sequence's rows (the op layer zeroed them)
  const HeadPtrs<Elem> hp = head_ptrs<Elem>(p, b, h);
  const float* lse_h = lse_rows(p, b, h);
  float* probs = p.p_ptr + b * p.p_batch_stride + h * p.p_head_stride;
  const bool dropout = p.p_dropout > 0.f;
  const DropoutState ds = dropout ? dropout_state_bwd(p) : DropoutState{};

  load_tile_async<kM, kD, T::kNThreads>(sQ, hp.q + m0 * p.q_row_stride, p.q_row_stride, p.seqlen_q - m0, p.d, tid);
  for (int j0 = 0; j0 < p.seqlen_k; j0 += kN) {
    load_tile_async<kN, kD, T::kNThreads>(sK, hp.k + j0 * p.k_row_stride, p.k_row_stride, p.seqlen_k - j0, p.d, tid);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    const bool kept = block_kept(p, b, h, m0 / kMaskBlock, j0 / kMaskBlock);
    for (int mt = 0; mt < T::kMTiles; ++mt) {  // 16-row tiles of this warp, one at a time
    const int i16 = m0 + (warp * T::kMTiles + mt) * 16, row0 = i16 + g;
    const ColRange rows[2] = {cols_of(p, row0), cols_of(p, row0 + 8)};
    float lse2[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int row = row0 + 8 * hr;
      const float lse = row < p.seqlen_q ? lse_h[row] : kNegInf;
      lse2[hr] = lse == kNegInf ? 0.f : lse * kLog2e;
    }
    float s[kN / 8][4];
    zero<kN>(s);
    gemm_ss<Elem, kN, kD, kS>(s, sQ + (i16 - m0) * kS, sK, lane);
    if (p.score_mod) modify_scores_qmajor<kN, Elem>(s, p, b, h, i16, j0, lane);
    else scale_acc<kN>(s, p.scale_softmax_log2);
    mask_qmajor<kN>(s, j0, rows, lane);
    bool keep[kN / 16][2][4];
#pragma unroll
    for (int c = 0; c < kN / 16; ++c) {
      if (dropout) dropout_keep_qmajor(keep[c], ds, hp.bh, i16, j0 + c * 16, lane);
    }
#pragma unroll
    for (int n = 0; n < kN / 8; ++n)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int row = row0 + 8 * (r >> 1), col = j0 + n * 8 + 2 * t + (r & 1);
        if (row >= p.seqlen_q || col >= p.seqlen_k) continue;
        float prob = kept ? fast_exp2(s[n][r] - lse2[r >> 1]) : 0.f;
        if (dropout && !keep[n / 2][n % 2][r]) prob = -prob;
        probs[row * p.p_row_stride + col] = prob;
      }
    }
    __syncthreads();  // before the next K tile overwrites sK
  }
}

}  // namespace flash::cuda
