// Warp-level building blocks on shared-memory tiles. A tile is a row-major array of 16-bit
// elements with a row stride of kHeadDim + 8 elements: the 16-byte pad puts the 8 rows one
// ldmatrix reads in 8 different bank groups, so fragment loads are conflict-free.
#pragma once

#include "mma_sm80.cuh"

namespace flash::cuda {

template <int kHeadDim>
struct Tile {
  static constexpr int kStride = kHeadDim + 8;  // elements per shared-memory row
};

// Cooperative cp.async of rows [0, kRows) of a (rows, head_dim) global tile into shared memory.
// Rows >= valid_rows and columns >= d are zero-filled (d is a multiple of 8). When the threads
// cover whole rows, each owns one 16-byte column chunk of every (kThreads / chunks-per-row)-th
// row, so its addresses are a base plus constant steps, and a tile wholly in range skips the
// per-chunk bounds checks; otherwise chunks are dealt out one by one.
template <int kRows, int kHeadDim, int kThreads, typename Elem>
__device__ __forceinline__ void load_tile_async(Elem* smem, const Elem* gmem, int64_t row_stride, int valid_rows,
                                                int d, int tid) {
  constexpr int kChunksPerRow = kHeadDim / 8, kStride = Tile<kHeadDim>::kStride;
  if constexpr (kThreads % kChunksPerRow == 0) {
    constexpr int kRowStep = kThreads / kChunksPerRow;
    const int r0 = tid / kChunksPerRow, col = (tid % kChunksPerRow) * 8;
    Elem* s = smem + r0 * kStride + col;
    const Elem* g = gmem + r0 * row_stride + col;
    if (valid_rows >= kRows && d >= kHeadDim) {
#pragma unroll
      for (int i = 0; i < kRows; i += kRowStep)
        if (kRows % kRowStep == 0 || r0 + i < kRows) cp_async_16(s + i * kStride, g + i * row_stride, true);
    } else {
#pragma unroll
      for (int i = 0; i < kRows; i += kRowStep) {
        const bool valid = r0 + i < valid_rows && col < d;
        if (kRows % kRowStep == 0 || r0 + i < kRows)
          cp_async_16(s + i * kStride, valid ? g + i * row_stride : gmem, valid);
      }
    }
  } else {
#pragma unroll
    for (int c = tid; c < kRows * kChunksPerRow; c += kThreads) {
      const int row = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
      const bool valid = row < valid_rows && col < d;
      cp_async_16(smem + row * kStride + col, valid ? gmem + row * row_stride + col : gmem, valid);
    }
  }
}

// mma operand fragments from shared memory. An A fragment (16 x 16) comes from A stored
// row-major ([m][k], kATrans = false) or from A^T stored row-major ([k][m], kATrans = true); a
// pair of B fragments (16 k x 16 n: two n8 tiles) from B^T stored row-major ([n][k], kBKN =
// false) or from B stored row-major ([k][n], kBKN = true). row0 / col0 index the tile in the
// stored layout's (m or n, k) order.
template <bool kATrans>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const void* base, int stride_bytes, int m0, int k0,
                                       int elem_bytes, int lane) {
  const char* s = static_cast<const char*>(base);
  if constexpr (!kATrans) {
    ldmatrix_x4(a, s + ((m0 + lane % 16) * stride_bytes) + (k0 + (lane / 16) * 8) * elem_bytes);
  } else {  // matrix lane/8: m offset 8 * (lane/8 % 2), k offset 8 * (lane/16)
    ldmatrix_x4_trans(a, s + (k0 + (lane / 16) * 8 + lane % 8) * stride_bytes + (m0 + 8 * ((lane / 8) % 2)) * elem_bytes);
  }
}
template <bool kBKN>
__device__ __forceinline__ void load_b(uint32_t (&b)[4], const void* base, int stride_bytes, int n0, int k0,
                                       int elem_bytes, int lane) {
  const char* s = static_cast<const char*>(base);
  if constexpr (!kBKN) {
    ldmatrix_x4(b, s + (n0 + (lane % 8) + 8 * (lane / 16)) * stride_bytes + (k0 + 8 * ((lane / 8) % 2)) * elem_bytes);
  } else {
    ldmatrix_x4_trans(b, s + (k0 + (lane % 8) + 8 * ((lane / 8) % 2)) * stride_bytes + (n0 + 8 * (lane / 16)) * elem_bytes);
  }
}

