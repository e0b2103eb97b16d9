"""flash_attn_with_kvcache: the cache after the append and the attention over it against the
float64 reference run entry by entry, cache rows the call must not read poisoned with NaN; decoding
step by step against flash_attn_func on the whole prefix; argument checks, opcheck and
torch.compile. CPU always; CUDA (marked gpu) on a GPU."""

import math

import pytest
import torch

from flash_attn import flash_attn_func, flash_attn_with_kvcache
from reference import attention_ref, check_rule, from_pages, lse_ref, page_table, to_pages

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def dtype_for(device):
    return torch.bfloat16 if device == "cuda" else torch.float32


def rotate_ref(x, cos, sin, pos, interleaved):
    """RoPE in float64, written out: x (batch, seqlen, heads, d), pos (batch, seqlen) positions."""
    rot = 2 * cos.shape[-1]
    c, s = cos.double()[pos][:, :, None], sin.double()[pos][:, :, None]
    xr = x[..., :rot].double()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        y = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :rot // 2], xr[..., rot // 2:]
        y = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((y.to(x.dtype), x[..., rot:]), dim=-1)


def make_case(device, dtype, b=3, entries=None, rows=80, sq=1, sn=1, h=4, hk=2, d=64, seqlens=None, leftpad=None,
              batch_idx=None):
    entries = entries or b
    q = torch.randn(b, sq, h, d, dtype=dtype, device=device)
    k_cache = torch.randn(entries, rows, hk, d, dtype=dtype, device=device)
    v_cache = torch.randn(entries, rows, hk, d, dtype=dtype, device=device)
    seqlens = torch.tensor(seqlens if seqlens is not None else [min(5 + 17 * i, rows - sn) for i in range(b)],
                           dtype=torch.int32, device=device)
    idx = None if batch_idx is None else torch.tensor(batch_idx, dtype=torch.int32, device=device)
    lp = None if leftpad is None else torch.tensor(leftpad, dtype=torch.int32, device=device)
    # Rows the call must not read: before the left padding and past the keys it will hold.
    for i in range(b):
        e = i if idx is None else int(idx[i])
        k_cache[e, int(seqlens[i]) + sn:] = float("nan")
        v_cache[e, int(seqlens[i]) + sn:] = float("nan")
        if lp is not None:
            k_cache[e, :int(lp[i])] = float("nan")
            v_cache[e, :int(lp[i])] = float("nan")
    if idx is None:  # entries past the batch's (a cache allocated for a larger batch)
        k_cache[b:] = v_cache[b:] = float("nan")
    k = torch.randn(b, sn, hk, d, dtype=dtype, device=device) if sn else None
    v = torch.randn(b, sn, hk, d, dtype=dtype, device=device) if sn else None
    return q, k_cache, v_cache, k, v, seqlens, idx, lp


