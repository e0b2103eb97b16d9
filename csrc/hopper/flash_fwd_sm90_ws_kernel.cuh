// The warp-specialized sm90 forward (FlashAttention-3's schedule): a producer warpgroup streams Q
// once and K, V tiles through a ring of shared-memory stages with TMA, each stage guarded by
// full/empty mbarriers; two consumer warpgroups (64 query rows each) run the MMAs and the softmax.
// Two overlaps hide the softmax behind the tensor cores:
// - within a warpgroup, S_j = Q K_j^T is issued together with O += P_{j-1} V_{j-1}, and the
//   softmax of S_j runs while the latter is in flight;
// - between the warpgroups, named barriers make them take turns issuing their MMAs, so one's
//   softmax overlaps the other's MMAs (ping-pong).
#pragma once

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "../cuda/flash_fwd_kernel.cuh"
#include "flash_fwd_sm90_traits.cuh"
#include "tma_view.cuh"

namespace flash::hopper {

// The kernel's parameters: the op's, plus the TMA descriptors the launcher built for q, k and v.
template <typename T>
struct FwdSm90WsParams {
  FwdParams p;
  typename T::TmaQ tma_q;
  typename T::TmaKV tma_k, tma_v;
};

// kBlockSparse: as in flash_fwd_sm90_kernel.
template <typename T, bool kBlockSparse>
__global__ void __launch_bounds__(T::kNThreads, 1) flash_fwd_sm90_ws_kernel(const __grid_constant__ FwdSm90WsParams<T> args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace cute;
  using Elem = typename T::Elem;
  using CElem = typename T::CElem;
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  constexpr int kD = T::kHeadDim, kM = T::kBlockM, kN = T::kBlockN, kStages = T::kStages;
  extern __shared__ char smem_raw[];
  CElem* sq_ptr = aligned_smem<T::kSmemAlign, CElem>(smem_raw);
  CElem* sk_ptr = sq_ptr + T::kSmemQ;
  CElem* sv_ptr = sk_ptr + T::kSmemKV;
  uint64_t* q_full = reinterpret_cast<uint64_t*>(sv_ptr + T::kSmemKV);
  uint64_t* k_full = q_full + 1;
  uint64_t* v_full = k_full + kStages;
  uint64_t* k_empty = v_full + kStages;
  uint64_t* v_empty = k_empty + kStages;
  Tensor sQ = make_tensor(make_smem_ptr(sq_ptr), typename T::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(sk_ptr), typename T::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(sv_ptr), typename T::SmemLayoutKV{});
  Tensor sVt = make_tensor(make_smem_ptr(sv_ptr), typename T::SmemLayoutVt{});

  // Last query block first (see flash_fwd_kernel).
  const int m_block = gridDim.x - 1 - blockIdx.x, m0 = m_block * kM, h = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  constexpr int kConsumerWarps = T::kNConsumerThreads / 32;
  const FwdParams p = seq_view(args.p, b);
  if (m0 >= p.seqlen_q) return;  // varlen: past this sequence's rows
  if (tid == 0) {
    Barrier::init(q_full, 1);
    for (int s = 0; s < kStages; ++s) {
      Barrier::init(k_full + s, 1);
      Barrier::init(v_full + s, 1);
      Barrier::init(k_empty + s, kConsumerWarps);
      Barrier::init(v_empty + s, kConsumerWarps);
    }
    cutlass::arch::fence_barrier_init();
  }
  // Every warp walks the same tiles (with a mask, each warp's lanes count its list together).
  const TileSeq tiles = cuda::key_tiles<kN, kBlockSparse>(p, b, h, m0, kM);
  __syncthreads();

  if (warp < 4) {  // producer warpgroup: one thread issues every copy
    cutlass::arch::warpgroup_reg_dealloc<T::kProducerRegs>();
    if (warp != 0 || lane != 0 || tiles.count == 0) return;
    const int hk = h / p.h_h_k_ratio;
    Tensor gQ = local_tile(tma_rows(args.tma_q, q_view(p), p.q_row0, h, b), Shape<Int<kM>, Int<kD>>{},
                           make_coord(m_block, 0));
    Tensor gK = local_tile(tma_rows(args.tma_k, k_view(p), p.k_row0, hk, b), Shape<Int<kN>, Int<kD>>{},
                           make_coord(_, 0));  // (kN, kD, tile)
    Tensor gV = local_tile(tma_rows(args.tma_v, v_view(p), p.k_row0, hk, b), Shape<Int<kN>, Int<kD>>{},
                           make_coord(_, 0));
    auto [tQg, tQs] = tma_partition(args.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
    auto [tKg, tKs] = tma_partition(args.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto [tVg, tVs] = tma_partition(args.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
    Barrier::arrive_and_expect_tx(q_full, T::kQBytes);
    copy(args.tma_q.with(*q_full), tQg, tQs);
    for (int it = 0; it < tiles.count; ++it) {
      const int stage = it % kStages, nb = tiles[it];
      const uint32_t phase = (it / kStages) & 1;
      Barrier::wait(k_empty + stage, phase ^ 1);  // a fresh barrier passes parity 1 at once
      Barrier::arrive_and_expect_tx(k_full + stage, T::kKVBytes);
      copy(args.tma_k.with(k_full[stage]), tKg(_, nb), tKs(_, stage));
      Barrier::wait(v_empty + stage, phase ^ 1);
      Barrier::arrive_and_expect_tx(v_full + stage, T::kKVBytes);
      copy(args.tma_v.with(v_full[stage]), tVg(_, nb), tVs(_, stage));
    }
    return;
  }

  // Consumer warpgroups 0 and 1 (threads 128..383).
  cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegs>();
  const int ctid = tid - 128, cwarp = ctid / 32, wg = ctid / 128;
  const int i16 = m0 + cwarp * 16;  // this warp's 16 query rows
  typename T::TiledMmaS mma_s;
  typename T::TiledMmaO mma_o;
  auto thr_s = mma_s.get_thread_slice(ctid);
  auto thr_o = mma_o.get_thread_slice(ctid);
  Tensor tSrQ = thr_s.partition_fragment_A(sQ);
  Tensor tSrK = thr_s.partition_fragment_B(sK);
  Tensor tOrVt = thr_o.partition_fragment_B(sVt);
  Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<kM>, Int<kN>>{});
  Tensor tOrO = partition_fragment_C(mma_o, Shape<Int<kM>, Int<kD>>{});
  Tensor tOrP = thr_o.partition_fragment_A(make_tensor(make_smem_ptr(sq_ptr), Layout<Shape<Int<kM>, Int<kN>>>{}));
  float(&s)[kN / 8][4] = as_rows16<kN>(tSrS);
  float(&acc)[kD / 8][4] = as_rows16<kD>(tOrO);
  cuda::zero<kD>(acc);
  float m[2] = {cuda::kNegInf, cuda::kNegInf}, l[2] = {0.f, 0.f}, alpha[2];

  // Ping-pong: a warpgroup waits for its turn before issuing MMAs and hands the turn over after.
  using cutlass::arch::NamedBarrier;
  const auto my_turn = [&] { NamedBarrier::sync(T::kNConsumerThreads, 1 + wg); };
  const auto pass_turn = [&] { NamedBarrier::arrive(T::kNConsumerThreads, 1 + (wg ^ 1)); };
  const auto release = [&](uint64_t* bar) {
    if (lane == 0) Barrier::arrive(bar);
  };
  const auto scores_to_probs = [&](int it) {
    const int j0 = tiles[it] * kN;
    const float scale_log2 = cuda::prepare_scores_qmajor<kN, Elem>(s, p, b, h, i16, j0, lane);
    if (!cuda::tile_fully_visible(p, m0, m0 + kM, j0, j0 + kN)) cuda::mask_tile_qmajor<kN>(s, p, i16, j0, lane);
    cuda::online_softmax_probs<kN>(s, m, l, scale_log2, alpha);
  };

  const int n = tiles.count;
  if (n > 0) {
    if (wg == 1) pass_turn();  // warpgroup 0 goes first
    Barrier::wait(q_full, 0);
    Barrier::wait(k_full, 0);
    my_turn();
    wgmma_gemm<true, -1>(mma_s, tSrQ, tSrK(_, _, _, 0), tSrS);
    if (wg == 0 || n > 1) pass_turn();  // every hand-over is matched by a wait
    wgmma_wait<0>(tSrS);
    release(k_empty);
    scores_to_probs(0);  // the accumulator is still zero: alpha is not needed
    to_a_operand<Elem, kN>(tOrP, s);
    for (int it = 1; it < n; ++it) {
      const int stage = it % kStages, prev = (it - 1) % kStages;
      Barrier::wait(k_full + stage, (it / kStages) & 1);
      my_turn();
      wgmma_gemm<true, -1>(mma_s, tSrQ, tSrK(_, _, _, stage), tSrS);
      Barrier::wait(v_full + prev, ((it - 1) / kStages) & 1);
      wgmma_gemm<false, -1>(mma_o, tOrP, tOrVt(_, _, _, prev), tOrO);
      if (wg == 0 || it + 1 < n) pass_turn();
      wgmma_wait<1>(tSrS);  // S_j is in; P_{j-1} V_{j-1} may still run
      release(k_empty + stage);
      scores_to_probs(it);
      wgmma_wait<0>(tOrO, tOrP);
      release(v_empty + prev);
      cuda::scale_rows<kD>(acc, alpha);
      to_a_operand<Elem, kN>(tOrP, s);
    }
    const int last = (n - 1) % kStages;
    Barrier::wait(v_full + last, ((n - 1) / kStages) & 1);
    wgmma_gemm<false, 0>(mma_o, tOrP, tOrVt(_, _, _, last), tOrO);
  }

  cuda::write_o_lse<Elem, kD>(p, b, h, i16 + lane / 4, acc, m, l, lane);
#endif
}

}  // namespace flash::hopper