// acc[mt] (16 x kN) += A_mt (16 x kK) * B (kK x kN), both operands in shared memory (row strides
// kStrideA / kStrideB elements; see load_a / load_b for the layouts). Each B fragment serves all
// kMT row tiles, so wider warp tiles need fewer fragment loads per mma.
template <typename Elem, int kMT, int kN, int kK, int kStrideA, int kStrideB, bool kATrans, bool kBKN>
__device__ __forceinline__ void gemm_smem(float (&acc)[kMT][kN / 8][4], const Elem* sA, const Elem* sB, int lane) {
  constexpr int kE = int(sizeof(Elem));
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    uint32_t a[kMT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) load_a<kATrans>(a[mt], sA, kStrideA * kE, mt * 16, kk * 16, kE, lane);
#pragma unroll
    for (int nn = 0; nn < kN / 16; ++nn) {
      uint32_t b[4];
      load_b<kBKN>(b, sB, kStrideB * kE, nn * 16, kk * 16, kE, lane);
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        mma_16816<Elem>(acc[mt][2 * nn], a[mt], b[0], b[1]);
        mma_16816<Elem>(acc[mt][2 * nn + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// Two independent products of the same shape and layouts, c0 += A0 B0 and c1 += A1 B1 (as
// gemm_smem), interleaved step by step: twice the independent mma chains hide the tensor pipe's
// latency better than two gemm_smem calls in a row.
template <typename Elem, int kMT, int kN, int kK, int kStrideA, int kStrideB, bool kATrans, bool kBKN>
__device__ __forceinline__ void gemm_smem_pair(float (&c0)[kMT][kN / 8][4], const Elem* sA0, const Elem* sB0,
                                               float (&c1)[kMT][kN / 8][4], const Elem* sA1, const Elem* sB1,
                                               int lane) {
  constexpr int kE = int(sizeof(Elem));
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    uint32_t a0[kMT][4], a1[kMT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      load_a<kATrans>(a0[mt], sA0, kStrideA * kE, mt * 16, kk * 16, kE, lane);
      load_a<kATrans>(a1[mt], sA1, kStrideA * kE, mt * 16, kk * 16, kE, lane);
    }
#pragma unroll
    for (int nn = 0; nn < kN / 16; ++nn) {
      uint32_t b0[4], b1[4];
      load_b<kBKN>(b0, sB0, kStrideB * kE, nn * 16, kk * 16, kE, lane);
      load_b<kBKN>(b1, sB1, kStrideB * kE, nn * 16, kk * 16, kE, lane);
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        mma_16816<Elem>(c0[mt][2 * nn], a0[mt], b0[0], b0[1]);
        mma_16816<Elem>(c1[mt][2 * nn], a1[mt], b1[0], b1[1]);
        mma_16816<Elem>(c0[mt][2 * nn + 1], a0[mt], b0[2], b0[3]);
        mma_16816<Elem>(c1[mt][2 * nn + 1], a1[mt], b1[2], b1[3]);
      }
    }
  }
}

// acc[mt] += A_mt * B^T, A row-major and B^T stored as kN rows of kK elements (S = Q K^T).
template <typename Elem, int kMT, int kN, int kK, int kStride>
__device__ __forceinline__ void gemm_ss(float (&acc)[kMT][kN / 8][4], const Elem* sA, const Elem* sB, int lane) {
  gemm_smem<Elem, kMT, kN, kK, kStride, kStride, false, false>(acc, sA, sB, lane);
}

// Single row tile form.
template <typename Elem, int kN, int kK, int kStride>
__device__ __forceinline__ void gemm_ss(float (&acc)[kN / 8][4], const Elem* sA, const Elem* sB, int lane) {
  gemm_ss<Elem, 1, kN, kK, kStride>(reinterpret_cast<float(&)[1][kN / 8][4]>(acc), sA, sB, lane);
}

// acc[mt] (16 x kN) += A_mt (16 x kK, held as mma A fragments) * B, where sB holds B (kK rows
// of kN). Each B fragment serves all kMT row tiles.
template <typename Elem, int kMT, int kK, int kN, int kStride>
__device__ __forceinline__ void gemm_rs(float (&acc)[kMT][kN / 8][4], const uint32_t (&a)[kMT][kK / 16][4],
                                        const Elem* sB, int lane) {
  constexpr int kE = int(sizeof(Elem));
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
#pragma unroll
    for (int nn = 0; nn < kN / 16; ++nn) {
      uint32_t b[4];
      load_b<true>(b, sB, kStride * kE, nn * 16, kk * 16, kE, lane);
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        mma_16816<Elem>(acc[mt][2 * nn], a[mt][kk], b[0], b[1]);
        mma_16816<Elem>(acc[mt][2 * nn + 1], a[mt][kk], b[2], b[3]);
      }
    }
  }
}

