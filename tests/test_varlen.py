"""Variable-length (packed) batches: flash_attn_varlen_func and its packed variants against the
float64 reference run sequence by sequence, against flash_attn_func on each sequence alone, the
argument checks, opcheck and torch.compile. CPU always; CUDA (marked gpu) on a GPU."""

import math

import pytest
import torch

from flash_attn import (flash_attn_func, flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                        flash_attn_varlen_qkvpacked_func)
from reference import attention_ref, check_rule, graph_counting_backend, poison_allocator, visible_mask

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]

# Per-sequence (seqlen_q, seqlen_k): empty and one-token sequences, sq != sk, lengths that are not
# tile multiples, one sequence longer than a 128-row tile.
LENGTHS = {
    "mixed": [(5, 7), (0, 3), (1, 1), (130, 200), (77, 77), (3, 0), (64, 64)],
    "one": [(33, 47)],
    "long": [(300, 257), (129, 1), (1, 129), (260, 260)],
}


def offsets(lengths, device):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=device)


def make_varlen(lengths, h, hk, d, dtype, device):
    lq, lk = [s for s, _ in lengths], [s for _, s in lengths]
    q = torch.randn(sum(lq), h, d, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(sum(lk), hk, d, dtype=dtype, device=device, requires_grad=True)
    v = torch.randn(sum(lk), hk, d, dtype=dtype, device=device, requires_grad=True)
    return q, k, v, offsets(lq, device), offsets(lk, device), max(lq), max(lk)


def split(t, cu):
    return [t[cu[i]:cu[i + 1]] for i in range(len(cu) - 1)]


def varlen_ref(q, k, v, cu_q, cu_k, upcast=True, keep_mask=None, **kw):
    """The reference on each sequence alone, packed again; keep_mask: (batch, h, max_q, max_k)."""
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    outs, probs = [], []
    for i, (qi, ki, vi) in enumerate(zip(split(q, cu_q), split(k, cu_k), split(v, cu_k))):
        keep = None if keep_mask is None else keep_mask[i:i + 1, :, :qi.shape[0], :ki.shape[0]]
        o, p = attention_ref(qi[None], ki[None], vi[None], upcast=upcast, keep_mask=keep, **kw)
        outs.append(o[0])
        probs.append(p[0])
    return torch.cat(outs), probs


def check_varlen(lengths, h, hk, d, dtype, device, dropout_p=0.0, deterministic=False, **kw):
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen(lengths, h, hk, d, dtype, device)
    if device == "cuda":
        poison_allocator()
    out, lse, s_dmask = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=dropout_p,
                                               deterministic=deterministic, return_attn_probs=True, **kw)
    assert out.shape == q.shape and lse.shape == (h, q.shape[0])
    assert s_dmask.shape == (len(lengths), h, max_q, max_k)
    keep = None if dropout_p == 0.0 else ~torch.signbit(s_dmask)
    dout = torch.randn_like(out)
    if device == "cuda":
        poison_allocator()
    grads = torch.autograd.grad(out, (q, k, v), dout)

    ref, ref_probs = varlen_ref(q, k, v, cu_q, cu_k, keep_mask=keep, dropout_p=dropout_p, **kw)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout.double())
    pt, _ = varlen_ref(q, k, v, cu_q, cu_k, upcast=False, keep_mask=keep, dropout_p=dropout_p, **kw)
    pt_grads = torch.autograd.grad(pt, (q, k, v), dout)
    check_rule("out", out, ref, pt, dtype)
    for name, g, rg, pg in zip(("dq", "dk", "dv"), grads, ref_grads, pt_grads):
        check_rule(name, g, rg, pg, dtype)

    # softmax_lse (h, total_q) and S_dmask: each sequence's block, zero past its lengths
    scale = kw.get("softmax_scale") or 1.0 / math.sqrt(d)
    window = (kw.get("window_size") or (-1, -1))
    for i, (sq, sk) in enumerate(lengths):
        qi, ki = q[cu_q[i]:cu_q[i + 1]].double(), k[cu_k[i]:cu_k[i + 1]].double().repeat_interleave(h // hk, 1)
        scores = torch.einsum("ihd,jhd->hij", qi * scale, ki)
        scores = scores.masked_fill(~visible_mask(sq, sk, kw.get("causal", False), window, scores.device),
                                    float("-inf"))
        ref_lse = torch.logsumexp(scores, dim=-1)
        ours = lse[:, cu_q[i]:cu_q[i + 1]]
        assert torch.equal(torch.isneginf(ours), torch.isneginf(ref_lse)), f"sequence {i}: -inf rows differ"
        fin = torch.isfinite(ref_lse)
        assert torch.allclose(ours[fin].double(), ref_lse[fin], atol=1e-3, rtol=1e-4), f"sequence {i}: lse"
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert torch.allclose(s_dmask[i, :, :sq, :sk].abs().double(), ref_probs[i], atol=tol)
        assert (s_dmask[i, :, sq:] == 0).all() and (s_dmask[i, :, :, sk:] == 0).all()
    return q, k, v, cu_q, cu_k, max_q, max_k, out, dout, grads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths", ["mixed", "one", "long"])
def test_varlen_matches_reference(lengths, causal, dtype, device):
    if device == "cuda" and dtype == torch.float32:
        pytest.skip("the CUDA kernels take 16-bit inputs")
    check_varlen(LENGTHS[lengths], 4, 2, 64, dtype, device, causal=causal)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d", [32, 40, 64, 96, 128, 160, 192, 256])
@pytest.mark.parametrize("hk", [1, 3])
def test_varlen_head_dims_and_gqa(d, hk, device):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    check_varlen(LENGTHS["mixed"], 3, hk, d, dtype, device, causal=d % 64 == 0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window_size", [(16, 0), (5, 9), (-1, 3), (40, -1)])
def test_varlen_sliding_window(window_size, device):
    dtype = torch.float16 if device == "cuda" else torch.float32
    check_varlen(LENGTHS["long"], 2, 2, 64, dtype, device, window_size=window_size)


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_dropout_and_scale(device):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    check_varlen(LENGTHS["mixed"], 2, 1, 64, dtype, device, dropout_p=0.2, causal=True, softmax_scale=0.3)


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_deterministic(device):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    check_varlen(LENGTHS["long"], 4, 2, 128, dtype, device, deterministic=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_equals_each_sequence_alone(causal, device):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen(LENGTHS["mixed"] + LENGTHS["long"], 4, 2, 128, dtype, device)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for qi, ki, vi, oi, gq, gk, gv, di in zip(split(q, cu_q), split(k, cu_k), split(v, cu_k), split(out, cu_q),
                                              split(grads[0], cu_q), split(grads[1], cu_k), split(grads[2], cu_k),
                                              split(dout, cu_q)):
        if qi.shape[0] == 0:  # no query sees these keys
            assert not gk.any() and not gv.any()
            continue
        alone = flash_attn_func(qi[None], ki[None], vi[None], causal=causal)
        if qi.shape[0] == 1 and qi.shape[1] > ki.shape[1]:  # alone, one query under GQA runs folded: rows grouped
            torch.testing.assert_close(oi, alone[0], rtol=1e-6 if dtype == torch.float32 else 1e-2,
                                       atol=1e-6 if dtype == torch.float32 else 1e-2)
        else:
            assert torch.equal(oi, alone[0]), "the forward must match the sequence run alone bit for bit"
        ga = torch.autograd.grad(alone, (qi, ki, vi), di[None])
        for g, a in zip((gq, gk, gv), ga):  # dQ is summed with atomics on the GPU: close, not bitwise
            assert torch.allclose(g.float(), a.float(), atol=1e-2 if dtype != torch.float32 else 1e-5, rtol=1e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_packed_variants_match(device):
    dtype = torch.float16 if device == "cuda" else torch.float32
    lengths = [(s, s) for s, _ in LENGTHS["mixed"]]
    q, k, v, cu, _, max_s, _ = make_varlen(lengths, 4, 4, 64, dtype, device)
    ref = flash_attn_varlen_func(q, k, v, cu, cu, max_s, max_s, causal=True)
    qkv = torch.stack([q.detach(), k.detach(), v.detach()], dim=1)
    assert torch.equal(flash_attn_varlen_qkvpacked_func(qkv, cu, max_s, causal=True), ref)
    kv = torch.stack([k.detach(), v.detach()], dim=1)
    assert torch.equal(flash_attn_varlen_kvpacked_func(q.detach(), kv, cu, cu, max_s, max_s, causal=True), ref)


@pytest.mark.gpu
def test_varlen_decoding_shapes_split_keys():
    """Packed sequences of a few queries over many keys with few heads: the forward splits the keys
    over CTAs and merges them (empty sequences included); output and gradients as the reference's."""
    lengths = [(1, 3000), (5, 1800), (0, 700), (3, 0)]
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen(lengths, 2, 1, 64, torch.bfloat16, "cuda")
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref, _ = varlen_ref(q, k, v, cu_q, cu_k, causal=True)
    pt, _ = varlen_ref(q, k, v, cu_q, cu_k, upcast=False, causal=True)
    check_rule("out", out, ref, pt, torch.bfloat16)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout.double())
    pt_grads = torch.autograd.grad(pt, (q, k, v), dout)
    for name, g, rg, pg in zip(("dq", "dk", "dv"), grads, ref_grads, pt_grads):
        check_rule(name, g, rg, pg, torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_non_contiguous_inputs(device):
    dtype = torch.float16 if device == "cuda" else torch.float32
    lengths = LENGTHS["mixed"]
    lq, lk = sum(s for s, _ in lengths), sum(s for _, s in lengths)
    qkv = torch.randn(lq, 4, 3, 64, dtype=dtype, device=device)
    kv = torch.randn(lk, 2, 2, 64, dtype=dtype, device=device)
    q, k, v = qkv[:, :, 0], kv[:, :, 0], kv[:, :, 1]
    cu_q, cu_k = offsets([s for s, _ in lengths], device), offsets([s for _, s in lengths], device)
    mq, mk = max(s for s, _ in lengths), max(s for _, s in lengths)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk)
    ref = flash_attn_varlen_func(q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, mq, mk)
    assert torch.equal(out, ref)
    # A strided head dim runs on a contiguous copy, as in flash-attn 2.x.
    k_t = torch.randn(lk, 64, 2, dtype=dtype, device=device).transpose(1, 2)
    assert torch.equal(flash_attn_varlen_func(q, k_t, v, cu_q, cu_k, mq, mk),
                       flash_attn_varlen_func(q, k_t.contiguous(), v, cu_q, cu_k, mq, mk))


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_empty_batch_and_larger_max_seqlen(device):
    dtype = torch.float16 if device == "cuda" else torch.float32
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen(LENGTHS["mixed"], 2, 2, 32, dtype, device)
    # max_seqlen larger than needed only costs time
    a = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q + 300, max_k + 7)
    b = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k)
    assert torch.equal(a, b)
    # zero sequences
    z = torch.zeros(1, dtype=torch.int32, device=device)
    e = torch.randn(0, 2, 32, dtype=dtype, device=device)
    out = flash_attn_varlen_func(e, e, e, z, z, 0, 0)
    assert out.shape == (0, 2, 32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("empty", ["keys", "queries"])
@pytest.mark.parametrize("d", [64, 128])
def test_varlen_no_keys_or_no_queries_at_all_with_larger_max_seqlen(device, empty, d):
    # Every sequence without keys (or queries) while max_seqlen says 3: nothing for the TMA kernels'
    # descriptors to describe (an empty tensor once aborted the process there); rows give 0.
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    lq, lk = ([1, 2], [0, 0]) if empty == "keys" else ([0, 0], [3, 1])
    cu_q, cu_k = (torch.tensor([0] + lens, device=device).cumsum(0).int() for lens in (lq, lk))
    q = torch.randn(sum(lq), 4, d, dtype=dtype, device=device, requires_grad=True)
    k, v = (torch.randn(sum(lk), 2, d, dtype=dtype, device=device, requires_grad=True) for _ in range(2))
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 3, causal=True, return_attn_probs=True)
    assert out.shape == q.shape and (out == 0).all() and torch.isneginf(lse).all()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert (dq == 0).all() and (dk == 0).all() and (dv == 0).all()


def good_args(device="cpu"):
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen(LENGTHS["mixed"], 2, 2, 32, torch.float32, device)
    return dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k)


