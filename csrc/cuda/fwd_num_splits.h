// How many CTAs split each query block's keys in the forward (split-KV, FwdParams::num_splits): a
// host-side choice of the op layer, kept out of flash_launch.h so that tuning it rebuilds only
// the op layer.
#pragma once

#include <algorithm>
#include <cstdint>

#include "flash_launch.h"

namespace flash::cuda {

// Split-KV (FwdParams::num_splits). requested 0: none where the query blocks already fill 80% of
// the SMs, nor for a forward without a cache of more than kDecodeRows query rows (the sm90 kernels
// run those unsplit); else as many as keep the grid at no more than two CTAs per SM, down to one
// key tile each. On the H200 (bf16, d=128) a grid a little over two CTAs per SM ran 7-12% slower
// than one just under (SMs with a third CTA finish last), and short caches ran fastest with one
// tile per split (NOTES, twenty-first session). requested n > 0: n. Both capped at one key tile
// each and kMaxSplits. The keys: p.longest_keys where known, else p.seqlen_k (a cache's rows).
inline int fwd_num_splits(const FwdParams& p, int num_sms, int requested) {
  if (requested <= 0 && p.seqused_k == nullptr && p.seqlen_q > kDecodeRows) return 1;
  const int bm = p.seqlen_q <= kDecodeRows ? kDecodeRows : fwd_block_m(int(dq_accum_row_stride(p.d)));
  const int64_t blocks = int64_t(p.b) * p.h * ((p.seqlen_q + bm - 1) / bm);
  const int keys = p.longest_keys >= 0 ? p.longest_keys : p.seqlen_k;
  const int key_tiles = (keys + kFwdBlockN - 1) / kFwdBlockN;
  if (blocks == 0 || key_tiles == 0) return 1;
  if (requested <= 0 && 5 * blocks >= 4 * int64_t(num_sms)) return 1;
  int64_t n = requested > 0 ? requested : 2 * int64_t(num_sms) / blocks;
  n = std::min<int64_t>({n, key_tiles, kMaxSplits});
  return int(std::max<int64_t>(n, 1));
}

}  // namespace flash::cuda
