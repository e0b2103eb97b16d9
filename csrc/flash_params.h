// The one parameter block that travels from the op layer (flash_api.cpp) to the CPU and CUDA
// launchers and into the kernels. Nothing below the op layer sees an at::Tensor: only raw
// pointers, element strides and sizes, so the same struct serves C++ on the host and CUDA kernels.
#pragma once

#include <cstdint>

namespace flash {

// A paged KV cache's page rows are a multiple of this (FwdParams::block_table).
inline constexpr int kPageBlockMultiple = 256;

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

struct QKVParams {
  const void* __restrict__ q_ptr = nullptr;
  const void* __restrict__ k_ptr = nullptr;
  const void* __restrict__ v_ptr = nullptr;

  // Strides in elements. Layout is (batch, seqlen, heads, headdim) with the last dim contiguous.
  int64_t q_batch_stride = 0, k_batch_stride = 0, v_batch_stride = 0;
  int64_t q_row_stride = 0, k_row_stride = 0, v_row_stride = 0;
  int64_t q_head_stride = 0, k_head_stride = 0, v_head_stride = 0;

  int h = 0;          // query heads
  int h_k = 0;        // key/value heads (MQA/GQA: h is a multiple of h_k)
  int h_h_k_ratio = 1;
};

struct FwdParams : QKVParams {
  void* __restrict__ o_ptr = nullptr;
  int64_t o_batch_stride = 0, o_row_stride = 0, o_head_stride = 0;

  // (batch, h, seqlen_q) float32, natural-log log-sum-exp of the scaled scores; -inf for a row
  // with nothing to attend to.
  float* __restrict__ softmax_lse_ptr = nullptr;

  // Optional (batch, h, seqlen_q, seqlen_k) float32 probabilities for testing; dropped entries
  // are stored negated. nullptr when not requested.
  float* __restrict__ p_ptr = nullptr;

  int b = 0, seqlen_q = 0, seqlen_k = 0, d = 0;  // d: the head dim the kernels read (CUDA: a multiple of 8)

  float scale_softmax = 1.f;       // applied to q.k
  float scale_softmax_log2 = 1.f;  // scale_softmax * log2(e): the kernels work in base 2

  // Causal is window (left, 0); -1 means unbounded. Both are bottom-right aligned:
  // query row i sees key j iff i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right.
  bool is_causal = false;
  int window_size_left = -1;
  int window_size_right = -1;

  // Dropout: keep an element iff its 16-bit Philox draw is >= dropout_threshold16.
  float p_dropout = 0.f;              // probability of dropping
  float rp_dropout = 1.f;             // 1 / (1 - p_dropout), applied to kept elements
  uint32_t dropout_threshold16 = 0;   // round(p_dropout * 65536)
  uint64_t philox_seed = 0;
  uint64_t philox_offset = 0;
  // CUDA: under graph capture the seed and offset are read through pointers at run time
  // (PyTorch's PhiloxCudaState); the forward writes the values it used to rng_state_ptr and the
  // backward reads them from there, so no host synchronisation is needed.
  const int64_t* philox_seed_ptr = nullptr;
  const int64_t* philox_offset_ptr = nullptr;
  uint64_t philox_offset_intragraph = 0;
  bool philox_captured = false;
  int64_t* rng_state_ptr = nullptr;

  // Block-sparse attention (optional): a mask over 128 x 128 (kMaskBlock) tiles of (queries,
  // keys), broadcast over batch and heads where its dim is 1. The lists hold, per row, the
  // count of kept blocks and then their indices in ascending order (padded with -1).
  const bool* block_layout = nullptr;      // (mask_b, mask_h, mask_q_blocks, mask_k_blocks)
  const int32_t* q_block_lists = nullptr;  // (mask_b, mask_h, mask_q_blocks, 1 + mask_k_blocks): key blocks
  const int32_t* k_block_lists = nullptr;  // (mask_b, mask_h, mask_k_blocks, 1 + mask_q_blocks): query blocks
  int mask_b = 1, mask_h = 1, mask_q_blocks = 0, mask_k_blocks = 0;

