// The dropout keep-mask of one score tile, from the shared Philox mapping in philox.h.
#pragma once

#include <cstdint>

#include "../philox.h"

namespace flash::cpu {

// keep[r * ld + c] = 1 iff element (i0 + r, j0 + c) of head `bh` survives dropout.
inline void dropout_keep_tile(uint8_t* keep, int ld, int64_t i0, int rows, int64_t j0, int cols,
                              uint32_t bh, uint64_t seed, uint64_t offset, uint32_t threshold) {
  const int64_t i1 = i0 + rows, j1 = j0 + cols;
  for (int64_t ci = i0 & ~int64_t(15); ci < i1; ci += 16) {
    for (int64_t cj = j0 & ~int64_t(15); cj < j1; cj += 16) {
      // One Philox call per (row r, column pair c) of the 8x8 quarter; it covers 8 elements.
      for (int r = 0; r < 8; ++r) {
        for (int c = 0; c < 8; c += 2) {
          const U32x4 draws = dropout_draws(dropout_cell(ci + r, cj + c), bh, seed, offset);
          for (int di = 0; di <= 8; di += 8) {
            const int64_t i = ci + r + di;
            if (i < i0 || i >= i1) continue;
            for (int dj : {0, 1, 8, 9}) {
              const int64_t j = cj + c + dj;
              if (j < j0 || j >= j1) continue;
              keep[(i - i0) * ld + (j - j0)] = draw16(draws, dropout_slot(i, j)) >= threshold;
            }
          }
        }
      }
    }
  }
}

}  // namespace flash::cpu
