// Warpgroup-level building blocks of the sm90 kernels: CuTe's GMMA atoms (wgmma.mma_async) on
// swizzled shared-memory tiles, the proxy fence that makes cp.async data visible to them, and
// views of CuTe accumulator fragments as the (16 x N) per-warp arrays the portable kernels use.
#pragma once

// wgmma N sizes that are multiples of 8 but not of 32 (head dims 160 and 224 on one atom)
#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#endif

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/arch/mma_sm90.hpp>

#include "../cuda/mma_sm80.cuh"

namespace flash::hopper {

template <typename Elem>
using CuteElem = std::conditional_t<std::is_same_v<Elem, __half>, cute::half_t, cute::bfloat16_t>;

// K-major shared-memory atom for rows of kHeadDim 16-bit elements: 128-byte swizzle where the row
// is a multiple of 64 elements, else 64-byte (head dims 32, 96, 160, 224).
template <typename CElem, int kHeadDim>
using SmemAtomK = std::conditional_t<kHeadDim % 64 == 0, cute::GMMA::Layout_K_SW128_Atom<CElem>,
                                     cute::GMMA::Layout_K_SW64_Atom<CElem>>;

// The start of dynamic shared memory rounded up to kAlign bytes (the 128-byte swizzle pattern is a
// function of the address and repeats every 1024 bytes; launchers ask for kAlign bytes extra).
template <int kAlign, typename T>
__device__ __forceinline__ T* aligned_smem(char* raw) {
  const uint32_t base = cuda::smem_addr(raw);
  return reinterpret_cast<T*>(raw + (kAlign - base % kAlign) % kAlign);
}

// cp.async writes go through the generic proxy; wgmma reads shared memory through the async
// proxy. Each thread fences its own completed copies before the barrier that publishes them.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// c (+)= a * b on one warpgroup's slice of a tiled GMMA, over every k block, issued as one commit
// group. kZeroInit: c is overwritten rather than accumulated. a is descriptors (SS) or registers
// (RS). kWait >= 0 then waits until at most kWait groups are pending (see wgmma_wait); -1 returns
// at once, and c (and a register a) must not be touched before a wgmma_wait covers this group.
template <bool kZeroInit, int kWait, typename TiledMma, typename TA, typename TB, typename TC>
__device__ __forceinline__ void wgmma_gemm(TiledMma& mma, const TA& a, const TB& b, TC& c) {
  using namespace cute;
  constexpr bool kRegA = !is_base_of<GMMA::DescriptorIterator, typename TiledMma::FrgTypeA>::value;
  if constexpr (kRegA) warpgroup_fence_operand(const_cast<TA&>(a));
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  if constexpr (kZeroInit) mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(mma, a(_, _, k), b(_, _, k), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  if constexpr (kWait >= 0) {
    warpgroup_wait<kWait>();
    warpgroup_fence_operand(c);
    if constexpr (kRegA) warpgroup_fence_operand(const_cast<TA&>(a));
  }
}

// Wait until at most kPending wgmma groups of this warpgroup are in flight; the fragments given
// (accumulators and register operands of the finished groups) are safe to use afterwards.
template <int kPending, typename... Frags>
__device__ __forceinline__ void wgmma_wait(Frags&... frags) {
  cute::warpgroup_wait<kPending>();
  (cute::warpgroup_fence_operand(frags), ...);
}

// A 64 x N wgmma accumulator slice, per thread, is the mma.sync (16 x N) layout of its warp's 16
// rows: value 4 n + r is row g + 8 (r / 2), column 8 n + 2 t + r % 2 (g = lane / 4, t = lane % 4).
template <int kN, typename Frag>
__device__ __forceinline__ float (&as_rows16(Frag& frag))[kN / 8][4] {
  static_assert(decltype(cute::size(frag))::value == kN / 2, "one 64-row slice of a 64 x kN accumulator");
  return *reinterpret_cast<float(*)[kN / 8][4]>(cute::raw_pointer_cast(frag.data()));
}

// The probabilities as the register A operand of the next GMMA: its (16 x 16) k blocks hold the
// same values in the same order as the accumulator's pairs of 8-column blocks.
template <typename Elem, int kN, typename Frag>
__device__ __forceinline__ void to_a_operand(Frag& a, const float (&s)[kN / 8][4]) {
  auto a32 = cute::recast<uint32_t>(a);
  static_assert(decltype(cute::size(a32))::value == kN / 4, "A operand of a 64 x kN product");
#pragma unroll
  for (int n = 0; n < kN / 8; ++n) {
    a32(2 * n) = cuda::pack2<Elem>(s[n][0], s[n][1]);
    a32(2 * n + 1) = cuda::pack2<Elem>(s[n][2], s[n][3]);
  }
}

// Cooperative cp.async of rows [0, kRows) of a (rows, head_dim) global tile into a swizzled
// shared-memory tile (a CuTe tensor); rows >= valid_rows and columns >= d are zero-filled.
template <int kRows, int kHeadDim, int kThreads, typename Elem, typename SmemTile>
__device__ __forceinline__ void load_tile_swizzled(SmemTile&& s, const Elem* gmem, int64_t row_stride,
                                                   int valid_rows, int d, int tid) {
  constexpr int kChunksPerRow = kHeadDim / 8;
  if constexpr (kThreads % kChunksPerRow == 0) {
    constexpr int kRowStep = kThreads / kChunksPerRow;
    const int r0 = tid / kChunksPerRow, col = (tid % kChunksPerRow) * 8;
    const Elem* g = gmem + r0 * row_stride + col;
    const bool full = valid_rows >= kRows && d >= kHeadDim;
#pragma unroll
    for (int i = 0; i < kRows; i += kRowStep) {
      if (kRows % kRowStep != 0 && r0 + i >= kRows) break;
      const bool valid = full || (r0 + i < valid_rows && col < d);
      cuda::cp_async_16(&s(r0 + i, col), valid ? g + i * row_stride : gmem, valid);
    }
  } else {
#pragma unroll
    for (int c = tid; c < kRows * kChunksPerRow; c += kThreads) {
      const int row = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
      const bool valid = row < valid_rows && col < d;
      cuda::cp_async_16(&s(row, col), valid ? gmem + row * row_stride + col : gmem, valid);
    }
  }
}

}  // namespace flash::hopper
