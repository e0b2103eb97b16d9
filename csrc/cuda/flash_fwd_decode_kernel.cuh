// Decoding over a KV cache with the keys of each tile split across the warps: one 16-row query tile
// (one query per head, or a GQA group's query heads as rows) per CTA, and each of kKeyWarps warps
// takes kBlockN / kKeyWarps keys of every key tile with its own running max, sum and output; the
// warps' partials merge through shared memory at the end. A one-warp CTA spends a tile's time
// issuing its loads, MMAs and softmax alone (about 2.5 us a 64-key tile on the H200, NOTES), so
// the cache streams at a fraction of HBM speed; four warps issue the same tile in about a quarter
// of the time.
#pragma once

#include "flash_fwd_kernel.cuh"

namespace flash::cuda {

template <typename Elem_, int kHeadDim_, int kBlockN_, int kKeyWarps_>
struct FwdSplitKeysTraits {
  using Elem = Elem_;
  static constexpr int kHeadDim = kHeadDim_, kBlockM = 16, kBlockN = kBlockN_, kKeyWarps = kKeyWarps_;
  static constexpr int kNWarps = kKeyWarps, kNThreads = 32 * kNWarps, kWarpKeys = kBlockN / kKeyWarps;
  static constexpr int kStride = Tile<kHeadDim>::kStride;
  static constexpr int kSmemQ = kBlockM * kStride, kSmemKV = kBlockN * kStride;  // K and V: two stages each
  static constexpr int kSmemBytes = (kSmemQ + 4 * kSmemKV) * int(sizeof(Elem));
  // A lane's partial: its output fragment, then its rows' max and sum; warps 1.. store theirs.
  static constexpr int kPartialFloats = kHeadDim / 2 + 4;
  static_assert(kWarpKeys % 16 == 0, "a warp's keys are whole k-steps of the P V MMA");
  static_assert((kKeyWarps - 1) * 32 * kPartialFloats * 4 <= 4 * kSmemKV * int(sizeof(Elem)),
                "the partials fit where K and V were");
};

// Lane `lane` of warp 0 adds the other warps' partials (stored [warp - 1][float][lane]) to its own,
// each rescaled to the largest of the rows' maxima.
template <int kD, int kKeyWarps>
__device__ __forceinline__ void merge_key_warps(const float* partials, float (&acc)[kD / 8][4], float (&m)[2],
                                                float (&l)[2], int lane) {
  constexpr int kFloats = kD / 2 + 4;
  const auto at = [&](int w, int i) { return partials[((w - 1) * kFloats + i) * 32 + lane]; };
  float mx[2] = {m[0], m[1]};
#pragma unroll
  for (int w = 1; w < kKeyWarps; ++w)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) mx[hr] = fmaxf(mx[hr], at(w, kD / 2 + hr));
  float base[2], own[2];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    base[hr] = mx[hr] == kNegInf ? 0.f : mx[hr];  // rows no warp saw stay 0
    own[hr] = fast_exp2(m[hr] - base[hr]);
    l[hr] *= own[hr];
    m[hr] = mx[hr];
  }
  scale_rows<kD>(acc, own);
#pragma unroll
  for (int w = 1; w < kKeyWarps; ++w) {
    float f[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      f[hr] = fast_exp2(at(w, kD / 2 + hr) - base[hr]);
      l[hr] = fmaf(at(w, kD / 2 + 2 + hr), f[hr], l[hr]);
    }
#pragma unroll
    for (int d = 0; d < kD / 8; ++d)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[d][r] = fmaf(at(w, d * 4 + r), f[r >> 1], acc[d][r]);
  }
}

