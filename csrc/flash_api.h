// What the op layer (flash_api.cpp) offers the other op files: the KV-cache op
// (flash_kvcache.cpp) checks its own arguments, then runs the shared forward.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <utility>

namespace flash {

// Whether checks that read index tensors on the host (a device sync) should run now: not while a
// CUDA graph is being captured, not with FLASH_ATTN_SKIP_VARLEN_CHECKS=1, not in a backward whose
// forward checked the same offsets (VarlenOffsetsChecked).
bool index_value_checks_wanted(const at::Tensor& t);

// One query per head under GQA, in a call where every query row would see the same keys with the
// same score terms (no window or ALiBi; a causal mask changes nothing for one query): the g =
// nheads / nheads_k query heads of a key head run as g query rows of it, so each key tile is read
// once per key head. q (b, 1, nheads, d) -> (b, g, nheads_k, d) (a view where q's strides allow);
// the forward's out (b, g, nheads_k, d) and softmax_lse (b, nheads_k, g) go back to (b, 1, nheads,
// d) and (b, nheads, 1).
bool gqa_fold_applies(const at::Tensor& q, int64_t nheads_k, int64_t window_size_left, int64_t window_size_right,
                      bool alibi);
at::Tensor fold_gqa_queries(const at::Tensor& q, int64_t nheads_k);
std::pair<at::Tensor, at::Tensor> unfold_gqa_rows(const at::Tensor& out, const at::Tensor& lse);

// How flash_attn_with_kvcache reads its cache (FwdParams::seqused_k): int32 device vectors of one
// entry per batch entry; batch_idx and leftpad may be null (entry b, row 0). A paged cache (CUDA):
// block_table (batch, pages_per_entry) with row stride block_table_stride, the cache's entries
// then being pages (FwdParams::block_table); batch_idx and leftpad null.
struct KvCacheRead {
  const int32_t* seqused;    // keys in the cache before the new ones
  const int32_t* batch_idx;  // the cache entry of each batch entry
  const int32_t* leftpad;    // each entry's first key row
  int seqlen_new;            // keys appended after seqused
  const int32_t* block_table = nullptr;
  int64_t block_table_stride = 0;
  int pages_per_entry = 0;
  int longest_keys = -1;  // FwdParams::longest_keys
};

// Queries packed as in flash_attn_varlen_func (q (total_q, nheads, headdim), cu_seqlens_q) over a
// cache: sequence i's keys are the cache read's (KvCacheRead::seqused); cu_seqlens_k and
// max_seqlen_k describe the same counts (checked: offsets from 0, non-decreasing, each at most
// max_seqlen_k; their last value is not the cache's rows).
struct VarlenQuery {
  const at::Tensor& cu_seqlens_q;
  const at::Tensor& cu_seqlens_k;
  int64_t max_seqlen_q, max_seqlen_k;
};

// The forward of q (batch, seqlen_q, nheads, headdim; any strides; with varlen, packed as it says)
// over k_cache and v_cache (entries, rows, nheads_k, headdim) as kv says. The caller has checked
// kv's values (or the kernels clamp them into the cache). On CUDA the cache must need no copy to
// reach the kernels: 16-byte aligned rows, headdim a multiple of 8. num_splits: CTAs sharing each
// query block's keys on CUDA (0: a heuristic, 1: none). Returns out (q's shape and strides) and
// softmax_lse (batch, nheads, seqlen_q), with varlen (nheads, total_q).
std::tuple<at::Tensor, at::Tensor> mha_fwd_kvcache_read(const at::Tensor& q, const at::Tensor& k_cache,
                                                        const at::Tensor& v_cache, const KvCacheRead& kv,
                                                        std::optional<double> softmax_scale, bool causal,
                                                        int64_t window_size_left, int64_t window_size_right,
                                                        const std::optional<at::Tensor>& alibi_slopes, double softcap,
                                                        int64_t num_splits, const VarlenQuery* varlen = nullptr);

}  // namespace flash
