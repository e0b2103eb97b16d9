// CPU forward: for each (batch, head, query block) stream the key/value blocks, keep a running
// row max and sum, rescale the accumulator, and never hold more than one tile of scores.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <limits>
#include <type_traits>
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

constexpr int kBlockM = 256;  // query rows per task (kMaskBlock with a block mask)
constexpr int kBlockN = 512;  // keys per tile (kMaskBlock with a block mask)
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kInf = std::numeric_limits<float>::infinity();

// KV: K and V's element type; float, or a 16-bit KV cache read in place (key_rows converts).
// A paged cache is read in place too (key_rows follows the block table).
template <typename KV>
struct HeadView {
  const float* q;
  const KV* k;
  const KV* v;
  float* o;
  float* lse;
  float* probs;  // (seqlen_q, seqlen_k) for this head, or nullptr
  int b, h;
  uint32_t bh;
};

// p: a seq_view.
template <typename KV>
HeadView<KV> head_view(const FwdParams& p, int b, int h) {
  const int hk = h / p.h_h_k_ratio;
  HeadView<KV> v;
  v.q = rows_of<const float>(p.q_ptr, b, h, p.q_row0, p.q_batch_stride, p.q_row_stride, p.q_head_stride);
  v.k = rows_of<const KV>(p.k_ptr, b, hk, p.k_row0, p.k_batch_stride, p.k_row_stride, p.k_head_stride);
  v.v = rows_of<const KV>(p.v_ptr, b, hk, p.k_row0, p.v_batch_stride, p.v_row_stride, p.v_head_stride);
  v.o = rows_of<float>(p.o_ptr, b, h, p.q_row0, p.o_batch_stride, p.o_row_stride, p.o_head_stride);
  v.b = b;
  v.h = h;
  v.bh = uint32_t(int64_t(b) * p.h + h);
  v.lse = lse_rows(p, b, h);
  v.probs = p.p_ptr ? p.p_ptr + b * p.p_batch_stride + h * p.p_head_stride : nullptr;
  return v;
}

struct Scratch {
  std::vector<float> s, acc, m, l, rows;  // rows: a K or V tile in float32 (key_rows)
  std::vector<uint8_t> keep;
  Scratch(int d, bool dropout, bool tile_copies)
      : s(kBlockM * kBlockN), acc(kBlockM * d), m(kBlockM), l(kBlockM), rows(tile_copies ? kBlockN * d : 0),
        keep(dropout ? kBlockM * kBlockN : 0) {}
};

template <typename KV>
void row_to_float(const KV* src, float* dst, int d) {
  if constexpr (std::is_same_v<KV, float>) {
    std::copy(src, src + d, dst);
  } else {
    using V16 = at::vec::Vectorized<KV>;
    int c = 0;
    for (; c + V16::size() <= d; c += V16::size()) {
      auto [lo, hi] = at::vec::convert_to_float<KV>(V16::loadu(src + c));
      lo.store(dst + c);
      hi.store(dst + c + V16::size() / 2);
    }
    for (; c < d; ++c) dst[c] = float(src[c]);
  }
}

// Keys [j0, j0 + n) of sequence b in K or V (x: its row 0, row stride ld) as float32: in place
// where they are float32 rows one after another, else converted (a 16-bit cache) or gathered
// from their pages (a tile that spans pages) into w.rows; ld_out: the returned rows' stride. A
// paged tile has the same width as a contiguous one, so both give the same sums, bit for bit.
template <typename KV>
const float* key_rows(const FwdParams& p, int b, const KV* x, int64_t ld, int j0, int n, Scratch& w,
                      int64_t& ld_out) {
  const int page = p.block_table != nullptr ? p.page_block_size : 0;
  if constexpr (std::is_same_v<KV, float>) {
    if (page == 0 || j0 % page + n <= page) {
      ld_out = ld;
      return x + key_tile_row(p, b, j0) * ld;
    }
  }
  for (int r = 0; r < n;) {  // runs of rows within one page
    const int run = page == 0 ? n - r : std::min(n - r, page - (j0 + r) % page);
    const KV* src = x + key_tile_row(p, b, j0 + r) * ld;
    for (int i = 0; i < run; ++i) row_to_float(src + i * ld, w.rows.data() + int64_t(r + i) * p.d, p.d);
    r += run;
  }
  ld_out = p.d;
  return w.rows.data();
}

