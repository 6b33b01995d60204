"""The lint check CI runs: ruff (lint and format, config in pyproject.toml) over the Python
sources and clang-format (.clang-format) over csrc/, tests/ and dev/ C++/CUDA sources, at the
versions tools/bootstrap.sh installs. A machine without the tools (an offline GPU machine)
skips, saying why; CI's bootstrap installs them, so there the check always runs."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CXX_SUFFIXES = {".h", ".cpp", ".cu", ".cuh"}
# written by tools/gen_cuda_instantiations.py, whose --check test keeps them as it writes them
GENERATED = "csrc/attention/cuda/instantiations/"


def _tool(name):
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (tools/bootstrap.sh test installs it)")
    return path


def _run(cmd):
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, f"{' '.join(cmd[:3])} ... failed:\n{res.stdout}\n{res.stderr}"


def _tracked(suffixes):
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if files.returncode != 0:
        pytest.skip("not a git checkout: the lint check lists the tracked files")
    return [
        f
        for f in files.stdout.split()
        if Path(f).suffix in suffixes and not f.startswith(GENERATED)
    ]


def test_ruff_check():
    _run([_tool("ruff"), "check", "."])


def test_ruff_format():
    _run([_tool("ruff"), "format", "--check", "."])


def test_clang_format():
    sources = _tracked(CXX_SUFFIXES)
    assert sources, "no C++/CUDA sources found"
    _run([_tool("clang-format"), "--dry-run", "--Werror", *sources])
