"""Block masks and pattern builders of flash_attn.block_sparse (no kernels involved)."""

import math

import pytest
import torch

from flash_attn.block_sparse import (BLOCK_SIZE, BlockSparseMask, butterfly_layout, coarsen_mask, expand_layout,
                                     global_local_layout, local_layout, random_layout)


def brute_force_lists(kept):
    counts = kept.sum(-1).to(torch.int32)
    idx = torch.full(kept.shape, -1, dtype=torch.int32)
    for pos in torch.cartesian_prod(*[torch.arange(n) for n in kept.shape[:-1]]).tolist():
        nz = kept[tuple(pos)].nonzero().flatten()
        idx[tuple(pos)][: len(nz)] = nz.to(torch.int32)
    return counts, idx


@pytest.mark.parametrize("sq,sk", [(1000, 1000), (1, 700), (513, 129), (128, 256)])
def test_index_lists_and_transpose(sq, sk):
    g = torch.Generator().manual_seed(sq + sk)
    layout = torch.rand(2, 3, math.ceil(sq / 128), math.ceil(sk / 128), generator=g) < 0.4
    mask = BlockSparseMask.from_layout(layout, sq, sk)
    counts, idx = brute_force_lists(layout)
    assert torch.equal(mask.q_counts, counts) and torch.equal(mask.q_indices, idx)
    counts_t, idx_t = brute_force_lists(layout.transpose(-1, -2))
    assert torch.equal(mask.k_counts, counts_t) and torch.equal(mask.k_indices, idx_t)
    assert mask.q_indices.dtype == torch.int32 and mask.k_counts.dtype == torch.int32
    dense = mask.dense()
    assert dense.shape == (2, 3, sq, sk)
    # Every element of a kept block, and nothing else.
    i, j = torch.arange(sq)[:, None] // 128, torch.arange(sk)[None, :] // 128
    assert torch.equal(dense, layout[:, :, i, j])


def test_two_dim_layout_broadcasts_and_checks():
    mask = BlockSparseMask.from_layout(torch.ones(4, 4, dtype=torch.bool), 512, 512)
    assert mask.layout.shape == (1, 1, 4, 4) and mask.density == 1.0
    mask.check_broadcast(8, 16)
    mask2 = BlockSparseMask.from_layout(torch.ones(2, 1, 4, 4, dtype=torch.bool), 512, 512)
    mask2.check_broadcast(2, 5)
    with pytest.raises(ValueError, match="does not broadcast to 3 x 5"):
        mask2.check_broadcast(3, 5)


def test_coarser_block_size_is_converted_exactly():
    g = torch.Generator().manual_seed(0)
    coarse = torch.rand(3, 2, generator=g) < 0.5
    coarse[0, 0] = True
    mask = BlockSparseMask.from_layout(coarse, 600, 400, block_size=(256, 256))
    assert mask.layout.shape == (1, 1, 5, 4)
    assert torch.equal(mask.dense()[0, 0], expand_layout(coarse, 600, 400, 256))


def test_bad_layouts_get_clear_errors():
    ok = torch.ones(2, 2, dtype=torch.bool)
    with pytest.raises(TypeError, match="bool tensor"):
        BlockSparseMask.from_layout(ok.int(), 256, 256)
    with pytest.raises(TypeError, match="torch.Tensor"):
        BlockSparseMask.from_layout([[True]], 128, 128)
    with pytest.raises(ValueError, match="must have 2 x 3 blocks"):
        BlockSparseMask.from_layout(ok, 256, 300)
    with pytest.raises(ValueError, match="shape"):
        BlockSparseMask.from_layout(torch.ones(1, 1, 1, 2, 2, dtype=torch.bool), 256, 256)
    for bs in (64, 96, (128, 192)):
        with pytest.raises(ValueError, match="multiple of 128"):
            BlockSparseMask.from_layout(ok, 256, 256, block_size=bs)


def test_local_and_global_layouts():
    band = local_layout(6, 6, 1)
    assert band.sum().item() == 6 + 2 * 5 and torch.equal(band, band.T)
    causal = local_layout(4, 6, 1, causal=True)  # bottom-right aligned: row i sits on key block i + 2
    assert causal[3].tolist() == [False, False, False, False, True, True]
    assert causal[0].tolist() == [False, True, True, False, False, False]
    gl = global_local_layout(8, 8, 0, 2)
    assert gl[:, :2].all() and gl[:2, :].all() and gl.diagonal().all() and gl[5, 3].item() is False


def test_random_layout_is_seeded_and_keeps_the_diagonal():
    a, b = random_layout(32, 32, 0.25, seed=7), random_layout(32, 32, 0.25, seed=7)
    assert torch.equal(a, b) and not torch.equal(a, random_layout(32, 32, 0.25, seed=8))
    assert a.diagonal().all() and (a.sum(-1) == 8).all()
    with pytest.raises(ValueError, match="density"):
        random_layout(4, 4, 0.0)


def test_butterfly_layout():
    n = 64
    bf = butterfly_layout(n)
    assert torch.equal(bf, bf.T) and bf.diagonal().all()
    assert (bf.sum(-1) == int(math.log2(n)) + 1).all()
    assert bf[5, 5 ^ 8].item() and not bf[5, 5 ^ 12].item()


def test_coarsen_mask_is_the_any_of_each_block():
    g = torch.Generator().manual_seed(1)
    m = torch.rand(2, 300, 500, generator=g) < 0.0005
    layout = coarsen_mask(m)
    assert layout.shape == (2, 3, 4)
    for bi in range(3):
        for bj in range(4):
            blk = m[:, bi * BLOCK_SIZE:(bi + 1) * BLOCK_SIZE, bj * BLOCK_SIZE:(bj + 1) * BLOCK_SIZE]
            assert torch.equal(layout[:, bi, bj], blk.flatten(1).any(-1))
    assert (expand_layout(layout, 300, 500) | ~m).all()  # a superset of the mask
