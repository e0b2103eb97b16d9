// The per-element score terms beyond q.k * scale: tanh soft-capping, an additive bias (attn_bias;
// boolean masks arrive as 0 / -inf) and ALiBi. One definition serves the CPU and every CUDA
// kernel, so their semantics cannot drift:
//   score(i, j) = cap(scale * q_i.k_j) + bias[b, h, i, j] - slope[b, h] * |i + seqlen_k - seqlen_q - j|
// with cap(x) = softcap * tanh(x / softcap) when softcap > 0, else x (the bias is added after the
// cap, as in flash-attn 2.x, so it is not capped).
#pragma once

#include <cmath>
#include <cstdint>

#include "flash_params.h"
#include "host_device.h"

namespace flash {

// tanh as the kernels evaluate it: the hardware approximation on the GPU (max relative error about
// 2^-11, the same in the forward and the backward, so the probabilities each recomputes agree).
FLASH_HOST_DEVICE float cap_tanh(float x) {
#ifdef __CUDA_ARCH__
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return std::tanh(x);
#endif
}

// What one (batch, head) needs; Bias is the bias's element type. p: a seq_view.
template <typename Bias>
struct ScoreModHead {
  const Bias* bias = nullptr;  // row 0 of head (b, h), or nullptr
  int64_t bias_row_stride = 0;
  float slope = 0.f;  // ALiBi slope of head (b, h); 0 without
  float softcap = 0.f;
  float scale = 1.f;
  int shift = 0;  // seqlen_k - seqlen_q: ALiBi's distance is bottom-right aligned like causal

  FLASH_HOST_DEVICE ScoreModHead(const FwdParams& p, int b, int h)
      : bias_row_stride(p.bias_row_stride), softcap(p.softcap), scale(p.scale_softmax), shift(p.seqlen_k - p.seqlen_q) {
    if (p.bias_ptr != nullptr)
      bias = static_cast<const Bias*>(p.bias_ptr) + b * p.bias_batch_stride + h * p.bias_head_stride;
    if (p.alibi_slopes_ptr != nullptr) slope = p.alibi_slopes_ptr[b * p.alibi_batch_stride + h];
  }

  // score(i, j) in natural-log units from the raw dot product q_i.k_j; dcap receives the cap's
  // derivative 1 - tanh^2 (1 without), the factor from dL/dscore to dL/d(scale * q.k).
  FLASH_HOST_DEVICE float operator()(int i, int j, float raw, float& dcap) const {
    float x = raw * scale;
    dcap = 1.f;
    if (softcap > 0.f) {
      const float t = cap_tanh(x / softcap);
      x = softcap * t;
      dcap = 1.f - t * t;
    }
    if (bias != nullptr) x += static_cast<float>(bias[i * bias_row_stride + j]);
    if (slope != 0.f) x -= slope * fabsf(float(i + shift - j));
    return x;
  }
  FLASH_HOST_DEVICE float operator()(int i, int j, float raw) const {
    float dcap;
    return (*this)(i, j, raw, dcap);
  }
};

// Where element (i, j) of head (b, h) of the bias gradient lies in BwdParams::dbias_ptr.
FLASH_HOST_DEVICE int64_t dbias_index(const BwdParams& p, int b, int h, int i, int j) {
  return b * p.dbias_batch_stride + h * p.dbias_head_stride + i * p.dbias_row_stride + j;
}

}  // namespace flash
