// Which keys a query row may see: one contiguous column range per row, shared by every backend
// so causal and sliding-window semantics cannot drift between the CPU and the GPU.
#pragma once

#include <algorithm>
#include <cstdint>

#include "host_device.h"

namespace flash {

struct ColRange {
  int lo;  // first visible key
  int hi;  // one past the last visible key; hi <= lo means the row sees nothing
};

// Bottom-right aligned window: row i is centred on key i + (seqlen_k - seqlen_q).
FLASH_HOST_DEVICE ColRange visible_cols(int row, int seqlen_q, int seqlen_k, int window_left,
                                        int window_right) {
  const int64_t centre = int64_t(row) + seqlen_k - seqlen_q;
  int64_t lo = window_left < 0 ? 0 : centre - window_left;
  int64_t hi = window_right < 0 ? seqlen_k : centre + window_right + 1;
  lo = lo < 0 ? 0 : lo;
  hi = hi > seqlen_k ? seqlen_k : hi;
  return ColRange{int(lo), int(hi < lo ? lo : hi)};
}

}  // namespace flash
