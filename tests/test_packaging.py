"""What `pip install` ships: every Python package under flash_attn/ is in the distribution (a
subpackage missing from pyproject.toml imports from the source tree, where the tests run, but
not from an installed wheel)."""

import pathlib
import warnings

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_subpackage_is_installed(monkeypatch):
    from setuptools.config.pyprojecttoml import read_configuration
    monkeypatch.chdir(ROOT)  # (package discovery looks below the working directory)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ([tool.setuptools] in pyproject.toml is "beta")
        config = read_configuration(ROOT / "pyproject.toml", expand=True)
    installed = set(config["tool"]["setuptools"]["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "flash_attn").rglob("__init__.py")}
    assert on_disk <= installed, f"packages pip install would leave out: {sorted(on_disk - installed)}"
    assert "flash_attn.utils" in on_disk


def test_library_uses_the_process_libstdcxx():
    """The ops library links libstdc++ dynamically. A private copy (a toolchain with only libstdc++.a,
    which setup.py works around) formats no numbers: TORCH_CHECK messages come out blank or crash."""
    import shutil
    import subprocess
    import pytest
    from flash_attn import _library
    if shutil.which("nm") is None:
        pytest.skip("needs nm (binutils)")
    symbols = subprocess.run(["nm", "--defined-only", _library.LIBRARY_PATH], capture_output=True, text=True).stdout
    if not symbols:
        symbols = subprocess.run(["nm", "-D", "--defined-only", _library.LIBRARY_PATH],
                                 capture_output=True, text=True).stdout
    assert symbols, f"nm read no symbols from {_library.LIBRARY_PATH}"
    assert "_ZNSo9_M_insertIdEERSoT_" not in symbols, f"{_library.LIBRARY_PATH} carries its own libstdc++"
