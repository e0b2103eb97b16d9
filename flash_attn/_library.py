"""Finds and loads the compiled ops library (flash_attn/_C*.so) into torch.ops.flash_attn."""

import glob
import os

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))


def _cpu_can_run_build() -> None:
    # The x86-64 build uses AVX2/FMA; loading it on an older CPU would die with SIGILL later.
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT" and os.uname().machine == "x86_64":
        raise ImportError(
            "flash_attn: this CPU lacks AVX2, which the default x86-64 build needs; rebuild with "
            "FLASH_ATTN_CPU_FLAGS='' to get a portable build")


def load() -> str:
    candidates = sorted(glob.glob(os.path.join(_HERE, "_C*.so")) + glob.glob(os.path.join(_HERE, "_C*.pyd")))
    if not candidates:
        raise ImportError(
            "flash_attn: the compiled ops library (flash_attn/_C*.so) is missing; build it with "
            "`pip install --no-build-isolation .` or `python setup.py build_ext --inplace`")
    _cpu_can_run_build()
    torch.ops.load_library(candidates[0])
    return candidates[0]


LIBRARY_PATH = load()
