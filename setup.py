"""Builds flash_attn's one ops library (flash_attn/_C.abi3.so) with torch's cpp_extension.

A CUDA build when nvcc and a CUDA build of torch are present, else CPU-only. The library has no
Python entry point of its own: ops are registered with TORCH_LIBRARY and loaded with
torch.ops.load_library, so one build serves every Python version (abi3).

Environment:
  FLASH_ATTN_CUDA=0|1          force the CPU-only or the CUDA build (default: auto-detect)
  FLASH_ATTN_CUDA_ARCHS="80+PTX;90a" SM architectures to compile for; with 90a (Hopper's
                               wgmma) the sm90 kernels in csrc/hopper/ are built too; "+PTX"
                               also embeds that arch's PTX, which newer GPUs (Blackwell) run
                               after the driver compiles it at first use
  FLASH_ATTN_CUDA_HDIMS="64,128" a subset of the kernel head dims (default: all)
  FLASH_ATTN_CUDA_DTYPES="bf16"  a subset of fp16,bf16 (default: both)
  FLASH_ATTN_CPU_FLAGS          extra C++ flags for the CPU kernels (default on x86-64: AVX2+FMA)
  FLASH_ATTN_CUTLASS_INCLUDE    CUTLASS/CuTe include dir (default: the nvidia-cutlass package's)
"""

import glob
import os
import platform
import shutil
import subprocess
import tempfile

from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
import torch

ROOT = os.path.dirname(os.path.abspath(__file__))


def _want_cuda() -> bool:
    forced = os.environ.get("FLASH_ATTN_CUDA")
    if forced is not None:
        return forced == "1"
    return torch.version.cuda is not None and CUDA_HOME is not None and (
        shutil.which("nvcc") is not None or os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc"))
    )


def _cutlass_include() -> list:
    """CUTLASS/CuTe headers (the sm90 kernels need them): FLASH_ATTN_CUTLASS_INCLUDE, else the
    nvidia-cutlass package."""
    path = os.environ.get("FLASH_ATTN_CUTLASS_INCLUDE")
    if not path:
        try:
            import cutlass_library
        except ImportError:
            return []
        path = os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include")
    return [path] if os.path.isfile(os.path.join(path, "cute", "tensor.hpp")) else []


def _cpu_flags() -> list:
    if "FLASH_ATTN_CPU_FLAGS" in os.environ:
        return os.environ["FLASH_ATTN_CPU_FLAGS"].split()
    if platform.machine() in ("x86_64", "AMD64"):
        # at::vec's AVX2 path; flash_attn/__init__.py refuses to load on CPUs without AVX2.
        return ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2"]
    return []


def _arch_entries() -> list:
    """(arch, with_ptx) for each entry of FLASH_ATTN_CUDA_ARCHS; "80+PTX" also embeds compute_80's PTX."""
    archs = os.environ.get("FLASH_ATTN_CUDA_ARCHS", "80+PTX;90a")
    entries = []
    for a in archs.replace(",", ";").split(";"):
        a = a.strip()
        if a:
            ptx = a.lower().endswith("+ptx")
            entries.append((a[:-4] if ptx else a, ptx))
    return entries


def _archs() -> list:
    return [a for a, _ in _arch_entries()]


def _arch_flags() -> list:
    flags = []
    for arch, ptx in _arch_entries():
        flags += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
        if ptx:  # GPUs newer than every listed arch compile it at first use (the driver caches the result)
            flags += ["-gencode", f"arch=compute_{arch},code=compute_{arch}"]
    return flags


HEAD_DIMS = [32, 64, 96, 128, 160, 192, 224, 256]  # csrc/cuda/flash_launch.h: kHeadDims
DTYPES = ["fp16", "bf16"]


def _subset(env, universe, cast):
    chosen = os.environ.get(env)
    if not chosen:
        return list(universe)
    picked = [cast(x) for x in chosen.replace(";", ",").split(",") if x.strip()]
    unknown = [x for x in picked if x not in universe]
    if unknown:
        raise ValueError(f"{env}: {unknown} not among {universe}")
    return picked


def _cuda_instantiations():
    """The generated kernel files to compile, and the masks that tell the dispatcher which exist."""
    hdims = _subset("FLASH_ATTN_CUDA_HDIMS", HEAD_DIMS, int)
    dtypes = _subset("FLASH_ATTN_CUDA_DTYPES", DTYPES, str.strip)
    families = [("cuda/instantiations/flash_fwd", hdims), ("cuda/instantiations/flash_bwd", hdims)]
    macros = []
    if "90a" in _archs() and not _cutlass_include():
        print("flash_attn: WARNING: CuTe headers not found (pip install nvidia-cutlass, or set "
              "FLASH_ATTN_CUTLASS_INCLUDE); building without the sm90 kernels")
    elif "90a" in _archs():  # wgmma needs the arch-specific target
        # The sm90 backward exists for the head dims generate_kernels.py wrote files for (has_sm90_bwd).
        bwd_sm90 = "hopper/instantiations/flash_bwd_sm90"
        bwd_hdims = [h for h in hdims if os.path.exists(os.path.join(ROOT, "csrc", f"{bwd_sm90}_hdim{h}_fp16.cu"))]
        families += [("hopper/instantiations/flash_fwd_sm90", hdims), (bwd_sm90, bwd_hdims)]
        macros.append(("FLASH_ATTN_WITH_SM90", None))
    files = [f"csrc/{family}_hdim{h}_{dt}.cu" for family, dims in families for dt in dtypes for h in dims]
    hdim_mask = sum(1 << HEAD_DIMS.index(h) for h in hdims)
    dtype_mask = sum(1 << DTYPES.index(dt) for dt in dtypes)
    return files, macros + [("FLASH_ATTN_HDIM_MASK", str(hdim_mask)), ("FLASH_ATTN_DTYPE_MASK", str(dtype_mask))]


