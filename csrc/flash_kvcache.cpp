// flash_attn::fwd_kvcache: flash-attn 2.x's flash_attn_with_kvcache after its rotary embeddings
// (applied by the Python wrapper): new keys and values appended to the cache in place, then
// attention over each batch entry's keys, cache rows [cache_leftpad[i], cache_seqlens[i] + new) of
// cache entry cache_batch_idx[i], or of the pages block_table[i] lists (a paged cache), which the
// kernels read in place (FwdParams::seqused_k, FwdParams::block_table). flash_attn::fwd_varlen_paged:
// flash_attn_varlen_func with block_table, packed queries over a paged cache. Forward only.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "flash_api.h"
#include "flash_params.h"

#ifdef FLASH_ATTN_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/flash_launch.h"
#endif

namespace flash {
namespace {

using OptTensor = std::optional<at::Tensor>;

constexpr const char* kKvcache = "flash_attn_with_kvcache";
constexpr const char* kVarlen = "flash_attn_varlen_func";

// fn: the Python function the error messages name.
void check_rank(const char* fn, const at::Tensor& t, int64_t rank, const char* name, const char* shape) {
  TORCH_CHECK(t.defined(), fn, ": ", name, " must be a tensor, got None");
  TORCH_CHECK(t.dim() == rank, fn, ": ", name, " must have shape ", shape, ", got a tensor of rank ", t.dim(),
              " with shape ", t.sizes());
}
void check_rank4(const at::Tensor& t, const char* name, const char* shape) { check_rank(kKvcache, t, 4, name, shape); }

// An int32 vector of one entry per batch entry, on q's device.
void check_per_batch(const at::Tensor& t, const char* name, int64_t batch, const at::Tensor& q) {
  TORCH_CHECK(t.scalar_type() == at::kInt, "flash_attn_with_kvcache: ", name, " must be int32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == batch, "flash_attn_with_kvcache: ", name,
              " must have shape (batch,) = (", batch, ",), got ", t.sizes());
  TORCH_CHECK(t.device() == q.device(), "flash_attn_with_kvcache: ", name, " must be on the device of q (", q.device(),
              "), got ", t.device());
}

// Row i of a block table (on the host): the pages that hold its first `keys` keys are pages of the
// cache (entries of it).
void check_pages(const char* fn, const int32_t* row, int64_t i, int64_t keys, int64_t page_rows, int64_t entries) {
  for (int64_t j = 0; j * page_rows < keys; ++j)
    TORCH_CHECK(row[j] >= 0 && row[j] < entries, fn, ": block_table[", i, ", ", j, "] = ", row[j],
                " is not a page of k_cache (", entries, " pages), and sequence ", i, "'s ", keys, " keys reach page ",
                j);
}

// The per-batch values, read on the host in one copy (a device sync; skipped where
// index_value_checks_wanted says so, like the varlen offsets): 0 <= leftpad <= seqlens and
// seqlens + new <= cache rows (per entry), 0 <= index < entries; with a block table, its pages
// that hold the keys are entries of the cache (pages of page_rows rows). Returns the most keys a
// batch entry reads, or -1 where the values were not read.
int check_values(const at::Tensor& seqlens, int64_t new_keys, const OptTensor& batch_idx, const OptTensor& leftpad,
                  const OptTensor& block_table, int64_t page_rows, int64_t rows, int64_t entries) {
  if (!index_value_checks_wanted(seqlens)) return -1;
  const int64_t b = seqlens.numel();
  std::vector<at::Tensor> parts{seqlens};
  if (leftpad) parts.push_back(*leftpad);
  if (batch_idx) parts.push_back(*batch_idx);
  if (block_table) parts.push_back(block_table->reshape({-1}));
  const at::Tensor host = (parts.size() == 1 ? seqlens : at::cat(parts)).to(at::kCPU);
  const int32_t* pn = host.data_ptr<int32_t>();
  const int32_t* plp = leftpad ? pn + b : nullptr;
  const int32_t* pi = batch_idx ? pn + (leftpad ? 2 : 1) * b : nullptr;
  const int32_t* pt = block_table ? pn + b : nullptr;  // (no leftpad or index with a table)
  const int64_t pages = block_table ? block_table->size(1) : 0;
  int64_t longest = 0;
  for (int64_t i = 0; i < b; ++i) {
    TORCH_CHECK(pn[i] >= 0 && pn[i] + new_keys <= rows, "flash_attn_with_kvcache: cache_seqlens[", i, "] = ", pn[i],
                (new_keys > 0 ? " plus the new keys" : ""), " must be in [0, seqlen_cache = ", rows,
                "]: the cache has no room past row ", rows);
    const int32_t lp = plp ? plp[i] : 0;
    TORCH_CHECK(lp >= 0 && lp <= pn[i] + new_keys, "flash_attn_with_kvcache: cache_leftpad[", i, "] = ", lp,
                " must be in [0, ", pn[i] + new_keys, "] (0 to that entry's keys)");
    TORCH_CHECK(!pi || (pi[i] >= 0 && pi[i] < entries), "flash_attn_with_kvcache: cache_batch_idx[", i, "] = ",
                pi ? pi[i] : 0, " is not an entry of k_cache (", entries, " entries)");
    if (pt) check_pages(kKvcache, pt + i * pages, i, pn[i] + new_keys, page_rows, entries);
    longest = std::max<int64_t>(longest, pn[i] + new_keys - lp);
  }
  return int(longest);
}

// A paged cache: block_table (batch, pages per entry) int32 of page indices, and pages of a
// multiple of kPageBlockMultiple rows (flash-attn 2.x's rule: a page then holds whole key tiles).
void check_block_table(const char* fn, const at::Tensor& t, int64_t batch, const at::Tensor& q,
                       const at::Tensor& k_cache) {
  TORCH_CHECK(t.scalar_type() == at::kInt, fn, ": block_table must be int32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 2 && t.size(0) == batch, fn, ": block_table must have shape (batch, max_num_blocks_per_seq) "
              "= (", batch, ", n), got ", t.sizes());
  TORCH_CHECK(t.device() == q.device(), fn, ": block_table must be on the device of q (", q.device(), "), got ",
              t.device());
  TORCH_CHECK(t.size(1) <= 1 || t.stride(1) == 1, fn, ": block_table must have a contiguous last dim, got strides ",
              t.strides());
  TORCH_CHECK(k_cache.size(1) > 0 && k_cache.size(1) % kPageBlockMultiple == 0, fn, ": with block_table, k_cache is "
              "(num_blocks, page_block_size, nheads_k, headdim) and page_block_size must be a positive multiple of ",
              kPageBlockMultiple, ", got ", k_cache.size(1));
  TORCH_CHECK(int64_t(t.size(1)) * k_cache.size(1) <= std::numeric_limits<int>::max() &&
              k_cache.size(0) * k_cache.size(1) <= std::numeric_limits<int>::max(),
              fn, ": block_table's pages and the cache's rows must fit in 32 bits");
}

// New keys and values: (batch, seqlen_new, nheads_k, headdim), the cache's dtype and device.
void check_new(const at::Tensor& t, const char* name, int64_t b, const at::Tensor& cache) {
  check_rank4(t, name, "(batch, seqlen_new, nheads_k, headdim)");
  TORCH_CHECK(t.size(0) == b && t.size(2) == cache.size(2) && t.size(3) == cache.size(3),
              "flash_attn_with_kvcache: ", name, " must have shape (batch, seqlen_new, nheads_k, headdim) = (", b,
              ", seqlen_new, ", cache.size(2), ", ", cache.size(3), "), got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == cache.scalar_type() && t.device() == cache.device(), "flash_attn_with_kvcache: ",
              name, " must have the cache's dtype and device (", cache.scalar_type(), ", ", cache.device(), "), got ",
              t.scalar_type(), ", ", t.device());
}

// The new keys and values into the cache at rows seqlens[i] + j of entry idx[i] (checked before,
// or dropped by the CUDA kernel where they would fall outside it).
void append(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& kn, const at::Tensor& vn,
            const at::Tensor& seqlens, const OptTensor& idx, const OptTensor& table, int64_t rows) {
  const int64_t b = kn.size(0), n = kn.size(1);
#ifdef FLASH_ATTN_WITH_CUDA
  if (k_cache.is_cuda()) {
    TORCH_CHECK(kn.stride(3) == 1 && vn.stride(3) == 1, "flash_attn_with_kvcache: k and v must have a contiguous "
                "head dim, got strides ", kn.strides(), " and ", vn.strides());
    c10::cuda::CUDAGuard guard(k_cache.device());
    cuda::KvAppendParams a{kn.data_ptr(), vn.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                           {kn.stride(0), kn.stride(1), kn.stride(2)}, {vn.stride(0), vn.stride(1), vn.stride(2)},
                           {k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)},
                           {v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)},
                           seqlens.data_ptr<int32_t>(), idx ? idx->data_ptr<int32_t>() : nullptr, int(b), int(n),
                           int(kn.size(2)), int(kn.size(3)), int(k_cache.size(0)), int(rows)};
    if (table) {
      a.block_table = table->data_ptr<int32_t>();
      a.block_table_stride = table->stride(0);
      a.page_block_size = int(k_cache.size(1));
    }
    cuda::kvcache_append(a, at::cuda::getCurrentCUDAStream().stream());
    return;
  }
#endif
  const auto i64 = seqlens.options().dtype(at::kLong);
  at::Tensor pos = seqlens.to(at::kLong).unsqueeze(1) + at::arange(n, i64);
  at::Tensor ent = (idx ? idx->to(at::kLong) : at::arange(b, i64)).unsqueeze(1).expand({b, n});
  if (table) {  // the rows' pages and their rows there
    const int64_t page = k_cache.size(1);
    ent = table->to(at::kLong).gather(1, at::floor_divide(pos, page));
    pos = at::remainder(pos, page);
  }
  k_cache.index_put_({ent, pos}, kn);
  v_cache.index_put_({ent, pos}, vn);
}