@pytest.mark.parametrize("change,message", [
    (dict(cu_seqlens_q=lambda a: a.long()), "cu_seqlens_q must be int32"),
    (dict(cu_seqlens_k=lambda a: a[:-1]), "must have the same length"),
    (dict(cu_seqlens_q=lambda a: a.flip(0)), r"cu_seqlens_q\[0\] must be 0"),
    (dict(cu_seqlens_k=lambda a: torch.cat([a[:2], a[1:2] - 1, a[3:]])), "non-decreasing"),
    (dict(cu_seqlens_q=lambda a: torch.cat([a[:-1], a[-1:] - 1])), "must equal q.size"),
    (dict(max_seqlen_q=lambda a: a - 1), "max_seqlen_q = .* is smaller than sequence"),
    (dict(max_seqlen_k=lambda a: -1), "must be >= 0"),
    (dict(q=lambda a: a[None]), "q must have shape \\(total, nheads, headdim\\)"),
    (dict(cu_seqlens_q=lambda a: a[:, None]), "1-D tensor"),
])
def test_varlen_errors(change, message):
    args = good_args()
    for name, f in change.items():
        args[name] = f(args[name])
    with pytest.raises(RuntimeError, match=message):
        flash_attn_varlen_func(**args)


def test_varlen_one_offsets_tensor_for_both_is_checked_against_each_total():
    # (The op reads a tensor passed as both offsets once; each check still names its side.)
    q, k, v = torch.randn(12, 2, 32), torch.randn(14, 2, 32), torch.randn(14, 2, 32)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"cu_seqlens_k\[-1\] must equal k.size\(0\) \(14\), got 12"):
        flash_attn_varlen_func(q, k, v, cu, cu, 7, 7)
    with pytest.raises(RuntimeError, match="max_seqlen_k = 6 is smaller than sequence 1's length 7"):
        flash_attn_varlen_func(q, k[:12], v[:12], cu, cu, 7, 6)


