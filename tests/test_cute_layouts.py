"""The CuTe and Hopper kernels' layouts and partitions, checked on the host (no GPU): tests/
cute_layout_check.cpp compiled with the host compiler against the CUTLASS headers the build
uses (setup.py's cutlass_include) and the CUDA toolkit's headers, then run. What it checks:
the file's header. Skipped only where the CUTLASS or CUDA headers are missing (tools/
bootstrap.sh installs the former wherever nvcc is)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from check_cuda_compile import find_cuda_home  # noqa: E402


def test_cute_layouts(setup_py, tmp_path):
    cutlass = setup_py.cutlass_include()
    cuda_home = find_cuda_home()
    if cutlass is None or cuda_home is None:
        pytest.skip("no CUTLASS headers or no CUDA toolkit on this machine")
    include = cuda_home / "include"
    exe = tmp_path / "cute_layout_check"
    cxx = os.environ.get("CXX", "c++")
    build = subprocess.run(
        [
            cxx,
            "-std=c++17",
            "-O1",
            f"-I{ROOT / 'csrc'}",
            f"-I{cutlass}",
            f"-I{include}",
            # libcu++ (cuda/std/...), which CUTLASS includes, lives here in CUDA 13
            f"-I{include / 'cccl'}",
            str(ROOT / "tests" / "cute_layout_check.cpp"),
            "-o",
            str(exe),
        ],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0 and "CUTE LAYOUT CHECK PASS" in run.stdout, run.stdout
