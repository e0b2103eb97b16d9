"""flash_attn_varlen_func with block_table: packed queries over a paged KV cache (forward only),
against the float64 reference run sequence by sequence on the keys its pages hold (the rows past
them NaN), the decoding shape (one query per sequence, GQA folded) against flash_attn_with_kvcache,
argument checks, opcheck and torch.compile. CPU always; CUDA (marked gpu) on a GPU."""

import pytest
import torch

from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
from flash_attn import ops
from reference import attention_ref, check_rule, graph_counting_backend, lse_ref, page_table, to_pages

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def offsets(lengths, device):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)


def make_paged(lens_q, lens_k, h, hk, d, page, device, spare_pages=1, dtype=None):
    """q packed, the keys of sequence i in rows [0, lens_k[i]) of a (b, rows, hk, d) cache (NaN
    past them), the same cache paged in shuffled order with spare_pages more table columns."""
    dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
    b = len(lens_q)
    n = max((k + page - 1) // page for k in lens_k + [1]) + spare_pages
    caches = [torch.randn(b, n * page, hk, d, dtype=dtype, device=device) for _ in range(2)]
    for c in caches:
        for i, k in enumerate(lens_k):
            c[i, k:] = float("nan")
    pages = b * n + 2
    table = page_table(b, n, pages, device)
    q = torch.randn(sum(lens_q), h, d, dtype=dtype, device=device)
    return q, caches, [to_pages(c, table, pages) for c in caches], table


def check_paged(device, lens_q, lens_k, h=4, hk=2, d=64, page=256, alibi=False, **kw):
    q, (kc, vc), (kp, vp), table = make_paged(lens_q, lens_k, h, hk, d, page, device)
    cu_q, cu_k = offsets(lens_q, device), offsets(lens_k, device)
    slopes = torch.rand(len(lens_q), h, device=device) * 0.3 if alibi else None
    out, lse, probs = flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, max(lens_q), max(lens_k), block_table=table,
                                             alibi_slopes=slopes, return_attn_probs=True, **kw)
    assert probs is None and out.shape == q.shape and lse.shape == (h, q.shape[0])
    for i, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        if sq == 0:
            continue
        qi = q[None, int(cu_q[i]):int(cu_q[i + 1])]
        ki, vi = kc[i:i + 1, :sk], vc[i:i + 1, :sk]
        ref_kw = dict(kw, alibi_slopes=None if slopes is None else slopes[i:i + 1])
        ref, _ = attention_ref(qi, ki, vi, **ref_kw)
        pt, _ = attention_ref(qi, ki, vi, upcast=False, **ref_kw)
        check_rule(f"out of sequence {i}", out[None, int(cu_q[i]):int(cu_q[i + 1])], ref, pt, q.dtype)
        want = lse_ref(qi, ki, **ref_kw)[0]
        got = lse[:, int(cu_q[i]):int(cu_q[i + 1])]
        seen = torch.isfinite(want)
        assert torch.equal(seen, torch.isfinite(got)), "rows that see no key: lse -inf"
        torch.testing.assert_close(got[seen].double(), want[seen], rtol=1e-3, atol=1e-3)
        if sk == 0:
            assert (out[int(cu_q[i]):int(cu_q[i + 1])] == 0).all()
    return out, lse


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("page", [256, 512])
def test_varlen_paged_matches_reference(causal, page, device):
    """Empty sequences of queries or keys, sq != sk, keys ending on and across page boundaries,
    more than one 128-row query block."""
    check_paged(device, [5, 0, 1, 130, 3, 2], [300, 3, 1, 512, 0, 256], page=page, causal=causal)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d", [32, 64, 128, 256])