// The kernels read a CUDA cache in place, which needs what cp.async needs (flash_api.cpp's
// cuda_operand would copy it otherwise): 16-byte aligned rows, the head dim a multiple of 8.
void check_cache_in_place(const char* fn, const at::Tensor& t, const char* name) {
  if (!t.is_cuda()) return;
  bool ok = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && t.size(3) % 8 == 0 && t.stride(3) == 1;
  for (int i = 0; i < 3; ++i) ok = ok && (t.size(i) <= 1 || t.stride(i) % 8 == 0);
  TORCH_CHECK(ok, fn, ": on CUDA ", name, " must have a head dim that is a multiple of 8, "
              "16-byte aligned data and strides that are multiples of 8 elements, got shape ", t.sizes(),
              " and strides ", t.strides());
}

// The varlen op's key counts and block table, read on the host in one copy (with the index
// checks' policy): each count in [0, the table's rows] and at most max_seqlen_k, the pages holding
// them pages of the cache; unit_cu_q (one query per sequence): cu_seqlens_q is 0, 1, ..., batch.
// Returns the longest count, or -1 where the values were not read.
int check_varlen_pages(const at::Tensor& keys, const at::Tensor& table, int64_t page_rows, int64_t rows,
                        int64_t entries, int64_t max_seqlen_k, const at::Tensor* unit_cu_q) {
  if (!index_value_checks_wanted(keys)) return -1;
  const int64_t b = keys.numel(), pages = table.size(1);
  std::vector<at::Tensor> parts{keys, table.reshape({-1})};
  if (unit_cu_q) parts.push_back(*unit_cu_q);
  const at::Tensor host = at::cat(parts).to(at::kCPU);
  const int32_t* pk = host.data_ptr<int32_t>();
  int longest = 0;
  for (int64_t i = 0; i < b; ++i) {
    TORCH_CHECK(pk[i] >= 0 && pk[i] <= rows, kVarlen, ": sequence ", i, " has ", pk[i], " keys (cu_seqlens_k[", i + 1,
                "] - cu_seqlens_k[", i, "]); with block_table that must be in [0, ", rows, "], the rows of its ",
                pages, " pages");
    TORCH_CHECK(pk[i] <= max_seqlen_k, kVarlen, ": max_seqlen_k = ", max_seqlen_k, " is smaller than sequence ", i,
                "'s length ", pk[i], " (from cu_seqlens_k)");
    check_pages(kVarlen, pk + b + i * pages, i, pk[i], page_rows, entries);
    longest = std::max(longest, pk[i]);
  }
  for (int64_t i = 0; unit_cu_q && i <= b; ++i)
    TORCH_CHECK(pk[b + b * pages + i] == i, kVarlen, ": cu_seqlens_q must be 0, 1, ..., ", b, " when q has one row per "
                "sequence and max_seqlen_q = 1, got cu_seqlens_q[", i, "] = ", pk[b + b * pages + i]);
  return longest;
}

