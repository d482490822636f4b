"""The import layout: Baton's kernels/ folder never shadows PyPI's `kernels` package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str) -> str:
    # cwd = repository root, which `python -c` puts first on sys.path: the worst case for shadowing.
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout.strip()


def test_pypi_kernels_and_baton_kernels_side_by_side():
    out = _run(
        "import kernels, baton.kernels.paged_attention as pa, transformers;"
        "print(kernels.__file__); print(pa.__file__); print(hasattr(kernels, 'get_kernel'))"
    )
    pypi_file, ours_file, has_api = out.splitlines()
    assert "site-packages" in pypi_file, f"`import kernels` resolved to {pypi_file}"
    assert Path(ours_file).resolve().parent == ROOT / "kernels"
    assert has_api == "True"


def test_top_level_folders_are_not_packages():
    # A regular package (with __init__.py) at the root would win over site-packages on sys.path.
    for name in ("kernels", "services"):
        assert not (ROOT / name / "__init__.py").exists(), f"{name}/__init__.py would shadow PyPI packages"


def test_wheel_carries_the_c_kernels_source(tmp_path: Path) -> None:
    """The CPU kernels compile from cpu_kernels.c where they run, so an installed Baton needs the file."""
    import shutil
    import zipfile

    # Built from a copy: setuptools writes build/ and *.egg-info beside the sources it builds.
    src = tmp_path / "src"
    for name in ("baton", "kernels", "services"):  # baton/kernels and baton/services link to the others
        shutil.copytree(ROOT / name, src / name, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(src)], check=True, capture_output=True, cwd=tmp_path)
    (wheel,) = tmp_path.glob("baton-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "baton/kernels/cpu_kernels.c" in names and "baton/kernels/cpu.py" in names