// The decoding forward without dropout or probabilities (fwd_decode_tiles): as flash_fwd_kernel,
// with split-KV's share of the key tiles per CTA, two K/V stages, and the keys of a tile split
// across the warps.
template <typename T>
__global__ void __launch_bounds__(T::kNThreads) flash_fwd_decode_kernel(const FwdParams params) {
  using Elem = typename T::Elem;
  constexpr int kD = T::kHeadDim, kM = T::kBlockM, kN = T::kBlockN, kS = T::kStride, kWN = T::kWarpKeys;
  extern __shared__ __align__(16) char smem_raw[];
  Elem* sQ = reinterpret_cast<Elem*>(smem_raw);
  Elem* sK = sQ + T::kSmemQ;      // two buffers
  Elem* sV = sK + 2 * T::kSmemKV;  // two buffers

  const int m0 = blockIdx.x * kM, h = blockIdx.y;
  const int b = blockIdx.z / params.num_splits, split = blockIdx.z % params.num_splits;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4;
  static_assert(kPageBlockMultiple % kN == 0, "a paged cache's pages must hold whole key tiles");
  const FwdParams p = seq_view(params, b);
  if (m0 >= p.seqlen_q) return;  // varlen: past this sequence's rows
  const HeadPtrs<Elem> hp = head_ptrs<Elem>(p, b, h);

  const TileSeq tiles = split_share(key_tiles<kN>(p, b, h, m0, kM), p.num_splits, split);
  const int warp_col = warp * kWN;  // this warp's keys within a tile

  float acc[kD / 8][4];
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.f, 0.f};
  zero<kD>(acc);

  const auto load_kv = [&](int nb, int stage) {
    const int64_t row = key_tile_row(p, b, nb * kN);
    load_tile_async<kN, kD, T::kNThreads>(sK + stage * T::kSmemKV, hp.k + row * p.k_row_stride, p.k_row_stride,
                                          p.seqlen_k - nb * kN, p.d, tid);
    load_tile_async<kN, kD, T::kNThreads>(sV + stage * T::kSmemKV, hp.v + row * p.v_row_stride, p.v_row_stride,
                                          p.seqlen_k - nb * kN, p.d, tid);
  };
  load_tile_async<kM, kD, T::kNThreads>(sQ, hp.q + m0 * p.q_row_stride, p.q_row_stride, p.seqlen_q - m0, p.d, tid);
  if (tiles.count > 0) load_kv(tiles[0], 0);
  cp_async_commit();

  for (int it = 0; it < tiles.count; ++it) {
    const int cur = it & 1, j0 = tiles[it] * kN + warp_col;
    cp_async_wait<0>();
    __syncthreads();  // K_j, V_j (and Q) are in; every warp is done with the other stage
    if (it + 1 < tiles.count) {
      load_kv(tiles[it + 1], cur ^ 1);
      cp_async_commit();
    }
    float s[kWN / 8][4];
    zero<kWN>(s);
    gemm_ss<Elem, kWN, kD, kS>(s, sQ, sK + cur * T::kSmemKV + warp_col * kS, lane);
    const float scale_log2 = prepare_scores_qmajor<kWN, Elem>(s, p, b, h, m0, j0, lane);
    if (!tile_fully_visible(p, m0, m0 + kM, j0, j0 + kWN)) mask_tile_qmajor<kWN>(s, p, m0, j0, lane);
    online_softmax<kWN, kD>(s, acc, m, l, scale_log2);
    uint32_t a[kWN / 16][4];
    acc_to_a<Elem, kWN>(a, s);
    gemm_rs<Elem, kWN, kD, kS>(acc, a, sV + cur * T::kSmemKV + warp_col * kS, lane);
  }

  if constexpr (T::kKeyWarps > 1) {
    float* partials = reinterpret_cast<float*>(sK);
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with K and V
    if (warp > 0) {
      float* mine = partials + (warp - 1) * T::kPartialFloats * 32 + lane;
#pragma unroll
      for (int d = 0; d < kD / 8; ++d)
#pragma unroll
        for (int r = 0; r < 4; ++r) mine[(d * 4 + r) * 32] = acc[d][r];
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        mine[(kD / 2 + hr) * 32] = m[hr];
        mine[(kD / 2 + 2 + hr) * 32] = l[hr];
      }
    }
    __syncthreads();
    if (warp > 0) return;
    merge_key_warps<kD, T::kKeyWarps>(partials, acc, m, l, lane);
  }
  const int row0 = m0 + g;
  if (p.num_splits > 1) write_split_partial<kD>(p, b, h, split, row0, acc, m, l, lane);
  else write_o_lse<Elem, kD>(p, b, h, row0, acc, m, l, lane);
}

}  // namespace flash::cuda
