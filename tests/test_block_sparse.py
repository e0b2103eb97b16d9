"""Block-sparse attention (CPU always; CUDA on the device) against the float64 reference with the
element-wise mask the block layout expands to: output, logsumexp and every gradient."""

import dataclasses
import math

import pytest
import torch

from flash_attn import BlockSparseMask, flash_attn_blocksparse_func, flash_attn_blocksparse_qkvpacked_func
from flash_attn import flash_attn_func
from flash_attn.block_sparse import BLOCK_SIZE, butterfly_layout, local_layout, random_layout
from flash_attn.modules import BlockSparseMultiheadAttention
from reference import attention_ref, check_grads_against_reference, poison_allocator, visible_mask

CUDA = pytest.param("cuda", marks=pytest.mark.gpu)
DEVICES = ["cpu", CUDA]


def dtypes_of(device):
    return [torch.float32, torch.bfloat16] if device == "cpu" else [torch.float16, torch.bfloat16]


def blocks(n):
    return (n + BLOCK_SIZE - 1) // BLOCK_SIZE


def random_mask(b, h, sq, sk, density=0.4, empty_row=True, device="cpu"):
    """A random layout over (b, h), with (when there are two or more query blocks) one query block
    that keeps nothing, so its rows must give 0."""
    layout = torch.rand(b, h, blocks(sq), blocks(sk)) < density
    if empty_row and blocks(sq) > 1:
        layout[..., 1, :] = False
    return BlockSparseMask.from_layout(layout, sq, sk).to(device)


def make(b, sq, sk, h, hk, d, dtype, device):
    return [torch.randn(b, s, n, d, dtype=dtype, device=device, requires_grad=True)
            for s, n in ((sq, h), (sk, hk), (sk, hk))]


def check(q, k, v, mask, causal=False, dropout_p=0.0, deterministic=False, window_size=(-1, -1)):
    out, lse, s_dmask = flash_attn_blocksparse_func(q, k, v, mask, dropout_p=dropout_p, causal=causal,
                                                    window_size=window_size, deterministic=deterministic,
                                                    return_attn_probs=True)
    keep = None if dropout_p == 0 else ~torch.signbit(s_dmask)
    dout = torch.randn_like(out)
    if q.is_cuda:
        poison_allocator()
    grads = torch.autograd.grad(out, (q, k, v), dout)
    dense = mask.dense().to(q.device)
    ref_probs = check_grads_against_reference(q, k, v, out, dout, grads, q.dtype, causal=causal,
                                              window_size=window_size, dropout_p=dropout_p, keep_mask=keep,
                                              attn_mask=dense)
    # The logsumexp of the reference's masked scores; -inf exactly where a row sees nothing.
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = torch.einsum("bihd,bjhd->bhij", q.double() * scale,
                          k.double().repeat_interleave(q.shape[2] // k.shape[2], dim=2))
    ok = visible_mask(q.shape[1], k.shape[1], causal, window_size, q.device) & dense
    ref_lse = scores.masked_fill(~ok, float("-inf")).logsumexp(-1)
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), "lse must be -inf exactly for rows that see nothing"
    assert torch.all((lse.double() - ref_lse)[~empty].abs() < 1e-2)
    assert torch.all(out.permute(0, 2, 1, 3)[empty] == 0), "rows that see nothing must give 0"
    assert torch.all(grads[0].permute(0, 2, 1, 3)[empty] == 0)
    if dropout_p == 0.0:  # the probabilities it returns are the reference's, zero outside the mask
        tol = 2e-3 if q.dtype == torch.float32 else 2e-2
        assert (s_dmask.double() - ref_probs).abs().max().item() < tol
    return out, grads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(1, 1), (128, 128), (300, 453), (453, 300), (700, 257), (1000, 1000)])
def test_matches_masked_dense(device, sq, sk, causal):
    for dtype in dtypes_of(device):
        check(*make(2, sq, sk, 4, 2, 64, dtype, device), random_mask(2, 4, sq, sk, device=device), causal=causal)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d", [32, 64, 96, 128, 160, 192, 256])
def test_head_dims(device, d):
    # 96 and 160: the sm90 forward with the portable backward; 192/256: the split-d sm90 backward.
    dtype = torch.bfloat16
    for causal in (False, True):
        check(*make(1, 517, 700, 2, 1, d, dtype, device), random_mask(1, 2, 517, 700, device=device), causal=causal)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout_batch,layout_heads", [(1, 1), (2, 1), (1, 4), (2, 4)])
def test_broadcast_over_batch_and_heads(device, layout_batch, layout_heads):
    dtype = dtypes_of(device)[-1]
    mask = random_mask(layout_batch, layout_heads, 384, 384, density=0.5, device=device)
    check(*make(2, 384, 384, 4, 4, 64, dtype, device), mask)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hk", [1, 2, 8])