def _extension():
    sources = [os.path.relpath(p, ROOT) for p in
               ["csrc/flash_api.cpp", "csrc/flash_autocast.cpp", "csrc/flash_autograd.cpp", "csrc/flash_kvcache.cpp"]
               + sorted(glob.glob(os.path.join(ROOT, "csrc", "cpu", "*.cpp")))]
    # -fopenmp: at::parallel_for is header code and runs serially unless _OPENMP is defined here;
    # the library then shares torch's libgomp (same soname, already loaded by torch).
    cxx = ["-O3", "-std=c++17", "-fvisibility=hidden", "-fopenmp"] + _cpu_flags()
    link = ["-fopenmp"]
    include_dirs = [os.path.join(ROOT, "csrc")]
    if not _want_cuda():
        return CppExtension("flash_attn._C", sources, include_dirs=include_dirs,
                            extra_compile_args={"cxx": cxx}, extra_link_args=link, py_limited_api=True)
    kernel_files, masks = _cuda_instantiations()
    sources += [os.path.relpath(p, ROOT) for p in sorted(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")))]
    sources += kernel_files
    nvcc = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "--expt-extended-lambda",
            "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
            "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
            "--threads", os.environ.get("FLASH_ATTN_NVCC_THREADS", "2")] + _arch_flags()
    return CUDAExtension("flash_attn._C", sources, include_dirs=include_dirs + _cutlass_include(),
                         define_macros=[("FLASH_ATTN_WITH_CUDA", None)] + masks,
                         extra_compile_args={"cxx": cxx, "nvcc": nvcc}, extra_link_args=link,
                         py_limited_api=True)


# ostream::_M_insert<double> lives in libstdc++.so; a library that defines it carries a copy of
# libstdc++ of its own (some toolchains only ship libstdc++.a, or force -static-libstdc++).
_PRIVATE_LIBSTDCXX_SYMBOL = "_ZNSo9_M_insertIdEERSoT_"


def _links_private_libstdcxx(linker, tmp, extra) -> bool:
    src, out = os.path.join(tmp, "probe.cpp"), os.path.join(tmp, "probe.so")
    with open(src, "w") as f:
        f.write("#include <sstream>\nstd::string show(double x) { std::ostringstream s; s << x; return s.str(); }\n")
    subprocess.run(linker + ["-fPIC", src, "-o", out] + extra, check=True, capture_output=True)
    symbols = subprocess.run(["nm", "--defined-only", out], check=True, capture_output=True, text=True).stdout
    return _PRIVATE_LIBSTDCXX_SYMBOL in symbols


def _shared_libstdcxx_flags(linkers) -> list:
    """Link flags that keep the library on the libstdc++ torch has loaded. A private copy has its own
    locale ids that the process's locale never registered, so formatting a number (every TORCH_CHECK
    message with one) prints nothing or crashes."""
    if platform.system() != "Linux":
        return []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            private = [l for l in linkers if _links_private_libstdcxx(l, tmp, [])]
        except (OSError, subprocess.CalledProcessError) as e:
            print(f"flash_attn: WARNING: could not check how the linker links libstdc++ ({e}); assuming shared")
            return []
        if not private:
            return []
        loaded = sorted({line.split()[-1] for line in open("/proc/self/maps") if "/libstdc++.so" in line})
        flags = [f"-L{os.path.dirname(loaded[0])}", "-l:libstdc++.so.6"] if loaded else []
        if not flags or any(_links_private_libstdcxx(l, tmp, flags) for l in private):
            raise RuntimeError(
                f"flash_attn: the C++ linker ({' '.join(private[0])}) puts a private copy of libstdc++ in "
                "the library, whose error messages would crash; set CXX to a compiler that links libstdc++ "
                "dynamically (e.g. CXX=/usr/bin/g++)")
        print(f"flash_attn: {private[0][0]} links libstdc++ statically; linking torch's {loaded[0]} instead")
        return flags


class _BuildExtension(BuildExtension.with_options(use_ninja=True)):
    def build_extensions(self):
        # distutils links a C++ extension with linker_so behind the C++ compiler; newer setuptools
        # also has linker_so_cxx. Check both.
        linkers = [(self.compiler.compiler_cxx or self.compiler.linker_so)[:1] + self.compiler.linker_so[1:]]
        if getattr(self.compiler, "linker_so_cxx", None):
            linkers.append(list(self.compiler.linker_so_cxx))
        flags = _shared_libstdcxx_flags(linkers)
        for ext in self.extensions:
            ext.extra_link_args = list(ext.extra_link_args or []) + flags
        super().build_extensions()


if __name__ == "__main__":  # (setuptools' build backend runs this file as __main__ too; tests import it)
    setup(
        ext_modules=[_extension()],
        cmdclass={"build_ext": _BuildExtension},
        options={"bdist_wheel": {"py_limited_api": "cp310"}},
    )
