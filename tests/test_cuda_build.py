"""Every CUDA source compiles (nvcc for sm_90a, and for sm_80 every source but the repeated
kernel instantiations, of which one per kernel kind; the op wrappers against torch's and the
toolkit's headers), even on a machine without a GPU or a CUDA build of torch: a CUDA source that
does not compile fails the suite. Skipped only where no CUDA toolkit is installed. Compiling
every instantiation for both architectures took 1246 s of a 1669 s suite on the 2-core Zen 3
build machine (2026-11-28); `python tools/check_cuda_compile.py` alone still does that."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NO_TOOLKIT = 2  # tools/check_cuda_compile.py's exit status when nvcc is missing


@pytest.mark.slow
def test_cuda_sources_compile():
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "check_cuda_compile.py"),
            *("--arch", "sm_90a", "--sample-arch", "sm_80"),
        ],
        capture_output=True,
        text=True,
    )
    if proc.returncode == NO_TOOLKIT:
        pytest.skip("no CUDA toolkit (nvcc) on this machine")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_cuda_instantiations_are_generated():
    """csrc/attention/cuda/instantiations is exactly what tools/gen_cuda_instantiations.py writes
    from instantiations.json (a kernel template change that needs new instantiations, a new
    head dim, or a hand edit, fails here)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gen_cuda_instantiations.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_cuda_kernel_set_has_one_source(monkeypatch, setup_py):
    """The instantiated dtypes and head dims come from csrc/attention/cuda/instantiations.json
    alone: setup.py's selection and nvcc masks, the generated files and the launcher's header
    agree with it (bit i of each mask is entry i of the file's list)."""
    import json
    import re

    kernel_set = json.loads(
        (ROOT / "csrc" / "attention" / "cuda" / "instantiations.json").read_text()
    )
    dtypes, mma_dtypes, head_dims = (
        list(kernel_set["dtypes"]),
        kernel_set["mma_dtypes"],
        kernel_set["mma_head_dims"],
    )
    header = (ROOT / "csrc" / "attention" / "cuda" / "instantiations" / "kernel_set.h").read_text()
    dims = re.search(r"kMmaHeadDims\[\] = \{([^}]*)\}", header).group(1)
    assert [int(d) for d in dims.split(",")] == head_dims
    bits = dict(re.findall(r"kDtypeBit<(\w+)> = (\d+);", header))
    assert [int(bits[kernel_set["dtypes"][d]]) for d in dtypes] == list(range(len(dtypes)))
    launcher = (ROOT / "csrc" / "attention" / "cuda" / "attention_launch.cu").read_text()
    assert '#include "attention/cuda/instantiations/kernel_set.h"' in launcher
    assert not re.search(r"kMmaHeadDims\[\]\s*=", launcher), "the launcher lists head dims again"

    for switch in ("ATTN_EXT_CUDA_DTYPES", "ATTN_EXT_CUDA_HEAD_DIMS", "ATTN_EXT_CUDA_BACKWARD"):
        monkeypatch.delenv(switch, raising=False)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0+PTX;9.0a")  # setup.py's default off a GPU
    keep, defines = setup_py._cuda_attention_selection()  # no switches: every file, every bit
    generated = sorted((ROOT / "csrc" / "attention" / "cuda" / "instantiations").glob("*.cu"))
    assert sorted(ROOT / k for k in keep) == generated
    assert f"-DATTN_EXT_CUDA_DTYPE_MASK={(1 << len(dtypes)) - 1}" in defines
    assert f"-DATTN_EXT_CUDA_HEAD_DIM_MASK={(1 << len(head_dims)) - 1}" in defines

    dtype, hd = mma_dtypes[-1], head_dims[-1]  # one narrowed build: the last of each list
    monkeypatch.setenv("ATTN_EXT_CUDA_DTYPES", dtype)
    monkeypatch.setenv("ATTN_EXT_CUDA_HEAD_DIMS", str(hd))
    monkeypatch.setenv("ATTN_EXT_CUDA_BACKWARD", "0")
    keep, defines = setup_py._cuda_attention_selection()
    # the CuTe and Hopper forwards' instantiations come with their head dim where the CUTLASS
    # headers are (the Hopper one where the architectures include sm_90a)
    cute = setup_py.cutlass_include() is not None
    assert sorted(Path(k).name for k in keep) == sorted(
        [f"fwd_generic_{dtype}.cu", f"fwd_mma_{dtype}_hd{hd}.cu"]
        + ([f"fwd_cute_{dtype}_hd{hd}.cu", f"fwd_hopper_{dtype}_hd{hd}.cu"] if cute else [])
    )
    assert f"-DATTN_EXT_CUDA_CUTE={int(cute)}" in defines
    assert f"-DATTN_EXT_CUDA_HOPPER={int(cute)}" in defines
    assert f"-DATTN_EXT_CUDA_DTYPE_MASK={1 << dtypes.index(dtype)}" in defines
    assert f"-DATTN_EXT_CUDA_HEAD_DIM_MASK={1 << head_dims.index(hd)}" in defines
    for arch in ("8.0", "8.0;9.0"):  # no sm_90a: no wgmma, no Hopper forward
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch)
        keep, defines = setup_py._cuda_attention_selection()
        assert not any("hopper" in Path(k).name for k in keep)
        assert "-DATTN_EXT_CUDA_HOPPER=0" in defines
    monkeypatch.setenv("ATTN_EXT_CUDA_HEAD_DIMS", str(head_dims[0] + 1))
    with pytest.raises(RuntimeError, match="unknown value"):
        setup_py._cuda_attention_selection()
