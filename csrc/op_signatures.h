// The C++ signatures of the flash_attn::fwd and flash_attn::bwd schemas (flash_api.cpp), for the
// kernels registered at other dispatch keys (autograd, autocast) that call the ops again.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <tuple>

namespace flash {

using OptTensor = std::optional<at::Tensor>;

using FwdResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using FwdSig = FwdResult(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, std::optional<double>, bool,
                         int64_t, int64_t, bool, bool, const OptTensor&, const OptTensor&, const OptTensor&,
                         const OptTensor&, const OptTensor&, c10::SymInt, c10::SymInt, const OptTensor&,
                         const OptTensor&, double);
using BwdSig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    double, std::optional<double>, bool, int64_t, int64_t, bool, const OptTensor&, const OptTensor&, const OptTensor&,
    const OptTensor&, const OptTensor&, const OptTensor&, c10::SymInt, c10::SymInt, const OptTensor&, const OptTensor&,
    double, bool);

// FwdSig's parameters with their names, and the names alone (forwarding them unchanged).
#define FLASH_FWD_PARAMS                                                                                             \
  const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, double dropout_p,                                  \
      std::optional<double> softmax_scale, bool causal, int64_t window_left, int64_t window_right,                  \
      bool return_softmax, bool deterministic, const OptTensor &block_layout, const OptTensor &q_block_lists,       \
      const OptTensor &k_block_lists, const OptTensor &cu_seqlens_q, const OptTensor &cu_seqlens_k,                 \
      c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k, const OptTensor &attn_bias,                                \
      const OptTensor &alibi_slopes, double softcap
#define FLASH_FWD_ARGS                                                                                               \
  q, k, v, dropout_p, softmax_scale, causal, window_left, window_right, return_softmax, deterministic, block_layout, \
      q_block_lists, k_block_lists, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, attn_bias,              \
      alibi_slopes, softcap

template <typename Sig>
c10::TypedOperatorHandle<Sig> op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

}  // namespace flash
