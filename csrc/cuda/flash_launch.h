// Entry points of the CUDA kernels, called by the op layer with a filled params struct.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

#include "../flash_params.h"
#include "../host_device.h"
#include "../seq_view.h"

namespace flash::cuda {

// Head dims with compiled kernels; other sizes run on the next larger one (zero-padded).
inline constexpr int kHeadDims[] = {32, 64, 96, 128, 160, 192, 224, 256};

using flash::kDqAccumRowPad;
using flash::padded_query_rows;

// The dQ accumulator: rows as BwdParams::stat_batch_stride lays them out (padded batches:
// (batch, h, padded_query_rows(seqlen_q))), each dq_accum_row_stride(d) floats: the head dim of
// the kernel that runs d.
inline int64_t dq_accum_row_stride(int64_t d) {
  for (int hd : kHeadDims)
    if (hd >= d) return hd;
  return d;
}

// Where column `col` of accumulator row `row` (of `d` columns) lives when
// BwdParams::dq_accum_swizzled: groups of 8 columns XOR-ed with the row's low 3 bits (2 where d is
// not a multiple of 64, so that a column stays within its row), the layout the warp-specialized
// sm90 backward keeps its dQ tile in shared memory (few bank conflicts) and reduces into the
// accumulator as one block.
FLASH_HOST_DEVICE int dq_accum_col(bool swizzled, int row, int col, int d) {
  return swizzled ? col ^ ((row & (d % 64 == 0 ? 7 : 3)) << 3) : col;
}

// The portable forward's tiles (FwdConfig is built from these): query rows and keys per tile. At
// most kDecodeRows query rows (decoding) over a KV cache, or split over CTAs, run smaller tiles
// (FwdDecodeConfig: 16 rows up to 16 query rows, else kDecodeRows), which spend less work on rows
// that do not exist.
FLASH_HOST_DEVICE constexpr int fwd_block_m(int head_dim) { return head_dim <= 128 ? 128 : 64; }
inline constexpr int kFwdBlockN = 64, kMaxSplits = 128, kDecodeRows = 64;
inline bool fwd_decode_tiles(const FwdParams& p) {
  return p.seqlen_q <= kDecodeRows && (p.seqused_k != nullptr || p.num_splits > 1);
}

// flash_attn_with_kvcache's append: new rows (batch, seqlen_new, h_k, d) of k and v into the cache
// at rows seqlens[b] + j of entry batch_idx[b] (b where null). Paged (block_table set, no
// batch_idx): row r of batch entry b is row r % page_block_size of page block_table[b *
// block_table_stride + r / page_block_size], entries = pages, rows = pages per entry x page rows.
// Rows that would fall outside the cache (only possible when the host checks were skipped) are
// dropped. 16-bit elements; strides in elements, (entry or page, row, head), the head dim contiguous.
struct KvAppendParams {
  const void *k_new, *v_new;
  void *k_cache, *v_cache;
  int64_t k_new_strides[3], v_new_strides[3], k_cache_strides[3], v_cache_strides[3];
  const int32_t* seqlens;
  const int32_t* batch_idx;
  int b, seqlen_new, h_k, d, entries, rows;
  const int32_t* block_table = nullptr;
  int64_t block_table_stride = 0;
  int page_block_size = 0;
};
void kvcache_append(const KvAppendParams& a, cudaStream_t stream);

void run_fwd(FwdParams& params, cudaStream_t stream);
void run_bwd(BwdParams& params, cudaStream_t stream);

// One (dtype, head dim) instantiation each, in instantiations/ (generated).
template <typename Elem, int kHeadDim>
void run_mha_fwd_(FwdParams& params, cudaStream_t stream);
template <typename Elem, int kHeadDim>
void run_mha_bwd_(BwdParams& params, cudaStream_t stream);

}  // namespace flash::cuda

namespace flash::hopper {
// The sm90 kernels (csrc/hopper/, built when FLASH_ATTN_WITH_SM90 is defined): each runs and
// returns true where it applies, else returns false and the portable kernel runs.
template <typename Elem, int kHeadDim>
bool run_mha_fwd_sm90_(FwdParams& params, cudaStream_t stream);
template <typename Elem, int kHeadDim>
bool run_mha_bwd_sm90_(BwdParams& params, cudaStream_t stream);  // head dims with has_sm90_bwd only
template <typename Elem, int kHeadDim>
bool sm90_bwd_applies(const BwdParams& params);  // whether run_mha_bwd_sm90_ would run
template <int kHeadDim>
inline constexpr bool has_sm90_bwd = kHeadDim <= 128 || kHeadDim == 192 || kHeadDim == 256;
}  // namespace flash::hopper
