"""Seeded random combinations of every feature against the float64 reference: shapes (odd, sq != sk,
GQA, every head dim, strided inputs), causal, windows, ALiBi, soft-capping, float and bool biases,
dropout and deterministic backward, for the dense, varlen, block-sparse and KV-cache paths. The
parametrized tests each cover one feature on its own or in fixed pairs; these draw the pairings
nobody wrote down. Case i uses random.Random(i + FLASH_ATTN_TEST_SEED); a failure prints the
drawn case. CPU runs a few per path; CUDA (marked gpu) many more, with longer sequences."""

import os
import random

import pytest
import torch

from flash_attn import BlockSparseMask, flash_attn_blocksparse_func, flash_attn_func, flash_attn_varlen_func
from reference import attention_ref, check_rule, output_rounding_term, poison_allocator
from test_kvcache import check_kvcache

OFFSET = int(os.environ.get("FLASH_ATTN_TEST_SEED", "0"))
CASES = {"cpu": 24, "cuda": 80}
HEAD_DIMS = {"cpu": [8, 16, 40, 64, 72, 128, 256], "cuda": [32, 40, 64, 96, 128, 160, 192, 224, 256]}
# Lengths around the kernels' tiles (64, 128, 176, 192 rows) and, on CUDA, long enough for
# several tiles per CTA, split and persistent schedules.
SEQLENS = {"cpu": [1, 2, 7, 64, 127, 129, 200, 300],
           "cuda": [1, 2, 7, 64, 127, 129, 176, 193, 300, 640, 1000, 2100]}


def cases(device):
    return [pytest.param(device, i, id=f"{device}-{i}", marks=[pytest.mark.gpu] if device == "cuda" else [])
            for i in range(CASES[device])]


ALL = cases("cpu") + cases("cuda")


def draw_dtype(rng, device):
    return rng.choice([torch.float32, torch.float32, torch.bfloat16]) if device == "cpu" else \
        rng.choice([torch.float16, torch.bfloat16])


def draw_mods(rng, b, h, d, device, window_sizes=(-1, 0, 5, 63, 200)):
    """causal, window_size, softcap, alibi_slopes and softmax_scale, each present or not."""
    kw = {}
    if rng.random() < 0.4:
        kw["causal"] = True
    if rng.random() < 0.3:
        kw["window_size"] = (rng.choice(window_sizes), rng.choice([-1, 0, 3, 100]))
    if rng.random() < 0.3:
        kw["softcap"] = rng.choice([1.0, 5.0, 30.0])
    if rng.random() < 0.3:
        kw["alibi_slopes"] = torch.rand((b, h) if rng.random() < 0.5 else (h,), device=device) * 0.5
    if rng.random() < 0.3:  # (a multiple of the default: much larger makes rows one-hot)
        kw["softmax_scale"] = rng.choice([0.25, 0.6, 2.0]) / d ** 0.5
    return kw


def describe(**kw):
    return ", ".join(f"{k}={tuple(v.shape) if torch.is_tensor(v) else v}" for k, v in kw.items())


def strided(x, rng):
    """x itself, or the same values in another memory order (the head dim strided too, sometimes)."""
    if rng.random() < 0.6:
        return x
    perm = list(range(x.dim()))
    rng.shuffle(perm)
    return x.permute(*perm).contiguous().permute(*[perm.index(i) for i in range(x.dim())])


def check_against_reference(case, out, inputs, dout, ref_fn, term_fn, dtype, names=("dq", "dk", "dv", "dbias")):
    """out and the gradients of inputs against ref_fn(upcast) in float64 and in the same precision;
    term_fn(out, ref) is the output_rounding_term whose gradients the backward may add."""
    if out.is_cuda:
        poison_allocator()
    grads = torch.autograd.grad(out, inputs, dout)
    ref = ref_fn(True)
    ref_grads = torch.autograd.grad(ref, inputs, dout.double(), retain_graph=True)
    pt = ref_fn(False)
    pt_grads = torch.autograd.grad(pt, inputs, dout)
    inherited_grads = torch.autograd.grad(term_fn(out, ref), inputs, allow_unused=True)
    try:
        if out.numel():
            check_rule("out", out, ref, pt, dtype)
        for name, g, rg, pg, ig, x in zip(names, grads, ref_grads, pt_grads, inherited_grads, inputs):
            assert g.shape == x.shape and g.dtype == x.dtype, f"{name}: {g.shape} {g.dtype}"
            if not g.numel():
                continue
            inherited = 0.0 if ig is None else ig.abs().max().item()
            if not rg.any() and not pg.any():
                # Exactly 0 (every row sees one key): PyTorch's softmax backward cancels exactly,
                # ours to the rounding of two sums of dO * V taken in different orders.
                assert g.abs().max() <= 1e-3 + inherited, f"{name} should be 0, got {g.abs().max():.3g}"
            else:
                check_rule(name, g, rg, pg, dtype, inherited)
    except AssertionError as e:
        raise AssertionError(f"{e} ({case})") from None


