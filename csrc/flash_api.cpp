// The op layer: schemas, argument checks with clear messages, output allocation, and the
// hand-off of one filled params struct to the CPU or CUDA implementation.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <optional>
#include <tuple>
#include <vector>

#include "block_mask.h"
#include "cpu/flash_cpu.h"
#include "env_switch.h"
#include "flash_api.h"
#include "flash_params.h"
#include "varlen_checks.h"

#ifdef FLASH_ATTN_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/flash_launch.h"
#include "cuda/fwd_num_splits.h"
#endif

namespace flash {

namespace {
thread_local bool offsets_checked = false;
}  // namespace
VarlenOffsetsChecked::VarlenOffsetsChecked() : previous_(offsets_checked) { offsets_checked = true; }
VarlenOffsetsChecked::~VarlenOffsetsChecked() { offsets_checked = previous_; }
bool VarlenOffsetsChecked::active() { return offsets_checked; }

namespace {

constexpr int64_t kMaxHeadDim = 256;

struct Shapes {
  int b, seqlen_q, seqlen_k, h, h_k, d;
};

bool supported_dtype(at::ScalarType t) {
  return t == at::kHalf || t == at::kBFloat16 || t == at::kFloat;
}

DType to_dtype(at::ScalarType t) {
  return t == at::kHalf ? DType::kFloat16 : t == at::kBFloat16 ? DType::kBFloat16 : DType::kFloat32;
}

int checked_int(int64_t v, const char* what) {
  TORCH_CHECK(v <= std::numeric_limits<int>::max(), "flash_attn: ", what, " must fit in 32 bits, got ", v);
  return int(v);
}

// Rank, dtype, device and last-dim contiguity of one (batch, seqlen, heads, headdim) operand.
void check_operand(const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK(t.defined(), "flash_attn: ", name, " must be a tensor, got None");
  TORCH_CHECK(t.dim() == 4, "flash_attn: ", name,
              " must have shape (batch, seqlen, nheads, headdim), got a tensor of rank ", t.dim(),
              " with shape ", t.sizes());
  TORCH_CHECK(supported_dtype(t.scalar_type()), "flash_attn: ", name,
              " must be float16, bfloat16 or float32, got ", t.scalar_type());
  TORCH_CHECK(t.scalar_type() == q.scalar_type(), "flash_attn: ", name, " must have the dtype of q (",
              q.scalar_type(), "), got ", t.scalar_type());
  TORCH_CHECK(t.device() == q.device(), "flash_attn: ", name, " must be on the device of q (", q.device(),
              "), got ", t.device());
  TORCH_CHECK(t.stride(-1) == 1 || t.size(-1) <= 1, "flash_attn: ", name,
              " must have a contiguous last dimension (stride 1), got stride ", t.stride(-1),
              "; call .contiguous() first");
}

Shapes check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  check_operand(q, "q", q);
  check_operand(k, "k", q);
  check_operand(v, "v", q);
  TORCH_CHECK(q.device().is_cpu() || q.device().is_cuda(), "flash_attn: q must be on a CPU or CUDA device, got ",
              q.device());
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0), "flash_attn: q, k and v must have the same batch size, got ",
              q.size(0), ", ", k.size(0), " and ", v.size(0));
  TORCH_CHECK(k.size(3) == q.size(3) && v.size(3) == q.size(3), "flash_attn: q, k and v must have the same head dim, got ",
              q.size(3), ", ", k.size(3), " and ", v.size(3));
  TORCH_CHECK(v.size(1) == k.size(1), "flash_attn: k and v must have the same seqlen, got ", k.size(1), " and ",
              v.size(1));
  TORCH_CHECK(v.size(2) == k.size(2), "flash_attn: k and v must have the same number of heads, got ", k.size(2),
              " and ", v.size(2));
  const int64_t d = q.size(3);
  TORCH_CHECK(d >= 1 && d <= kMaxHeadDim, "flash_attn: head dim must be between 1 and ", kMaxHeadDim, ", got ", d);
  TORCH_CHECK(k.size(2) >= 1 && q.size(2) % k.size(2) == 0,
              "flash_attn: the number of query heads must be a multiple of the number of key/value heads, got ",
              q.size(2), " query heads and ", k.size(2), " key/value heads");
  return Shapes{checked_int(q.size(0), "batch"), checked_int(q.size(1), "seqlen_q"),
                checked_int(k.size(1), "seqlen_k"), checked_int(q.size(2), "nheads"),
                checked_int(k.size(2), "nheads_k"), int(d)};
}

void check_scalars(double dropout_p, double scale, int64_t window_left, int64_t window_right) {
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "flash_attn: dropout_p must be in [0, 1), got ", dropout_p);
  TORCH_CHECK(std::isfinite(scale), "flash_attn: softmax_scale must be finite, got ", scale);
  TORCH_CHECK(window_left >= -1 && window_right >= -1,
              "flash_attn: window sizes must be -1 (unbounded) or >= 0, got (", window_left, ", ", window_right, ")");
}

// Variable-length batches: cu_seqlens_q / cu_seqlens_k given, or neither.
struct Varlen {
  const std::optional<at::Tensor>& cu_q;
  const std::optional<at::Tensor>& cu_k;
  int64_t max_q, max_k;
  // k and v are a KV cache (FwdParams::seqused_k says each sequence's keys): cu_k counts them, its
  // last offset is not k's rows.
  bool k_cache = false;
  bool present() const { return cu_q.has_value() && cu_q->defined(); }
  int batch() const { return int(cu_q->numel()) - 1; }
};

void check_cu_seqlens_tensor(const std::optional<at::Tensor>& cu, const char* name, const at::Tensor& q) {
  TORCH_CHECK(cu.has_value() && cu->defined(), "flash_attn: cu_seqlens_q and cu_seqlens_k must be given together, got ",
              name, " = None");
  TORCH_CHECK(cu->scalar_type() == at::kInt, "flash_attn: ", name, " must be int32, got ", cu->scalar_type());
  TORCH_CHECK(cu->dim() == 1 && cu->numel() >= 1, "flash_attn: ", name,
              " must be a 1-D tensor of batch + 1 offsets, got shape ", cu->sizes());
  TORCH_CHECK(cu->is_contiguous(), "flash_attn: ", name, " must be contiguous");
  TORCH_CHECK(cu->device() == q.device(), "flash_attn: ", name, " must be on the device of q (", q.device(), "), got ",
              cu->device());
}

// The offsets themselves (c: a host copy of n of them): 0 first, non-decreasing, ending at the
// packed tensor's rows (total; unchecked where negative), no sequence longer than max_seqlen.
void check_cu_seqlens_values(const int32_t* c, int64_t n, const char* name, int64_t total, const char* total_what,
                             int64_t max_seqlen, const char* max_name) {
  TORCH_CHECK(c[0] == 0, "flash_attn: ", name, "[0] must be 0, got ", c[0]);
  for (int64_t i = 0; i + 1 < n; ++i) {
    TORCH_CHECK(c[i + 1] >= c[i], "flash_attn: ", name, " must be non-decreasing, got ", name, "[", i, "] = ", c[i],
                " > ", name, "[", i + 1, "] = ", c[i + 1]);
    TORCH_CHECK(c[i + 1] - c[i] <= max_seqlen, "flash_attn: ", max_name, " = ", max_seqlen,
                " is smaller than sequence ", i, "'s length ", c[i + 1] - c[i], " (from ", name, ")");
  }
  TORCH_CHECK(total < 0 || c[n - 1] == total, "flash_attn: ", name, "[-1] must equal ", total_what, " (", total,
              "), got ", c[n - 1]);
}