@pytest.mark.gpu
def test_varlen_offsets_read_with_one_sync_when_shared():
    from torch.profiler import ProfilerActivity, profile
    q = torch.randn(12, 2, 32, device="cuda", dtype=torch.float16)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32, device="cuda")
    flash_attn_varlen_func(q, q, q, cu, cu, 7, 7)  # (warm-up)
    copies = []
    for cu_k in (cu, cu.clone()):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            flash_attn_varlen_func(q, q, q, cu, cu_k, 7, 7)
            torch.cuda.synchronize()
        copies.append(sum("DtoH" in e.name for e in prof.events()))
    assert copies == [1, 2], copies  # device-to-host copies: one when the offsets are one tensor


def test_varlen_error_one_offsets_tensor_only():
    args = good_args()
    with pytest.raises(RuntimeError, match="must be given together"):
        torch.ops.flash_attn.fwd(args["q"], args["k"], args["v"], cu_seqlens_q=args["cu_seqlens_q"],
                                 max_seqlen_q=args["max_seqlen_q"], max_seqlen_k=args["max_seqlen_k"])


def test_varlen_error_with_block_mask():
    args = good_args()
    layout = torch.ones(1, 1, 2, 2, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="cannot be combined with cu_seqlens"):
        torch.ops.flash_attn.fwd(args["q"], args["k"], args["v"], block_layout=layout,
                                 q_block_lists=torch.zeros(1, 1, 2, 3, dtype=torch.int32),
                                 k_block_lists=torch.zeros(1, 1, 2, 3, dtype=torch.int32),
                                 cu_seqlens_q=args["cu_seqlens_q"], cu_seqlens_k=args["cu_seqlens_k"],
                                 max_seqlen_q=args["max_seqlen_q"], max_seqlen_k=args["max_seqlen_k"])


