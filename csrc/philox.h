// Counter-based random numbers for dropout (Philox4x32-10), identical on the host and the device,
// so the backward regenerates the forward's mask and the CPU and CUDA paths drop the same elements.
#pragma once

#include <cstdint>

#include "host_device.h"

namespace flash {

struct U32x4 {
  uint32_t x, y, z, w;
};

FLASH_HOST_DEVICE uint32_t mulhi32(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return uint32_t((uint64_t(a) * uint64_t(b)) >> 32);
#endif
}

FLASH_HOST_DEVICE U32x4 philox4x32_10(U32x4 ctr, uint32_t key0, uint32_t key1) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const uint32_t hi0 = mulhi32(kMul0, ctr.x), lo0 = kMul0 * ctr.x;
    const uint32_t hi1 = mulhi32(kMul1, ctr.z), lo1 = kMul1 * ctr.z;
    ctr = U32x4{hi1 ^ ctr.y ^ key0, lo1, hi0 ^ ctr.w ^ key1, lo0};
    key0 += kWeyl0;
    key1 += kWeyl1;
  }
  return ctr;
}

// Dropout draws are grouped so that one Philox call yields the 8 values that one thread owns in a
// 16x16 tile of an mma.sync / wgmma accumulator: rows {r, r+8} x cols {c, c+1, c+8, c+9} with
// r = i % 8 and c = 2 * ((j % 8) / 2). dropout_cell() names the call, dropout_slot() the value.
struct DropoutCell {
  uint32_t col16;  // j / 16
  uint32_t row_id; // (i / 16) * 32 + (i % 8) * 4 + (j % 8) / 2
};

FLASH_HOST_DEVICE DropoutCell dropout_cell(int64_t i, int64_t j) {
  return DropoutCell{uint32_t(j >> 4), uint32_t(((i >> 4) << 5) | ((i & 7) << 2) | ((j & 7) >> 1))};
}

FLASH_HOST_DEVICE int dropout_slot(int64_t i, int64_t j) {
  return int(((i >> 3) & 1) * 4 + ((j >> 3) & 1) * 2 + (j & 1));
}

// The 8 16-bit draws of one cell for head `bh` (= batch * h + head) of the call with (seed, offset).
FLASH_HOST_DEVICE U32x4 dropout_draws(DropoutCell cell, uint32_t bh, uint64_t seed,
                                      uint64_t offset) {
  return philox4x32_10(U32x4{cell.col16, cell.row_id, bh, uint32_t(offset)}, uint32_t(seed),
                       uint32_t(seed >> 32) ^ uint32_t(offset >> 32));
}

FLASH_HOST_DEVICE uint32_t draw16(const U32x4& r, int slot) {
  const uint32_t word = (slot >> 1) == 0 ? r.x : (slot >> 1) == 1 ? r.y : (slot >> 1) == 2 ? r.z : r.w;
  return (word >> ((slot & 1) * 16)) & 0xFFFFu;
}

}  // namespace flash
