// The sm90 forward kernel: the portable forward's algorithm (flash_fwd_kernel.cuh) with both
// GEMMs on warpgroup MMAs. Each warpgroup owns 64 query rows; K and V tiles stream through
// swizzled, double-buffered shared memory with cp.async (the next pair loads during the whole of
// this step); S = Q K^T and O += P V run as wgmma, the online softmax in registers between them.
// (Issuing S_j with P_{j-1} V_{j-1} so that the softmax overlaps the tensor cores, as
// FlashAttention-3 does, measured slower here: benchmarks/NOTES.md.)
#pragma once

#include "../cuda/flash_fwd_kernel.cuh"
#include "flash_fwd_sm90_traits.cuh"

namespace flash::hopper {

// kBlockSparse: whether a block mask may be set; without, the tile walk folds to counting.
template <typename T, bool kBlockSparse>
__global__ void __launch_bounds__(T::kNThreads, T::kMinBlocks) flash_fwd_sm90_kernel(const FwdParams params) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace cute;
  using Elem = typename T::Elem;
  using CElem = typename T::CElem;
  using cuda::cp_async_commit;
  using cuda::cp_async_wait;
  constexpr int kD = T::kHeadDim, kM = T::kBlockM, kN = T::kBlockN;
  static_assert(kPageBlockMultiple % kN == 0, "a paged cache's pages must hold whole key tiles");
  extern __shared__ char smem_raw[];
  CElem* sq_ptr = aligned_smem<T::kSmemAlign, CElem>(smem_raw);
  CElem* sk_ptr = sq_ptr + T::kSmemQ;
  CElem* sv_ptr = sk_ptr + T::kSmemK;
  Tensor sQ = make_tensor(make_smem_ptr(sq_ptr), typename T::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(sk_ptr), typename T::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(sv_ptr), typename T::SmemLayoutV{});
  Tensor sVt = make_tensor(make_smem_ptr(sv_ptr), typename T::SmemLayoutVt{});

  // Last query block first (see flash_fwd_kernel).
  const int m0 = (gridDim.x - 1 - blockIdx.x) * kM, h = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int i16 = m0 + warp * 16;  // this warp's 16 query rows (warpgroup w: rows 64 w ..)
  const FwdParams p = seq_view(params, b);
  if (m0 >= p.seqlen_q) return;  // varlen: past this sequence's rows
  const cuda::HeadPtrs<Elem> hp = cuda::head_ptrs<Elem>(p, b, h);

  typename T::TiledMmaS mma_s;
  typename T::TiledMmaO mma_o;
  auto thr_s = mma_s.get_thread_slice(tid);
  auto thr_o = mma_o.get_thread_slice(tid);
  Tensor tSrQ = thr_s.partition_fragment_A(sQ);   // descriptors, (MMA, MMA_M, MMA_K)
  Tensor tSrK = thr_s.partition_fragment_B(sK);   // descriptors, (MMA, MMA_N, MMA_K, stage)
  Tensor tOrVt = thr_o.partition_fragment_B(sVt); // descriptors, (MMA, MMA_N, MMA_K, stage)
  Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<kM>, Int<kN>>{});
  Tensor tOrO = partition_fragment_C(mma_o, Shape<Int<kM>, Int<kD>>{});
  Tensor tOrP = thr_o.partition_fragment_A(make_tensor(make_smem_ptr(sq_ptr), Layout<Shape<Int<kM>, Int<kN>>>{}));
  float(&s)[kN / 8][4] = as_rows16<kN>(tSrS);
  float(&acc)[kD / 8][4] = as_rows16<kD>(tOrO);

  const TileSeq tiles = cuda::key_tiles<kN, kBlockSparse>(p, b, h, m0, kM);
  cuda::zero<kD>(acc);
  float m[2] = {cuda::kNegInf, cuda::kNegInf}, l[2] = {0.f, 0.f};

  const auto load_kv = [&](int nb, int stage) {  // K_j and V_j into one buffer
    const int j0 = nb * kN;
    const int64_t row = key_tile_row(p, b, j0);
    load_tile_swizzled<kN, kD, T::kNThreads>(sK(_, _, stage), hp.k + row * p.k_row_stride, p.k_row_stride,
                                             p.seqlen_k - j0, p.d, tid);
    load_tile_swizzled<kN, kD, T::kNThreads>(sV(_, _, stage), hp.v + row * p.v_row_stride, p.v_row_stride,
                                             p.seqlen_k - j0, p.d, tid);
  };
  load_tile_swizzled<kM, kD, T::kNThreads>(sQ, hp.q + int64_t(m0) * p.q_row_stride, p.q_row_stride, p.seqlen_q - m0,
                                           p.d, tid);
  if (tiles.count > 0) load_kv(tiles[0], 0);
  cp_async_commit();

  for (int it = 0; it < tiles.count; ++it) {
    const int j0 = tiles[it] * kN, stage = it & 1;
    cp_async_wait<0>();
    fence_proxy_async_smem();
    __syncthreads();  // K_j and V_j (and Q) are in; every warpgroup is done with the other buffer
    if (it + 1 < tiles.count) {
      load_kv(tiles[it + 1], stage ^ 1);
      cp_async_commit();
    }
    wgmma_gemm<true, 0>(mma_s, tSrQ, tSrK(_, _, _, stage), tSrS);
    const float scale_log2 = cuda::prepare_scores_qmajor<kN, Elem>(s, p, b, h, i16, j0, lane);
    if (!cuda::tile_fully_visible(p, m0, m0 + kM, j0, j0 + kN)) cuda::mask_tile_qmajor<kN>(s, p, i16, j0, lane);
    cuda::online_softmax<kN, kD>(s, acc, m, l, scale_log2);
    to_a_operand<Elem, kN>(tOrP, s);
    wgmma_gemm<false, 0>(mma_o, tOrP, tOrVt(_, _, _, stage), tOrO);
  }
  cp_async_wait<0>();

  cuda::write_o_lse<Elem, kD>(p, b, h, i16 + lane / 4, acc, m, l, lane);
#endif
}

}  // namespace flash::hopper
