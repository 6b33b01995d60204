#!/usr/bin/env python
"""Compiles every CUDA source of attn_ext without a GPU and without a CUDA build of torch.

* every ``csrc/**/*.cu`` with nvcc for each architecture (default ``sm_80`` and
  ``sm_90a``: A100 and H100), to an object file;
* every ``.cpp`` of a ``csrc/<family>/cuda/`` folder (the op wrappers), and every other ``csrc``
  source with an ``ATTN_EXT_WITH_CUDA`` part, with the host C++ compiler, syntax only, against
  torch's headers and the CUDA toolkit's. A CPU-only torch ships the c10/ATen CUDA headers but
  not the generated ``c10/cuda/impl/cuda_cmake_macros.h``; a one-line stand-in is supplied.

Exit status 0 when everything compiles, 1 when something does not (its compiler output is
printed), 2 when no CUDA toolkit is found.

``--sample-arch`` compiles, for those architectures, every source but the generated kernel
instantiations (``csrc/attention/cuda/instantiations/``) and one instantiation of each kernel
kind (bf16, the first head dim in file order): the other instantiations of a kind are the same
template with another element type or head dim, compiled for the ``--arch`` architectures.
NVVM (cicc) takes ~85% of an instantiation's time, once per architecture, and at -O0 / -O1 it
is slower, not faster (the CuTe kernels uninlined: 474 / 140 s against 57 s for one forward,
2026-11-28), so leaving out repeats is what shortens the check; the test suite runs
``--arch sm_90a --sample-arch sm_80`` (tests/test_cuda_build.py).

    python tools/check_cuda_compile.py                 # both architectures, every source
    python tools/check_cuda_compile.py --arch sm_90a   # one
    python tools/check_cuda_compile.py --arch sm_90a --sample-arch sm_80  # the suite's check
    python tools/check_cuda_compile.py --only decoding/cuda/decode_split_kv.cu  # some files
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_ARCHS = ("sm_80", "sm_90a")
NVCC_FLAGS = [
    "-std=c++17",
    "--expt-relaxed-constexpr",
    "-O3",
    "-DATTN_EXT_WITH_CUDA",
    "-DATTN_EXT_CUDA_CUTE=1",
    "-DATTN_EXT_CUDA_HOPPER=1",
]
# The host sources in the dialect the CUDA build compiles them in (setup.py's nvcc flags, and
# torch 2.11's C++ flags on the GPU machine): C++17. Newer torch headers use a few C++20
# extensions that g++ accepts in C++17 with a warning, which is silenced.
CXX_FLAGS = ["-std=c++17", "-Wno-c++20-extensions", "-fsyntax-only", "-DATTN_EXT_WITH_CUDA"]


def find_cuda_home():
    for cand in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if cand and (Path(cand) / "bin" / "nvcc").exists():
            return Path(cand)
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    # Resolve wrapper scripts (e.g. /usr/local/bin/nvcc -> /usr/local/cuda-X/bin/nvcc).
    out = subprocess.run(
        [nvcc, "--dryrun", "-E", "-x", "cu", os.devnull], capture_output=True, text=True
    )
    for line in (out.stdout + out.stderr).splitlines():
        if "TOP=" in line:
            return Path(line.split("TOP=", 1)[1].strip()).resolve()
    return Path(nvcc).resolve().parent.parent


def include_flags():
    """-I flags of torch's headers, csrc/ and the CUTLASS headers (found by setup.py's own
    rule), or None without the CUTLASS headers."""
    from torch.utils import cpp_extension

    sys.path.insert(0, str(ROOT))
    from setup import cutlass_include

    cutlass = cutlass_include()
    if cutlass is None:
        return None
    return [f"-I{p}" for p in cpp_extension.include_paths()] + [
        f"-I{ROOT / 'csrc'}",
        f"-I{cutlass}",
    ]


def gencode(arch: str) -> list:
    num = arch.removeprefix("sm_")
    return [f"-gencode=arch=compute_{num},code=sm_{num}"]


INSTANTIATIONS = Path("csrc") / "attention" / "cuda" / "instantiations"
# The element type whose instantiation of each kernel kind --sample-arch compiles.
SAMPLE_DTYPE = "bf16"


def kernel_kind(src: Path) -> str:
    """fwd_cute_bf16_hd128.cu -> fwd_cute: an instantiation file's kernel template."""
    return src.stem.split(f"_{SAMPLE_DTYPE}")[0] if f"_{SAMPLE_DTYPE}" in src.stem else ""


