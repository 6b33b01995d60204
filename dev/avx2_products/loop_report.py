"""The FMA loops GCC made of a CPU kernel: for each function whose name contains a pattern, every
backward branch whose body holds FMAs, with the body's instruction count, FMAs, broadcasts, stack
references and FMAs that take a memory operand (a panel vector reloaded per row instead of held in
a register). A clean AVX2 micro-tile loop of R rows x 2 vectors reads `fma 2R bcast R rsp 0
memfma 0`. Codegen, not timing: isolated bench binaries compile the same header differently from
the extension's translation units (dev/cpu_forward_experiments.md, "Chunk pairs in registers"), so
read the built object.

    python dev/avx2_products/loop_report.py build/temp.*/csrc/attention/cpu/block_kernels.o \
        'avx2::scores_tile('
"""

import re
import subprocess
import sys


def loops(obj: str, pattern: str):
    listing = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", "-C", obj],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for block in re.split(r"\n(?=[0-9a-f]+ <)", listing):
        head = block.split("\n", 1)[0]
        if pattern not in head:
            continue
        yield head, list(_fma_loops(block))


def _fma_loops(block: str):
    code = []
    for line in block.splitlines()[1:]:
        m = re.match(r"\s*([0-9a-f]+):\s*(.*)", line)
        if m:
            code.append((int(m.group(1), 16), m.group(2)))
    index = {addr: i for i, (addr, _) in enumerate(code)}
    for i, (addr, text) in enumerate(code):
        m = re.match(r"(j\w+)\s+([0-9a-f]+)", text)
        if not m or m.group(1) == "jmp":
            continue
        target = int(m.group(2), 16)
        if target > addr or target not in index:
            continue
        body = [t for _, t in code[index[target] : i + 1]]
        fma = sum("vfmadd" in t for t in body)
        if fma:
            yield {
                "at": hex(target),
                "len": len(body),
                "fma": fma,
                "bcast": sum("vbroadcast" in t for t in body),
                "rsp": sum("rsp" in t for t in body),
                "memfma": sum("vfmadd" in t and "(" in t for t in body),
            }


if __name__ == "__main__":
    for head, found in loops(sys.argv[1], sys.argv[2]):
        print(head[:140])
        for loop in found:
            print("  " + " ".join(f"{k} {v}" for k, v in loop.items()))
