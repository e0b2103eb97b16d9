// Autocast for flash_attn::fwd, as PyTorch's scaled_dot_product_attention has it: inside a
// torch.autocast region q, k, v and a floating attn_bias run in the region's lower-precision
// dtype (float32 inputs from an fp32 model no longer hit "the CUDA kernels take float16 or
// bfloat16"), and the casts stay on the autograd graph, so fp32 leaves get fp32 gradients.
// alibi_slopes stays float32 (its required dtype); bool masks and float64 inputs are not cast.
#include <ATen/autocast_mode.h>
#include <torch/library.h>

#include "op_signatures.h"

namespace flash {
namespace {

template <c10::DeviceType kDevice>
FwdResult fwd_autocast(FLASH_FWD_PARAMS) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(at::autocast::get_autocast_dispatch_key_from_device_type(kDevice));
  const at::ScalarType to = at::autocast::get_autocast_dtype(kDevice);
  static const auto fwd = op_handle<FwdSig>("flash_attn::fwd");
  return fwd.call(at::autocast::cached_cast(to, q, kDevice), at::autocast::cached_cast(to, k, kDevice),
                  at::autocast::cached_cast(to, v, kDevice), dropout_p, softmax_scale, causal, window_left,
                  window_right, return_softmax, deterministic, block_layout, q_block_lists, k_block_lists,
                  cu_seqlens_q, cu_seqlens_k, std::move(max_seqlen_q), std::move(max_seqlen_k),
                  at::autocast::cached_cast(to, attn_bias, kDevice), alibi_slopes, softcap);
}

}  // namespace
}  // namespace flash

TORCH_LIBRARY_IMPL(flash_attn, AutocastCPU, m) { m.impl("fwd", &flash::fwd_autocast<c10::DeviceType::CPU>); }
TORCH_LIBRARY_IMPL(flash_attn, AutocastCUDA, m) { m.impl("fwd", &flash::fwd_autocast<c10::DeviceType::CUDA>); }