def check_kvcache(device, b=3, entries=None, rows=80, sq=1, sn=1, h=4, hk=2, d=64, seqlens=None, leftpad=None,
                  batch_idx=None, rotary=None, causal=False, window_size=(-1, -1), alibi=False, softcap=0.0,
                  softmax_scale=None, num_splits=0, page=None, dtype=None):
    """page: the same case through a paged cache of that many rows a page (block_table)."""
    dtype = dtype or dtype_for(device)
    q, k_cache, v_cache, k, v, seqlens, idx, lp = make_case(device, dtype, b, entries, rows, sq, sn, h, hk, d,
                                                            seqlens, leftpad, batch_idx)
    cos = sin = None
    if rotary is not None:  # rotary = interleaved
        angle = torch.rand(rows, d // 4, device=device) * 2 * math.pi
        cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    slopes = torch.rand(b, h, device=device) * 0.3 if alibi else None
    cache_before = k_cache.clone(), v_cache.clone()
    table = None
    if page is not None:  # three pages more than the table lists
        pages = b * (rows // page) + 3
        table = page_table(b, rows // page, pages, device)
        k_cache, v_cache = to_pages(k_cache, table, pages), to_pages(v_cache, table, pages)
        unused = torch.ones(pages, dtype=torch.bool, device=device)
        unused[table.long().flatten()] = False
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
                                       cache_seqlens=seqlens, cache_batch_idx=idx, cache_leftpad=lp,
                                       block_table=table, softmax_scale=softmax_scale, causal=causal,
                                       window_size=window_size, softcap=softcap, rotary_interleaved=bool(rotary),
                                       alibi_slopes=slopes, num_splits=num_splits, return_softmax_lse=True)
    assert out.shape == q.shape and lse.shape == (b, h, sq) and lse.is_contiguous()
    if page is not None:  # pages no entry lists stay as they were; the rest read back as entries
        assert k_cache[unused].isnan().all() and v_cache[unused].isnan().all()
        k_cache, v_cache = from_pages(k_cache, table), from_pages(v_cache, table)

    # The cache: the new rows (rotated) at cache_seqlens, every other row as it was.
    entry = list(range(b)) if idx is None else idx.tolist()
    want_k, want_v = cache_before[0].clone(), cache_before[1].clone()
    for i, e in enumerate(entry):
        n = int(seqlens[i])
        if sn:
            pos = torch.arange(n, n + sn, device=device)[None]
            want_k[e, n:n + sn] = rotate_ref(k[i:i + 1], cos, sin, pos, rotary)[0] if rotary is not None else k[i]
            want_v[e, n:n + sn] = v[i]
    tol = 0 if rotary is None else 1e-5 if dtype == torch.float32 else 1e-2  # (RoPE: float32 against float64)
    torch.testing.assert_close(k_cache, want_k, rtol=tol, atol=tol, equal_nan=True)
    torch.testing.assert_close(v_cache, want_v, rtol=0, atol=0, equal_nan=True)

    # The attention, entry by entry, on cache rows [leftpad, seqlens + sn).
    rotate_q = rotary is not None and (causal or tuple(window_size) != (-1, -1))
    for i, e in enumerate(entry):
        lo, hi = (0 if lp is None else int(lp[i])), int(seqlens[i]) + sn
        qi = q[i:i + 1]
        if rotary is not None:
            n = int(seqlens[i])
            pos = torch.arange(n, n + sq, device=device)[None] if rotate_q else torch.full((1, sq), n, device=device)
            qi = rotate_ref(qi, cos, sin, pos, rotary)
        ki, vi = want_k[e:e + 1, lo:hi], want_v[e:e + 1, lo:hi]
        kw = dict(causal=causal, window_size=window_size, softcap=softcap, softmax_scale=softmax_scale,
                  alibi_slopes=None if slopes is None else slopes[i:i + 1])
        ref, probs = attention_ref(qi, ki, vi, **kw)
        pt, _ = attention_ref(qi, ki, vi, upcast=False, **kw)
        check_rule(f"out[{i}]", out[i:i + 1], ref, pt, dtype)
        ref_lse = lse_ref(qi, ki, **kw)
        seen = torch.isfinite(ref_lse)
        assert torch.equal(seen, torch.isfinite(lse[i:i + 1])), "rows that see no key: lse -inf"
        torch.testing.assert_close(lse[i:i + 1][seen].double(), ref_lse[seen], rtol=1e-3, atol=1e-3)
        if hi == lo:
            assert (out[i] == 0).all() and torch.isneginf(lse[i]).all()
    return out, lse


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sn", [0, 1, 5])
@pytest.mark.parametrize("sq", [1, 3, 130])
@pytest.mark.parametrize("causal", [False, True])
def test_kvcache_matches_reference(sn, sq, causal, device):
    check_kvcache(device, rows=200, sq=sq, sn=sn, causal=causal, seqlens=[0, 60, 200 - sn])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d", [32, 40, 64, 96, 128, 160, 192, 256])
@pytest.mark.parametrize("hk", [1, 4])
def test_kvcache_head_dims_and_gqa(d, hk, device):
    check_kvcache(device, sq=2, sn=2, h=4, hk=hk, d=d, causal=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hk", [1, 4])
@pytest.mark.parametrize("sq", [1, 5])
def test_kvcache_batch_of_one(sq, hk, device):
    check_kvcache(device, b=1, rows=1000, sq=sq, sn=1, h=4, hk=hk, seqlens=[900], causal=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_kvcache_rotary(interleaved, causal, device):
    check_kvcache(device, sq=4, sn=4, rotary=interleaved, causal=causal)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["plain", "rotary", "idx_leftpad", "paged"])
def test_kvcache_16_bit_on_the_cpu(case, dtype):
    """A 16-bit cache on the CPU (read in float32 there) gives q's dtype back."""
    kw = dict(plain=dict(sq=3, sn=2, causal=True), rotary=dict(sq=2, sn=2, rotary=False, causal=True),
              idx_leftpad=dict(b=3, entries=5, rows=150, sq=2, sn=3, batch_idx=[4, 0, 2], leftpad=[0, 20, 77],
                               seqlens=[10, 30, 140]),
              paged=dict(rows=512, sq=2, sn=1, page=256))[case]
    out, _ = check_kvcache("cpu", dtype=dtype, **kw)
    assert out.dtype == dtype


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sq", [1, 3])
def test_kvcache_larger_cache_than_batch(sq, device):
    """Without cache_batch_idx batch entry i reads cache entry i (as flash-attn's), so a cache
    allocated for a larger batch serves a smaller one; its other entries are never touched."""
    check_kvcache(device, b=2, entries=5, sq=sq, sn=2, causal=True)


@pytest.mark.parametrize("device", DEVICES)
def test_kvcache_batch_idx_and_leftpad(device):
    check_kvcache(device, b=3, entries=5, rows=150, sq=2, sn=3, batch_idx=[4, 0, 2], leftpad=[0, 20, 77],
                  seqlens=[10, 30, 140], causal=True, rotary=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page", [256, 512])
@pytest.mark.parametrize("sq, sn", [(1, 1), (3, 0), (5, 5), (130, 2)])
@pytest.mark.parametrize("hk", [1, 2])
def test_kvcache_paged(page, sq, sn, hk, device):
    """A paged cache (block_table): the keys cross pages, the pages lie shuffled, an entry with no
    keys, one whose keys end on a page boundary and one with a full table."""
    rows = 1024
    check_kvcache(device, b=4, rows=rows, sq=sq, sn=sn, h=4, hk=hk, causal=True, page=page,
                  seqlens=[0, page - sn, 300, rows - sn])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("num_splits", [0, 1, 3])
def test_kvcache_paged_splits_and_head_dims(d, num_splits, device):
    check_kvcache(device, b=3, rows=768, sq=1, sn=1, h=8, hk=2, d=d, page=256, num_splits=num_splits,
                  seqlens=[700, 40, 511])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_kvcache_paged_rotary_window_alibi_softcap(interleaved, device):
    check_kvcache(device, b=2, rows=512, sq=3, sn=3, page=256, rotary=interleaved, causal=True, seqlens=[250, 400])
    check_kvcache(device, b=2, rows=512, sq=3, sn=2, page=256, window_size=(100, 0), alibi=True, softcap=4.0,
                  seqlens=[254, 300])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sq,page,dtype", [(1, 256, None), (4, 256, None), (1, 768, None), (3, 512, torch.bfloat16)])
def test_kvcache_paged_equals_contiguous(sq, page, dtype, device):
    """The same step on a paged cache and on the contiguous one: the same kernels read the same
    keys, so the outputs, logsumexps and appended rows agree exactly (on the CPU too, where a key
    tile may span pages)."""
    dtype = dtype or dtype_for(device)
    b, h, hk, d, rows = 3, 8, 2, 128, 1536
    q = torch.randn(b, sq, h, d, dtype=dtype, device=device)
    kn, vn = (torch.randn(b, 2, hk, d, dtype=dtype, device=device) for _ in range(2))
    kc, vc = (torch.randn(b, rows, hk, d, dtype=dtype, device=device) for _ in range(2))
    seqlens = torch.tensor([1500, 255, 17], dtype=torch.int32, device=device)
    pages = b * rows // page + 1
    table = page_table(b, rows // page, pages, device)
    kp, vp = to_pages(kc, table, pages), to_pages(vc, table, pages)
    want = flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, causal=True, return_softmax_lse=True)
    got = flash_attn_with_kvcache(q, kp, vp, kn, vn, cache_seqlens=seqlens, block_table=table, causal=True,
                                  return_softmax_lse=True)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    torch.testing.assert_close(from_pages(kp, table), kc, rtol=0, atol=0)
    torch.testing.assert_close(from_pages(vp, table), vc, rtol=0, atol=0)


def test_kvcache_paged_cpu_reads_pages_in_place():
    """The CPU follows the block table tile by tile: no copy of the pages a table lists (a copy of
    every listed page per step costs time and memory in proportion to the table, not the keys)."""
    b, h, hk, d, page, pages_each = 2, 4, 2, 64, 256, 64
    pages = b * pages_each
    kp, vp = (torch.randn(pages, page, hk, d) for _ in range(2))
    table = torch.arange(pages, dtype=torch.int32).view(b, pages_each)
    q = torch.randn(b, 1, h, d)
    seqlens = torch.tensor([300, 5], dtype=torch.int32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = flash_attn_with_kvcache(q, kp, vp, cache_seqlens=seqlens, block_table=table)
    copies = [e.key for e in prof.key_averages() if e.key in ("aten::index_select", "aten::copy_", "aten::clone")]
    assert not copies, copies
    want = flash_attn_with_kvcache(q, kp.view(b, pages_each * page, hk, d), vp.view(b, pages_each * page, hk, d),
                                   cache_seqlens=seqlens)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window_size", [(8, 0), (20, 4), (-1, 2)])
@pytest.mark.parametrize("sq", [1, 6])
def test_kvcache_window(window_size, sq, device):
    check_kvcache(device, rows=160, sq=sq, sn=6, window_size=window_size)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sq", [1, 3])
def test_kvcache_alibi_softcap_scale(sq, device):
    check_kvcache(device, sq=sq, sn=1, alibi=True, softcap=5.0, softmax_scale=0.2, causal=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [0, 1, 2, 3, 7, 200])
@pytest.mark.parametrize("sq", [1, 2])
def test_kvcache_num_splits(num_splits, sq, device):
    """Split-KV (CUDA): any number of splits, some with no key tile (an entry with no keys, one
    with fewer tiles than splits), gives the reference's output and logsumexp."""
    check_kvcache(device, b=4, rows=700, sq=sq, sn=1, h=8, hk=2, seqlens=[0, 30, 400, 699], causal=True,
                  num_splits=num_splits)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [1, 0, 5])
@pytest.mark.parametrize("sq", [1, 2])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_kvcache_long_caches(d, sq, num_splits, device):
    """Many key tiles per CTA and lengths around a tile's edges (on CUDA each warp of a decoding
    CTA takes part of every tile, and a warp may see no key of a sequence at all)."""
    check_kvcache(device, b=6, rows=3000, sq=sq, sn=1, h=8, hk=1, d=d, seqlens=[0, 14, 62, 63, 64, 2998],
                  num_splits=num_splits, causal=True)


def kernels_run(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events()}


SM90_DECODE_CASES = {  # name: check_kvcache's arguments; NaN past each sequence's keys (make_case)
    "tail_edges": dict(b=6, rows=3000, sq=1, sn=1, h=8, hk=1, d=128, seqlens=[0, 14, 126, 127, 128, 2998],
                       causal=True),
    "sq2_d64": dict(b=4, rows=700, sq=2, sn=2, h=4, hk=4, d=64, seqlens=[3, 129, 255, 698], causal=True),
    "d256_gqa": dict(b=3, rows=500, sq=1, sn=1, h=8, hk=2, d=256, seqlens=[1, 200, 499], causal=True),
    "d96_no_new": dict(b=3, rows=400, sq=3, sn=0, h=2, hk=1, d=96, seqlens=[0, 130, 400]),
    "batch_idx_leftpad": dict(b=3, entries=5, rows=600, sq=1, sn=1, h=4, hk=2, d=128, seqlens=[300, 77, 500],
                              leftpad=[0, 13, 250], batch_idx=[4, 0, 2], causal=True),
    "window_alibi_softcap": dict(b=2, rows=900, sq=2, sn=1, h=4, hk=2, d=128, seqlens=[257, 800], causal=True,
                                 window_size=(300, 0), alibi=True, softcap=30.0),
    "rotary": dict(b=2, rows=300, sq=1, sn=1, h=4, hk=1, d=64, seqlens=[40, 290], rotary=True, causal=True),
    "chunk_of_queries": dict(b=2, rows=900, sq=130, sn=5, h=2, hk=1, d=128, seqlens=[0, 700], causal=True),
}


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                    reason="Hopper (sm_90) only")
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("case", sorted(SM90_DECODE_CASES))
def test_kvcache_on_the_sm90_kernel(case, num_splits, monkeypatch):
    """Reads of a cache that is not paged on the warp-specialized sm90 kernel, unsplit and split
    (TMA loads whole key tiles, so its V rows past a sequence's keys, NaN here, must not reach the
    output), against the reference, and the kernel that ran is that one."""
    monkeypatch.setenv("FLASH_ATTN_DECODE_SM90", "1")
    kw = SM90_DECODE_CASES[case]
    if kw["sq"] > 64 and num_splits > 1:
        pytest.skip("split reads of more than 64 query rows run the portable kernel")
    names = kernels_run(lambda: check_kvcache("cuda", num_splits=num_splits, **kw))
    assert any("flash_fwd_sm90_ws_kernel" in n for n in names)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                    reason="Hopper (sm_90) only")
@pytest.mark.parametrize("longest,rows,sm90", [(9000, 9100, True), (1024, 32768, False), (8000, 8192, False)])
def test_kvcache_sm90_rule_reads_the_longest_sequence(longest, rows, sm90, monkeypatch):
    """Without the override, decoding runs the sm90 kernel from 8192 keys in the longest sequence,
    whatever the cache's rows (a large, mostly empty cache keeps the decoding tiles); under CUDA
    graph capture the counts are not read and the decoding tiles run."""
    monkeypatch.delenv("FLASH_ATTN_DECODE_SM90", raising=False)
    kw = dict(b=2, rows=rows, sq=1, sn=1, h=8, hk=2, d=128, seqlens=[longest - 1, 100], causal=True)
    names = kernels_run(lambda: check_kvcache("cuda", **kw))
    assert any("flash_fwd_sm90_ws_kernel" in n for n in names) == sm90, sorted(names)
    if not sm90:
        return
    q, k_cache, v_cache, k, v, seqlens, _, _ = make_case("cuda", torch.bfloat16, **{x: kw[x] for x in
                                                         ("b", "rows", "sq", "sn", "h", "hk", "d", "seqlens")})
    call = lambda: flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True)
    want = call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    names = kernels_run(graph.replay)
    assert any("flash_fwd" in n for n in names), sorted(names)  # (the profiler sees the replay's kernels)
    assert not any("flash_fwd_sm90_ws_kernel" in n for n in names), sorted(names)
    torch.testing.assert_close(out, want, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_kvcache_without_new_keys_and_full_cache(device):
    """cache_seqlens=None: every entry's whole cache."""
    dtype = dtype_for(device)
    q = torch.randn(2, 3, 2, 64, dtype=dtype, device=device)
    kc, vc = (torch.randn(2, 37, 1, 64, dtype=dtype, device=device) for _ in range(2))
    out = flash_attn_with_kvcache(q, kc, vc, causal=True)
    tol = 1e-6 if device == "cpu" else 2e-2  # (the cache path and the dense one may run different kernels)
    torch.testing.assert_close(out, flash_attn_func(q, kc, vc, causal=True), rtol=tol, atol=tol)


@pytest.mark.parametrize("device", DEVICES)
def test_kvcache_decoding_equals_full_prefix(device):
    """A prompt written to the cache, then tokens decoded one at a time with int cache_seqlens,
    each step equal to flash_attn_func (causal) on the whole prefix."""
    dtype = dtype_for(device)
    b, h, hk, d, rows, prompt, steps = 2, 4, 2, 64, 64, 11, 5
    k_all, v_all = (torch.randn(b, prompt + steps, hk, d, dtype=dtype, device=device) for _ in range(2))
    q_all = torch.randn(b, prompt + steps, h, d, dtype=dtype, device=device)
    kc, vc = (torch.zeros(b, rows, hk, d, dtype=dtype, device=device) for _ in range(2))
    out = flash_attn_with_kvcache(q_all[:, :prompt], kc, vc, k_all[:, :prompt], v_all[:, :prompt],
                                  cache_seqlens=0, causal=True)
    full = flash_attn_func(q_all[:, :prompt], k_all[:, :prompt], v_all[:, :prompt], causal=True)
    tol = 1e-6 if device == "cpu" else 2e-2  # (the cache path and the dense one may run different kernels)
    torch.testing.assert_close(out, full, rtol=tol, atol=tol)
    for t in range(prompt, prompt + steps):
        out = flash_attn_with_kvcache(q_all[:, t:t + 1], kc, vc, k_all[:, t:t + 1], v_all[:, t:t + 1],
                                      cache_seqlens=t, causal=True)
        full = flash_attn_func(q_all[:, t:t + 1], k_all[:, :t + 1], v_all[:, :t + 1], causal=True)
        torch.testing.assert_close(out, full, rtol=tol, atol=tol)


def good(device="cpu"):
    return dict(q=torch.randn(2, 1, 2, 32), k_cache=torch.randn(2, 10, 1, 32), v_cache=torch.randn(2, 10, 1, 32),
                k=torch.randn(2, 1, 1, 32), v=torch.randn(2, 1, 1, 32),
                cache_seqlens=torch.tensor([3, 9], dtype=torch.int32))


def good_paged():
    """good() with a paged cache: 5 pages of 256 rows, entry 0 on pages 3 and 1, entry 1 on 0 and 4."""
    return dict(good(), k_cache=torch.randn(5, 256, 1, 32), v_cache=torch.randn(5, 256, 1, 32),
                block_table=torch.tensor([[3, 1], [0, 4]], dtype=torch.int32),
                cache_seqlens=torch.tensor([300, 9], dtype=torch.int32))


@pytest.mark.parametrize("change, message", [
    (dict(k_cache=torch.randn(5, 100, 1, 32), v_cache=torch.randn(5, 100, 1, 32)), "multiple of 256, got 100"),
    (dict(block_table=torch.tensor([[3, 1], [0, 4]])), "block_table must be int32"),
    (dict(block_table=torch.tensor([3, 1], dtype=torch.int32)), r"block_table must have shape \(batch, "),
    (dict(block_table=torch.tensor([[3, 1], [0, 4]], dtype=torch.int32).t()), "contiguous last dim"),
    (dict(block_table=torch.tensor([[3, 1], [5, 4]], dtype=torch.int32)), r"block_table\[1, 0\] = 5 is not a page"),
    (dict(block_table=torch.tensor([[3, -1], [0, 4]], dtype=torch.int32)), r"block_table\[0, 1\] = -1"),
    (dict(cache_seqlens=torch.tensor([512, 9], dtype=torch.int32)), "no room past row 512"),
    (dict(cache_batch_idx=torch.tensor([0, 1], dtype=torch.int32)), "cache_batch_idx cannot be combined"),
    (dict(cache_leftpad=torch.tensor([0, 1], dtype=torch.int32)), "cache_leftpad cannot be combined"),
    (dict(rotary_cos=torch.randn(511, 8), rotary_sin=torch.randn(511, 8)), "covers 511 positions, fewer than the "
     "cache's 512 rows"),
])
def test_kvcache_paged_errors(change, message):
    a = good_paged()
    a.update(change)
    with pytest.raises((RuntimeError, ValueError), match=message):
        flash_attn_with_kvcache(**a)


def test_kvcache_paged_unlisted_pages_may_hold_anything():
    """Table entries past an entry's keys are never read, so they may hold any value."""
    a = good_paged()
    a["block_table"][1, 1] = 1000
    flash_attn_with_kvcache(**a)


@pytest.mark.parametrize("change, message", [
    (dict(v=None), "k and v must be given together"),
    (dict(cache_seqlens=None), "cache_seqlens, which must then be given"),
    (dict(cache_seqlens=torch.tensor([3, 10], dtype=torch.int32)), "no room past row 10"),
    (dict(cache_seqlens=torch.tensor([3, 9])), "cache_seqlens must be int32"),
    (dict(cache_seqlens=torch.tensor([3], dtype=torch.int32)), r"cache_seqlens must have shape \(batch,\)"),
    (dict(cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32)), "cache_batch_idx\\[1\\] = 2 is not an entry"),
    (dict(cache_leftpad=torch.tensor([5, 0], dtype=torch.int32)), "cache_leftpad\\[0\\] = 5"),
    (dict(k=torch.randn(2, 1, 2, 32)), "k must have shape"),
    (dict(k=torch.randn(2, 1, 1, 32, dtype=torch.float64)), "k must have the cache's dtype"),
    (dict(v_cache=torch.randn(2, 9, 1, 32)), "v_cache must have the shape of k_cache"),
    (dict(k_cache=torch.randn(1, 10, 1, 32), v_cache=torch.randn(1, 10, 1, 32)), "fewer than q's 2; pass cache_batch_idx"),
    (dict(q=torch.randn(2, 2, 32)), "q must have shape"),
    (dict(rotary_cos=torch.randn(10, 8)), "rotary_cos and rotary_sin must be given together"),
    (dict(rotary_cos=torch.randn(9, 8), rotary_sin=torch.randn(9, 8)), "covers 9 positions"),
    (dict(k=None, v=None, rotary_cos=torch.randn(10, 8), rotary_sin=torch.randn(10, 8)), "pass k and v too"),
])
def test_kvcache_errors(change, message):
    a = good()
    a.update(change)
    with pytest.raises((RuntimeError, ValueError, NotImplementedError), match=message):
        flash_attn_with_kvcache(**a)


@pytest.mark.parametrize("device", DEVICES)
def test_kvcache_strided_head_dim_of_new_tokens(device):
    # q, k and v with a head-dim stride != 1 run on contiguous copies, as in flash-attn 2.x; the
    # cache, written in place, keeps its own layout rule.
    dtype = dtype_for(device)
    q, k_cache, v_cache, k, v, seqlens, _, _ = make_case(device, dtype, sn=2)
    q_t, k_t = (x.transpose(-1, -2).contiguous().transpose(-1, -2) for x in (q, k))
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    out = flash_attn_with_kvcache(q_t, *caches[0], k_t, v, cache_seqlens=seqlens, causal=True)
    ref = flash_attn_with_kvcache(q, *caches[1], k, v, cache_seqlens=seqlens, causal=True)
    assert q_t.stride(-1) != 1 and torch.equal(out, ref)
    torch.testing.assert_close(caches[0], caches[1], rtol=0, atol=0, equal_nan=True)


def test_kvcache_opcheck():
    a = good()
    args = (a["q"], a["k_cache"], a["v_cache"], a["k"], a["v"], a["cache_seqlens"])
    torch.library.opcheck(torch.ops.flash_attn.fwd_kvcache.default, args, dict(causal=True))
    a = good_paged()
    args = (a["q"], a["k_cache"], a["v_cache"], a["k"], a["v"], a["cache_seqlens"])
    torch.library.opcheck(torch.ops.flash_attn.fwd_kvcache.default, args,
                          dict(block_table=a["block_table"], causal=True))


def test_kvcache_compile_fullgraph():
    """A decode step, cache append included, compiled without graph breaks."""
    torch._dynamo.reset()

    def step(q, kc, vc, k, v, n):
        return flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=n, causal=True)

    a, b = good(), good()
    for t in ("k_cache", "v_cache"):
        b[t] = a[t].clone()
    eager = step(a["q"], a["k_cache"], a["v_cache"], a["k"], a["v"], a["cache_seqlens"])
    out = torch.compile(step, fullgraph=True)(a["q"], b["k_cache"], b["v_cache"], a["k"], a["v"], a["cache_seqlens"])
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(b["k_cache"], a["k_cache"])