  // Variable-length batches: the b sequences lie packed along the rows of q, out, dO, dQ (total_q
  // rows) and of k, v, dK, dV (total_k rows), sequence i at rows [cu_seqlens[i], cu_seqlens[i + 1]),
  // with batch strides 0. seqlen_q / seqlen_k are then the longest sequences' lengths (they size the
  // grids); a kernel takes its own sequence's lengths and first rows from seq_view (seq_view.h).
  const int32_t* cu_seqlens_q = nullptr;  // (b + 1), or nullptr: a padded batch
  const int32_t* cu_seqlens_k = nullptr;
  int total_q = 0, total_k = 0;  // rows of the packed tensors (varlen), else seqlen_q / seqlen_k
  int q_row0 = 0, k_row0 = 0;    // set by seq_view: the sequence's first q row and k row (else 0)

  // KV-cache reads (flash_attn_with_kvcache; padded q): k and v are a cache of k_entries entries
  // of k_entry_rows rows, seen as one packed row range (batch stride 0). Batch entry b reads rows
  // [leftpad, seqused_k[b] + seqlen_knew) of entry kv_batch_idx[b] (default b), leftpad =
  // k_leftpad[b] (default 0); seq_view clamps all of them into the cache. The rows past them may
  // hold anything (NaN too), so only kernels whose loads fill zeros past seqlen_k take a cache.
  const int32_t* seqused_k = nullptr;
  const int32_t* kv_batch_idx = nullptr;
  const int32_t* k_leftpad = nullptr;
  int seqlen_knew = 0, k_entries = 0, k_entry_rows = 0;
  // The most keys any batch entry reads, where the op layer read the counts on the host (its
  // checks do, outside CUDA graph capture); -1: not known. Sizes split-KV and the decoding kernel's
  // choice instead of the cache's rows, which a mostly empty cache overstates.
  int longest_keys = -1;
  // A paged cache (block_table set; no kv_batch_idx or k_leftpad): k_entries pages of
  // page_block_size rows; batch entry b's key j lives in page block_table[b * block_table_stride +
  // j / page_block_size] at row j % page_block_size, and k_entry_rows = pages per entry x page rows.
  // Pages hold whole key tiles: page_block_size is a multiple of kPageBlockMultiple (flash-attn
  // 2.x's rule), and every forward kernel's key tile divides that.
  const int32_t* block_table = nullptr;
  int64_t block_table_stride = 0;
  int page_block_size = 0;

  // softmax_lse is (batch, h, seqlen_q), or (h, total_q) with varlen (batch stride 0); row i of
  // head (b, h) is at b * lse_batch_stride + h * lse_head_stride + q_row0 + i.
  int64_t lse_batch_stride = 0, lse_head_stride = 0;
  // Split-KV (CUDA: the KV-cache forward, and decoding shapes of the others, when too few query
  // blocks would fill the GPU; cuda::fwd_num_splits): num_splits CTAs
  // share each (query block, head, batch)'s key tiles, each writing its rows' normalised output and
  // logsumexp in float32: split s's row at index s * lse_accum_split_stride + (the row's index in
  // softmax_lse's layout) of lse_accum_ptr, and d floats from d times that index of o_accum_ptr.
  // A combine kernel merges them into out and softmax_lse.
  int num_splits = 1;
  float* o_accum_ptr = nullptr;
  float* lse_accum_ptr = nullptr;
  int64_t lse_accum_split_stride = 0;
  // p_ptr is (batch, h, seqlen_q, seqlen_k), the maxima with varlen.
  int64_t p_batch_stride = 0, p_head_stride = 0, p_row_stride = 0;

  // Score modifiers (score_mod.h), all optional: the kernels then take
  // score(i, j) = cap(scale * q_i.k_j) + bias[b, h, i, j] - slope[b, h] * |i + seqlen_k - seqlen_q - j|.
  // bias_ptr has the kernels' element type (CUDA: q's; CPU: float32), (b, h, rows, seqlen_k) with
  // unit column stride and stride 0 on broadcast dims; CUDA: 4-byte aligned with even strides (the
  // kernels read two keys at once). Not with varlen.
  const void* __restrict__ bias_ptr = nullptr;
  int64_t bias_batch_stride = 0, bias_head_stride = 0, bias_row_stride = 0;
  const float* __restrict__ alibi_slopes_ptr = nullptr;  // float32 (batch or 1, h)
  int64_t alibi_batch_stride = 0;                        // 0: one slope per head for every batch entry
  float softcap = 0.f;                                   // > 0: cap(x) = softcap * tanh(x / softcap)
  bool score_mod = false;                                // any of the three is on