@pytest.mark.parametrize("device, index", ALL)
def test_dense(device, index):
    rng = random.Random(index + OFFSET)
    dtype = draw_dtype(rng, device)
    hk = rng.choice([1, 2, 3])
    b, h, d = rng.choice([1, 2, 3]), hk * rng.choice([1, 2, 4]), rng.choice(HEAD_DIMS[device])
    sq, sk = rng.choice(SEQLENS[device]), rng.choice(SEQLENS[device] + [513])
    kw = draw_mods(rng, b, h, d, device)
    if rng.random() < 0.3:
        # Every broadcast form but the scalar, whose gradient cancels to 0 over all rows.
        shape = rng.choice([(b, h, sq, sk), (1, h, sq, sk), (b, 1, 1, sk), (b, h, sq, 1), (sq, sk), (h, 1, sk),
                            (sk,)])
        if rng.random() < 0.5:
            kw["attn_bias"] = torch.rand(shape, device=device) < 0.7
        else:
            kw["attn_bias"] = (torch.randn(shape, device=device) * 2).to(dtype).requires_grad_(rng.random() < 0.5)
    dropout_p = rng.choice([0.0, 0.0, 0.0, 0.1, 0.5])
    deterministic = rng.random() < 0.3
    q, k, v = (strided(torch.randn(b, s, n, d, dtype=dtype, device=device), rng).requires_grad_()
               for s, n in ((sq, h), (sk, hk), (sk, hk)))
    case = describe(dtype=dtype, b=b, sq=sq, sk=sk, h=h, hk=hk, d=d, dropout_p=dropout_p,
                    deterministic=deterministic, **kw)
    if device == "cuda":
        poison_allocator()
    out, _, s_dmask = flash_attn_func(q, k, v, dropout_p=dropout_p, deterministic=deterministic,
                                      return_attn_probs=True, **kw)
    keep = None if dropout_p == 0 else ~torch.signbit(s_dmask)
    bias = kw.get("attn_bias")
    inputs = [q, k, v] + ([bias] if bias is not None and bias.requires_grad else [])
    dout = torch.randn_like(out)
    check_against_reference(case, out, inputs, dout, lambda upcast: attention_ref(
        q, k, v, keep_mask=keep, dropout_p=dropout_p, upcast=upcast, **kw)[0],
        lambda out, ref: output_rounding_term(q, k, out, ref, dout, **kw), dtype)


@pytest.mark.parametrize("device, index", ALL)
def test_varlen(device, index):
    rng = random.Random(index + OFFSET)
    dtype = draw_dtype(rng, device)
    batch = rng.choice([1, 2, 3, 5])
    lengths = [(rng.choice(SEQLENS[device] + [0]), rng.choice(SEQLENS[device] + [0])) for _ in range(batch)]
    hk = rng.choice([1, 2])
    h, d = hk * rng.choice([1, 2, 3]), rng.choice(HEAD_DIMS[device])
    kw = draw_mods(rng, batch, h, d, device)
    dropout_p = rng.choice([0.0, 0.0, 0.0, 0.2])
    deterministic = rng.random() < 0.3
    lq, lk = [s for s, _ in lengths], [s for _, s in lengths]
    q = torch.randn(sum(lq), h, d, dtype=dtype, device=device, requires_grad=True)
    k, v = (torch.randn(sum(lk), hk, d, dtype=dtype, device=device, requires_grad=True) for _ in range(2))
    cu_q, cu_k = (torch.tensor([0] + lens, device=device).cumsum(0).int() for lens in (lq, lk))
    max_q, max_k = max(lq) + rng.choice([0, 0, 5]), max(lk) + rng.choice([0, 0, 3])  # (an upper bound is fine)
    case = describe(dtype=dtype, lengths=lengths, h=h, hk=hk, d=d, dropout_p=dropout_p,
                    deterministic=deterministic, **kw)
    if device == "cuda":
        poison_allocator()
    out, _, s_dmask = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=dropout_p,
                                             deterministic=deterministic, return_attn_probs=True, **kw)
    keep = None if dropout_p == 0 else ~torch.signbit(s_dmask)

    def sequences():  # (query rows, key rows, the sequence's own keyword arguments)
        slopes = kw.get("alibi_slopes")
        for i in range(batch):
            kwi = dict(kw, alibi_slopes=slopes[i] if slopes is not None and slopes.dim() == 2 else slopes)
            yield i, slice(sum(lq[:i]), sum(lq[:i + 1])), slice(sum(lk[:i]), sum(lk[:i + 1])), kwi

    def reference(upcast):  # each sequence alone, packed again
        return torch.cat([attention_ref(q[rq][None], k[rk][None], v[rk][None], upcast=upcast, dropout_p=dropout_p,
                                        keep_mask=None if keep is None else keep[i:i + 1, :, :lq[i], :lk[i]],
                                        **kwi)[0][0] for i, rq, rk, kwi in sequences()])

    def term(out, ref):
        return sum(output_rounding_term(q[rq][None], k[rk][None], out[rq][None], ref[rq][None], dout[rq][None], **kwi)
                   for _, rq, rk, kwi in sequences())

    dout = torch.randn_like(out)
    check_against_reference(case, out, [q, k, v], dout, reference, term, dtype)