def test_gqa(device, hk):
    check(*make(2, 300, 650, 8, hk, 64, dtypes_of(device)[-1], device), random_mask(2, 8, 300, 650, device=device),
          causal=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
def test_dropout(device, causal):
    for d in (64, 128, 256):
        check(*make(2, 333, 521, 4, 2, d, dtypes_of(device)[-1], device), random_mask(2, 4, 333, 521, device=device),
              causal=causal, dropout_p=0.17)


@pytest.mark.parametrize("device", DEVICES)
def test_window_on_top_of_the_mask(device):
    check(*make(1, 600, 600, 2, 2, 64, dtypes_of(device)[-1], device), random_mask(1, 2, 600, 600, 0.6, device=device),
          window_size=(150, 20))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal,window_size", [(False, (-1, -1)), (True, (-1, -1)), (False, (300, 100))])
@pytest.mark.parametrize("layout_batch,layout_heads", [(2, 4), (1, 1)])
def test_deterministic_backward(device, d, causal, window_size, layout_batch, layout_heads):
    # On Hopper the sm90 kernel orders dQ's additions over the kept key blocks only (the turns
    # count them in the mask's rows); elsewhere the dQ kernel runs.
    q, k, v = make(2, 500, 1400, 4, 2, d, dtypes_of(device)[-1], device)
    mask = random_mask(layout_batch, layout_heads, 500, 1400, device=device)
    kw = dict(causal=causal, window_size=window_size, deterministic=True)
    check(q, k, v, mask, **kw)
    out = flash_attn_blocksparse_func(q, k, v, mask, **kw)
    again = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    twice = torch.autograd.grad(flash_attn_blocksparse_func(q, k, v, mask, **kw), (q, k, v), torch.ones_like(out))
    for a, b in zip(again, twice):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("through_the_mask", [False, True])
def test_full_layout_equals_dense(device, through_the_mask):
    # A full layout runs the dense kernels (full=True, what from_layout sets); through the mask
    # (full=False) the sparse kernels visit the dense tiles in the dense order: identical results.
    q, k, v = make(2, 333, 777, 4, 2, 64, dtypes_of(device)[0], device)
    full = BlockSparseMask.from_layout(torch.ones(blocks(333), blocks(777), dtype=torch.bool), 333, 777).to(device)
    assert full.full and not BlockSparseMask.from_layout(torch.eye(3, 7, dtype=torch.bool), 333, 777).full
    if through_the_mask:
        full = dataclasses.replace(full, full=False)
    for causal in (False, True):
        ours = flash_attn_blocksparse_func(q, k, v, full, causal=causal, deterministic=True)
        dense = flash_attn_func(q, k, v, causal=causal, deterministic=True)
        g1 = torch.autograd.grad(ours, (q, k, v), torch.ones_like(ours))
        g2 = torch.autograd.grad(dense, (q, k, v), torch.ones_like(dense))
        for a, b in zip((ours,) + g1, (dense,) + g2):
            if device == "cuda" or not through_the_mask:
                assert torch.equal(a, b)
            else:  # the CPU tiles a masked call at 128 x 128, its dense one at 256 x 512: close, not equal
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal,window_size", [(False, (-1, -1)), (True, (-1, -1)), (False, (200, 90))])
def test_runs_of_consecutive_blocks(device, causal, window_size):
    # A row whose kept blocks are consecutive walks them as a plain range, cut by causal and the
    # window: runs at the start, the middle, the end, of one block, of every block, and past the
    # causal diagonal; the rest of the rows keep scattered blocks, so both walks meet in one call.
    sq, sk = 1000, 900
    layout = torch.zeros(blocks(sq), blocks(sk), dtype=torch.bool)
    runs = [(0, 3), (2, 5), (4, 8), (7, 8), (0, 8), (5, 6), (3, 8)]
    for qb, (lo, hi) in enumerate(runs):
        layout[qb, lo:hi] = True
    layout[len(runs), ::2] = True
    check(*make(1, sq, sk, 2, 1, 64, dtypes_of(device)[-1], device),
          BlockSparseMask.from_layout(layout, sq, sk).to(device), causal=causal, window_size=window_size)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_layout_gives_zeros(device):
    q, k, v = make(1, 300, 300, 2, 2, 64, dtypes_of(device)[-1], device)
    empty = BlockSparseMask.from_layout(torch.zeros(3, 3, dtype=torch.bool), 300, 300).to(device)
    out, lse, _ = flash_attn_blocksparse_func(q, k, v, empty, return_attn_probs=True)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))
    for g in torch.autograd.grad(out, (q, k, v), torch.randn_like(out)):
        assert torch.all(g == 0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pattern", ["butterfly", "local_causal", "random"])
def test_pattern_builders_run_through_the_kernels(device, pattern):
    n = 1000
    nb = blocks(n)
    layout = {"butterfly": butterfly_layout(nb), "local_causal": local_layout(nb, nb, 2, causal=True),
              "random": random_layout(nb, nb, 0.3, seed=3)}[pattern]
    check(*make(1, n, n, 2, 2, 64, dtypes_of(device)[-1], device),
          BlockSparseMask.from_layout(layout, n, n).to(device), causal=pattern == "local_causal")


@pytest.mark.parametrize("device", DEVICES)
def test_layout_tensor_and_packed_variant(device):
    qkv = torch.randn(2, 260, 3, 4, 64, dtype=dtypes_of(device)[-1], device=device)
    layout = torch.rand(blocks(260), blocks(260)) < 0.5
    layout[0, 0] = True
    mask = BlockSparseMask.from_layout(layout, 260, 260).to(device)
    a = flash_attn_blocksparse_qkvpacked_func(qkv, mask, causal=True)
    b = flash_attn_blocksparse_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], layout.to(device), causal=True)
    assert torch.equal(a, b)