// Both offsets tensors' values. Reading them costs a device-to-host copy (a sync), one for both
// when they are the same tensor (self-attention, the packed-qkv functions), and none while a CUDA
// graph is being captured (a copy cannot be captured), when FLASH_ATTN_SKIP_VARLEN_CHECKS=1, and
// in the backward of an autograd graph whose forward checked them (VarlenOffsetsChecked).
void check_offsets_values(const Varlen& vl, int64_t total_q, int64_t total_k) {
  if (!index_value_checks_wanted(*vl.cu_q)) return;
  const at::Tensor host_q = vl.cu_q->to(at::kCPU);
  const at::Tensor host_k = vl.cu_k->is_same(*vl.cu_q) ? host_q : vl.cu_k->to(at::kCPU);
  const int64_t n = host_q.numel();
  check_cu_seqlens_values(host_q.data_ptr<int32_t>(), n, "cu_seqlens_q", total_q, "q.size(0)", vl.max_q,
                          "max_seqlen_q");
  check_cu_seqlens_values(host_k.data_ptr<int32_t>(), n, "cu_seqlens_k", total_k, "k.size(0)", vl.max_k,
                          "max_seqlen_k");
}

// Checks a varlen call's arguments (q: (total_q, nheads, headdim), k and v: (total_k, nheads_k,
// headdim)) and returns q, k, v as one packed batch entry (1, total, heads, headdim), which the
// rest of the op layer handles like a padded batch.
std::tuple<at::Tensor, at::Tensor, at::Tensor> check_varlen(const Varlen& vl, const at::Tensor& q, const at::Tensor& k,
                                                            const at::Tensor& v) {
  if (!vl.present()) {
    TORCH_CHECK(!(vl.cu_k.has_value() && vl.cu_k->defined()),
                "flash_attn: cu_seqlens_q and cu_seqlens_k must be given together, got cu_seqlens_q = None");
    return {q, k, v};
  }
  const auto check_rank3 = [](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.defined(), "flash_attn: ", name, " must be a tensor, got None");
    TORCH_CHECK(t.dim() == 3, "flash_attn: with cu_seqlens, ", name,
                " must have shape (total, nheads, headdim), got a tensor of rank ", t.dim(), " with shape ", t.sizes());
  };
  check_rank3(q, "q");
  check_rank3(k, "k");
  check_rank3(v, "v");
  check_cu_seqlens_tensor(vl.cu_q, "cu_seqlens_q", q);
  check_cu_seqlens_tensor(vl.cu_k, "cu_seqlens_k", q);
  TORCH_CHECK(vl.cu_q->numel() == vl.cu_k->numel(), "flash_attn: cu_seqlens_q and cu_seqlens_k must have the same "
              "length (batch + 1), got ", vl.cu_q->numel(), " and ", vl.cu_k->numel());
  TORCH_CHECK(vl.max_q >= 0 && vl.max_k >= 0, "flash_attn: max_seqlen_q and max_seqlen_k must be >= 0, got ",
              vl.max_q, " and ", vl.max_k);
  checked_int(vl.max_q, "max_seqlen_q");
  checked_int(vl.max_k, "max_seqlen_k");
  check_offsets_values(vl, q.size(0), vl.k_cache ? -1 : k.size(0));
  return {q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)};
}

// Shapes of a varlen call from its packed (1, total, heads, headdim) operands: batch = the number
// of sequences, seqlens = the longest.
Shapes varlen_shapes(Shapes s, const Varlen& vl) {
  s.b = vl.batch();
  s.seqlen_q = int(vl.max_q);
  s.seqlen_k = int(vl.max_k);
  return s;
}

// A varlen batch with no query rows or no key rows at all (max_seqlen may still say more): no
// kernel runs, since the TMA kernels' descriptors cannot describe an empty tensor; every row
// gives 0 (logsumexp -inf), every gradient 0.
bool packed_rows_empty(const Varlen& vl, const Shapes& packed) {
  return vl.present() && (packed.seqlen_q == 0 || packed.seqlen_k == 0);
}

void set_strides(const at::Tensor& t, int64_t& batch, int64_t& row, int64_t& head) {
  batch = t.stride(0);
  row = t.stride(1);
  head = t.stride(2);
}

// Everything the forward and backward share: pointers, strides, sizes, scale, mask, dropout.
void set_fwd_params(FwdParams& p, const Shapes& s, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& out, const at::Tensor& lse, double dropout_p, double scale, bool causal,
                    int64_t window_left, int64_t window_right) {
  p.q_ptr = q.data_ptr();
  p.k_ptr = k.data_ptr();
  p.v_ptr = v.data_ptr();
  p.o_ptr = out.data_ptr();
  set_strides(q, p.q_batch_stride, p.q_row_stride, p.q_head_stride);
  set_strides(k, p.k_batch_stride, p.k_row_stride, p.k_head_stride);
  set_strides(v, p.v_batch_stride, p.v_row_stride, p.v_head_stride);
  set_strides(out, p.o_batch_stride, p.o_row_stride, p.o_head_stride);
  p.softmax_lse_ptr = lse.data_ptr<float>();
  p.b = s.b;
  p.seqlen_q = s.seqlen_q;
  p.seqlen_k = s.seqlen_k;
  p.h = s.h;
  p.h_k = s.h_k;
  p.h_h_k_ratio = s.h / s.h_k;
  p.d = s.d;
  p.scale_softmax = float(scale);
  p.scale_softmax_log2 = float(scale * M_LOG2E);
  p.is_causal = causal;
  p.window_size_left = int(std::min<int64_t>(window_left, std::numeric_limits<int>::max()));
  p.window_size_right = causal ? 0 : int(std::min<int64_t>(window_right, std::numeric_limits<int>::max()));
  p.p_dropout = float(dropout_p);
  p.rp_dropout = float(1.0 / (1.0 - dropout_p));
  p.dropout_threshold16 = uint32_t(std::llround(dropout_p * 65536.0));
  p.dtype = to_dtype(q.scalar_type());
  p.total_q = s.seqlen_q;
  p.total_k = s.seqlen_k;
  p.lse_head_stride = s.seqlen_q;
  p.lse_batch_stride = int64_t(s.h) * s.seqlen_q;
  p.p_row_stride = s.seqlen_k;
  p.p_head_stride = int64_t(s.seqlen_q) * s.seqlen_k;
  p.p_batch_stride = int64_t(s.h) * p.p_head_stride;
}

// A varlen call: the offsets, the packed row counts, batch strides 0 (the sequences share batch
// entry 0 and are told apart by their first rows) and softmax_lse as (h, total_q). total_q and
// total_k: the packed operands' rows.
void set_varlen_params(FwdParams& p, const Varlen& vl, int64_t total_q, int64_t total_k) {
  if (!vl.present()) return;
  p.cu_seqlens_q = vl.cu_q->data_ptr<int32_t>();
  p.cu_seqlens_k = vl.cu_k->data_ptr<int32_t>();
  p.total_q = int(total_q);
  p.total_k = int(total_k);
  p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = p.o_batch_stride = 0;
  p.lse_batch_stride = 0;
  p.lse_head_stride = total_q;
}