@pytest.mark.parametrize("device, index", ALL)
def test_block_sparse(device, index):
    rng = random.Random(index + OFFSET)
    dtype = draw_dtype(rng, device)
    hk = rng.choice([1, 2])
    b, h, d = rng.choice([1, 2]), hk * rng.choice([1, 2]), rng.choice(HEAD_DIMS[device])
    sq, sk = rng.choice(SEQLENS[device]), rng.choice(SEQLENS[device] + [513])
    layout_shape = (rng.choice([1, b]), rng.choice([1, h]), (sq + 127) // 128, (sk + 127) // 128)
    density = rng.choice([0.2, 0.5, 0.9])
    mask = BlockSparseMask.from_layout(torch.rand(layout_shape) < density, sq, sk).to(device)
    kw = draw_mods(rng, b, h, d, device, window_sizes=(-1, 0, 5, 130))
    if rng.random() < 0.3:
        shape = rng.choice([(b, h, sq, sk), (1, h, sq, sk), (b, 1, 1, sk), (sq, sk)])
        kw["attn_bias"] = torch.rand(shape, device=device) < 0.7 if rng.random() < 0.5 else \
            (torch.randn(shape, device=device) * 2).to(dtype).requires_grad_(rng.random() < 0.5)
    dropout_p = rng.choice([0.0, 0.0, 0.2])
    deterministic = rng.random() < 0.3
    q, k, v = (torch.randn(b, s, n, d, dtype=dtype, device=device, requires_grad=True)
               for s, n in ((sq, h), (sk, hk), (sk, hk)))
    case = describe(dtype=dtype, b=b, sq=sq, sk=sk, h=h, hk=hk, d=d, layout=layout_shape, density=density,
                    dropout_p=dropout_p, deterministic=deterministic, **kw)
    if device == "cuda":
        poison_allocator()
    out, _, s_dmask = flash_attn_blocksparse_func(q, k, v, mask, dropout_p=dropout_p, deterministic=deterministic,
                                                  return_attn_probs=True, **kw)
    keep = None if dropout_p == 0 else ~torch.signbit(s_dmask)
    dense = mask.dense().to(device)
    bias = kw.get("attn_bias")
    inputs = [q, k, v] + ([bias] if bias is not None and bias.requires_grad else [])
    dout = torch.randn_like(out)
    check_against_reference(case, out, inputs, dout, lambda upcast: attention_ref(
        q, k, v, keep_mask=keep, dropout_p=dropout_p, upcast=upcast, attn_mask=dense, **kw)[0],
        lambda out, ref: output_rounding_term(q, k, out, ref, dout, attn_mask=dense, **kw), dtype)


@pytest.mark.parametrize("device, index", ALL)
def test_kvcache(device, index):
    rng = random.Random(index + OFFSET)
    hk = rng.choice([1, 2, 4])
    b, h, d = rng.choice([1, 2, 3, 4]), hk * rng.choice([1, 2, 4, 8]), rng.choice(HEAD_DIMS[device][1:])
    rows = rng.choice([20, 130, 300, 700] + ([2100] if device == "cuda" else []))
    new = min(rng.choice([0, 0, 1, 1, 3, 8]), rows)
    queries = rng.choice([1, 1, 2, 5, 65]) if new == 0 else rng.choice([1, new])
    by_index = rng.random() < 0.3
    entries = b + (rng.choice([0, 2]) if by_index else 0)
    batch_idx = rng.sample(range(entries), b) if by_index else None
    seqlens = [rng.randint(0, rows - new) for _ in range(b)]
    leftpad = [rng.randint(0, s) for s in seqlens] if rng.random() < 0.3 else None
    kw = dict(causal=rng.random() < 0.5, num_splits=rng.choice([0, 0, 1, 3]))
    if rng.random() < 0.3:
        kw["window_size"] = (rng.choice([-1, 0, 8, 100]), rng.choice([-1, 0, 2]))
    if rng.random() < 0.3:
        kw["alibi"] = True
    if rng.random() < 0.3:
        kw["softcap"] = rng.choice([2.0, 20.0])
    if rng.random() < 0.3:
        kw["softmax_scale"] = rng.choice([0.25, 2.0]) / d ** 0.5
    if new and rng.random() < 0.3:
        kw["rotary"] = rng.random() < 0.5  # (interleaved or not)
    if batch_idx is None and leftpad is None and rng.random() < 0.4:  # a paged cache (its rows a whole table)
        kw["page"] = rng.choice([256, 512])
        rows = kw["page"] * rng.choice([1, 2, 3])
        seqlens = [rng.randint(0, rows - new) for _ in range(b)]
    args = dict(b=b, entries=entries, rows=rows, sq=queries, sn=new, h=h, hk=hk, d=d, seqlens=seqlens,
                leftpad=leftpad, batch_idx=batch_idx, **kw)
    try:
        check_kvcache(device, **args)
    except AssertionError as e:
        raise AssertionError(f"{e} ({describe(**args)})") from None