  DType dtype = DType::kFloat32;
  // CPU: K and V's element type (float32 but for a 16-bit KV cache, which the forward converts
  // tile by tile instead of copying it whole).
  DType kv_dtype = DType::kFloat32;
};

struct BwdParams : FwdParams {
  const void* __restrict__ do_ptr = nullptr;
  int64_t do_batch_stride = 0, do_row_stride = 0, do_head_stride = 0;

  void* __restrict__ dq_ptr = nullptr;
  void* __restrict__ dk_ptr = nullptr;
  void* __restrict__ dv_ptr = nullptr;
  int64_t dq_batch_stride = 0, dq_row_stride = 0, dq_head_stride = 0;
  int64_t dk_batch_stride = 0, dk_row_stride = 0, dk_head_stride = 0;
  int64_t dv_batch_stride = 0, dv_row_stride = 0, dv_head_stride = 0;

  // CUDA, from the pre-pass: rowsum(dO * O) and, when set, logsumexp * log2(e) (0 where the
  // logsumexp is -inf), float32, with the rows of stat_batch_stride below; padded rows hold 0.
  float* __restrict__ dsoftmax_sum_ptr = nullptr;
  float* __restrict__ softmax_lse_log2_ptr = nullptr;

  // CUDA without GQA: dK/dV go straight to dk_ptr / dv_ptr (dk_accum_ptr == nullptr).
  // Otherwise float32 scratch the op layer allocates: per-query-head dK/dV before the GQA group sum,
  // rows as kv_accum_batch_stride below lays them out, d floats each, and dQ partial sums, one per split of the key
  // blocks, laid out (batch, h, num_splits, seqlen_q, d) ((h, num_splits, total_q, d) with varlen)
  // and summed by the op layer. CUDA: when set, one zeroed dQ accumulator the kernels add into,
  // laid out as stat_batch_stride and cuda::dq_accum_row_stride() say: atomically, or (also
  // dq_semaphore_ptr: deterministic) in a fixed order of the key blocks.
  float* __restrict__ dk_accum_ptr = nullptr;
  float* __restrict__ dv_accum_ptr = nullptr;
  float* __restrict__ dq_accum_ptr = nullptr;
  bool dq_accum_swizzled = false;  // set by the kernel that wrote it (cuda::dq_accum_col)
  // CUDA, deterministic: one zeroed counter per 64-row query block of the stat rows (row r's at
  // r / 64), which orders the key blocks' dQ additions (the sm90 backward; where that does not
  // apply, the launcher clears both pointers and runs the dQ kernel instead).
  int* __restrict__ dq_semaphore_ptr = nullptr;
  int num_splits = 1;

  // CUDA: where row i of head (b, h) lies in the per-row buffers above (D, the base-2 logsumexp
  // and, times its row stride, the dQ accumulator): b * stat_batch_stride + h * stat_head_stride +
  // stat_row0 + i. Padded batches: (batch, h, padded_query_rows(seqlen_q)); varlen: (h, rows) with
  // each sequence at its own padded offset (seq_view sets stat_row0; see varlen_stat_row0).
  int64_t stat_batch_stride = 0, stat_head_stride = 0;
  int stat_row0 = 0;
  // The GQA dK/dV scratch rows: key j of head (b, h) at row b * kv_accum_batch_stride +
  // h * kv_accum_head_stride + k_row0 + j ((batch, h, seqlen_k) or, varlen, (h, total_k)).
  int64_t kv_accum_batch_stride = 0, kv_accum_head_stride = 0;

  // The bias gradient (dL/dscore, before the capping's derivative) when the bias requires grad:
  // element (b, h, i, j) at b * dbias_batch_stride + h * dbias_head_stride + i * dbias_row_stride
  // + j (score_mod.h: dbias_index). float32, or with dbias_elem (CUDA) the kernels' element type.
  // With dbias_atomic the strides may be 0 (broadcast dims) and the kernels add (float32);
  // otherwise every visited element is written once into a zeroed buffer.
  void* __restrict__ dbias_ptr = nullptr;
  int64_t dbias_batch_stride = 0, dbias_head_stride = 0, dbias_row_stride = 0;
  bool dbias_atomic = false;
  bool dbias_elem = false;
};

}  // namespace flash