// A KV-cache read (FwdParams::seqused_k): the cache's geometry, and seqlen_k = its rows (what
// sizes the split-KV heuristic; each batch entry's own count comes from seq_view).
void set_kvcache_params(FwdParams& p, const KvCacheRead* kv, const at::Tensor& cache) {
  if (kv == nullptr) return;
  p.seqused_k = kv->seqused;
  p.kv_batch_idx = kv->batch_idx;
  p.k_leftpad = kv->leftpad;
  p.seqlen_knew = kv->seqlen_new;
  p.longest_keys = kv->longest_keys;
  p.k_batch_stride = p.v_batch_stride = 0;  // (the broadcast; also where the batch has one entry)
  p.k_entries = int(cache.size(0));
  p.k_entry_rows = p.seqlen_k = p.total_k = int(cache.size(1));
  if (kv->block_table != nullptr) {  // entries are pages; a batch entry spans pages_per_entry of them
    p.block_table = kv->block_table;
    p.block_table_stride = kv->block_table_stride;
    p.page_block_size = int(cache.size(1));
    p.k_entry_rows = p.seqlen_k = p.total_k = kv->pages_per_entry * p.page_block_size;
  }
}

// The backward's extra layouts: the GQA dK/dV scratch rows (batch, h, seqlen_k) and, with varlen,
// (h, total_k); with varlen also batch strides 0 for dO, dQ, dK, dV and the per-row buffers (the
// caller sets their padded-batch strides). packed: the packed operands' shapes.
void set_bwd_varlen_params(BwdParams& p, const Varlen& vl, const Shapes& packed) {
  p.kv_accum_head_stride = packed.seqlen_k;
  p.kv_accum_batch_stride = int64_t(p.h) * packed.seqlen_k;
  if (!vl.present()) return;
  set_varlen_params(p, vl, packed.seqlen_q, packed.seqlen_k);
  p.do_batch_stride = p.dq_batch_stride = p.dk_batch_stride = p.dv_batch_stride = 0;
  p.kv_accum_batch_stride = 0;
  p.stat_batch_stride = 0;
}

// The block-sparse mask's three tensors (flash_attn.block_sparse.BlockSparseMask builds them):
// all given or none.
struct BlockMask {
  const std::optional<at::Tensor>& layout;
  const std::optional<at::Tensor>& q_lists;
  const std::optional<at::Tensor>& k_lists;
  bool present() const { return layout.has_value() && layout->defined(); }
};

void check_mask_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype, const at::Tensor& q,
                       std::initializer_list<int64_t> shape) {
  TORCH_CHECK(t.scalar_type() == dtype, "flash_attn: ", name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.device() == q.device(), "flash_attn: ", name, " must be on the device of q (", q.device(), "), got ",
              t.device(), "; move the mask with BlockSparseMask.to(device) once, outside the step");
  TORCH_CHECK(t.sizes().equals(shape), "flash_attn: ", name, " must have shape ", at::IntArrayRef(shape), ", got ",
              t.sizes());
  TORCH_CHECK(t.is_contiguous(), "flash_attn: ", name, " must be contiguous");
}

void check_block_mask(const Shapes& s, const at::Tensor& q, const BlockMask& m) {
  const bool lists = m.q_lists.has_value() && m.q_lists->defined() && m.k_lists.has_value() && m.k_lists->defined();
  if (!m.present()) {
    TORCH_CHECK(!(m.q_lists.has_value() && m.q_lists->defined()) && !(m.k_lists.has_value() && m.k_lists->defined()),
                "flash_attn: q_block_lists / k_block_lists were given without block_layout");
    return;
  }
  TORCH_CHECK(lists, "flash_attn: block_layout needs q_block_lists and k_block_lists (build all three with "
              "flash_attn.BlockSparseMask.from_layout)");
  const at::Tensor& l = *m.layout;
  TORCH_CHECK(l.dim() == 4, "flash_attn: block_layout must have shape (batch or 1, nheads or 1, q_blocks, k_blocks), "
              "got ", l.sizes());
  const int64_t nq = (s.seqlen_q + kMaskBlock - 1) / kMaskBlock, nk = (s.seqlen_k + kMaskBlock - 1) / kMaskBlock;
  TORCH_CHECK((l.size(0) == 1 || l.size(0) == s.b) && (l.size(1) == 1 || l.size(1) == s.h),
              "flash_attn: block_layout's batch and head dims (", l.size(0), ", ", l.size(1),
              ") must each be 1 or equal to batch and nheads (", s.b, ", ", s.h, ")");
  TORCH_CHECK(l.size(2) == nq && l.size(3) == nk, "flash_attn: block_layout must have ", nq, " x ", nk, " blocks of ",
              kMaskBlock, " for seqlen_q = ", s.seqlen_q, ", seqlen_k = ", s.seqlen_k, ", got ", l.size(2), " x ",
              l.size(3));
  check_mask_tensor(l, "block_layout", at::kBool, q, {l.size(0), l.size(1), nq, nk});
  check_mask_tensor(*m.q_lists, "q_block_lists", at::kInt, q, {l.size(0), l.size(1), nq, 1 + nk});
  check_mask_tensor(*m.k_lists, "k_block_lists", at::kInt, q, {l.size(0), l.size(1), nk, 1 + nq});
}

void set_block_mask(FwdParams& p, const BlockMask& m) {
  if (!m.present()) return;
  p.block_layout = m.layout->data_ptr<bool>();
  p.q_block_lists = m.q_lists->data_ptr<int32_t>();
  p.k_block_lists = m.k_lists->data_ptr<int32_t>();
  p.mask_b = int(m.layout->size(0));
  p.mask_h = int(m.layout->size(1));
  p.mask_q_blocks = int(m.layout->size(2));
  p.mask_k_blocks = int(m.layout->size(3));
}

// attn_bias, alibi_slopes and softcap (score_mod.h).
struct ScoreMods {
  const std::optional<at::Tensor>& bias;
  const std::optional<at::Tensor>& alibi;
  double softcap;
  bool has_bias() const { return bias.has_value() && bias->defined(); }
  bool has_alibi() const { return alibi.has_value() && alibi->defined(); }
};

void check_score_mods(const ScoreMods& m, const Shapes& s, const at::Tensor& q, bool varlen) {
  TORCH_CHECK(std::isfinite(m.softcap) && m.softcap >= 0.0, "flash_attn: softcap must be >= 0 (0 = off), got ",
              m.softcap);
  if (m.has_bias()) {
    const at::Tensor& b = *m.bias;
    TORCH_CHECK(!varlen, "flash_attn: attn_bias cannot be combined with cu_seqlens (variable-length batches); "
                "use a padded batch, or causal / window_size / alibi_slopes, which work with varlen");
    TORCH_CHECK(b.scalar_type() == at::kBool || supported_dtype(b.scalar_type()),
                "flash_attn: attn_bias must be bool (True = attend) or float16, bfloat16 or float32, got ",
                b.scalar_type());
    TORCH_CHECK(b.device() == q.device(), "flash_attn: attn_bias must be on the device of q (", q.device(), "), got ",
                b.device());
    const int64_t full[4] = {s.b, s.h, s.seqlen_q, s.seqlen_k};
    bool ok = b.dim() <= 4;
    for (int64_t i = 0; ok && i < b.dim(); ++i) {
      const int64_t n = b.size(i), want = full[4 - b.dim() + i];
      ok = n == 1 || n == want;
    }
    TORCH_CHECK(ok, "flash_attn: attn_bias must be broadcastable to (batch, nheads, seqlen_q, seqlen_k) = (", s.b,
                ", ", s.h, ", ", s.seqlen_q, ", ", s.seqlen_k, "), got shape ", b.sizes());
  }
  if (m.has_alibi()) {
    const at::Tensor& a = *m.alibi;
    TORCH_CHECK(a.scalar_type() == at::kFloat, "flash_attn: alibi_slopes must be float32, got ", a.scalar_type());
    TORCH_CHECK(a.device() == q.device(), "flash_attn: alibi_slopes must be on the device of q (", q.device(),
                "), got ", a.device());
    TORCH_CHECK((a.dim() == 1 && a.size(0) == s.h) || (a.dim() == 2 && (a.size(0) == s.b || a.size(0) == 1) &&
                                                       a.size(1) == s.h),
                "flash_attn: alibi_slopes must have shape (nheads,) = (", s.h, ",) or (batch, nheads) = (", s.b, ", ",
                s.h, "), got ", a.sizes());
    TORCH_CHECK(a.stride(-1) == 1, "flash_attn: alibi_slopes must be contiguous");
  }
}

