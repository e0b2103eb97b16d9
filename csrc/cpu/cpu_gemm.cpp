#include "cpu_gemm.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <limits>

// The Fortran BLAS entry point that PyTorch's CPU build exports (MKL on x86-64 wheels). Declared
// weak so a torch build without it still loads; we then fall back to at::mm on views.
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c,
                       const int* ldc) __attribute__((weak));

namespace flash::cpu {

void gemm_rowmajor(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a,
                   int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) {
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < n; ++j) c[i * ldc + j] = beta == 0.f ? 0.f : beta * c[i * ldc + j];
    return;
  }
  // BLAS wants each leading dim >= the stored row length. A stored matrix of one row never steps
  // by it, and torch gives size-1 dims any stride (1, 0, ...), so such a row's ld is moot: raise
  // it. Rows that overlap (a broadcast stride of 0, say) or an ld past int go to at::addmm.
  const int64_t a_rows = trans_a ? k : m, a_cols = trans_a ? m : k;
  const int64_t b_rows = trans_b ? n : k, b_cols = trans_b ? k : n;
  if (a_rows == 1) lda = std::max<int64_t>(lda, a_cols);
  if (b_rows == 1) ldb = std::max<int64_t>(ldb, b_cols);
  if (m == 1) ldc = std::max<int64_t>(ldc, n);
  const bool blas_ok = lda >= a_cols && ldb >= b_cols && ldc >= n &&
                       std::max({lda, ldb, ldc}) <= std::numeric_limits<int>::max();
  if (sgemm_ != nullptr && blas_ok) {
    // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: swap the operands.
    const char ta = trans_b ? 'T' : 'N', tb = trans_a ? 'T' : 'N';
    const int lda_i = int(ldb), ldb_i = int(lda), ldc_i = int(ldc);
    sgemm_(&ta, &tb, &n, &m, &k, &alpha, b, &lda_i, a, &ldb_i, &beta, c, &ldc_i);
    return;
  }
  const auto opts = at::TensorOptions().dtype(at::kFloat);
  auto A = at::from_blob(const_cast<float*>(a), trans_a ? at::IntArrayRef{k, m} : at::IntArrayRef{m, k},
                         {lda, 1}, opts);
  auto B = at::from_blob(const_cast<float*>(b), trans_b ? at::IntArrayRef{n, k} : at::IntArrayRef{k, n},
                         {ldb, 1}, opts);
  auto C = at::from_blob(c, {m, n}, {ldc, 1}, opts);
  at::addmm_out(C, C, trans_a ? A.t() : A, trans_b ? B.t() : B, beta, alpha);
}

}  // namespace flash::cpu