def test_varlen_error_bwd_lse_shape():
    a = good_args()
    out, lse, _, _ = torch.ops.flash_attn.fwd(a["q"], a["k"], a["v"], cu_seqlens_q=a["cu_seqlens_q"],
                                              cu_seqlens_k=a["cu_seqlens_k"], max_seqlen_q=a["max_seqlen_q"],
                                              max_seqlen_k=a["max_seqlen_k"])
    with pytest.raises(RuntimeError, match=r"softmax_lse must have shape \(nheads, total_q\)"):
        torch.ops.flash_attn.bwd(out, a["q"], a["k"], a["v"], out, lse[None], cu_seqlens_q=a["cu_seqlens_q"],
                                 cu_seqlens_k=a["cu_seqlens_k"], max_seqlen_q=a["max_seqlen_q"],
                                 max_seqlen_k=a["max_seqlen_k"])


@pytest.mark.parametrize("return_softmax", [False, True])
def test_varlen_opcheck(return_softmax):
    a = good_args()
    q, k, v = (a[n].detach() for n in "qkv")
    vl = (a["cu_seqlens_q"], a["cu_seqlens_k"], a["max_seqlen_q"], a["max_seqlen_k"])
    torch.library.opcheck(torch.ops.flash_attn.fwd.default,
                          (q, k, v, 0.0, None, True, -1, -1, return_softmax, False, None, None, None, *vl))
    out, lse, _, rng = torch.ops.flash_attn.fwd(q, k, v, 0.0, None, True, -1, -1, False, False, None, None, None, *vl)
    torch.library.opcheck(torch.ops.flash_attn.bwd.default,
                          (torch.randn_like(out), q, k, v, out, lse, 0.0, None, True, -1, -1, False, rng, None, None,
                           None, *vl))