// The bias as the kernels read it: 4-D, in their element type (bool: 0 where True, -inf where
// False), unit column stride (a bias broadcast over the keys is expanded along them). pairs (CUDA):
// the kernels read adjacent keys as one 32-bit word, so the start is 4-byte aligned and the
// strides even (an odd row length is padded by one).
at::Tensor kernel_bias(const ScoreMods& m, const Shapes& s, at::ScalarType dtype, bool pairs) {
  if (!m.has_bias()) return at::Tensor();
  at::Tensor b = *m.bias;
  while (b.dim() < 4) b = b.unsqueeze(0);
  b = b.scalar_type() == at::kBool
          ? at::zeros(b.sizes(), b.options().dtype(dtype)).masked_fill_(b.logical_not(), -INFINITY)
          : b.to(dtype);
  if (b.size(3) != s.seqlen_k || (b.stride(3) != 1 && s.seqlen_k > 1))
    b = b.expand({b.size(0), b.size(1), b.size(2), s.seqlen_k}).contiguous();
  bool aligned = reinterpret_cast<uintptr_t>(b.data_ptr()) % 4 == 0;
  for (int64_t i = 0; i < 3; ++i) aligned = aligned && (b.size(i) == 1 || b.stride(i) % 2 == 0);
  if (pairs && !aligned) {
    at::Tensor padded = at::empty({b.size(0), b.size(1), b.size(2), s.seqlen_k + s.seqlen_k % 2}, b.options());
    b = padded.narrow(3, 0, s.seqlen_k).copy_(b);
  }
  return b;
}

// A 4-D tensor's stride along dim i, 0 where it is broadcast (size 1).
int64_t bcast_stride(const at::Tensor& t, int64_t i) { return t.size(i) == 1 ? 0 : t.stride(i); }

// bias: kernel_bias's result (or undefined).
void set_score_mod_params(FwdParams& p, const at::Tensor& bias, const ScoreMods& m) {
  if (bias.defined()) {
    p.bias_ptr = bias.data_ptr();
    p.bias_batch_stride = bcast_stride(bias, 0);
    p.bias_head_stride = bcast_stride(bias, 1);
    p.bias_row_stride = bcast_stride(bias, 2);
  }
  if (m.has_alibi()) {
    p.alibi_slopes_ptr = m.alibi->data_ptr<float>();
    p.alibi_batch_stride = m.alibi->dim() == 2 ? bcast_stride(*m.alibi, 0) : 0;
  }
  p.softcap = float(m.softcap);
  p.score_mod = bias.defined() || m.has_alibi() || m.softcap > 0.0;
}

// The bias gradient's buffer: the bias's own broadcast shape in float32, which the kernels add
// into atomically (CUDA, not deterministic), or the full (batch, nheads, seqlen_q, seqlen_k), where
// each element is written once: directly in the bias's dtype when that is the kernels' (CUDA, a
// full-shape bias), else in float32 with the broadcast dims summed afterwards (finish_dbias).
struct DBias {
  at::Tensor acc;
  bool atomic = false;
};

DBias alloc_dbias(const at::Tensor& bias, const at::Tensor& kbias, const Shapes& s, bool cuda, bool deterministic) {
  const auto f32 = kbias.options().dtype(at::kFloat);
  const bool full = kbias.size(0) == s.b && kbias.size(1) == s.h && kbias.size(2) == s.seqlen_q;
  const bool atomic = cuda && !deterministic && !full;
  if (atomic) return DBias{at::zeros({kbias.size(0), kbias.size(1), kbias.size(2), s.seqlen_k}, f32), true};
  const bool elem = cuda && full && bias.scalar_type() == kbias.scalar_type() && bias.size(-1) == s.seqlen_k;
  return DBias{at::zeros({s.b, s.h, s.seqlen_q, s.seqlen_k}, elem ? kbias.options() : f32), false};
}

void set_dbias_params(BwdParams& p, const DBias& d) {
  p.dbias_ptr = d.acc.data_ptr();
  p.dbias_batch_stride = bcast_stride(d.acc, 0);
  p.dbias_head_stride = bcast_stride(d.acc, 1);
  p.dbias_row_stride = bcast_stride(d.acc, 2);
  p.dbias_atomic = d.atomic;
  p.dbias_elem = d.acc.scalar_type() != at::kFloat;
}

// The gradient in the shape and dtype of the bias the caller passed.
at::Tensor finish_dbias(const at::Tensor& acc, const at::Tensor& bias) {
  at::Tensor b = bias;
  while (b.dim() < 4) b = b.unsqueeze(0);
  std::vector<int64_t> dims;
  for (int64_t i = 0; i < 4; ++i)
    if (b.size(i) == 1 && acc.size(i) != 1) dims.push_back(i);
  const at::Tensor r = dims.empty() ? acc : acc.sum(dims, /*keepdim=*/true);
  return r.reshape(bias.sizes()).to(bias.scalar_type());
}

// The score modifiers into p, for the CUDA kernels (bias in q's dtype, read as pairs) or the CPU
// (float32). Returns the bias the kernels read, which must outlive the launch.
at::Tensor set_score_mods(FwdParams& p, const ScoreMods& m, const Shapes& s, const at::Tensor& q, bool cuda) {
  at::Tensor kbias = kernel_bias(m, s, cuda ? q.scalar_type() : at::kFloat, /*pairs=*/cuda);
  set_score_mod_params(p, kbias, m);
  return kbias;
}

// The backward's: the modifiers and, when requested, the bias gradient's buffer (DBias::acc
// undefined otherwise).
DBias set_bwd_score_mods(BwdParams& p, const ScoreMods& m, const Shapes& s, const at::Tensor& q, bool cuda,
                         bool deterministic, bool bias_requires_grad, at::Tensor& kbias) {
  kbias = set_score_mods(p, m, s, q, cuda);
  if (!bias_requires_grad) return DBias{};
  DBias d = alloc_dbias(*m.bias, kbias, s, cuda, deterministic);
  set_dbias_params(p, d);
  return d;
}

// The gradient in the shape and dtype of the bias the caller passed (an empty tensor when it was
// not requested).
at::Tensor dbias_result(const DBias& d, const ScoreMods& m, const at::Tensor& q) {
  return d.acc.defined() ? finish_dbias(d.acc, *m.bias) : at::empty({0}, q.options());
}

// What the forward and backward check alike: operands (varlen ones as one packed batch entry),
// shapes, scalars and the block mask.
struct Call {
  at::Tensor q, k, v;  // varlen: (1, total, heads, headdim)
  Shapes packed;       // shapes of q, k, v as above
  Shapes s;            // the call's: varlen batch = sequences, seqlens = the longest
  double scale;
};

double default_scale(std::optional<double> scale, int d) { return scale.value_or(1.0 / std::sqrt(double(d))); }

Call check_call(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const Varlen& vl,
                const BlockMask& mask, const ScoreMods& mods, double dropout_p, std::optional<double> softmax_scale,
                int64_t window_left, int64_t window_right) {
  Call c;
  std::tie(c.q, c.k, c.v) = check_varlen(vl, q_in, k_in, v_in);
  c.packed = check_qkv(c.q, c.k, c.v);
  c.s = vl.present() ? varlen_shapes(c.packed, vl) : c.packed;
  c.scale = default_scale(softmax_scale, c.s.d);
  check_scalars(dropout_p, c.scale, window_left, window_right);
  TORCH_CHECK(!(vl.present() && mask.present()), "flash_attn: a block mask (block_layout) cannot be combined with "
              "cu_seqlens (variable-length batches)");
  check_block_mask(c.s, c.q, mask);
  check_score_mods(mods, c.s, c.q, vl.present());
  return c;
}

