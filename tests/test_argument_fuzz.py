"""Seeded random calls of the four C++ ops (forward and backward, varlen, KV cache, paged varlen)
at edge sizes, each either valid (it must run and give finite results of the right shape) or with
exactly one argument spoiled (it must raise an error that names it). Beyond the fixed cases of
test_errors.py and test_kvcache.py, the spoiled argument meets random shapes and options, so a
check that depends on another argument's value is exercised too. `make asan` runs this under
AddressSanitizer and UBSan on the CPU, and on a GPU it is what compute-sanitizer runs: an
out-of-bounds access that a bad argument slips through aborts there.
Case i uses random.Random(i + FLASH_ATTN_TEST_SEED)."""

import os
import random

import pytest
import torch

from flash_attn import ops

OFFSET = int(os.environ.get("FLASH_ATTN_TEST_SEED", "0"))
CASES = 120
NAN = float("nan")


def i32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def offsets(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


class Draw:
    """One case: rng, device and dtype, and which argument (if any) to spoil."""

    def __init__(self, rng, device, spoils):
        self.rng, self.device = rng, device
        self.dtype = rng.choice([torch.float32, torch.bfloat16] if device == "cpu" else [torch.float16, torch.bfloat16])
        self.spoil = rng.choice([None] * max(2, len(spoils) // 3) + list(spoils))
        self.expect = spoils.get(self.spoil)

    def pick(self, *xs):
        return self.rng.choice(xs)

    def randn(self, *shape, dtype=None):
        return torch.randn(*shape, dtype=dtype or self.dtype, device=self.device)


DENSE = {
    "head_dim": "head dim must be", "gqa": "multiple of the number of key/value heads",
    "dtype": "must be float16, bfloat16 or float32", "k_head_dim": "same head dim",
    "alibi": "alibi_slopes must have shape", "softcap": "softcap must be", "bias_shape": "attn_bias must be broadcastable",
    "bias_dtype": "attn_bias must be bool", "dropout": "dropout_p must be in", "scale": "softmax_scale must be finite",
    "window": "window sizes must be", "lse": "softmax_lse must have shape", "rng_state": "rng_state",
    "dout": "dout must have",
}


def dense(c):
    b, sq, sk, d = c.pick(1, 2, 3), c.pick(0, 1, 2, 63, 65, 130), c.pick(0, 1, 2, 63, 65, 130), c.pick(32, 40, 64, 96, 256)
    hk = c.pick(1, 2, 3)
    h = hk * c.pick(1, 2)
    if c.spoil == "head_dim":
        d = c.pick(264, 512)
    if c.spoil == "gqa":
        h = hk * 2 + 1 if hk > 1 else 3
        hk = 2
    dtype = torch.float64 if c.spoil == "dtype" else c.dtype
    q = c.randn(b, sq, h, d, dtype=dtype)
    if c.rng.random() < 0.3:
        q = c.randn(b, h, sq, d, dtype=dtype).transpose(1, 2)
    k = c.randn(b, sk, hk, d + 8 if c.spoil == "k_head_dim" else d, dtype=dtype)
    v = c.randn(b, sk, hk, d, dtype=dtype)
    kw = {}
    if c.rng.random() < 0.3 or c.spoil == "alibi":
        shape = (h + 1,) if c.spoil == "alibi" else c.pick((h,), (b, h))
        kw["alibi_slopes"] = torch.rand(shape, device=c.device)
    if c.rng.random() < 0.3 or c.spoil == "softcap":
        kw["softcap"] = c.pick(-1.0, NAN) if c.spoil == "softcap" else c.pick(0.0, 5.0)
    if c.rng.random() < 0.3 or c.spoil in ("bias_shape", "bias_dtype"):
        shape = (b, h, sq, sk + 2) if c.spoil == "bias_shape" else c.pick((b, h, sq, sk), (1, 1, sq, sk), (sk,), (h, 1, 1))
        dt = torch.int64 if c.spoil == "bias_dtype" else c.pick(torch.bool, torch.float32, dtype)
        kw["attn_bias"] = (torch.randn(shape, device=c.device) * 3).to(dt)
    dropout = c.pick(1.0, -0.1) if c.spoil == "dropout" else 0.2 if c.spoil == "rng_state" else c.pick(0.0, 0.0, 0.2)
    scale = c.pick(float("inf"), NAN) if c.spoil == "scale" else c.pick(None, 0.1)
    left, right = (c.pick(-2, -7), -1) if c.spoil == "window" else (c.pick(-1, 0, 5), c.pick(-1, 0, 3))
    causal, det = c.pick(False, True), c.pick(False, True)
    out, lse, _, rng_state = ops.fwd(q, k, v, dropout, scale, causal, left, right, False, det, **kw)
    results = [out, lse]
    backward = c.spoil in ("lse", "rng_state", "dout") or (c.spoil is None and out.numel() and c.rng.random() < 0.6)
    if backward:
        dout = c.randn(*out.shape[:-1], d + 8) if c.spoil == "dout" else torch.randn_like(out)
        lse = lse[..., :-1] if c.spoil == "lse" and sq else lse.unsqueeze(0) if c.spoil == "lse" else lse
        rng_state = torch.zeros(3, dtype=torch.int64, device=c.device) if c.spoil == "rng_state" else rng_state
        bias = kw.get("attn_bias")
        grad_bias = bias is not None and bias.is_floating_point() and c.rng.random() < 0.5
        results += ops.bwd(dout, q, k, v, out, lse, dropout, scale, causal, left, right, det, rng_state,
                           bias_requires_grad=grad_bias, **kw)[:3]
    return results


VARLEN = {
    "cu_dtype": "cu_seqlens_q must be int32", "cu_length": "must have the same length",
    "cu_order": "non-decreasing", "cu_total": r"must equal q\.size\(0\)", "cu_start": r"cu_seqlens_k\[0\] must be 0",
    "max_seqlen": "is smaller than sequence",
}


def varlen(c):
    batch, hk, d = c.pick(2, 4) if c.spoil == "cu_order" else c.pick(1, 2, 4), c.pick(1, 2), c.pick(32, 64, 128)
    h = hk * c.pick(1, 2)
    lens_q = [c.pick(0, 1, 2, 65, 129) for _ in range(batch)]
    lens_k = [c.pick(0, 1, 2, 65, 129) for _ in range(batch)]
    cu_q, cu_k = offsets(lens_q), offsets(lens_k)
    q, k, v = c.randn(cu_q[-1], h, d), c.randn(cu_k[-1], hk, d), c.randn(cu_k[-1], hk, d)
    if c.spoil == "cu_order":  # sequence 1 one row "long" backwards
        cu_q = [0, max(lens_q[0], 1), max(lens_q[0], 1) - 1] + [x + 1 for x in cu_q[3:]]
        q = c.randn(cu_q[-1], h, d)
    if c.spoil == "cu_total":  # (one row past q's; max_seqlen_q below still covers it)
        cu_q[-1] += 1
    if c.spoil == "cu_start":
        cu_k = [x + 3 for x in cu_k]
    cq, ck = i32(cu_q, c.device), i32(cu_k, c.device)
    if c.spoil == "cu_dtype":
        cq = cq.long()
    if c.spoil == "cu_length":
        ck = ck[:-1] if batch > 1 else torch.cat([ck, ck[-1:]])
    max_q, max_k = max(lens_q) + c.pick(1, 7), max(lens_k)
    if c.spoil == "max_seqlen":
        max_k = max(lens_k) - 1 if max(lens_k) else 0
        if max_k == 0:
            k, v = c.randn(cu_k[-1] + 1, hk, d), c.randn(cu_k[-1] + 1, hk, d)
            ck = i32(cu_k[:-1] + [cu_k[-1] + 1], c.device)
    kw = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=max_q, max_seqlen_k=max_k)
    if c.rng.random() < 0.3:
        kw["alibi_slopes"] = torch.rand(h, device=c.device)
    if c.rng.random() < 0.3:
        kw["softcap"] = 3.0
    dropout, causal, left = c.pick(0.0, 0.2), c.pick(False, True), c.pick(-1, 10)
    out, lse, _, rng_state = ops.fwd(q, k, v, dropout, None, causal, left, -1, False, False, **kw)
    if c.rng.random() < 0.5:
        return [out, lse] + list(ops.bwd(torch.randn_like(out), q, k, v, out, lse, dropout, None, causal, left, -1,
                                         c.pick(False, True), rng_state, **kw)[:3])
    return [out, lse]


KVCACHE = {
    "seqlens": "the cache has no room past row", "batch_idx": "is not an entry of k_cache",
    "leftpad": r"cache_leftpad\[0\] = ", "splits": "num_splits must be >= 0",
    "no_seqlens": "cache_seqlens, which must then be given", "page": "is not a page of k_cache",
    "page_rows": "page_block_size must be", "entries": "fewer than q's",
}


def kvcache(c):
    b, sq, hk, d = c.pick(1, 2, 3), c.pick(1, 1, 2, 7, 65), c.pick(1, 2), c.pick(32, 64, 128)
    h = hk * c.pick(1, 4)
    if c.spoil == "entries":
        b = max(b, 2)
    paged = c.spoil in ("page", "page_rows") or (c.spoil not in ("batch_idx", "leftpad", "entries") and
                                                  c.rng.random() < 0.3)
    new = c.pick(0, 0, 1, 3) if c.spoil != "no_seqlens" else 2
    if paged:
        page = 16 if c.spoil == "page_rows" else c.pick(256, 512)
        width = c.pick(1, 2)
        rows, pages = width * page, b * width + c.pick(0, 2)
        k_cache = c.randn(pages, page, hk, d)
        table = [[c.rng.randrange(pages) for _ in range(width)] for _ in range(b)]
    else:
        rows = c.pick(1, 9, 130, 300)
        entries = b + c.pick(0, 0, 2) if c.spoil != "entries" else b - 1
        k_cache = c.randn(entries, rows, hk, d)
        table = None
    v_cache = torch.randn_like(k_cache)
    new = min(new, rows)
    seqlens = [c.rng.randint(0, rows - new) for _ in range(b)]
    kw = {}
    if c.spoil == "seqlens":
        seqlens[0] = c.pick(-1, rows - new + 1)
    if c.spoil == "page":
        seqlens[0] = max(seqlens[0], 1)
        table[0][0] = c.pick(-1, k_cache.shape[0])
    if table is not None:
        kw["block_table"] = i32(table, c.device)
    elif c.spoil == "batch_idx" or (c.spoil != "entries" and c.rng.random() < 0.3):
        idx = c.rng.sample(range(k_cache.shape[0]), b)
        if c.spoil == "batch_idx":
            idx[0] = c.pick(-1, k_cache.shape[0])
        kw["cache_batch_idx"] = i32(idx, c.device)
    if c.spoil == "leftpad" or (table is None and c.rng.random() < 0.3):
        pad = [c.rng.randint(0, max(s, 0)) for s in seqlens]
        if c.spoil == "leftpad":
            pad[0] = seqlens[0] + new + 1 if c.rng.random() < 0.5 else -1
        kw["cache_leftpad"] = i32(pad, c.device)
    seqlens_t = None if c.spoil == "no_seqlens" or (new == 0 and c.rng.random() < 0.2 and "cache_leftpad" not in kw
                                                    and c.spoil != "seqlens") \
        else i32(seqlens, c.device)
    if seqlens_t is None and c.spoil != "no_seqlens":
        seqlens = [rows] * b
    q = c.randn(b, sq, h, d)
    k_new, v_new = (c.randn(b, new, hk, d) if new else None for _ in range(2))
    slopes = torch.rand(h, device=c.device) if c.rng.random() < 0.2 else None
    splits = -1 if c.spoil == "splits" else c.pick(0, 1, 3)
    return list(ops.fwd_kvcache(q, k_cache, v_cache, k_new, v_new, seqlens_t, kw.get("cache_batch_idx"),
                                kw.get("cache_leftpad"), kw.get("block_table"), None, c.pick(False, True),
                                c.pick(-1, 3), c.pick(-1, 0), slopes, c.pick(0.0, 4.0), splits))


PAGED_VARLEN = {
    "page": "is not a page of k_cache", "keys": "with block_table that must be in", "page_rows": "page_block_size must be",
    "max_seqlen": "is smaller than sequence",
}


def paged_varlen(c):
    batch, hk, d, width = c.pick(1, 2, 3), c.pick(1, 2), c.pick(32, 64), c.pick(1, 2, 3)
    h = hk * c.pick(1, 2)
    page = 16 if c.spoil == "page_rows" else c.pick(256, 512)
    pages = c.pick(1, 3, 6)
    lens_q = [c.pick(0, 1, 3) for _ in range(batch)]
    lens_k = [c.rng.randint(0, width * page) for _ in range(batch)]
    table = [[c.rng.randrange(pages) for _ in range(width)] for _ in range(batch)]
    if c.spoil == "page":
        lens_k[0] = max(lens_k[0], 1)
        table[0][0] = c.pick(-1, pages)
    if c.spoil == "keys":
        lens_k[0] = width * page + 1
    k_cache = c.randn(pages, page, hk, d)
    v_cache = torch.randn_like(k_cache)
    q = c.randn(sum(lens_q), h, d)
    max_q, max_k = max(lens_q), max(lens_k)
    if c.spoil == "max_seqlen":
        lens_k[0] = max(lens_k[0], 1)
        max_k = max(lens_k) - 1
    return list(ops.fwd_varlen_paged(q, k_cache, v_cache, i32(offsets(lens_q), c.device),
                                     i32(offsets(lens_k), c.device), max_q, max_k, i32(table, c.device), None,
                                     c.pick(False, True), c.pick(-1, 7), -1, None, c.pick(0.0, 2.0)))


OPS = [(dense, DENSE), (varlen, VARLEN), (kvcache, KVCACHE), (paged_varlen, PAGED_VARLEN)]


def cases(device):
    return [pytest.param(device, i, id=f"{device}-{i}", marks=[pytest.mark.gpu] if device == "cuda" else [])
            for i in range(CASES)]


@pytest.mark.parametrize("device, index", cases("cpu") + cases("cuda"))
def test_argument_fuzz(device, index):
    rng = random.Random(index + OFFSET)
    fn, spoils = OPS[index % len(OPS)]
    c = Draw(rng, device, spoils)
    where = f"{fn.__name__}, spoiled: {c.spoil}"
    with torch.no_grad():
        if c.spoil is None:
            for t in fn(c):
                assert not t.is_floating_point() or not t.isnan().any(), f"NaN ({where})"
            if device == "cuda":
                torch.cuda.synchronize()
        else:
            with pytest.raises((RuntimeError, ValueError), match=c.expect):
                fn(c)