// Attention of q over the cache as kv (and block_table, where given) says, shared by the two ops.
// q (batch, seqlen_q, nheads, headdim), or packed as varlen says. One decoding query per head
// under GQA (padded q) runs folded (gqa_fold_applies): the cache is read once per key head.
std::tuple<at::Tensor, at::Tensor> read_cache(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                              KvCacheRead kv, const OptTensor& table,
                                              std::optional<double> softmax_scale, bool causal,
                                              int64_t window_size_left, int64_t window_size_right,
                                              const OptTensor& alibi_slopes, double softcap, int64_t num_splits,
                                              const VarlenQuery* varlen = nullptr) {
  const int64_t hk = k_cache.size(2);
  const bool fold = !varlen && gqa_fold_applies(q, hk, window_size_left, window_size_right,
                                                alibi_slopes && alibi_slopes->defined());
  const at::Tensor qv = fold ? fold_gqa_queries(q, hk) : q;
  if (table) {  // the kernels follow the table
    kv.block_table = table->data_ptr<int32_t>();
    kv.block_table_stride = table->stride(0);
    kv.pages_per_entry = int(table->size(1));
  }
  auto [out, lse] = mha_fwd_kvcache_read(qv, k_cache, v_cache, kv, softmax_scale, causal && !fold, window_size_left,
                                         window_size_right, alibi_slopes, softcap, num_splits, varlen);
  if (fold) return unfold_gqa_rows(out, lse);  // (out has qv's strides: the unfold is a view)
  return {out.contiguous(), lse};
}