at::Tensor as_float(const at::Tensor& t) { return t.scalar_type() == at::kFloat ? t : t.to(at::kFloat); }

// Seed for one dropout call on the CPU, drawn from the default CPU generator (torch.manual_seed).
uint64_t draw_cpu_seed() {
  auto* gen = at::check_generator<at::CPUGeneratorImpl>(at::detail::getDefaultCPUGenerator());
  std::lock_guard<std::mutex> lock(gen->mutex_);
  return gen->random64();
}

#ifdef FLASH_ATTN_WITH_CUDA
int64_t round_up8(int64_t d) { return (d + 7) / 8 * 8; }

void check_cuda_operands(const at::Tensor& q) {
  const cudaDeviceProp* props = at::cuda::getDeviceProperties(q.get_device());
  TORCH_CHECK(props->major >= 8, "flash_attn: the CUDA kernels need compute capability 8.0 or newer (Ampere, Ada, "
              "Hopper); ", props->name, " is ", props->major, ".", props->minor);
  TORCH_CHECK(q.scalar_type() != at::kFloat, "flash_attn: the CUDA kernels take float16 or bfloat16 inputs, got "
              "float32 (the CPU implementation takes float32)");
}

// What cp.async needs: 16-byte aligned rows, the head dim padded with zeros to a multiple of 8.
at::Tensor cuda_operand(const at::Tensor& t, int64_t d8) {
  at::Tensor x = t.size(3) == d8 ? t : at::constant_pad_nd(t, {0, d8 - t.size(3)}, 0);
  bool aligned = reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0;
  for (int i = 0; i < 3; ++i) aligned = aligned && (x.size(i) <= 1 || x.stride(i) % 8 == 0);
  return aligned ? x : x.contiguous();
}

struct CudaQKV {
  int64_t d8;
  at::Tensor q, k, v;
  double scale;      // > 0: the kernels fold it into their exponents after taking row maxima
  double dq_factor;  // what the backward multiplies the kernels' dQ by
};

// The kernels take a positive scale. A negative one runs as (-q, -scale), exactly the same
// scores, with dQ negated; zero runs as (q = 0, scale 1), the same all-zero scores, with dQ = 0.
CudaQKV cuda_qkv(const Shapes& s, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  check_cuda_operands(q);
  const int64_t d8 = round_up8(s.d);
  const at::Tensor qs = scale > 0 ? q : scale < 0 ? q.neg() : at::zeros_like(q);
  return CudaQKV{d8, cuda_operand(qs, d8), cuda_operand(k, d8), cuda_operand(v, d8),
                 scale > 0 ? scale : scale < 0 ? -scale : 1.0, scale > 0 ? 1.0 : scale < 0 ? -1.0 : 0.0};
}

void set_cuda_philox(FwdParams& p) {
  auto* gen = at::check_generator<at::CUDAGeneratorImpl>(at::cuda::detail::getDefaultCUDAGenerator());
  at::PhiloxCudaState st;
  {
    std::lock_guard<std::mutex> lock(gen->mutex_);
    st = gen->philox_cuda_state(4);  // one counter word per launch; see philox.h
  }
  if (st.captured_) {
    p.philox_captured = true;
    p.philox_seed_ptr = st.seed_.ptr;
    p.philox_offset_ptr = st.offset_.ptr;
    p.philox_offset_intragraph = st.offset_intragraph_;
  } else {
    p.philox_seed = st.seed_.val;
    p.philox_offset = st.offset_.val;
  }
}
#endif