def sampled(sources: list) -> set:
    """The sources --sample-arch compiles: every one outside the instantiations folder, and per
    kernel kind the first bf16 instantiation in file order."""
    chosen, kinds = set(), set()
    for src in sorted(sources):
        if src.relative_to(ROOT).parent != INSTANTIATIONS:
            chosen.add(src)
            continue
        kind = kernel_kind(src)
        if kind and kind not in kinds:
            kinds.add(kind)
            chosen.add(src)
    return chosen


def run(cmd):
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--arch", nargs="+", default=list(DEFAULT_ARCHS))
    ap.add_argument(
        "--sample-arch",
        nargs="+",
        default=[],
        help="architectures to compile only outside the instantiations and for one "
        "instantiation per kernel kind (see above)",
    )
    ap.add_argument(
        "--jobs", type=int, default=int(os.environ.get("MAX_JOBS", os.cpu_count() or 1))
    )
    ap.add_argument(
        "--only",
        nargs="+",
        default=[],
        metavar="PATH",
        help="compile only the sources whose csrc-relative path contains one of these strings",
    )
    args = ap.parse_args(argv)

    cuda_home = find_cuda_home()
    if cuda_home is None:
        print("check_cuda_compile: no CUDA toolkit (nvcc) found")
        return 2
    includes = include_flags()
    if includes is None:
        print(
            "check_cuda_compile: no CUTLASS headers for the CuTe kernels "
            "(pip install --no-deps nvidia-cutlass==4.2.0.0, as tools/bootstrap.sh does)"
        )
        return 1
    nvcc = str(cuda_home / "bin" / "nvcc")
    cu = sorted((ROOT / "csrc").rglob("*.cu"))
    # setup.py's rule: the .cpp files of the cuda/ folders are the CUDA build's; the others
    # count when they have a CUDA-only part (under ATTN_EXT_WITH_CUDA)
    cpp = sorted(
        p
        for p in (ROOT / "csrc").rglob("*.cpp")
        if "cuda" in p.relative_to(ROOT).parts[:-1] or "ATTN_EXT_WITH_CUDA" in p.read_text()
    )
    if args.only:

        def selected(path):
            return any(s in str(path.relative_to(ROOT / "csrc")) for s in args.only)

        cu, cpp = [p for p in cu if selected(p)], [p for p in cpp if selected(p)]
    with tempfile.TemporaryDirectory() as tmp:
        stub = Path(tmp) / "stub" / "c10" / "cuda" / "impl"
        stub.mkdir(parents=True)
        (stub / "cuda_cmake_macros.h").write_text(
            "#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n"
        )
        jobs = []
        # One nvcc run per source for every architecture: the front end and the host pass run
        # once (about 20% less time than one run per architecture).
        sample = sampled(cu) if args.sample_arch else set()
        for src in cu:
            archs = [*args.arch, *(args.sample_arch if src in sample else [])]
            gencodes = [flag for arch in archs for flag in gencode(arch)]
            # named by the path: two families may have kernels of the same file name
            obj = Path(tmp) / ("_".join(src.relative_to(ROOT).parts) + ".o")
            jobs.append(
                (
                    f"{src.relative_to(ROOT)} [{', '.join(archs)}]",
                    [nvcc, "-c", str(src), "-o", str(obj), *gencodes, *NVCC_FLAGS, *includes],
                )
            )
        cxx = os.environ.get("CXX", "c++")
        for src in cpp:
            jobs.append(
                (
                    f"{src.relative_to(ROOT)} [host]",
                    [
                        cxx,
                        str(src),
                        *CXX_FLAGS,
                        *includes,
                        f"-I{cuda_home / 'include'}",
                        f"-idirafter{Path(tmp) / 'stub'}",
                    ],
                )
            )
        # The host syntax checks are the longest jobs: start them first.
        jobs.sort(key=lambda j: not j[0].endswith("[host]"))
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            results = list(pool.map(lambda j: (j[0], *run(j[1])), jobs))
    failed = [(name, out) for name, rc, out, _ in results if rc != 0]
    for name, rc, _, secs in results:
        print(f"{'ok  ' if rc == 0 else 'FAIL'} {secs:6.1f}s  {name}")
    for name, out in failed:
        print(f"\n---- {name}\n{out}")
    print(
        f"\n{len(results) - len(failed)}/{len(results)} CUDA compile jobs succeeded "
        f"(nvcc from {cuda_home}; archs {', '.join(args.arch)}"
        + (f"; sampled for {', '.join(args.sample_arch)}" if args.sample_arch else "")
        + ")"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
