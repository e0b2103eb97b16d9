// Dropout on mma accumulator fragments with the Philox mapping of philox.h: one Philox call
// gives the 8 draws a thread owns in a 16x16 query-major tile; the key-major (transposed) tiles
// of the dK/dV kernel need two calls per 16x16 tile.
#pragma once

#include "../flash_params.h"
#include "../philox.h"

namespace flash::cuda {

struct DropoutState {
  uint64_t seed, offset;
  uint32_t threshold;
};

// Seed and offset of this launch (read through pointers under CUDA graph capture).
__device__ __forceinline__ DropoutState dropout_state_fwd(const FwdParams& p) {
  DropoutState s{p.philox_seed, p.philox_offset, p.dropout_threshold16};
  if (p.philox_captured) {
    s.seed = uint64_t(*p.philox_seed_ptr);
    s.offset = uint64_t(*p.philox_offset_ptr) + p.philox_offset_intragraph;
  }
  return s;
}

// The backward replays the forward's seed and offset from rng_state.
__device__ __forceinline__ DropoutState dropout_state_bwd(const FwdParams& p) {
  return DropoutState{uint64_t(p.rng_state_ptr[0]), uint64_t(p.rng_state_ptr[1]), p.dropout_threshold16};
}

// Query-major 16x16 tile at (i16, j16), both multiples of 16, held as two n8 accumulator tiles:
// keep[h][r] is register r of tile h (h = 0: keys j16..j16+7, h = 1: j16+8..j16+15).
__device__ __forceinline__ void dropout_keep_qmajor(bool (&keep)[2][4], const DropoutState& ds, uint32_t bh,
                                                    int64_t i16, int64_t j16, int lane) {
  const int g = lane / 4, t = lane % 4;
  const U32x4 draws = dropout_draws(DropoutCell{uint32_t(j16 >> 4), uint32_t(((i16 >> 4) << 5) | (g << 2) | t)},
                                    bh, ds.seed, ds.offset);
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int r = 0; r < 4; ++r) keep[h][r] = draw16(draws, (r >> 1) * 4 + h * 2 + (r & 1)) >= ds.threshold;
}

// Key-major tile: rows (keys) j16 + {g, g+8}, columns (queries) i16 + 2t + {0,1} + {0,8}.
__device__ __forceinline__ void dropout_keep_kmajor(bool (&keep)[2][4], const DropoutState& ds, uint32_t bh,
                                                    int64_t i16, int64_t j16, int lane) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int e = 0; e < 2; ++e) {  // query column parity: query & 7 == 2t + e
    const U32x4 draws = dropout_draws(
        DropoutCell{uint32_t(j16 >> 4), uint32_t(((i16 >> 4) << 5) | ((2 * t + e) << 2) | (g >> 1))}, bh, ds.seed,
        ds.offset);
#pragma unroll
    for (int hq = 0; hq < 2; ++hq)    // query + 8 * hq: accumulator tile hq
#pragma unroll
      for (int hk = 0; hk < 2; ++hk)  // key + 8 * hk: register pair hk
        keep[hq][hk * 2 + e] = draw16(draws, hq * 4 + hk * 2 + (g & 1)) >= ds.threshold;
  }
}

}  // namespace flash::cuda