// The forward after the op's arguments are gathered: checks, allocation, the kernels. kv: k_in and
// v_in are a KV cache (entries, rows, h_k, d) read as kv says. out takes q's strides with a cache
// or out_like_q (the callers that fold GQA heads into rows pass a permuted view of q, so that the
// unfolded output is a view of a contiguous tensor). num_splits (CUDA, no dropout or
// probabilities): 1, none; 0, as many as fwd_num_splits finds useful; n, n.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> run_fwd(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const Varlen& vl, const BlockMask& mask,
    const ScoreMods& mods, double dropout_p, std::optional<double> softmax_scale, bool causal,
    int64_t window_size_left, int64_t window_size_right, bool return_softmax, const KvCacheRead* kv = nullptr,
    int num_splits = 1, bool out_like_q = false) {
  // A cache is one packed row range that every batch entry sees (batch stride 0; with varlen q,
  // the packed rows of a varlen k), read in place in its own dtype (the CPU converts a 16-bit
  // one tile by tile).
  const auto as_cache = [&](const at::Tensor& t) {
    const at::Tensor rows = t.reshape({t.size(0) * t.size(1), t.size(2), t.size(3)});
    return vl.present() ? rows : rows.unsqueeze(0).expand({q_in.size(0), -1, -1, -1});
  };
  const Call c = check_call(q_in, kv ? as_cache(k_in) : k_in, kv ? as_cache(v_in) : v_in, vl, mask, mods, dropout_p,
                            softmax_scale, window_size_left, window_size_right);
  const at::Tensor &q = c.q, &k = c.k, &v = c.v;
  const Shapes &packed = c.packed, &s = c.s;
  const double scale = c.scale;

  const auto opts = q.options();
  at::Tensor out = kv || out_like_q ? at::empty_like(q) : at::empty(q.sizes(), opts);
  at::Tensor lse = vl.present() ? at::empty({s.h, packed.seqlen_q}, opts.dtype(at::kFloat))
                                : at::empty({s.b, s.h, s.seqlen_q}, opts.dtype(at::kFloat));
  // Varlen: zeros past each sequence's own rows and keys.
  at::Tensor probs = !return_softmax ? at::empty({0}, opts)
                     : vl.present()  ? at::zeros({s.b, s.h, s.seqlen_q, s.seqlen_k}, opts.dtype(at::kFloat))
                                     : at::empty({s.b, s.h, s.seqlen_q, s.seqlen_k}, opts.dtype(at::kFloat));
  const auto unpack = [&](const at::Tensor& t) { return vl.present() ? t.squeeze(0) : t; };
#ifdef FLASH_ATTN_WITH_CUDA
  if (q.is_cuda()) {
    c10::cuda::CUDAGuard guard(q.device());
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
    // Zeros, overwritten with the seed and offset by a kernel that draws dropout. A memset costs
    // less host time than at::zeros' fill launch. The KV-cache op returns none (and a decoding
    // step is short enough for the memset's launch to show).
    at::Tensor rng_state = at::empty({kv ? 0 : 2}, opts.dtype(at::kLong));
    if (!kv) C10_CUDA_CHECK(cudaMemsetAsync(rng_state.data_ptr(), 0, 2 * sizeof(int64_t), stream));
    if (packed_rows_empty(vl, packed)) {  // (probs: zeros already)
      out.zero_();
      lse.fill_(-std::numeric_limits<float>::infinity());
      return {unpack(out), lse, return_softmax ? probs.to(q.scalar_type()) : probs, rng_state};
    }
    const auto [d8, qc, kc, vc, cscale, dq_factor] = cuda_qkv(s, q, k, v, scale);
    at::Tensor out_k = d8 == s.d ? out : at::empty({q.size(0), q.size(1), s.h, d8}, opts);
    TORCH_CHECK(!kv || kc.data_ptr() == k_in.data_ptr(), "flash_attn (internal): a KV cache must reach the kernels "
                "in place (flash_kvcache.cpp checks what that takes)");
    FwdParams p;
    set_fwd_params(p, s, qc, kc, vc, out_k, lse, dropout_p, cscale, causal, window_size_left, window_size_right);
    set_varlen_params(p, vl, packed.seqlen_q, packed.seqlen_k);
    set_kvcache_params(p, kv, k_in);
    p.d = int(d8);
    set_block_mask(p, mask);
    const at::Tensor kbias = set_score_mods(p, mods, s, q, /*cuda=*/true);
    p.p_ptr = return_softmax ? probs.data_ptr<float>() : nullptr;
    p.rng_state_ptr = kv ? nullptr : rng_state.data_ptr<int64_t>();
    if (dropout_p > 0.0) set_cuda_philox(p);
    at::Tensor o_accum, lse_accum;  // split-KV's partials (FwdParams::num_splits)
    if (num_splits != 1 && dropout_p == 0.0 && !return_softmax) {
      const int sms = at::cuda::getDeviceProperties(q.get_device())->multiProcessorCount;
      p.num_splits = cuda::fwd_num_splits(p, sms, num_splits);
      if (p.num_splits > 1) {
        lse_accum = at::empty({p.num_splits, lse.numel()}, opts.dtype(at::kFloat));
        o_accum = at::empty({p.num_splits, lse.numel(), int64_t(p.d)}, opts.dtype(at::kFloat));
        p.lse_accum_ptr = lse_accum.data_ptr<float>();
        p.o_accum_ptr = o_accum.data_ptr<float>();
        p.lse_accum_split_stride = lse.numel();
      }
    }
    cuda::run_fwd(p, stream);
    if (!out_k.is_same(out)) out.copy_(out_k.narrow(3, 0, s.d));
    return {unpack(out), lse, return_softmax ? probs.to(q.scalar_type()) : probs, rng_state};
  }
#endif

  at::Tensor rng_state = at::zeros({2}, opts.dtype(at::kLong));
  // (A cache stays in its dtype: the kernel converts the tiles it reads, not the whole cache.)
  const at::Tensor qf = as_float(q), kf = kv ? k : as_float(k), vf = kv ? v : as_float(v);
  at::Tensor out_f = q.scalar_type() == at::kFloat ? out : at::empty(out.sizes(), opts.dtype(at::kFloat));
  FwdParams p;
  set_fwd_params(p, s, qf, kf, vf, out_f, lse, dropout_p, scale, causal, window_size_left, window_size_right);
  p.kv_dtype = to_dtype(kf.scalar_type());
  set_varlen_params(p, vl, packed.seqlen_q, packed.seqlen_k);
  set_kvcache_params(p, kv, k_in);
  set_block_mask(p, mask);
  const at::Tensor kbias = set_score_mods(p, mods, s, q, /*cuda=*/false);
  p.p_ptr = return_softmax ? probs.data_ptr<float>() : nullptr;
  if (dropout_p > 0.0) {
    p.philox_seed = draw_cpu_seed();
    p.philox_offset = 0;
    rng_state.data_ptr<int64_t>()[0] = int64_t(p.philox_seed);
  }
  cpu::run_fwd(p);
  if (!out_f.is_same(out)) out.copy_(out_f);
  return {unpack(out), lse, return_softmax ? probs.to(q.scalar_type()) : probs, rng_state};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> mha_fwd(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, double dropout_p,
    std::optional<double> softmax_scale, bool causal, int64_t window_size_left, int64_t window_size_right,
    bool return_softmax, bool deterministic, const std::optional<at::Tensor>& block_layout,
    const std::optional<at::Tensor>& q_block_lists, const std::optional<at::Tensor>& k_block_lists,
    const std::optional<at::Tensor>& cu_seqlens_q, const std::optional<at::Tensor>& cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, const std::optional<at::Tensor>& attn_bias, const std::optional<at::Tensor>& alibi_slopes,
    double softcap) {
  const Varlen vl{cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k};
  const BlockMask mask{block_layout, q_block_lists, k_block_lists};
  const ScoreMods mods{attn_bias, alibi_slopes, softcap};
  (void)deterministic;  // the forward is deterministic; the flag rides along for the backward
  // Decoding through this function under GQA: fold the query heads into rows (gqa_fold_applies),
  // where the rows' scores have no per-head or per-row term and nothing is drawn per element.
  // (The backward runs unfolded on the out and softmax_lse returned here.)
  const bool same_kv = k_in.dim() == 4 && v_in.sizes() == k_in.sizes() && q_in.dim() == 4 &&
                       k_in.size(0) == q_in.size(0) && k_in.size(3) == q_in.size(3);
  if (same_kv && gqa_fold_applies(q_in, k_in.size(2), window_size_left, window_size_right, mods.has_alibi()) &&
      dropout_p == 0.0 && !return_softmax && !vl.present() && !mask.present() && !mods.has_bias() &&
      !(cu_seqlens_k && cu_seqlens_k->defined())) {
    auto [out, lse, probs, rng_state] = run_fwd(fold_gqa_queries(q_in, k_in.size(2)), k_in, v_in, vl, mask, mods, 0.0,
                                                softmax_scale, false, -1, -1, false, nullptr, 0, true);
    auto [o, l] = unfold_gqa_rows(out, lse);  // (a view: out has the folded q's strides)
    return {o, l, probs, rng_state};
  }
  // num_splits 0: decoding shapes that leave SMs idle split their keys (cuda::fwd_num_splits).
  return run_fwd(q_in, k_in, v_in, vl, mask, mods, dropout_p, softmax_scale, causal, window_size_left,
                 window_size_right, return_softmax, nullptr, 0);
}

// q, dout, out: as the caller passed them (varlen: 3-D); s: the call's shapes.
void check_bwd_inputs(const Shapes& s, const at::Tensor& q, const at::Tensor& dout, const at::Tensor& out,
                      const at::Tensor& lse, double dropout_p, const std::optional<at::Tensor>& rng_state, bool varlen) {
  TORCH_CHECK(dout.defined() && dout.sizes() == q.sizes(), "flash_attn: dout must have the shape of q ", q.sizes(),
              ", got ", dout.defined() ? dout.sizes() : at::IntArrayRef{});
  TORCH_CHECK(out.defined() && out.sizes() == q.sizes(), "flash_attn: out must have the shape of q ", q.sizes(),
              ", got ", out.defined() ? out.sizes() : at::IntArrayRef{});
  check_operand(varlen ? dout.unsqueeze(0) : dout, "dout", varlen ? q.unsqueeze(0) : q);
  check_operand(varlen ? out.unsqueeze(0) : out, "out", varlen ? q.unsqueeze(0) : q);
  TORCH_CHECK(lse.scalar_type() == at::kFloat, "flash_attn: softmax_lse must be float32, got ", lse.scalar_type());
  TORCH_CHECK(lse.device() == q.device(), "flash_attn: softmax_lse must be on the device of q (", q.device(), "), got ",
              lse.device());
  if (varlen) {
    TORCH_CHECK(lse.dim() == 2 && lse.size(0) == s.h && lse.size(1) == q.size(0),
                "flash_attn: with cu_seqlens, softmax_lse must have shape (nheads, total_q) = (", s.h, ", ", q.size(0),
                "), got ", lse.sizes());
  } else {
    TORCH_CHECK(lse.dim() == 3 && lse.size(0) == s.b && lse.size(1) == s.h && lse.size(2) == s.seqlen_q,
                "flash_attn: softmax_lse must have shape (batch, nheads, seqlen_q) = (", s.b, ", ", s.h, ", ",
                s.seqlen_q, "), got ", lse.sizes());
  }
  if (dropout_p > 0.0) {
    TORCH_CHECK(rng_state.has_value() && rng_state->defined(), "flash_attn: rng_state is required when dropout_p > 0");
    TORCH_CHECK(rng_state->scalar_type() == at::kLong && rng_state->numel() == 2,
                "flash_attn: rng_state must be an int64 tensor of 2 elements (seed, offset), got ",
                rng_state->scalar_type(), " with shape ", rng_state->sizes());
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> mha_bwd(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& softmax_lse, double dropout_p, std::optional<double> softmax_scale,
    bool causal, int64_t window_size_left, int64_t window_size_right, bool deterministic,
    const std::optional<at::Tensor>& rng_state, const std::optional<at::Tensor>& block_layout,
    const std::optional<at::Tensor>& q_block_lists, const std::optional<at::Tensor>& k_block_lists,
    const std::optional<at::Tensor>& cu_seqlens_q, const std::optional<at::Tensor>& cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, const std::optional<at::Tensor>& attn_bias, const std::optional<at::Tensor>& alibi_slopes,
    double softcap, bool bias_requires_grad) {
  // torch.use_deterministic_algorithms(True) asks every op for reproducible results (SDPA's
  // backends honour it too), so it selects the deterministic backward whatever the flag says.
  deterministic = deterministic || at::globalContext().deterministicAlgorithms();
  const Varlen vl{cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k};
  const BlockMask mask{block_layout, q_block_lists, k_block_lists};
  const ScoreMods mods{attn_bias, alibi_slopes, softcap};
  const Call c =
      check_call(q_in, k_in, v_in, vl, mask, mods, dropout_p, softmax_scale, window_size_left, window_size_right);
  TORCH_CHECK(!bias_requires_grad || (mods.has_bias() && attn_bias->is_floating_point()),
              "flash_attn: bias_requires_grad needs a floating-point attn_bias");
  const at::Tensor &q = c.q, &k = c.k, &v = c.v;
  const Shapes &packed = c.packed, &s = c.s;
  const double scale = c.scale;
  check_bwd_inputs(s, q_in, dout_in, out_in, softmax_lse, dropout_p, rng_state, vl.present());
  const at::Tensor dout = vl.present() ? dout_in.unsqueeze(0) : dout_in;
  const at::Tensor out = vl.present() ? out_in.unsqueeze(0) : out_in;
  const auto unpack = [&](const at::Tensor& t) { return vl.present() ? t.squeeze(0) : t; };

  const at::Tensor lse = softmax_lse.contiguous();
  const auto f32 = q.options().dtype(at::kFloat);
  // Sum per-query-head float32 dK/dV (entries, h, rows, d_acc) over each GQA group and return
  // (entries, rows, h_k, d) in the input dtype: entries x rows is batch x seqlen_k, or 1 x total_k.
  auto group_sum = [&](const at::Tensor& acc) {
    return acc.view({acc.size(0), s.h_k, s.h / s.h_k, acc.size(2), acc.size(3)})
        .sum(2)
        .narrow(3, 0, s.d)
        .permute({0, 2, 1, 3})
        .to(q.scalar_type())
        .contiguous();
  };
  // The CPU always reduces in a fixed order. CUDA adds dQ with float32 atomics unless
  // deterministic, which orders the additions (sm90) or runs a separate dQ kernel instead (slower;
  // both bitwise reproducible).

#ifdef FLASH_ATTN_WITH_CUDA
  if (q.is_cuda()) {
    c10::cuda::CUDAGuard guard(q.device());
    if (packed_rows_empty(vl, packed))
      return {unpack(at::zeros_like(q)), unpack(at::zeros_like(k)), unpack(at::zeros_like(v)), at::empty({0}, q.options())};
    const auto [d8, qc, kc, vc, cscale, dq_factor] = cuda_qkv(s, q, k, v, scale);
    const at::Tensor oc = cuda_operand(out, d8), doc = cuda_operand(dout, d8);
    at::Tensor dq = at::empty({q.size(0), q.size(1), s.h, d8}, q.options());
    // Without GQA the kernel writes dK/dV in the input dtype; with GQA per-query-head float32
    // partials that are summed here. A CTA with no visible query still writes zeros.
    const bool gqa = s.h != s.h_k;
    const auto kv_alloc = [&](at::TensorOptions o, std::initializer_list<int64_t> shape) {
      return s.seqlen_q == 0 ? at::zeros(shape, o) : at::empty(shape, o);
    };
    const int64_t entries = k.size(0), rows_k = k.size(1);  // varlen: 1, total_k
    at::Tensor dk = gqa ? kv_alloc(f32, {entries, s.h, rows_k, d8}) : kv_alloc(q.options(), {entries, rows_k, s.h_k, d8});
    at::Tensor dv = gqa ? kv_alloc(f32, {entries, s.h, rows_k, d8}) : kv_alloc(q.options(), {entries, rows_k, s.h_k, d8});
    // D and the base-2 logsumexp per row (rows padded; the pre-pass writes every row a kernel reads).
    const int64_t stat_entries = vl.present() ? 1 : s.b;
    const int64_t stat_rows = vl.present() ? varlen_stat_rows(packed.seqlen_q, s.b) : cuda::padded_query_rows(s.seqlen_q);
    at::Tensor dsum = at::empty({stat_entries, s.h, stat_rows}, f32);
    at::Tensor lse_log2 = at::empty({stat_entries, s.h, stat_rows}, f32);
    at::Tensor rng = dropout_p > 0.0 ? rng_state->to(q.device()) : at::Tensor();
    BwdParams p;
    set_fwd_params(p, s, qc, kc, vc, oc, lse, dropout_p, cscale, causal, window_size_left, window_size_right);
    p.d = int(d8);
    set_block_mask(p, mask);
    p.do_ptr = doc.data_ptr();
    set_strides(doc, p.do_batch_stride, p.do_row_stride, p.do_head_stride);
    p.dq_ptr = dq.data_ptr();
    set_strides(dq, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride);
    if (gqa) {
      p.dk_accum_ptr = dk.data_ptr<float>();
      p.dv_accum_ptr = dv.data_ptr<float>();
    } else {
      p.dk_ptr = dk.data_ptr();
      p.dv_ptr = dv.data_ptr();
      set_strides(dk, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride);
      set_strides(dv, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride);
    }
    p.dsoftmax_sum_ptr = dsum.data_ptr<float>();
    p.softmax_lse_log2_ptr = lse_log2.data_ptr<float>();
    p.stat_head_stride = stat_rows;
    p.stat_batch_stride = int64_t(s.h) * stat_rows;
    set_bwd_varlen_params(p, vl, packed);
    at::Tensor dq_accum, dq_semaphores;
    // Deterministic on Hopper: the sm90 kernel adds dQ in key-block order (per-query-block
    // counters); the launcher falls back to the dQ kernel, which needs neither, where it cannot.
    const bool ordered_dq =
        deterministic && dropout_p == 0.0 && at::cuda::getCurrentDeviceProperties()->major == 9 && d8 <= 128;
    if (!deterministic || ordered_dq) {
      dq_accum = at::empty({stat_entries, s.h, stat_rows, cuda::dq_accum_row_stride(d8)}, f32);  // the D pre-pass zeroes it
      p.dq_accum_ptr = dq_accum.data_ptr<float>();
    }
    if (ordered_dq) {
      dq_semaphores = at::zeros({stat_entries, s.h, (stat_rows + 63) / 64}, q.options().dtype(at::kInt));
      p.dq_semaphore_ptr = dq_semaphores.data_ptr<int>();
    }
    p.rng_state_ptr = dropout_p > 0.0 ? rng.data_ptr<int64_t>() : nullptr;
    at::Tensor kbias;
    const DBias dbias = set_bwd_score_mods(p, mods, s, q, /*cuda=*/true, deterministic, bias_requires_grad, kbias);
    if (s.seqlen_k == 0) dq.zero_();
    cuda::run_bwd(p, at::cuda::getCurrentCUDAStream().stream());
    const auto trim = [&](const at::Tensor& x) { return unpack(d8 == s.d ? x : x.narrow(3, 0, s.d).contiguous()); };
    if (dq_factor != 1.0) dq.mul_(dq_factor);
    return {trim(dq), gqa ? unpack(group_sum(dk)) : trim(dk), gqa ? unpack(group_sum(dv)) : trim(dv),
            dbias_result(dbias, mods, q)};
  }
#endif

  uint64_t seed = 0, offset = 0;
  if (dropout_p > 0.0) {
    const at::Tensor st = rng_state->to(at::kCPU);
    seed = uint64_t(st.data_ptr<int64_t>()[0]);
    offset = uint64_t(st.data_ptr<int64_t>()[1]);
  }
  // Varlen: one entry of total rows, like the packed operands.
  at::Tensor dk_accum = at::empty({k.size(0), s.h, k.size(1), s.d}, f32);
  at::Tensor dv_accum = at::empty({k.size(0), s.h, k.size(1), s.d}, f32);

  const at::Tensor qf = as_float(q), kf = as_float(k), vf = as_float(v), of = as_float(out), dof = as_float(dout);
  const int splits = cpu::bwd_num_splits(s.b, s.h, s.seqlen_k);
  at::Tensor dq_accum = at::empty({q.size(0), s.h, splits, q.size(1), s.d}, f32);
  BwdParams p;
  set_fwd_params(p, s, qf, kf, vf, of, lse, dropout_p, scale, causal, window_size_left, window_size_right);
  set_block_mask(p, mask);
  p.philox_seed = seed;
  p.philox_offset = offset;
  p.do_ptr = dof.data_ptr();
  set_strides(dof, p.do_batch_stride, p.do_row_stride, p.do_head_stride);
  p.dk_accum_ptr = dk_accum.data_ptr<float>();
  p.dv_accum_ptr = dv_accum.data_ptr<float>();
  p.dq_accum_ptr = dq_accum.data_ptr<float>();
  p.num_splits = splits;
  set_bwd_varlen_params(p, vl, packed);
  at::Tensor kbias;
  const DBias dbias = set_bwd_score_mods(p, mods, s, q, /*cuda=*/false, deterministic, bias_requires_grad, kbias);
  cpu::run_bwd(p);
  at::Tensor dq = (splits == 1 ? dq_accum.select(2, 0) : dq_accum.sum(2)).permute({0, 2, 1, 3});
  return {unpack(dq.to(q.scalar_type()).contiguous()), unpack(group_sum(dk_accum)), unpack(group_sum(dv_accum)),
          dbias_result(dbias, mods, q)};
}

}  // namespace

bool gqa_fold_applies(const at::Tensor& q, int64_t nheads_k, int64_t window_size_left, int64_t window_size_right,
                      bool alibi) {
  return q.dim() == 4 && q.size(1) == 1 && nheads_k > 0 && q.size(2) > nheads_k && q.size(2) % nheads_k == 0 &&
         window_size_left == -1 && window_size_right == -1 && !alibi;
}

at::Tensor fold_gqa_queries(const at::Tensor& q, int64_t nheads_k) {
  return q.reshape({q.size(0), nheads_k, q.size(2) / nheads_k, q.size(3)}).transpose(1, 2);
}

std::pair<at::Tensor, at::Tensor> unfold_gqa_rows(const at::Tensor& out, const at::Tensor& lse) {
  const int64_t b = out.size(0), h = out.size(1) * out.size(2);
  return {out.transpose(1, 2).reshape({b, 1, h, out.size(3)}), lse.reshape({b, h, 1})};
}

bool index_value_checks_wanted(const at::Tensor& t) {
  if (VarlenOffsetsChecked::active()) return false;
#ifdef FLASH_ATTN_WITH_CUDA
  if (t.is_cuda() && c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) return false;
#endif
  static const bool skip = env_switch("FLASH_ATTN_SKIP_VARLEN_CHECKS").value_or(false);
  return !skip;
}

std::tuple<at::Tensor, at::Tensor> mha_fwd_kvcache_read(const at::Tensor& q, const at::Tensor& k_cache,
                                                        const at::Tensor& v_cache, const KvCacheRead& kv,
                                                        std::optional<double> softmax_scale, bool causal,
                                                        int64_t window_size_left, int64_t window_size_right,
                                                        const std::optional<at::Tensor>& alibi_slopes, double softcap,
                                                        int64_t num_splits, const VarlenQuery* varlen) {
  const std::optional<at::Tensor> none;
  const std::optional<at::Tensor> cu_q = varlen ? std::optional<at::Tensor>(varlen->cu_seqlens_q) : none;
  const std::optional<at::Tensor> cu_k = varlen ? std::optional<at::Tensor>(varlen->cu_seqlens_k) : none;
  const Varlen vl{cu_q, cu_k, varlen ? varlen->max_seqlen_q : 0, varlen ? varlen->max_seqlen_k : 0, true};
  auto [out, lse, probs, rng_state] =
      run_fwd(q, k_cache, v_cache, vl, BlockMask{none, none, none}, ScoreMods{none, alibi_slopes, softcap}, 0.0,
              softmax_scale, causal, window_size_left, window_size_right, false, &kv,
              int(std::clamp<int64_t>(num_splits, 0, 1 << 20)));
  return {out, lse};
}

}  // namespace flash

TORCH_LIBRARY(flash_attn, m) {
  // Fake (meta) kernels live in this Python module; torch imports it on demand. Autograd:
  // flash_autograd.cpp.
  m.set_python_module("flash_attn.ops");
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, float dropout_p=0., float? softmax_scale=None, bool causal=False, "
      "int window_size_left=-1, int window_size_right=-1, bool return_softmax=False, bool deterministic=False, "
      "Tensor? block_layout=None, Tensor? q_block_lists=None, Tensor? k_block_lists=None, "
      "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, SymInt max_seqlen_q=0, SymInt max_seqlen_k=0, "
      "Tensor? attn_bias=None, Tensor? alibi_slopes=None, float softcap=0.) "
      "-> (Tensor out, Tensor softmax_lse, Tensor S_dmask, Tensor rng_state)",
      {at::Tag::nondeterministic_seeded});
  m.def(
      "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, float dropout_p=0., "
      "float? softmax_scale=None, bool causal=False, int window_size_left=-1, int window_size_right=-1, "
      "bool deterministic=False, Tensor? rng_state=None, Tensor? block_layout=None, Tensor? q_block_lists=None, "
      "Tensor? k_block_lists=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, SymInt max_seqlen_q=0, "
      "SymInt max_seqlen_k=0, Tensor? attn_bias=None, Tensor? alibi_slopes=None, float softcap=0., "
      "bool bias_requires_grad=False) -> (Tensor dq, Tensor dk, Tensor dv, Tensor dbias)");
}

TORCH_LIBRARY_IMPL(flash_attn, CPU, m) {
  m.impl("fwd", &flash::mha_fwd);
  m.impl("bwd", &flash::mha_bwd);
}

#ifdef FLASH_ATTN_WITH_CUDA
TORCH_LIBRARY_IMPL(flash_attn, CUDA, m) {
  m.impl("fwd", &flash::mha_fwd);
  m.impl("bwd", &flash::mha_bwd);
}
#endif
