"""Which GPUs a build runs on: FLASH_ATTN_CUDA_ARCHS's gencode flags, and a library whose binaries
are for another GPU either running its PTX (the driver compiles it at first use) or refusing with
a clear error before any launch."""

import glob
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent


def load_setup_module():
    spec = importlib.util.spec_from_file_location("flash_attn_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # (setup() itself runs only as __main__)
    return module


@pytest.mark.parametrize("setting, archs, flags", [
    (None, ["80", "90a"], ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_80,code=compute_80",
                           "-gencode", "arch=compute_90a,code=sm_90a"]),
    ("90a", ["90a"], ["-gencode", "arch=compute_90a,code=sm_90a"]),
    ("80, 90a;100+ptx", ["80", "90a", "100"],
     ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90a,code=sm_90a",
      "-gencode", "arch=compute_100,code=sm_100", "-gencode", "arch=compute_100,code=compute_100"]),
])
def test_arch_flags(monkeypatch, setting, archs, flags):
    """FLASH_ATTN_CUDA_ARCHS (default 80+PTX;90a): a binary per arch, and the PTX where it says +PTX."""
    if setting is None:
        monkeypatch.delenv("FLASH_ATTN_CUDA_ARCHS", raising=False)
    else:
        monkeypatch.setenv("FLASH_ATTN_CUDA_ARCHS", setting)
    setup = load_setup_module()
    assert setup._archs() == archs
    assert setup._arch_flags() == flags


CHECK = """
import sys
import torch
sys.path[:0] = [{pkg!r}, {tests!r}]
import flash_attn
from flash_attn import _library, flash_attn_func
from reference import check_grads_against_reference
assert _library.LIBRARY_PATH.startswith({pkg!r}), _library.LIBRARY_PATH
torch.manual_seed(0)
q, k, v = (torch.randn(2, 333, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
out = flash_attn_func(q, k, v, causal=True)
dout = torch.randn_like(out)
grads = torch.autograd.grad(out, (q, k, v), dout)
check_grads_against_reference(q, k, v, out, dout, grads, torch.bfloat16, causal=True)
print("checked")
"""


@pytest.mark.gpu
@pytest.mark.slow
def test_build_for_an_older_arch_runs_its_ptx_or_refuses(tmp_path):
    """A head-dim-64 bf16 library built for sm_80 with its PTX: on a GPU of another major version
    (Hopper and newer) the driver compiles the PTX and the portable kernels give correct results;
    with PTX compilation disabled the first call raises our error, naming the GPU and what to
    rebuild with, instead of CUDA's "no kernel image". Builds the library (a few minutes)."""
    major, minor = torch.cuda.get_device_capability()
    if major < 9:
        pytest.skip("sm_80 binaries run on this GPU: no other-arch case to build")
    env = dict(os.environ, FLASH_ATTN_CUDA="1", FLASH_ATTN_CUDA_ARCHS="80+PTX", FLASH_ATTN_CUDA_HDIMS="64",
               FLASH_ATTN_CUDA_DTYPES="bf16", MAX_JOBS=str(os.cpu_count() or 2))
    build = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", str(tmp_path / "lib"),
                            "--build-temp", str(tmp_path / "tmp")], cwd=ROOT, env=env, capture_output=True, text=True)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    pkg = tmp_path / "pkg"
    shutil.copytree(ROOT / "flash_attn", pkg / "flash_attn", ignore=shutil.ignore_patterns("_C*.so", "__pycache__"))
    (lib,) = glob.glob(str(tmp_path / "lib" / "flash_attn" / "_C*.so"))
    shutil.copy(lib, pkg / "flash_attn")
    script = CHECK.format(pkg=str(pkg), tests=str(ROOT / "tests"))

    # The driver keeps what it compiled from PTX in its cache and uses it even with PTX compilation
    # disabled, so the first run gets a cache of its own and the second none.
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900,
                         env=dict(os.environ, CUDA_CACHE_PATH=str(tmp_path / "jit_cache")))
    assert ran.returncode == 0 and "checked" in ran.stdout, ran.stdout[-3000:] + ran.stderr[-3000:]

    refused = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                             env=dict(os.environ, CUDA_DISABLE_PTX_JIT="1", CUDA_CACHE_DISABLE="1"))
    name = torch.cuda.get_device_name()
    assert refused.returncode != 0, refused.stdout[-3000:]
    assert "flash_attn: this build has no CUDA" in refused.stderr, refused.stderr[-3000:]
    assert f"{name} (sm_{major}{minor})" in refused.stderr, refused.stderr[-3000:]
    assert f"FLASH_ATTN_CUDA_ARCHS including {major}{minor}" in refused.stderr, refused.stderr[-3000:]
