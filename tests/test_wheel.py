"""Build once, install many: `pip wheel --no-build-isolation --no-deps .` gives a wheel that
installs into a fresh virtual environment (torch from the system site-packages, nothing
downloaded), imports from there rather than from the source tree, runs an op, and pins torch to
the version it was built against.

The wheel reuses the persistent object folder (setup.py's BUILD_TEMP, which the editable install
of tools/bootstrap.sh and `setup.py build_ext --inplace` fill), so the test only links and
packages. Without that folder the wheel would compile everything (minutes): skipped then."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

# Run inside the venv from a folder outside the repository, so that the repository's attn_ext
# cannot be what gets imported.
_PROBE = r"""
import importlib.metadata as md, json, sys, torch
import attn_ext
q = torch.randn(1, 2, 5, 8, dtype=torch.float64)
k, v = torch.randn_like(q), torch.randn_like(q)
out = attn_ext.attention(q, k, v, causal=True)
want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
print(json.dumps({"file": attn_ext.__file__, "requires": md.requires("attn_ext"),
                  "version": md.version("attn_ext"),
                  "max_err": (out - want).abs().max().item()}))
"""


@pytest.mark.slow
def test_wheel_installs_into_fresh_venv(tmp_path, setup_py):
    build_temp = Path(setup_py.BUILD_TEMP)
    if not (build_temp / "build.ninja").exists():
        pytest.skip(
            f"no persistent build in {build_temp.relative_to(ROOT)} (run "
            "tools/bootstrap.sh or setup.py build_ext --inplace first): the wheel would "
            "compile everything"
        )
    t0 = time.perf_counter()
    dist = tmp_path / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-build-isolation",
            "--no-deps",
            "--no-index",
            "-q",
            "-w",
            str(dist),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    wheels = list(dist.glob("attn_ext-*.whl"))
    assert len(wheels) == 1, wheels
    t_wheel = time.perf_counter() - t0

    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
        check=True,
    )
    py = venv / "bin" / "python"
    # Without the caller's PYTHONPATH: a source tree on it would make pip see attn_ext as
    # installed already (and skip the wheel), and the probe import it from there.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(py),
            "install",
            "--no-deps",
            "--no-index",
            "-q",
            str(wheels[0]),
        ],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    proc = subprocess.run(
        [str(py), "-c", _PROBE], cwd=outside, env=env, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])

    assert Path(got["file"]).resolve().is_relative_to(venv.resolve()), got["file"]
    assert got["max_err"] < 1e-12
    base_torch = torch.__version__.split("+")[0]
    unconditional = [r for r in got["requires"] if ";" not in r]  # not the extras
    assert unconditional == [f"torch=={base_torch}"], got["requires"]
    assert got["version"] == setup_py._version(setup_py._cuda_enabled())  # +cu<ver> for CUDA builds
    print(f"wheel {t_wheel:.1f}s, install + import {time.perf_counter() - t0 - t_wheel:.1f}s")
