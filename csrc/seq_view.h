// One sequence of a batch as the kernels see it. A padded batch needs nothing: every sequence has
// seqlen_q x seqlen_k and starts at row 0 of its batch entry. A variable-length (packed) batch
// keeps its sequences one after another along the rows, so each CTA first takes its own
// sequence's lengths and first rows; every row index below then works unchanged.
#pragma once

#include <cstdint>
#include <type_traits>

#include "flash_params.h"
#include "host_device.h"

namespace flash {

// The backward's per-row buffers (CUDA: D, the base-2 logsumexp, the float32 dQ accumulator) pad
// each sequence's rows to a multiple of every main kernel's query block, so whole query blocks
// can be read and added without bounds checks.
inline constexpr int kDqAccumRowPad = 128;
FLASH_HOST_DEVICE int64_t padded_query_rows(int64_t seqlen_q) {
  return (seqlen_q + kDqAccumRowPad - 1) / kDqAccumRowPad * kDqAccumRowPad;
}

// Varlen: the first of sequence b's padded rows (its rows start at cu_seqlen_q = row b of
// cu_seqlens_q). Each sequence gets padded_query_rows(its length) rows before the next one begins
// and the last one ends within varlen_stat_rows(total_q, batch).
FLASH_HOST_DEVICE int64_t varlen_stat_row0(int64_t cu_seqlen_q, int b) {
  return (cu_seqlen_q + int64_t(b) * kDqAccumRowPad) / kDqAccumRowPad * kDqAccumRowPad;
}
FLASH_HOST_DEVICE int64_t varlen_stat_rows(int64_t total_q, int batch) {
  return padded_query_rows(total_q + int64_t(batch) * kDqAccumRowPad);
}

FLASH_HOST_DEVICE int clamp_int(int x, int lo, int hi) { return x < lo ? lo : x > hi ? hi : x; }

// p as sequence b sees it: with varlen, its own lengths and first rows; with a KV cache (forward),
// its keys' first row and count; otherwise p itself.
template <typename Params>
FLASH_HOST_DEVICE Params seq_view(const Params& p, int b) {
  Params v = p;
  if (p.cu_seqlens_q != nullptr) {
    const int q0 = p.cu_seqlens_q[b], k0 = p.cu_seqlens_k[b];
    v.seqlen_q = p.cu_seqlens_q[b + 1] - q0;
    v.seqlen_k = p.cu_seqlens_k[b + 1] - k0;
    v.q_row0 = q0;
    v.k_row0 = k0;
    if constexpr (std::is_base_of_v<BwdParams, Params>) v.stat_row0 = int(varlen_stat_row0(q0, b));
  }
  if constexpr (!std::is_base_of_v<BwdParams, Params>) {
    if (p.seqused_k != nullptr) {  // a KV cache; the clamps keep unchecked indices inside it
      const int rows = p.k_entry_rows;
      const int e = p.kv_batch_idx != nullptr ? clamp_int(p.kv_batch_idx[b], 0, p.k_entries - 1) : b;
      const int lp = p.k_leftpad != nullptr ? clamp_int(p.k_leftpad[b], 0, rows) : 0;
      v.k_row0 = p.block_table != nullptr ? 0 : e * rows + lp;  // (paged: key_tile_row places each tile)
      v.seqlen_k = clamp_int(p.seqused_k[b] + p.seqlen_knew - lp, 0, rows - lp);
    }
  }
  return v;
}

// The row of key j0 (the first of a key tile on CUDA, where a page holds whole tiles; any key on
// the CPU), counted from the sequence's first key row: j0, or with a paged cache its place in its
// page, the page index clamped into the cache like seq_view's values.
FLASH_HOST_DEVICE int64_t key_tile_row(const FwdParams& p, int b, int j0) {
  if (p.block_table == nullptr) return j0;
  const int page = p.block_table[b * p.block_table_stride + j0 / p.page_block_size];
  return int64_t(clamp_int(page, 0, p.k_entries - 1)) * p.page_block_size + j0 % p.page_block_size;
}

// Row 0 of head (b, h) of an operand laid out (batch, rows, heads, d) with these strides, at the
// sequence's first row row0.
template <typename Elem, typename Ptr>
FLASH_HOST_DEVICE Elem* rows_of(Ptr* base, int b, int h, int row0, int64_t batch_stride, int64_t row_stride,
                                int64_t head_stride) {
  return static_cast<Elem*>(base) + b * batch_stride + int64_t(row0) * row_stride + h * head_stride;
}

// Row 0 of head (b, h) of softmax_lse (see FwdParams::lse_batch_stride).
FLASH_HOST_DEVICE float* lse_rows(const FwdParams& p, int b, int h) {
  return p.softmax_lse_ptr + b * p.lse_batch_stride + h * p.lse_head_stride + p.q_row0;
}

// Index of row 0 of head (b, h) in the backward's per-row buffers (see BwdParams::stat_batch_stride).
FLASH_HOST_DEVICE int64_t stat_row(const BwdParams& p, int b, int h) {
  return b * p.stat_batch_stride + h * p.stat_head_stride + p.stat_row0;
}

// Index of key 0 of head (b, h) in the GQA dK/dV scratch rows.
FLASH_HOST_DEVICE int64_t kv_accum_row(const BwdParams& p, int b, int h) {
  return b * p.kv_accum_batch_stride + h * p.kv_accum_head_stride + p.k_row0;
}

}  // namespace flash
