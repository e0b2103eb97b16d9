"""Memory is linear in sequence length: at seqlen 8192 the CPU forward+backward allocates O(N)
extra memory, while standard attention allocates the N x N score matrix. Measured as the peak
resident-set growth (VmHWM after a reset) of a child process, so no other test's allocations interfere."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[2])
from flash_attn import flash_attn_func
torch.set_num_threads(2)
s, impl = int(sys.argv[3]), sys.argv[1]
q, k, v = [torch.randn(1, s, 1, 64, requires_grad=True) for _ in range(3)]
dout = torch.randn(1, s, 1, 64)
if impl == "flash":
    warm = [torch.randn(1, 64, 1, 64, requires_grad=True) for _ in range(3)]
    flash_attn_func(*warm).sum().backward()   # load kernels and thread pools first
def status_kb(key):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key + ":"))
open("/proc/self/clear_refs", "w").write("5")  # reset the peak-RSS mark (VmHWM) to the current RSS
before = status_kb("VmRSS")
if impl == "flash":
    out = flash_attn_func(q, k, v)
else:
    scores = torch.einsum("bihd,bjhd->bhij", q, k) / 8.0
    out = torch.einsum("bhij,bjhd->bihd", torch.softmax(scores, -1), v)
out.backward(dout)
print(json.dumps({"extra_mb": (status_kb("VmHWM") - before) / 1024}))
"""


def peak_extra_mb(impl, seqlen):
    res = subprocess.run([sys.executable, "-c", CHILD, impl, ROOT, str(seqlen)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])["extra_mb"]


@pytest.mark.slow
@pytest.mark.skipif("libasan" in os.environ.get("LD_PRELOAD", ""), reason="AddressSanitizer's allocator (make asan) "
                    "inflates the resident set")
def test_memory_is_linear_not_quadratic():
    n2_mb = 8192 * 8192 * 4 / 2**20  # one float32 score matrix: 256 MB
    standard = peak_extra_mb("standard", 8192)
    assert standard > n2_mb, f"standard attention should hold the N^2 matrix; measured {standard:.0f} MB"
    # A fixed part (BLAS and thread-pool buffers, about 35 MB) plus O(N) tensors: doubling N from
    # 4096 adds a few MB, where an N^2 buffer would add 192 MB.
    half, full = peak_extra_mb("flash", 4096), peak_extra_mb("flash", 8192)
    assert full < n2_mb / 4, f"flash attention grew the RSS by {full:.0f} MB at seqlen 8192"
    assert full - half < n2_mb / 16, f"RSS growth from seqlen 4096 to 8192 was {full - half:.0f} MB"