// q: (batch, seqlen_q, nheads, headdim); k_cache, v_cache: (batch_cache, seqlen_cache, nheads_k,
// headdim), written in place at rows cache_seqlens[i] + j where k_new, v_new (batch, seqlen_new,
// nheads_k, headdim) are given. cache_seqlens (batch,) int32, or None for full entries. With
// block_table (batch, max_num_blocks_per_seq) int32, the cache is (num_blocks, page_block_size,
// nheads_k, headdim) and entry i is the table's row i of pages. num_splits: split-KV on CUDA (0: as many as fill the GPU, 1: none, n: n). Returns out (batch,
// seqlen_q, nheads, headdim) and softmax_lse (batch, nheads, seqlen_q).
std::tuple<at::Tensor, at::Tensor> mha_fwd_kvcache(const at::Tensor& q, at::Tensor& k_cache, at::Tensor& v_cache,
                                                   const OptTensor& k_new, const OptTensor& v_new,
                                                   const OptTensor& cache_seqlens, const OptTensor& cache_batch_idx,
                                                   const OptTensor& cache_leftpad, const OptTensor& block_table,
                                                   std::optional<double> softmax_scale,
                                                   bool causal, int64_t window_size_left, int64_t window_size_right,
                                                   const OptTensor& alibi_slopes, double softcap, int64_t num_splits) {
  const auto given = [](const OptTensor& t) { return t && t->defined() ? t : std::nullopt; };
  const OptTensor kn = given(k_new), vn = given(v_new), idx = given(cache_batch_idx), lp = given(cache_leftpad),
                  table = given(block_table);
  check_rank4(q, "q", "(batch, seqlen_q, nheads, headdim)");
  check_rank4(k_cache, "k_cache", "(batch_cache, seqlen_cache, nheads_k, headdim)");
  check_rank4(v_cache, "v_cache", "(batch_cache, seqlen_cache, nheads_k, headdim)");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "flash_attn_with_kvcache: v_cache must have the shape of k_cache ",
              k_cache.sizes(), ", got ", v_cache.sizes());
  const int64_t b = q.size(0), sq = q.size(1), entries = k_cache.size(0);
  if (table) {
    check_block_table(kKvcache, *table, b, q, k_cache);
    TORCH_CHECK(!idx, "flash_attn_with_kvcache: cache_batch_idx cannot be combined with block_table (the table "
                "already says which pages each batch entry reads)");
    TORCH_CHECK(!lp, "flash_attn_with_kvcache: cache_leftpad cannot be combined with block_table");
  }
  // Rows of one batch entry's cache: a paged entry spans its block table row's pages.
  const int64_t rows = table ? table->size(1) * k_cache.size(1) : k_cache.size(1);
  TORCH_CHECK(kn.has_value() == vn.has_value(), "flash_attn_with_kvcache: k and v must be given together, got ",
              kn ? "v = None" : "k = None");
  if (kn) {
    check_new(*kn, "k", b, k_cache);
    check_new(*vn, "v", b, v_cache);
    TORCH_CHECK(vn->size(1) == kn->size(1), "flash_attn_with_kvcache: k and v must have the same seqlen_new, got ",
                kn->size(1), " and ", vn->size(1));
  }
  TORCH_CHECK(num_splits >= 0, "flash_attn_with_kvcache: num_splits must be >= 0 (0: chosen here), got ", num_splits);
  const int64_t new_keys = kn ? kn->size(1) : 0;
  TORCH_CHECK(!kn || (cache_seqlens && cache_seqlens->defined()),
              "flash_attn_with_kvcache: k and v are appended at cache_seqlens, which must then be given, got None");
  const at::Tensor seqlens = cache_seqlens && cache_seqlens->defined()
                                 ? *cache_seqlens
                                 : at::full({b}, rows, q.options().dtype(at::kInt));
  check_per_batch(seqlens, "cache_seqlens", b, q);
  if (idx) check_per_batch(*idx, "cache_batch_idx", b, q);
  if (lp) check_per_batch(*lp, "cache_leftpad", b, q);
  // (Without cache_batch_idx batch entry i reads cache entry i, as flash-attn's: a cache allocated
  // for a larger batch serves a smaller one.)
  TORCH_CHECK(idx || table || entries >= b, "flash_attn_with_kvcache: k_cache has ", entries,
              " batch entries, fewer than q's ", b, "; pass cache_batch_idx to pick entries");
  TORCH_CHECK(entries > 0 || b == 0, "flash_attn_with_kvcache: k_cache has no ", table ? "pages" : "batch entries",
              " for q's ", b);
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  TORCH_CHECK(b * sq <= kIntMax && entries * k_cache.size(1) <= kIntMax && rows <= kIntMax,
              "flash_attn_with_kvcache: batch x seqlen must fit in 32 bits for q and for the cache");
  check_cache_in_place(kKvcache, k_cache, "k_cache");
  check_cache_in_place(kKvcache, v_cache, "v_cache");
  const int longest = check_values(seqlens, new_keys, idx, lp, table, k_cache.size(1), rows, entries);

  if (kn) append(k_cache, v_cache, *kn, *vn, seqlens, idx, table, rows);
  KvCacheRead kv{seqlens.data_ptr<int32_t>(), idx ? idx->data_ptr<int32_t>() : nullptr,
                 lp ? lp->data_ptr<int32_t>() : nullptr, int(new_keys)};
  kv.longest_keys = longest;
  return read_cache(q, k_cache, v_cache, kv, table, softmax_scale, causal, window_size_left, window_size_right,
                    alibi_slopes, softcap, num_splits);
}

