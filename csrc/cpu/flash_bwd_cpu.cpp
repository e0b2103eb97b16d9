// CPU backward: per (batch, query head, split of the key blocks), walk the key/value blocks; for
// each, recompute P tile by tile from Q, K and the logsumexp, and accumulate dV, dK (per block) and
// dQ (per split; the op layer sums the splits in a fixed order, so results are deterministic).
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

#include "../block_mask.h"
#include "../seq_view.h"
#include "cpu_gemm.h"
#include "dropout_tile.h"
#include "flash_cpu.h"
#include "row_ops.h"
#include "score_mod_row.h"
#include "tile_geometry.h"

namespace flash::cpu {
namespace {

constexpr int kBlockM = 64;   // query rows per tile
constexpr int kBlockN = 128;  // keys per block
static_assert(kMaskBlock % kBlockM == 0 && kMaskBlock == kBlockN, "a tile lies in one mask block");
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kInf = std::numeric_limits<float>::infinity();

struct HeadGrads {
  const float *q, *k, *v, *o, *dout, *lse;
  float *dk_accum, *dv_accum;
  int b, h;
  uint32_t bh;
};

// p: a seq_view.
HeadGrads head_grads(const BwdParams& p, int b, int h) {
  const int hk = h / p.h_h_k_ratio;
  HeadGrads g;
  g.q = rows_of<const float>(p.q_ptr, b, h, p.q_row0, p.q_batch_stride, p.q_row_stride, p.q_head_stride);
  g.k = rows_of<const float>(p.k_ptr, b, hk, p.k_row0, p.k_batch_stride, p.k_row_stride, p.k_head_stride);
  g.v = rows_of<const float>(p.v_ptr, b, hk, p.k_row0, p.v_batch_stride, p.v_row_stride, p.v_head_stride);
  g.o = rows_of<const float>(p.o_ptr, b, h, p.q_row0, p.o_batch_stride, p.o_row_stride, p.o_head_stride);
  g.dout = rows_of<const float>(p.do_ptr, b, h, p.q_row0, p.do_batch_stride, p.do_row_stride, p.do_head_stride);
  g.b = b;
  g.h = h;
  g.bh = uint32_t(int64_t(b) * p.h + h);
  g.lse = lse_rows(p, b, h);
  g.dk_accum = p.dk_accum_ptr + kv_accum_row(p, b, h) * p.d;
  g.dv_accum = p.dv_accum_ptr + kv_accum_row(p, b, h) * p.d;
  return g;
}

struct Scratch {
  std::vector<float> rowsum_do_o, p, dp, dk, dv, dcap;
  std::vector<uint8_t> keep;
  Scratch(const BwdParams& prm)
      : rowsum_do_o(prm.seqlen_q), p(kBlockM * kBlockN),
        dp(kBlockM * kBlockN), dk(kBlockN * prm.d), dv(kBlockN * prm.d),
        dcap(prm.softcap > 0.f ? kBlockM * kBlockN : 0),
        keep(prm.p_dropout > 0.f ? kBlockM * kBlockN : 0) {}
};

// One (query tile, key block) step: P, dV += P_drop^T dO, dP, dS, dK += dS^T Q, dQ += dS K.
void tile_step(const BwdParams& p, const HeadGrads& g, int i0, int rows, int j0, int cols, float* dq, Scratch& w) {
  const int d = p.d;
  const bool dropout = p.p_dropout > 0.f;
  float* P = w.p.data();
  float* dP = w.dp.data();
  const float* q_i = g.q + i0 * p.q_row_stride;
  const float* do_i = g.dout + i0 * p.do_row_stride;
  const ScoreModHead<float> mod(p, g.b, g.h);
  float* dcap = w.dcap.empty() ? nullptr : w.dcap.data();

  gemm_rowmajor(false, true, rows, cols, d, 1.f, q_i, p.q_row_stride, g.k + j0 * p.k_row_stride,
                p.k_row_stride, 0.f, P, kBlockN);
  if (dropout)
    dropout_keep_tile(w.keep.data(), kBlockN, i0, rows, j0, cols, g.bh, p.philox_seed,
                      p.philox_offset, p.dropout_threshold16);
  for (int r = 0; r < rows; ++r) {
    float* prow = P + r * kBlockN;
    const float lse = g.lse[i0 + r];
    ColRange c = clip_to_tile(row_cols(p, i0 + r), j0, cols);
    if (lse == -kInf) c.hi = c.lo;  // the row attends to nothing (a bias of -inf on every key)
    const float scale = modify_row(p, mod, prow, i0 + r, j0, c, cols, dcap ? dcap + r * kBlockN : nullptr);
    if (c.hi > c.lo) exp2_rescale_sum(prow + c.lo, c.hi - c.lo, scale, lse * kLog2e);
    fill_row(prow, c.lo, 0.f);
    fill_row(prow + c.hi, cols - c.hi, 0.f);
    if (dropout) apply_keep(dP + r * kBlockN, prow, w.keep.data() + r * kBlockN, cols, p.rp_dropout);
  }
  // dV_j += P_drop^T dO_i (P_drop staged in dP when dropout is on)
  gemm_rowmajor(true, false, cols, d, rows, 1.f, dropout ? dP : P, kBlockN, do_i, p.do_row_stride, 1.f,
                w.dv.data(), d);
  // dP = dO_i V_j^T
  gemm_rowmajor(false, true, rows, cols, d, 1.f, do_i, p.do_row_stride, g.v + j0 * p.v_row_stride,
                p.v_row_stride, 0.f, dP, kBlockN);
  for (int r = 0; r < rows; ++r) {
    float* dprow = dP + r * kBlockN;
    if (dropout) apply_keep(dprow, dprow, w.keep.data() + r * kBlockN, cols, p.rp_dropout);
    float* ds = P + r * kBlockN;
    softmax_grad_row(ds, dprow, cols, w.rowsum_do_o[i0 + r]);  // P becomes dS = dL/dscore
    if (p.dbias_ptr != nullptr)
      std::copy(ds, ds + cols, static_cast<float*>(p.dbias_ptr) + dbias_index(p, g.b, g.h, i0 + r, j0));
    if (dcap != nullptr)  // through the cap: dL/d(scale q.k)
      for (int col = 0; col < cols; ++col) ds[col] *= dcap[r * kBlockN + col];
  }
  // dK_j += scale * dS^T Q_i ; dQ_i += scale * dS K_j
  gemm_rowmajor(true, false, cols, d, rows, p.scale_softmax, P, kBlockN, q_i, p.q_row_stride, 1.f,
                w.dk.data(), d);
  gemm_rowmajor(false, false, rows, d, cols, p.scale_softmax, P, kBlockN, g.k + j0 * p.k_row_stride,
                p.k_row_stride, 1.f, dq + int64_t(i0) * d, d);
}

// Key blocks [block_begin, block_end) of one head; dq is this split's (seqlen_q, d) partial sum.
void head_backward(const BwdParams& p, const HeadGrads& g, int block_begin, int block_end, float* dq, Scratch& w) {
  const int d = p.d;
  // D = rowsum(dO * O): the softmax-gradient correction, identical with or without dropout.
  for (int i = 0; i < p.seqlen_q; ++i)
    w.rowsum_do_o[i] = dot(g.dout + i * p.do_row_stride, g.o + i * p.o_row_stride, d);
  std::fill(dq, dq + int64_t(p.seqlen_q) * d, 0.f);

  for (int j0 = block_begin * kBlockN; j0 < std::min(p.seqlen_k, block_end * kBlockN); j0 += kBlockN) {
    const int cols = std::min(kBlockN, p.seqlen_k - j0);
    std::fill(w.dk.begin(), w.dk.end(), 0.f);
    std::fill(w.dv.begin(), w.dv.end(), 0.f);
    for (int i0 = 0; i0 < p.seqlen_q; i0 += kBlockM) {
      const int rows = std::min(kBlockM, p.seqlen_q - i0);
      if (tile_visible(p, i0, i0 + rows, j0, j0 + cols) && block_kept(p, g.b, g.h, i0 / kMaskBlock, j0 / kMaskBlock))
        tile_step(p, g, i0, rows, j0, cols, dq, w);
    }
    std::copy(w.dk.begin(), w.dk.begin() + int64_t(cols) * d, g.dk_accum + int64_t(j0) * d);
    std::copy(w.dv.begin(), w.dv.begin() + int64_t(cols) * d, g.dv_accum + int64_t(j0) * d);
  }
}

}  // namespace

int bwd_num_splits(int batch, int heads, int seqlen_k) {
  // Enough tasks to keep every thread busy when batch * heads is small; each split costs one
  // (seqlen_q, d) float32 partial dQ, so memory stays linear.
  const int64_t heads_total = std::max<int64_t>(1, int64_t(batch) * heads);
  const int64_t want = (at::get_num_threads() + heads_total - 1) / heads_total;
  return int(std::clamp<int64_t>(want, 1, std::max(1, ceil_div(seqlen_k, kBlockN))));
}

void run_bwd(const BwdParams& p) {
  const int64_t tasks = int64_t(p.b) * p.h * p.num_splits;
  if (tasks == 0) return;
  const int n_blocks = ceil_div(p.seqlen_k, kBlockN);
  const int per_split = ceil_div(n_blocks, p.num_splits);
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    Scratch w(p);
    for (int64_t t = begin; t < end; ++t) {
      const int split = int(t % p.num_splits);
      const int64_t bh = t / p.num_splits;
      const int b = int(bh / p.h), h = int(bh % p.h);
      const BwdParams ps = seq_view(p, b);
      // dQ partial sums (b, h, split, seqlen_q, d), or with varlen (h, split, total_q, d).
      const bool packed = p.cu_seqlens_q != nullptr;
      const int64_t slab = int64_t(packed ? p.total_q : p.seqlen_q) * p.d;
      float* dq = p.dq_accum_ptr + ((int64_t(packed ? 0 : b) * p.h + h) * p.num_splits + split) * slab +
                  int64_t(ps.q_row0) * p.d;
      head_backward(ps, head_grads(ps, b, h), split * per_split, std::min(ceil_div(ps.seqlen_k, kBlockN), (split + 1) * per_split),
                    dq, w);
    }
  });
}

}  // namespace flash::cpu