def test_bad_masks_get_clear_errors():
    q, k, v = make(2, 300, 300, 4, 4, 64, torch.float32, "cpu")
    good = torch.ones(3, 3, dtype=torch.bool)
    with pytest.raises(TypeError, match="bool"):
        flash_attn_blocksparse_func(q, k, v, good.int())
    with pytest.raises(ValueError, match="3 x 3 blocks"):
        flash_attn_blocksparse_func(q, k, v, torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="built for seqlen_q=256"):
        flash_attn_blocksparse_func(q, k, v, BlockSparseMask.from_layout(torch.ones(2, 2, dtype=torch.bool), 256, 256))
    with pytest.raises(RuntimeError, match="batch and head dims"):
        flash_attn_blocksparse_func(q, k, v, torch.ones(3, 3, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="BlockSparseMask"):
        flash_attn_blocksparse_func(q, k, v, [[True]])
    mask = BlockSparseMask.from_layout(good, 300, 300)
    with pytest.raises(RuntimeError, match="q_block_lists must be Int"):
        torch.ops.flash_attn.fwd(q, k, v, 0.0, None, False, -1, -1, False, False, mask.layout,
                                 mask.q_lists.long(), mask.k_lists)
    with pytest.raises(RuntimeError, match="needs q_block_lists and k_block_lists"):
        torch.ops.flash_attn.fwd(q, k, v, 0.0, None, False, -1, -1, False, False, mask.layout, None, None)


@pytest.mark.gpu
def test_mask_on_the_wrong_device_is_an_error():
    q, k, v = make(1, 256, 256, 2, 2, 64, torch.bfloat16, "cuda")
    mask = BlockSparseMask.from_layout(torch.ones(2, 2, dtype=torch.bool), 256, 256)
    with pytest.raises(RuntimeError, match="block_layout must be on the device of q"):
        flash_attn_blocksparse_func(q, k, v, mask)


def test_opcheck_with_a_block_mask():
    q, k, v = make(2, 300, 260, 4, 2, 32, torch.float32, "cpu")
    mask = random_mask(2, 1, 300, 260)
    masks = (mask.layout, mask.q_lists, mask.k_lists)
    torch.library.opcheck(torch.ops.flash_attn.fwd.default,
                          (q, k, v, 0.0, None, True, -1, -1, False, False) + masks)
    with torch.no_grad():
        out, lse, _, rng = torch.ops.flash_attn.fwd(q, k, v, 0.0, None, True, -1, -1, False, False, *masks)
    torch.library.opcheck(torch.ops.flash_attn.bwd.default,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, 0.0, None, True,
                           -1, -1, False, rng) + masks)


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    q, k, v = make(1, 260, 260, 2, 2, 32, torch.float32, "cpu")
    mask = random_mask(1, 2, 260, 260, density=0.7)

    def f(q, k, v):
        return flash_attn_blocksparse_func(q, k, v, mask, causal=True).square().sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    want = torch.autograd.grad(f(q, k, v), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("pattern,options", [("local", dict(window_blocks=1, causal=True)), ("butterfly", {}),
                                             ("global_local", dict(window_blocks=1, global_blocks=1)),
                                             ("random", dict(density=0.5, seed=1))])
def test_block_sparse_layer(pattern, options):
    layer = BlockSparseMultiheadAttention(64, 4, pattern=pattern, pattern_options=options)
    x = torch.randn(2, 600, 64, requires_grad=True)
    y = layer(x)
    mask = layer.mask_for(600, x.device)
    assert mask is layer.mask_for(600, x.device), "masks are cached per sequence length"
    q, k, v = layer.Wqkv(x).view(2, 600, 3, 4, 16).unbind(2)
    ref, _ = attention_ref(q, k, v, attn_mask=mask.dense())
    torch.testing.assert_close(y, layer.out_proj(ref.float().reshape(2, 600, 64)), atol=1e-4, rtol=1e-4)
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
