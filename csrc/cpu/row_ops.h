// Vectorised per-row pieces of the online softmax (at::vec picks AVX2/AVX-512/NEON at build time).
#pragma once

#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace flash::cpu {

using Vec = at::vec::Vectorized<float>;

inline float row_max(const float* x, int n) {
  float m = -std::numeric_limits<float>::infinity();
  int c = 0;
  if (n >= Vec::size()) {
    Vec vm = Vec::loadu(x);
    for (c = Vec::size(); c + Vec::size() <= n; c += Vec::size()) vm = at::vec::maximum(vm, Vec::loadu(x + c));
    m = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vm);
  }
  for (; c < n; ++c) m = std::max(m, x[c]);
  return m;
}

// x <- 2^(x * scale - shift); returns the sum of the new values. Uses at::vec's fast exp
// (about 20 ulp, the one PyTorch's own CPU flash attention uses) on the natural-log argument.
inline float exp2_rescale_sum(float* x, int n, float scale, float shift) {
  constexpr float kLn2 = 0.6931471805599453f;
  const Vec vs(scale * kLn2), vsh(shift * kLn2);
  Vec acc(0.f);
  int c = 0;
  for (; c + Vec::size() <= n; c += Vec::size()) {
    Vec p = at::vec::fmsub(Vec::loadu(x + c), vs, vsh).exp_u20();
    p.store(x + c);
    acc = acc + p;
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
  for (; c < n; ++c) {
    x[c] = std::exp2(x[c] * scale - shift);
    sum += x[c];
  }
  return sum;
}

inline void scale_row(float* x, int n, float a) {
  int c = 0;
  for (; c + Vec::size() <= n; c += Vec::size()) (Vec::loadu(x + c) * Vec(a)).store(x + c);
  for (; c < n; ++c) x[c] *= a;
}

inline void fill_row(float* x, int n, float v) { std::fill(x, x + std::max(n, 0), v); }

inline float dot(const float* a, const float* b, int n) {
  Vec acc(0.f);
  int c = 0;
  for (; c + Vec::size() <= n; c += Vec::size()) acc = at::vec::fmadd(Vec::loadu(a + c), Vec::loadu(b + c), acc);
  float s = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  for (; c < n; ++c) s += a[c] * b[c];
  return s;
}

// Dropout on one row: dst = src * (keep ? 1/(1-p) : 0).
inline void apply_keep(float* dst, const float* src, const uint8_t* keep, int n, float rp) {
  for (int c = 0; c < n; ++c) dst[c] = keep[c] ? src[c] * rp : 0.f;
}

// dS = P * (dP - D) where dP has already been masked and rescaled by dropout.
inline void softmax_grad_row(float* p_to_ds, const float* dp, int n, float d_row) {
  const Vec vd(d_row);
  int c = 0;
  for (; c + Vec::size() <= n; c += Vec::size())
    (Vec::loadu(p_to_ds + c) * (Vec::loadu(dp + c) - vd)).store(p_to_ds + c);
  for (; c < n; ++c) p_to_ds[c] *= dp[c] - d_row;
}

}  // namespace flash::cpu
