// The (seqlen, head dim, heads, batch) views of the attention operands that the warp-specialized
// sm90 kernels build their TMA descriptors from.
#pragma once

#include <cute/tensor.hpp>

#include <cstdint>

#include "../flash_params.h"
#include "../host_device.h"

namespace flash::hopper {

// A (seqlen, d, heads, batch) view of q, k, v or dO for a TMA descriptor, whose base address and
// strides must be multiples of 16 bytes. The op layer makes the strides of dims longer than 1
// multiples of 8 elements; a dim of length 1 may carry any stride, so it gets one past the
// tensor's extent instead (never used to address anything).
struct TmaView {
  const void* ptr;
  int seqlen, d, heads, batch;
  int64_t row, head, bat;

  bool compatible() const {
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return false;
    return (seqlen == 1 || row % 8 == 0) && (heads == 1 || head % 8 == 0) && (batch == 1 || bat % 8 == 0);
  }
  template <typename CElem>
  auto tensor() const {
    const int64_t extent = (seqlen - 1) * row + (heads - 1) * head + (batch - 1) * bat + d;
    const int64_t past = (extent + 7) / 8 * 8;
    return cute::make_tensor(cute::make_gmem_ptr(static_cast<const CElem*>(ptr)),
                             cute::make_shape(seqlen, d, heads, batch),
                             cute::make_stride(seqlen == 1 ? past : row, cute::_1{}, heads == 1 ? past : head,
                                               batch == 1 ? past : bat));
  }
};

// Varlen: the packed tensor as one batch entry of total rows; each CTA offsets its coordinates
// by its sequence's first row (tma_rows). TMA zero-fills rows past the tensor's end, and a
// sequence's rows past its own end (the next sequence's) are masked or not stored by the kernels.
FLASH_HOST_DEVICE TmaView q_view(const FwdParams& p) {
  const bool packed = p.cu_seqlens_q != nullptr;
  return {p.q_ptr, packed ? p.total_q : p.seqlen_q, p.d, p.h, packed ? 1 : p.b,
          p.q_row_stride, p.q_head_stride, p.q_batch_stride};
}
// A KV cache (seqused_k, not paged) is its entries' rows one after another, as one batch entry
// (seq_view's k_row0 picks the entry); its rows past a sequence's keys are the kernel's to mask.
FLASH_HOST_DEVICE TmaView k_view(const FwdParams& p) {
  const bool cache = p.seqused_k != nullptr, packed = cache || p.cu_seqlens_k != nullptr;
  const int rows = cache ? p.k_entries * p.k_entry_rows : packed ? p.total_k : p.seqlen_k;
  return {p.k_ptr, rows, p.d, p.h_k, packed ? 1 : p.b, p.k_row_stride, p.k_head_stride, p.k_batch_stride};
}
// Another operand of the same shape as v's.
FLASH_HOST_DEVICE TmaView same_shape(TmaView v, const void* ptr, int64_t row, int64_t head, int64_t bat) {
  v.ptr = ptr;
  v.row = row;
  v.head = head;
  v.bat = bat;
  return v;
}
FLASH_HOST_DEVICE TmaView v_view(const FwdParams& p) {
  return same_shape(k_view(p), p.v_ptr, p.v_row_stride, p.v_head_stride, p.v_batch_stride);
}
FLASH_HOST_DEVICE TmaView o_view(const FwdParams& p) {
  return same_shape(q_view(p), p.o_ptr, p.o_row_stride, p.o_head_stride, p.o_batch_stride);
}
FLASH_HOST_DEVICE TmaView do_view(const BwdParams& p) {
  return same_shape(q_view(p), p.do_ptr, p.do_row_stride, p.do_head_stride, p.do_batch_stride);
}

// The (rows, d) coordinates TMA copies of head h of batch entry b read, from row row0 on (a
// seq_view's q_row0 / k_row0; 0 for padded batches). v: the view the descriptor was built from.
template <typename Tma>
__device__ __forceinline__ auto tma_rows(const Tma& tma, const TmaView& v, int row0, int h, int b) {
  using namespace cute;
  Tensor m = tma.get_tma_tensor(make_shape(v.seqlen, v.d, v.heads, v.batch));
  return domain_offset(make_coord(row0, 0), m(_, _, h, v.batch == 1 ? 0 : b));
}

}  // namespace flash::hopper