// Scores of rows [i0, i0+rows) against keys [j0, j0+cols) into w.s (ld kBlockN), and the
// tile's dropout keep-mask into w.keep when dropout is on.
template <typename KV>
void score_tile(const FwdParams& p, const HeadView<KV>& hv, int i0, int rows, int j0, int cols, Scratch& w) {
  int64_t ldk;
  const float* k = key_rows(p, hv.b, hv.k, p.k_row_stride, j0, cols, w, ldk);
  gemm_rowmajor(false, true, rows, cols, p.d, 1.f, hv.q + i0 * p.q_row_stride, p.q_row_stride, k, ldk, 0.f,
                w.s.data(), kBlockN);
  if (p.p_dropout > 0.f)
    dropout_keep_tile(w.keep.data(), kBlockN, i0, rows, j0, cols, hv.bh, p.philox_seed, p.philox_offset,
                      p.dropout_threshold16);
}

// Calls f(j0, cols) for the key tiles that query rows [i0, i0 + rows) visit, ascending: kBlockN
// wide over the keys the rows can see, or, with a block mask, those keys' kept mask blocks.
template <typename KV, typename F>
void for_each_key_tile(const FwdParams& p, const HeadView<KV>& hv, int i0, int rows, F&& f) {
  const ColRange span = block_cols(p, i0, i0 + rows);
  const int32_t* kept = kept_key_blocks(p, hv.b, hv.h, i0 / kMaskBlock);
  if (kept == nullptr) {
    for (int j0 = span.lo - span.lo % kBlockN; j0 < span.hi; j0 += kBlockN) f(j0, std::min(kBlockN, p.seqlen_k - j0));
    return;
  }
  const TileSeq tiles = tile_seq<kMaskBlock>(kept, span.lo / kMaskBlock, ceil_div(span.hi, kMaskBlock));
  for (int i = 0; i < tiles.count; ++i) {
    const int j0 = tiles[i] * kMaskBlock;
    f(j0, std::min(kMaskBlock, p.seqlen_k - j0));
  }
}

int query_block_rows(const FwdParams& p) { return p.q_block_lists != nullptr ? kMaskBlock : kBlockM; }

template <typename KV>
void query_block(const FwdParams& p, const HeadView<KV>& hv, int i0, Scratch& w) {
  const int rows = std::min(query_block_rows(p), p.seqlen_q - i0), d = p.d;
  const bool dropout = p.p_dropout > 0.f;
  std::fill(w.acc.begin(), w.acc.end(), 0.f);
  std::fill(w.m.begin(), w.m.end(), -kInf);
  std::fill(w.l.begin(), w.l.end(), 0.f);
  const ScoreModHead<float> mod(p, hv.b, hv.h);

  for_each_key_tile(p, hv, i0, rows, [&](int j0, int cols) {
    score_tile(p, hv, i0, rows, j0, cols, w);
    for (int r = 0; r < rows; ++r) {
      float* srow = w.s.data() + r * kBlockN;
      const ColRange c = clip_to_tile(row_cols(p, i0 + r), j0, cols);
      if (c.hi <= c.lo) {  // nothing visible in this tile: contributes zero
        fill_row(srow, cols, 0.f);
        continue;
      }
      const float scale = modify_row(p, mod, srow, i0 + r, j0, c, cols);
      const float m_new = std::max(w.m[r], row_max(srow + c.lo, c.hi - c.lo) * scale);
      if (m_new == -kInf) {  // a bias of -inf everywhere so far: still nothing to attend to
        fill_row(srow, cols, 0.f);
        continue;
      }
      const float alpha = std::exp2(w.m[r] - m_new);  // 0 when the row had no max yet
      const float sum = exp2_rescale_sum(srow + c.lo, c.hi - c.lo, scale, m_new);
      fill_row(srow, c.lo, 0.f);
      fill_row(srow + c.hi, cols - c.hi, 0.f);
      w.l[r] = w.l[r] * alpha + sum;
      w.m[r] = m_new;
      if (alpha != 1.f) scale_row(w.acc.data() + r * d, d, alpha);
      if (dropout) apply_keep(srow, srow, w.keep.data() + r * kBlockN, cols, p.rp_dropout);
    }
    // acc += P V
    int64_t ldv;
    const float* v = key_rows(p, hv.b, hv.v, p.v_row_stride, j0, cols, w, ldv);
    gemm_rowmajor(false, false, rows, d, cols, 1.f, w.s.data(), kBlockN, v, ldv, 1.f, w.acc.data(), d);
  });

  for (int r = 0; r < rows; ++r) {
    float* orow = hv.o + (i0 + r) * p.o_row_stride;
    const float* arow = w.acc.data() + r * d;
    const float inv = w.l[r] > 0.f ? 1.f / w.l[r] : 0.f;
    for (int c = 0; c < d; ++c) orow[c] = arow[c] * inv;
    hv.lse[i0 + r] = w.l[r] > 0.f ? (w.m[r] + std::log2(w.l[r])) * kLn2 : -kInf;
  }
}

