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


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tensors_on_a_non_current_device():
    # The ops switch to q's device (kernels, streams and the dropout generator), so inputs on
    # cuda:1 while cuda:0 is current give the same results as on cuda:0; mixing the two is an error.
    # Both the portable kernels (dropout, deterministic) and, on Hopper, the sm90 ones (default);
    # the atomic dQ of the default mode is compared with a tolerance, everything else bitwise.
    assert torch.cuda.current_device() == 0
    for kwargs in (dict(dropout_p=0.1, deterministic=True), dict()):
        results = []
        for dev in ("cuda:0", "cuda:1"):
            torch.manual_seed(0)
            torch.cuda.manual_seed_all(0)
            q, k, v = [torch.randn(2, 300, 4, 64, dtype=torch.bfloat16).to(dev).requires_grad_() for _ in range(3)]
            out = flash_attn_func(q, k, v, causal=True, **kwargs)
            out.backward(torch.ones_like(out))
            results.append([t.cpu() for t in (out, q.grad, k.grad, v.grad)])
        for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
            if name == "dq" and not kwargs:
                torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)
            else:
                assert torch.equal(a, b), name
    assert torch.cuda.current_device() == 0
    with pytest.raises(RuntimeError, match=r"k must be on the device of q \(cuda:1\), got cuda:0"):
        flash_attn_func(q.detach(), k.detach().to("cuda:0"), v.detach())
