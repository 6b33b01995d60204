#!/usr/bin/env python
"""The SASS of one CUDA source, without a GPU: per kernel, ptxas's registers and spills, the
instruction count of each loop (a backward branch; the spin-waits' short ones left out), and
the opcodes asked for.

Compiles the source to a cubin with tools/check_cuda_compile.py's flags and include paths, then
disassembles it with nvdisasm, which the CUDA toolkit here lacks and PyPI has:

    pip download --no-deps -d .whl nvidia-cuda-nvdisasm    # once; .whl/ is git-ignored
    python dev/sass_report.py attention/cuda/instantiations/fwd_cute_bf16_hd128.cu
    python dev/sass_report.py decoding/cuda/decode_split_kv.cu --arch sm_80 --ops MUFU.EX2,LDL

Each kernel's line names it by the parts of its mangled name given in --tags (default: the
CuTe forward's exp2 policies). What it measured: dev/gpu_notes.md, 2026-11-27 (fourth session).
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import check_cuda_compile as ccc  # noqa: E402  (the compile check's flags and paths)

DEFAULT_OPS = "HMMA.16816.F32.BF16,MUFU.EX2,FSETP.GEU.AND,FMUL,FFMA,LDL,STL,BRA"
INSTR = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
PREDICATE = re.compile(r"^@!?U?P[T0-9]+\s+")


def nvdisasm(tmp: Path) -> str:
    """nvdisasm from the wheel in .whl/, unpacked into tmp."""
    wheels = sorted((ROOT / ".whl").glob("nvidia_cuda_nvdisasm-*.whl"))
    if not wheels:
        sys.exit("sass_report: pip download --no-deps -d .whl nvidia-cuda-nvdisasm (see --help)")
    with zipfile.ZipFile(wheels[-1]) as z:
        name = next(n for n in z.namelist() if n.endswith("bin/nvdisasm"))
        path = Path(z.extract(name, tmp))
    path.chmod(0o755)
    return str(path)


def kernels(sass: str) -> dict:
    """function name -> [(address, instruction or None, label or None)] in order."""
    out, cur = {}, None
    for line in sass.splitlines():
        m = re.search(r"\.text\.([A-Za-z0-9_]+)", line)
        if m and ("section" in line or line.strip().endswith(":")):
            cur = m.group(1)
            out[cur] = []
        elif cur is not None:
            m = INSTR.match(line)
            if m:
                out[cur].append((int(m.group(1), 16), m.group(2), None))
            elif re.match(r"\s*\.L_x_\d+:", line):
                out[cur].append((None, None, line.strip()[:-1]))
    return out


def loops(body: list) -> list:
    """(first, last address) of each backward branch's range."""
    at, found = {}, []
    for i, (_, _, label) in enumerate(body):
        if label:
            at[label] = next((a for a, t, _ in body[i + 1 :] if a is not None), None)
    for a, t, _ in body:
        m = t and "BRA" in t and re.search(r"\.L_x_\d+", t)
        if m and at.get(m.group(0)) is not None and at[m.group(0)] < a:
            found.append((at[m.group(0)], a))
    return found


def opcode(instr: str) -> str:
    return PREDICATE.sub("", instr).split()[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("source", help="a .cu path under csrc/")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--ops", default=DEFAULT_OPS, help="comma-separated opcodes to count")
    ap.add_argument("--tags", default="ScaleFirst,FoldScale", help="names for the kernels")
    ap.add_argument(
        "--min-loop", type=int, default=100, help="list loops of at least this many instructions"
    )
    args = ap.parse_args(argv)
    cuda_home, includes = ccc.find_cuda_home(), ccc.include_flags()
    if cuda_home is None or includes is None:
        sys.exit("sass_report: no CUDA toolkit (nvcc) or no CUTLASS headers found")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cubin = tmp / "out.cubin"
        cmd = [
            str(cuda_home / "bin" / "nvcc"),
            "-cubin",
            f"-arch={args.arch}",
            str(ROOT / "csrc" / args.source),
            "-o",
            str(cubin),
            "-Xptxas",
            "-v",
            *ccc.NVCC_FLAGS,
            *includes,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stderr)
            return 1
        resources = [
            re.sub(r"^ptxas info\s+:\s+", "", line)
            for line in proc.stderr.splitlines()
            if "Compiling entry" in line or "registers" in line or "spill" in line
        ]
        print("\n".join(resources))
        sass = subprocess.run(
            [nvdisasm(tmp), "-c", str(cubin)], capture_output=True, text=True, check=True
        ).stdout
    ops, tags = args.ops.split(","), args.tags.split(",")
    for name, body in kernels(sass).items():
        tag = next((t for t in tags if t in name), name[:60])
        counts = collections.Counter(opcode(t) for a, t, _ in body if a is not None)
        print(
            f"{tag}: {sum(counts.values())} instructions, "
            + ", ".join(f"{o} {counts[o]}" for o in ops)
        )
        for lo, hi in loops(body):
            c = collections.Counter(
                opcode(t) for a, t, _ in body if a is not None and lo <= a <= hi
            )
            if sum(c.values()) < args.min_loop:
                continue
            print(
                f"  loop {lo:#x}-{hi:#x}: {sum(c.values())} instructions, "
                + ", ".join(f"{o} {c[o]}" for o in ops)
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