// The exact probabilities for return_attn_probs: recomputed once the row's logsumexp is known.
template <typename KV>
void write_probs(const FwdParams& p, const HeadView<KV>& hv, int i0, Scratch& w) {
  const int rows = std::min(query_block_rows(p), p.seqlen_q - i0);
  const bool dropout = p.p_dropout > 0.f;
  const ScoreModHead<float> mod(p, hv.b, hv.h);
  for (int j0 = 0; j0 < p.seqlen_k; j0 += kBlockN) {
    const int cols = std::min(kBlockN, p.seqlen_k - j0);
    score_tile(p, hv, i0, rows, j0, cols, w);
    for (int r = 0; r < rows; ++r) {
      float* srow = w.s.data() + r * kBlockN;
      float* dst = hv.probs + (i0 + r) * p.p_row_stride + j0;
      const ColRange c = clip_to_tile(row_cols(p, i0 + r), j0, cols);
      const float lse = hv.lse[i0 + r], shift = lse * kLog2e;
      const float scale = modify_row(p, mod, srow, i0 + r, j0, c, cols);
      for (int col = 0; col < cols; ++col) {
        const bool kept = block_kept(p, hv.b, hv.h, (i0 + r) / kMaskBlock, (j0 + col) / kMaskBlock);
        const bool seen = kept && col >= c.lo && col < c.hi && lse != -kInf;
        float prob = seen ? std::exp2(srow[col] * scale - shift) : 0.f;
        if (dropout && !w.keep[r * kBlockN + col]) prob = -prob;  // dropped: stored negated
        dst[col] = prob;
      }
    }
  }
}

template <typename KV>
void run_fwd_with(const FwdParams& p) {
  const int block_m = query_block_rows(p), n_mblocks = ceil_div(p.seqlen_q, block_m);
  const int64_t tasks = int64_t(p.b) * p.h * n_mblocks;
  if (tasks == 0) return;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    Scratch w(p.d, p.p_dropout > 0.f, !std::is_same_v<KV, float> || p.block_table != nullptr);
    for (int64_t t = begin; t < end; ++t) {
      const int mb = int(t % n_mblocks);
      const int h = int((t / n_mblocks) % p.h);
      const int b = int(t / (int64_t(n_mblocks) * p.h));
      const FwdParams ps = seq_view(p, b);
      if (mb * block_m >= ps.seqlen_q) continue;  // varlen: past this sequence's rows
      const HeadView<KV> hv = head_view<KV>(ps, b, h);
      query_block(ps, hv, mb * block_m, w);
      if (hv.probs) write_probs(ps, hv, mb * block_m, w);
    }
  });
}

}  // namespace

void run_fwd(const FwdParams& p) {
  switch (p.kv_dtype) {
    case DType::kBFloat16: return run_fwd_with<c10::BFloat16>(p);
    case DType::kFloat16: return run_fwd_with<c10::Half>(p);
    default: return run_fwd_with<float>(p);
  }
}

}  // namespace flash::cpu