template <typename Elem, int kK, int kN, int kStride>
__device__ __forceinline__ void gemm_rs(float (&acc)[kN / 8][4], const uint32_t (&a)[kK / 16][4], const Elem* sB,
                                        int lane) {
  gemm_rs<Elem, 1, kK, kN, kStride>(reinterpret_cast<float(&)[1][kN / 8][4]>(acc),
                                    reinterpret_cast<const uint32_t(&)[1][kK / 16][4]>(a), sB, lane);
}

// The accumulator of one gemm (16 x kN, fp32) as the A operand of the next (16-bit).
template <typename Elem, int kN>
__device__ __forceinline__ void acc_to_a(uint32_t (&a)[kN / 16][4], const float (&c)[kN / 8][4]) {
#pragma unroll
  for (int kk = 0; kk < kN / 16; ++kk) {
    a[kk][0] = pack2<Elem>(c[2 * kk][0], c[2 * kk][1]);
    a[kk][1] = pack2<Elem>(c[2 * kk][2], c[2 * kk][3]);
    a[kk][2] = pack2<Elem>(c[2 * kk + 1][0], c[2 * kk + 1][1]);
    a[kk][3] = pack2<Elem>(c[2 * kk + 1][2], c[2 * kk + 1][3]);
  }
}

// Store row g + 8 hr of a 16-row accumulator tile, times scale, as 16-bit values at row_ptr;
// columns >= d are skipped.
template <typename Elem, int kD>
__device__ __forceinline__ void store_acc_row(Elem* row_ptr, const float (&acc)[kD / 8][4], int hr, float scale,
                                              int d, int lane) {
  // One address per row and constant offsets from it (a per-column address made the compiler
  // rebuild the 64-bit pointer for every store).
  uint32_t* dst = reinterpret_cast<uint32_t*>(row_ptr + 2 * (lane % 4));
  const int cols = (d - 2 * (lane % 4) + 7) / 8;  // this lane's column pairs below d
#pragma unroll
  for (int dt = 0; dt < kD / 8; ++dt)
    if (dt < cols) dst[dt * 4] = pack2<Elem>(acc[dt][2 * hr] * scale, acc[dt][2 * hr + 1] * scale);
}

template <int kN>
__device__ __forceinline__ void zero(float (&acc)[kN / 8][4]) {
#pragma unroll
  for (int n = 0; n < kN / 8; ++n)
#pragma unroll
    for (int r = 0; r < 4; ++r) acc[n][r] = 0.f;
}

// kMT row tiles at once.
template <int kN, int kMT>
__device__ __forceinline__ void zero(float (&acc)[kMT][kN / 8][4]) {
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) zero<kN>(acc[mt]);
}

}  // namespace flash::cuda
