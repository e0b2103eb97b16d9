"""Device handling that needs a CUDA device to test (skipped without one)."""

import pytest
import torch

from flash_attn import flash_attn_func


@pytest.mark.gpu
def test_mixed_devices_raise_clear_error():
    q = torch.randn(1, 8, 2, 32, device="cuda", dtype=torch.float16)
    k = torch.randn(1, 8, 2, 32, dtype=torch.float16)
    with pytest.raises(RuntimeError, match=r"k must be on the device of q \(cuda:0\), got cpu"):
        flash_attn_func(q, k, k)
