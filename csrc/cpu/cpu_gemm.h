// Row-major float32 GEMM for the CPU tiles: C = alpha * op(A) op(B) + beta * C.
#pragma once

#include <cstdint>

namespace flash::cpu {

// trans_a / trans_b: whether A (m x k) / B (k x n) are stored transposed. Leading dims are row
// strides in elements. Runs single-threaded: callers parallelise over tiles.
void gemm_rowmajor(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a,
                   int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

}  // namespace flash::cpu
