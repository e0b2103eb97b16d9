"""flash_attn.bert_padding: padded batch <-> packed tokens, against an element-by-element loop."""

import pytest
import torch

from flash_attn.bert_padding import (index_first_axis, index_put_first_axis, pad_input, unpad_input,
                                     unpad_input_for_concatenated_sequences)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def padding_mask(batch, seqlen, device):
    """Right-padded rows of random length, one full row, one empty row, and one row with holes."""
    lengths = torch.randint(1, seqlen, (batch,))
    lengths[0], lengths[1] = seqlen, 0
    mask = torch.arange(seqlen)[None, :] < lengths[:, None]
    mask[2] = torch.rand(seqlen) < 0.5
    return mask.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64])
def test_unpad_then_pad(device, mask_dtype):
    batch, seqlen = 5, 13
    x = torch.randn(batch, seqlen, 3, 4, device=device, requires_grad=True)
    mask = padding_mask(batch, seqlen, device)
    x_unpad, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, mask.to(mask_dtype))
    expected = torch.cat([x[b][mask[b]] for b in range(batch)])
    assert torch.equal(x_unpad, expected)
    assert torch.equal(x.reshape(-1, 3, 4)[indices], expected)
    lengths = mask.sum(-1)
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0] + lengths.cumsum(0).tolist()
    assert max_seqlen == int(lengths.max()) and isinstance(max_seqlen, int)
    assert seqused.dtype == torch.int32 and torch.equal(seqused, lengths.int())
    padded = pad_input(x_unpad, indices, batch, seqlen)
    assert torch.equal(padded, torch.where(mask[..., None, None], x, torch.zeros_like(x)))
    padded.square().sum().backward()  # d/dx: 2 x at real tokens, 0 at padding
    assert torch.equal(x.grad, torch.where(mask[..., None, None], 2 * x, torch.zeros_like(x)).detach())


def test_unused_mask_is_packed_but_not_used():
    batch, seqlen = 3, 8
    x = torch.randn(batch, seqlen, 2)
    mask = torch.zeros(batch, seqlen, dtype=torch.bool)
    mask[:, :3] = True
    unused = torch.zeros_like(mask)
    unused[:, 3:5] = True  # allocated (e.g. cache slots) but not attended to
    x_unpad, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, mask, unused)
    assert x_unpad.shape == (15, 2) and cu_seqlens.tolist() == [0, 5, 10, 15] and max_seqlen == 5
    assert seqused.tolist() == [3, 3, 3]


def test_index_helpers_are_inverses():
    values = torch.randn(6, 2, 3, requires_grad=True)
    indices = torch.randperm(10)[:6]
    placed = index_put_first_axis(values, indices, 10)
    assert torch.equal(index_first_axis(placed, indices), values)
    assert torch.equal(placed.abs().sum((1, 2)) > 0, torch.isin(torch.arange(10), indices))
    placed.sum().backward()
    assert torch.equal(values.grad, torch.ones_like(values))


def test_concatenated_sequences():
    x = torch.randn(2, 6, 4)
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [3, 2, 1, 0, 0, 0]])
    x_unpad, indices, cu_seqlens, max_seqlen = unpad_input_for_concatenated_sequences(x, lengths)
    assert cu_seqlens.tolist() == [0, 2, 5, 8, 10, 11] and max_seqlen == 3
    assert torch.equal(x_unpad, torch.cat([x[0, :5], x[1, :6]]))
    assert torch.equal(pad_input(x_unpad, indices, 2, 6)[0, 5], torch.zeros(4))


def test_empty_batch():
    x_unpad, indices, cu_seqlens, max_seqlen, seqused = unpad_input(torch.randn(0, 4, 2),
                                                                    torch.zeros(0, 4, dtype=torch.bool))
    assert x_unpad.shape == (0, 2) and cu_seqlens.tolist() == [0] and max_seqlen == 0 and seqused.numel() == 0