def test_kvcache_empty_queries_and_batch():
    q, kc, vc = torch.randn(2, 0, 2, 32), torch.randn(2, 10, 1, 32), torch.randn(2, 10, 1, 32)
    kn = torch.randn(2, 1, 1, 32)
    out, lse = flash_attn_with_kvcache(q, kc, vc, kn, torch.randn(2, 1, 1, 32), cache_seqlens=3,
                                       return_softmax_lse=True)
    assert out.shape == (2, 0, 2, 32) and lse.shape == (2, 2, 0) and torch.equal(kc[:, 3], kn[:, 0])
    assert flash_attn_with_kvcache(torch.randn(0, 1, 2, 32), kc[:0], vc[:0]).shape == (0, 1, 2, 32)


@pytest.mark.gpu
@pytest.mark.parametrize("hk", [1, 4])
def test_kvcache_cuda_graph_decoding(hk):
    """A decoding step captured once in a CUDA graph (the host check is skipped while capturing),
    replayed with cache_seqlens moved on in place: each replay equals the eager step."""
    b, h, d, rows = 2, 4, 64, 300
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
    kn, vn = (torch.randn(b, 1, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kc, vc = (torch.randn(b, rows, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seqlens = torch.tensor([5, 200], dtype=torch.int32, device="cuda")
    step = lambda: flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, causal=True)  # noqa: E731
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for t in range(3):
        seqlens += 7
        for x in (q, kn, vn):
            x.normal_()
        graph.replay()
        kc2, vc2 = kc.clone(), vc.clone()
        want = flash_attn_with_kvcache(q, kc2, vc2, kn, vn, cache_seqlens=seqlens, causal=True)
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        torch.testing.assert_close(kc2, kc, rtol=0, atol=0)
