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

template <typename Sig>
c10::TypedOperatorHandle<Sig> op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

}  // namespace flash
