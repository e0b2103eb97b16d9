// Autograd for flash_attn::fwd, in C++: the backward node calls flash_attn::bwd directly, so a
// training step runs no Python between the forward and the backward kernels (a Python autograd
// function costs ~0.3 ms of host time per step: the engine's device thread must take the GIL).
// Registered for the Autograd key, below which the CPU, CUDA and fake (torch.compile) kernels run.
#include <torch/autograd.h>
#include <torch/library.h>

#include "op_signatures.h"
#include "varlen_checks.h"

namespace flash {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

OptTensor optional_of(const at::Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

const c10::TypedOperatorHandle<BwdSig>& bwd_op() {
  static const auto handle = op_handle<BwdSig>("flash_attn::bwd");
  return handle;
}

class FlashAttnFunction : public torch::autograd::Function<FlashAttnFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, FLASH_FWD_PARAMS) {
    static const auto fwd = op_handle<FwdSig>("flash_attn::fwd");
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [out, lse, probs, rng_state] = fwd.call(FLASH_FWD_ARGS);
    // Absent optional tensors are saved as undefined tensors and come back as nullopt.
    const OptTensor opt_before_bias[] = {block_layout, q_block_lists, k_block_lists, cu_seqlens_q, cu_seqlens_k};
    ctx->save_for_backward({q, k, v, out, lse, rng_state, block_layout.value_or(at::Tensor()),
                            q_block_lists.value_or(at::Tensor()), k_block_lists.value_or(at::Tensor()),
                            cu_seqlens_q.value_or(at::Tensor()), cu_seqlens_k.value_or(at::Tensor()),
                            attn_bias.value_or(at::Tensor()), alibi_slopes.value_or(at::Tensor())});
    // The bias's gradient edge: edges exist for the tensor arguments that are present.
    int64_t bias_edge = 3;
    for (const OptTensor& t : opt_before_bias) bias_edge += t.has_value() && t->defined();
    ctx->saved_data["bias_edge"] = bias_edge;
    ctx->saved_data["softcap"] = softcap;
    ctx->saved_data["max_seqlen_q"] = max_seqlen_q;
    ctx->saved_data["max_seqlen_k"] = max_seqlen_k;
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["softmax_scale"] = softmax_scale;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["window_left"] = window_left;
    ctx->saved_data["window_right"] = window_right;
    ctx->saved_data["deterministic"] = deterministic;
    ctx->mark_non_differentiable({lse, probs, rng_state});
    // Only out has a gradient: skip allocating and zero-filling the others'.
    ctx->set_materialize_grads(false);
    return {out, lse, probs, rng_state};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    constexpr int kNumInputs = 20;  // one gradient slot per forward argument
    constexpr int kBiasInput = 17;
    variable_list result(kNumInputs);
    const at::Tensor& dout = grads[0];
    if (!dout.defined()) return result;  // out does not reach the loss
    const auto& bwd = bwd_op();
    const variable_list saved = ctx->get_saved_variables();
    const auto& d = ctx->saved_data;
    const std::optional<double> softmax_scale =
        d.at("softmax_scale").isNone() ? std::nullopt : std::optional<double>(d.at("softmax_scale").toDouble());
    // The op wants a unit-stride last dim (a broadcast gradient can have stride 0 there).
    const at::Tensor dout_c = dout.sym_stride(-1) == 1 ? dout : dout.contiguous();
    const VarlenOffsetsChecked checked_by_forward;
    const at::Tensor& bias = saved[11];
    const bool bias_grad = bias.defined() && bias.is_floating_point() &&
                           ctx->needs_input_grad(size_t(d.at("bias_edge").toInt()));
    auto [dq, dk, dv, dbias] = bwd.call(dout_c, saved[0], saved[1], saved[2], saved[3], saved[4], d.at("dropout_p").toDouble(),
                                 softmax_scale, d.at("causal").toBool(), d.at("window_left").toInt(),
                                 d.at("window_right").toInt(), d.at("deterministic").toBool(), saved[5],
                                 optional_of(saved[6]), optional_of(saved[7]), optional_of(saved[8]),
                                 optional_of(saved[9]), optional_of(saved[10]), d.at("max_seqlen_q").toSymInt(),
                                 d.at("max_seqlen_k").toSymInt(), optional_of(bias), optional_of(saved[12]),
                                 d.at("softcap").toDouble(), bias_grad);
    result[0] = dq;
    result[1] = dk;
    result[2] = dv;
    if (bias_grad) result[kBiasInput] = dbias;
    return result;
  }
};

// flash_attn::bwd is not differentiable. Where a gradient would flow through it (a second
// derivative: grad(..., create_graph=True), then backward through its result) its outputs carry a
// node that raises, instead of the dispatcher's fallback, which only warns and lets the second
// derivative come out silently wrong (no gradient reaches q, k, v).
class FlashAttnBackwardFunction : public torch::autograd::Function<FlashAttnBackwardFunction> {
 public:
  template <typename... Args>
  static variable_list forward(AutogradContext* ctx, const Args&... args) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [dq, dk, dv, dbias] = bwd_op().call(args...);
    return {dq, dk, dv, dbias};
  }
  static variable_list backward(AutogradContext*, variable_list) {
    TORCH_CHECK(false, "flash_attn: the attention backward is not differentiable, so second derivatives are not "
                "supported (a gradient taken with create_graph=True, then differentiated again)");
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bwd_autograd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, double dropout_p, std::optional<double> softmax_scale, bool causal, int64_t window_left,
    int64_t window_right, bool deterministic, const OptTensor& rng_state, const OptTensor& block_layout,
    const OptTensor& q_block_lists, const OptTensor& k_block_lists, const OptTensor& cu_seqlens_q,
    const OptTensor& cu_seqlens_k, c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k, const OptTensor& attn_bias,
    const OptTensor& alibi_slopes, double softcap, bool bias_requires_grad) {
#define FLASH_BWD_ARGS                                                                                              \
  dout, q, k, v, out, lse, dropout_p, softmax_scale, causal, window_left, window_right, deterministic, rng_state,   \
      block_layout, q_block_lists, k_block_lists, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, attn_bias, \
      alibi_slopes, softcap, bias_requires_grad
  if (!at::GradMode::is_enabled()) {  // (every first-order backward: no node to record)
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return bwd_op().call(FLASH_BWD_ARGS);
  }
  const variable_list r = FlashAttnBackwardFunction::apply(FLASH_BWD_ARGS);
#undef FLASH_BWD_ARGS
  return {r[0], r[1], r[2], r[3]};
}

FwdResult fwd_autograd(FLASH_FWD_PARAMS) {
  const variable_list r = FlashAttnFunction::apply(FLASH_FWD_ARGS);
  return {r[0], r[1], r[2], r[3]};
}

}  // namespace
}  // namespace flash

TORCH_LIBRARY_IMPL(flash_attn, Autograd, m) {
  m.impl("fwd", &flash::fwd_autograd);
  m.impl("bwd", &flash::bwd_autograd);
}