class PackedSelfAttention(torch.nn.Module):
    """A padded batch turned into packed sequences inside the graph: cu_seqlens is data-dependent,
    max_seqlen a Python int argument."""

    def __init__(self, dim=32, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)

    def forward(self, x, lengths, max_seqlen: int):
        cu = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
        qkv = self.qkv(x).view(x.shape[0], 3, self.heads, -1)
        out = flash_attn_varlen_qkvpacked_func(qkv, cu, max_seqlen, causal=True)
        return out.reshape(x.shape[0], -1)


def test_varlen_compile_fullgraph():
    torch._dynamo.reset()
    model = PackedSelfAttention()
    lengths = torch.tensor([5, 0, 9, 2])
    x = torch.randn(int(lengths.sum()), 32, requires_grad=True)
    eager = model(x, lengths, 9)
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(x, lengths, 9)
    assert torch.allclose(out, eager, atol=1e-5)
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_varlen_compile_does_not_recompile_for_each_longest_length():
    # max_seqlen is a SymInt in the ops' schema: batches whose longest sequence differs (every
    # step of a varlen training loop) share one graph once dynamo has seen two of them.
    torch._dynamo.reset()
    backend, graphs = graph_counting_backend()

    model = PackedSelfAttention()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    for lengths in ([5, 0, 9], [7, 20, 3], [30, 1, 2], [3, 4, 11], [16, 16, 2]):
        lengths = torch.tensor(lengths)
        x = torch.randn(int(lengths.sum()), 32, requires_grad=True)
        out = compiled(x, lengths, int(lengths.max()))
        grad = torch.autograd.grad(out.sum(), x)[0]
        x_eager = x.detach().requires_grad_()
        eager = model(x_eager, lengths, int(lengths.max()))
        torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grad, torch.autograd.grad(eager.sum(), x_eager)[0], atol=1e-5, rtol=1e-5)
    assert len(graphs) <= 2, f"{len(graphs)} graphs for 5 batches"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
def test_padded_batch_through_unpad_matches_masked_reference(causal, device):
    """A padded batch with a key padding mask, run as unpad_input -> varlen -> pad_input, equals
    attention on the padded batch with the padding masked out (padded query rows give 0)."""
    from flash_attn.bert_padding import pad_input, unpad_input
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    b, s, h, d = 4, 150, 2, 64
    lengths = torch.tensor([150, 1, 77, 0])
    mask = torch.arange(s)[None, :] < lengths[:, None]
    x = torch.randn(b, s, 3, h, d, dtype=dtype, device=device)
    packed, indices, cu, max_s, _ = unpad_input(x.flatten(2), mask.to(device))
    packed = packed.view(-1, 3, h, d)
    out = pad_input(flash_attn_varlen_qkvpacked_func(packed, cu, max_s, causal=causal), indices, b, s)
    # Reference: each row sees its sequence's keys only, top-left aligned as each sequence is alone.
    ref_rows = []
    for i in range(b):
        n = int(lengths[i])
        r, _ = attention_ref(x[i:i + 1, :n, 0], x[i:i + 1, :n, 1], x[i:i + 1, :n, 2], causal=causal)
        ref_rows.append(torch.nn.functional.pad(r[0], (0, 0, 0, 0, 0, s - n)))
    ref = torch.stack(ref_rows)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out.double(), ref, atol=tol, rtol=tol)
    assert (out[~mask.to(device)] == 0).all()


def test_varlen_backward_op_checks_offsets_outside_autograd():
    """The autograd backward trusts the offsets its forward checked; a direct call of the backward
    op (after an autograd backward on the same thread) still checks them."""
    a = good_args()
    out = flash_attn_varlen_func(**a)
    out.sum().backward()
    q, k, v = (a[n].detach() for n in "qkv")
    out, lse, _, _ = torch.ops.flash_attn.fwd(q, k, v, cu_seqlens_q=a["cu_seqlens_q"], cu_seqlens_k=a["cu_seqlens_k"],
                                              max_seqlen_q=a["max_seqlen_q"], max_seqlen_k=a["max_seqlen_k"])
    with pytest.raises(RuntimeError, match="is smaller than sequence"):
        torch.ops.flash_attn.bwd(out, q, k, v, out, lse, cu_seqlens_q=a["cu_seqlens_q"],
                                 cu_seqlens_k=a["cu_seqlens_k"], max_seqlen_q=a["max_seqlen_q"] - 1,
                                 max_seqlen_k=a["max_seqlen_k"])
