// The score modifiers (../score_mod.h) on one row of a CPU score tile.
#pragma once

#include "../mask.h"
#include "../score_mod.h"

namespace flash::cpu {

// Row i of a tile at key j0 holds raw dot products; its visible columns [c.lo, c.hi) become the
// modified scores in log2 units. Returns the scale the softmax applies next: 1, or
// scale_softmax_log2 when there are no modifiers (the row is left as is). dcap, when given,
// receives the cap's derivative for each of the tile's cols columns (1 outside [c.lo, c.hi)).
inline float modify_row(const FwdParams& p, const ScoreModHead<float>& mod, float* srow, int i, int j0, ColRange c,
                        int cols, float* dcap = nullptr) {
  constexpr float kLog2e = 1.4426950408889634f;
  if (!p.score_mod) return p.scale_softmax_log2;
  for (int col = 0; col < cols; ++col) {
    float d = 1.f;
    if (col >= c.lo && col < c.hi) srow[col] = mod(i, j0 + col, srow[col], d) * kLog2e;
    if (dcap != nullptr) dcap[col] = d;
  }
  return 1.f;
}

}  // namespace flash::cpu
