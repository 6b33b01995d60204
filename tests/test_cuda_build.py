"""Every CUDA source compiles (nvcc for sm_80 and sm_90a; the op wrappers against torch's and the
toolkit's headers), even on a machine without a GPU or a CUDA build of torch: a CUDA source that
does not compile fails the suite. Skipped only where no CUDA toolkit is installed."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NO_TOOLKIT = 2  # tools/check_cuda_compile.py's exit status when nvcc is missing


@pytest.mark.slow
def test_cuda_sources_compile():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "check_cuda_compile.py")],
                          capture_output=True, text=True)
    if proc.returncode == NO_TOOLKIT:
        pytest.skip("no CUDA toolkit (nvcc) on this machine")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_cuda_instantiations_are_generated():
    """csrc/cuda/instantiations is exactly what tools/gen_cuda_instantiations.py writes (a kernel
    template change that needs new instantiations, or a hand edit, fails here)."""
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_cuda_instantiations.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