// flash_attn_varlen_func with block_table: packed queries (total_q, nheads, headdim), sequence i
// at rows cu_seqlens_q[i] .. cu_seqlens_q[i + 1] - 1, over the first cu_seqlens_k[i + 1] -
// cu_seqlens_k[i] keys of the pages block_table[i] lists (k_cache, v_cache: (num_blocks,
// page_block_size, nheads_k, headdim)). Returns out (total_q, nheads, headdim) and softmax_lse
// (nheads, total_q). Forward only.
std::tuple<at::Tensor, at::Tensor> mha_varlen_fwd_paged(const at::Tensor& q, const at::Tensor& k_cache,
                                                        const at::Tensor& v_cache, const at::Tensor& cu_seqlens_q,
                                                        const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                                                        int64_t max_seqlen_k, const at::Tensor& block_table,
                                                        std::optional<double> softmax_scale, bool causal,
                                                        int64_t window_size_left, int64_t window_size_right,
                                                        const OptTensor& alibi_slopes, double softcap) {
  check_rank(kVarlen, q, 3, "q", "(total_q, nheads, headdim)");
  check_rank(kVarlen, k_cache, 4, "k_cache", "(num_blocks, page_block_size, nheads_k, headdim) with block_table");
  check_rank(kVarlen, v_cache, 4, "v_cache", "(num_blocks, page_block_size, nheads_k, headdim) with block_table");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), kVarlen, ": v_cache must have the shape of k_cache ",
              k_cache.sizes(), ", got ", v_cache.sizes());
  for (const auto& [t, name] : {std::pair{&cu_seqlens_q, "cu_seqlens_q"}, std::pair{&cu_seqlens_k, "cu_seqlens_k"}}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->dim() == 1 && t->numel() >= 1 && t->device() == q.device(),
                kVarlen, ": ", name, " must be a 1-D int32 tensor of batch + 1 offsets on q's device, got ",
                t->scalar_type(), " of shape ", t->sizes(), " on ", t->device());
  }
  TORCH_CHECK(cu_seqlens_q.numel() == cu_seqlens_k.numel(), kVarlen, ": cu_seqlens_q and cu_seqlens_k must have the "
              "same length (batch + 1), got ", cu_seqlens_q.numel(), " and ", cu_seqlens_k.numel());
  const int64_t b = cu_seqlens_k.numel() - 1, entries = k_cache.size(0);
  check_block_table(kVarlen, block_table, b, q, k_cache);
  const int64_t rows = block_table.size(1) * k_cache.size(1);
  TORCH_CHECK(entries > 0 || b == 0, kVarlen, ": k_cache has no pages for ", b, " sequences");
  check_cache_in_place(kVarlen, k_cache, "k_cache");
  check_cache_in_place(kVarlen, v_cache, "v_cache");
  // Each sequence's key count, and (one decoding query per sequence) the fold's read as a padded batch.
  const at::Tensor keys = cu_seqlens_k.narrow(0, 1, b) - cu_seqlens_k.narrow(0, 0, b);
  const bool one_query_each = max_seqlen_q == 1 && q.size(0) == b;
  KvCacheRead kv{keys.data_ptr<int32_t>(), nullptr, nullptr, 0};
  kv.longest_keys = check_varlen_pages(keys, block_table, k_cache.size(1), rows, entries, max_seqlen_k,
                                       one_query_each ? &cu_seqlens_q : nullptr);
  if (one_query_each) {  // sequence i is query row i: a batch of one query each (GQA folds there)
    auto [out, lse] = read_cache(q.unsqueeze(1), k_cache, v_cache, kv, block_table, softmax_scale, causal,
                                 window_size_left, window_size_right, alibi_slopes, softcap, 0);
    return {out.squeeze(1), lse.squeeze(2).t().contiguous()};
  }
  const VarlenQuery vq{cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k};
  return read_cache(q, k_cache, v_cache, kv, block_table, softmax_scale, causal, window_size_left, window_size_right,
                    alibi_slopes, softcap, 0, &vq);
}

}  // namespace
}  // namespace flash

