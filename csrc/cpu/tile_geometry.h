// Tile sizes and the per-tile visibility tests shared by the CPU forward and backward.
#pragma once

#include <algorithm>

#include "../flash_params.h"
#include "../mask.h"

namespace flash::cpu {

inline ColRange row_cols(const FwdParams& p, int row) {
  return visible_cols(row, p.seqlen_q, p.seqlen_k, p.window_size_left, p.window_size_right);
}

// The visible ranges' ends never decrease with the row, so the keys any row of [i0, i1) can see
// lie in [lo(i0), hi(i1 - 1)).
inline ColRange block_cols(const FwdParams& p, int i0, int i1) {
  const ColRange first = row_cols(p, i0), last = row_cols(p, i1 - 1);
  return ColRange{first.lo, std::max(first.lo, last.hi)};
}

// Whether any row of [i0, i1) can see any key of [j0, j1) (conservative for narrow windows;
// the per-row ranges do the exact masking).
inline bool tile_visible(const FwdParams& p, int i0, int i1, int j0, int j1) {
  const ColRange r = block_cols(p, i0, i1);
  return r.lo < j1 && r.hi > j0;
}

// Clip a row's visible range to the tile [j0, j0 + cols), relative to j0.
inline ColRange clip_to_tile(ColRange r, int j0, int cols) {
  const int lo = std::clamp(r.lo - j0, 0, cols), hi = std::clamp(r.hi - j0, 0, cols);
  return ColRange{lo, std::max(lo, hi)};
}

inline int ceil_div(int a, int b) { return (a + b - 1) / b; }

}  // namespace flash::cpu