@pytest.mark.parametrize("hk", [1, 4])
def test_varlen_paged_head_dims_and_gqa(d, hk, device):
    check_paged(device, [3, 70], [260, 600], h=4, hk=hk, d=d, causal=True)


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_paged_window_alibi_softcap(device):
    check_paged(device, [4, 9], [400, 9], window_size=(50, 0), softcap=5.0, softmax_scale=0.2)
    check_paged(device, [4, 9], [400, 9], alibi=True, causal=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("h, hk", [(4, 4), (8, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_paged_decoding(h, hk, causal, device):
    """One query per sequence (decoding): the reference, and flash_attn_with_kvcache on the same
    pages and lengths, exactly (both run the padded, GQA-folded read)."""
    lens_k = [1, 257, 700, 0]
    out, lse = check_paged(device, [1] * 4, lens_k, h=h, hk=hk, causal=causal)
    q, _, (kp, vp), table = make_paged([1] * 4, lens_k, h, hk, 64, 256, device)
    torch.manual_seed(0)
    q = torch.randn_like(q)
    got, got_lse, _ = flash_attn_varlen_func(q, kp, vp, offsets([1] * 4, device), offsets(lens_k, device), 1,
                                             max(lens_k), causal=causal, block_table=table, return_attn_probs=True)
    seqlens = torch.tensor(lens_k, dtype=torch.int32, device=device)
    want, want_lse = flash_attn_with_kvcache(q[:, None], kp, vp, cache_seqlens=seqlens, block_table=table,
                                             causal=causal, return_softmax_lse=True)
    torch.testing.assert_close(got, want[:, 0], rtol=0, atol=0)
    torch.testing.assert_close(got_lse, want_lse[:, :, 0].t(), rtol=0, atol=0)


@pytest.mark.parametrize("device, dtype", [("cpu", None), ("cpu", torch.bfloat16), ("cpu", torch.float16),
                                           pytest.param("cuda", None, marks=pytest.mark.gpu)])
def test_varlen_paged_equals_contiguous_varlen(device, dtype):
    """The same packed queries over the same keys, paged and packed contiguously (on the CPU a
    16-bit cache is read in place, tile by tile, and packed keys are converted up front)."""
    lens_q, lens_k = [7, 1, 200], [300, 40, 513]
    q, (kc, vc), (kp, vp), table = make_paged(lens_q, lens_k, 4, 2, 64, 256, device, dtype=dtype)
    cu_q, cu_k = offsets(lens_q, device), offsets(lens_k, device)
    k = torch.cat([kc[i, :n] for i, n in enumerate(lens_k)])
    v = torch.cat([vc[i, :n] for i, n in enumerate(lens_k)])
    want = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
    got = flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, max(lens_q), max(lens_k), causal=True, block_table=table)
    tol = 1e-5 if device == "cpu" and dtype is None else 2e-2  # (CUDA: other kernels; 16-bit: rounding)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def good():
    """Two sequences (3 and 1 queries, 300 and 9 keys) over 5 pages of 256 rows."""
    return dict(q=torch.randn(4, 2, 32), k=torch.randn(5, 256, 1, 32), v=torch.randn(5, 256, 1, 32),
                cu_seqlens_q=torch.tensor([0, 3, 4], dtype=torch.int32),
                cu_seqlens_k=torch.tensor([0, 300, 309], dtype=torch.int32), max_seqlen_q=3, max_seqlen_k=300,
                block_table=torch.tensor([[3, 1], [0, 4]], dtype=torch.int32))


@pytest.mark.parametrize("change, message", [
    (dict(k=torch.randn(5, 100, 1, 32), v=torch.randn(5, 100, 1, 32)), "multiple of 256, got 100"),
    (dict(k=torch.randn(1280, 1, 32)), "k_cache must have shape"),
    (dict(block_table=torch.tensor([[3, 1], [0, 4]])), "block_table must be int32"),
    (dict(block_table=torch.tensor([[3, 1]], dtype=torch.int32)), r"block_table must have shape \(batch, "),
    (dict(block_table=torch.tensor([[3, 9], [0, 4]], dtype=torch.int32)), r"block_table\[0, 1\] = 9 is not a page"),
    (dict(cu_seqlens_k=torch.tensor([0, 600, 609], dtype=torch.int32), max_seqlen_k=600),
     "sequence 0 has 600 keys"),
    (dict(cu_seqlens_k=torch.tensor([0, 300, 309], dtype=torch.int32), max_seqlen_k=299), "max_seqlen_k = 299"),
    # (one query per sequence takes a path of its own, which once skipped this check)
    (dict(q=torch.randn(2, 2, 32), cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32), max_seqlen_q=1,
          max_seqlen_k=299), "max_seqlen_k = 299 is smaller than sequence 0's length 300"),
    (dict(cu_seqlens_q=torch.tensor([0, 3, 5], dtype=torch.int32)), r"cu_seqlens_q\[-1\] must equal"),
    (dict(cu_seqlens_q=torch.tensor([0, 4], dtype=torch.int32)), "same length"),
    (dict(cu_seqlens_q=torch.tensor([0, 3, 4])), "cu_seqlens_q must be a 1-D int32"),
    (dict(q=torch.randn(2, 2, 32), cu_seqlens_q=torch.tensor([0, 0, 2], dtype=torch.int32), max_seqlen_q=1),
     r"cu_seqlens_q must be 0, 1, \.\.\., 2"),
    (dict(dropout_p=0.1), "dropout_p must be 0"),
    (dict(q=torch.randn(4, 2, 32, requires_grad=True)), "no gradient"),
])
def test_varlen_paged_errors(change, message):
    a = good()
    a.update(change)
    with pytest.raises((RuntimeError, ValueError, NotImplementedError), match=message):
        flash_attn_varlen_func(**a)


def test_varlen_paged_under_no_grad_and_unused_table_entries():
    """Inputs that require grad are fine under no_grad; table entries past a sequence's keys are
    never read, so they may hold anything."""
    a = good()
    a["block_table"][1, 1] = 1000
    a["q"].requires_grad_()
    with torch.no_grad():
        assert flash_attn_varlen_func(**a).shape == (4, 2, 32)


def test_varlen_paged_opcheck():
    a = good()
    args = (a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"], 3, 300, a["block_table"])
    torch.library.opcheck(ops.fwd_varlen_paged, args, dict(causal=True))


def test_varlen_paged_compile_fullgraph():
    torch._dynamo.reset()
    a = good()

    def step(q, k, v, cu_q, cu_k, table):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 300, causal=True, block_table=table)

    args = (a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"], a["block_table"])
    torch.testing.assert_close(torch.compile(step, fullgraph=True)(*args), step(*args))


def test_varlen_paged_compile_does_not_recompile_for_each_longest_length():
    # max_seqlen_q / _k are SymInts in fwd_varlen_paged's schema, as in the dense ops'.
    torch._dynamo.reset()
    backend, graphs = graph_counting_backend()

    def step(q, k, v, cu_q, cu_k, table, max_q: int, max_k: int):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, block_table=table)

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    for lens_q, lens_k in (([3, 1], [300, 9]), ([2, 4], [20, 90]), ([5, 1], [7, 400]), ([1, 6], [60, 61])):
        q, _, (kp, vp), table = make_paged(lens_q, lens_k, 2, 1, 32, 256, "cpu")
        args = (q, kp, vp, offsets(lens_q, "cpu"), offsets(lens_k, "cpu"), table, max(lens_q), max(lens_k))
        torch.testing.assert_close(compiled(*args), step(*args), equal_nan=False)
    assert len(graphs) <= 2, f"{len(graphs)} graphs for 4 batches"