TORCH_LIBRARY_FRAGMENT(flash_attn, m) {
  m.def(
      "fwd_kvcache(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k=None, Tensor? v=None, "
      "Tensor? cache_seqlens=None, Tensor? cache_batch_idx=None, Tensor? cache_leftpad=None, "
      "Tensor? block_table=None, "
      "float? softmax_scale=None, bool causal=False, int window_size_left=-1, int window_size_right=-1, "
      "Tensor? alibi_slopes=None, float softcap=0., int num_splits=0) -> (Tensor out, Tensor softmax_lse)");

  m.def(
      "fwd_varlen_paged(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "SymInt max_seqlen_q, SymInt max_seqlen_k, Tensor block_table, float? softmax_scale=None, bool causal=False, "
      "int window_size_left=-1, int window_size_right=-1, Tensor? alibi_slopes=None, float softcap=0.) "
      "-> (Tensor out, Tensor softmax_lse)");
}

TORCH_LIBRARY_IMPL(flash_attn, CPU, m) {
  m.impl("fwd_kvcache", &flash::mha_fwd_kvcache);
  m.impl("fwd_varlen_paged", &flash::mha_varlen_fwd_paged);
}

#ifdef FLASH_ATTN_WITH_CUDA
TORCH_LIBRARY_IMPL(flash_attn, CUDA, m) {
  m.impl("fwd_kvcache", &flash::mha_fwd_kvcache);
  m.impl("fwd_varlen_paged", &flash::mha_varlen_fwd_paged);
}
#endif
