// The (seqlen, head dim, heads, batch) views of the attention operands that the warp-specialized
// sm90 kernels build their TMA descriptors from.
#pragma once

#include <cute/tensor.hpp>

#include <cstdint>

#include "../flash_params.h"

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

inline TmaView q_view(const FwdParams& p) {
  return {p.q_ptr, p.seqlen_q, p.d, p.h, p.b, p.q_row_stride, p.q_head_stride, p.q_batch_stride};
}
inline TmaView k_view(const FwdParams& p) {
  return {p.k_ptr, p.seqlen_k, p.d, p.h_k, p.b, p.k_row_stride, p.k_head_stride, p.k_batch_stride};
}
inline TmaView v_view(const FwdParams& p) {
  return {p.v_ptr, p.seqlen_k, p.d, p.h_k, p.b, p.v_row_stride, p.v_head_stride, p.v_batch_stride};
}

inline TmaView do_view(const BwdParams& p) {
  return {p.do_ptr, p.seqlen_q, p.d, p.h, p.b, p.do_row_stride, p.do_head_stride, p.do_batch_stride};
}

}  // namespace flash::hopper
