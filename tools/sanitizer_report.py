#!/usr/bin/env python
"""Summarises a sanitizer run of tools/sanitize_cpu.sh: the report files ASan/LSan wrote (one
per process, ASAN_OPTIONS log_path) and the pytest output (where UBSan writes, and the count
of tests).

    python tools/sanitizer_report.py LOG_DIR --pytest-log FILE --ours PATTERN [--ours ...]

A leak record is one "Direct leak" or "Indirect leak" block of an LSan report (one allocation
stack, any number of objects). It is ours when any frame of its stack contains one of the
--ours patterns (the extension's module, `attn_ext::`, its source folder): an allocation made
by torch or libgomp on behalf of our code counts as ours too. The others are the process-
lifetime allocations of CPython, torch and whatever else ran; they are counted, grouped by
the module that allocated, and not listed. Errors are ASan/UBSan/LSan error reports other than
LSan's leak report (LSan failing to run counts as an error: its "leaks 0" would mean nothing).

Prints tests executed, errors, leak records total and ours (with their stacks); exits 1 when
there is an error, a leak record of ours, or pytest did not pass.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path
from typing import Dict, List, Tuple

LEAK = re.compile(r"^(Direct|Indirect) leak of (\d+) byte\(s\) in (\d+) object\(s\)")
FRAME = re.compile(r"^\s+#\d+ ")
MODULE = re.compile(r"\{([^{}]*)\}\s*$")  # the stack_trace_format the script sets ends in {%m}
ERROR = re.compile(r"==\d+==ERROR: (\w+): (.*)")
UBSAN = re.compile(r"runtime error: ")
LSAN_FATAL = re.compile(r"LeakSanitizer has encountered a fatal error|Tracer caught signal")
# frames of the sanitizer runtime itself (the allocator's entry points)
RUNTIME = ("libasan", "libubsan", "liblsan", "libsanitizer")
SUMMARY = re.compile(r"^(\d+ [a-z]+(, \d+ [a-z]+)*|no tests ran) in [\d.]+s")
COUNT = re.compile(r"(\d+) (passed|failed|xfailed|xpassed|skipped|deselected|errors?|warnings?)")


class Record:
    def __init__(self, kind: str, header: str, source: str):
        self.kind, self.header, self.source = kind, header, source
        self.frames: List[str] = []
        self.bytes = self.objects = 0

    def text(self) -> str:
        return "\n".join([f"{self.header}   [{self.source}]"] + self.frames)

    def allocating_module(self) -> str:
        for f in self.frames:
            m = MODULE.search(f)
            mod = m.group(1) if m else ""
            if mod and not any(r in mod for r in RUNTIME):
                return Path(mod).name
        return "?"


def parse_lines(lines: List[str], source: str) -> Tuple[List[Record], List[Record], List[str]]:
    """(leak records, error records, warnings) of one report file or log."""
    leaks: List[Record] = []
    errors: List[Record] = []
    warnings: List[str] = []
    current = None
    for line in lines:
        line = line.rstrip("\n")
        if current is not None and FRAME.match(line):
            current.frames.append(line)
            continue
        current = None
        m = LEAK.match(line)
        if m:
            current = Record("leak", line, source)
            current.bytes, current.objects = int(m.group(2)), int(m.group(3))
            leaks.append(current)
            continue
        m = ERROR.search(line)
        if m and not m.group(2).startswith("detected memory leaks"):
            current = Record("error", line.strip(), source)
            errors.append(current)
            continue
        if UBSAN.search(line) or LSAN_FATAL.search(line):
            current = Record("error", line.strip(), source)
            errors.append(current)
            continue
        if "==WARNING:" in line:
            warnings.append(line.split("==WARNING:", 1)[1].strip())
    return leaks, errors, warnings


def tests_executed(log: Path) -> Tuple[int, str]:
    """(passed + failed + xfailed + xpassed, pytest's summary line) from the pytest output."""
    if not log.exists():
        return 0, "(no pytest output)"
    summary = ""
    for line in log.read_text(errors="replace").splitlines():
        if SUMMARY.match(line.strip("= ")):
            summary = line.strip("= ")
    counts: Dict[str, int] = collections.Counter()
    for n, what in COUNT.findall(summary):
        counts[what.rstrip("s") if what.startswith("error") else what] += int(n)
    executed = sum(counts[k] for k in ("passed", "failed", "xfailed", "xpassed"))
    return executed, summary or "(no summary: pytest did not finish)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log_dir", type=Path, help="the folder of ASan/LSan report files")
    ap.add_argument("--pytest-log", type=Path, required=True)
    ap.add_argument("--pytest-rc", type=int, default=0)
    ap.add_argument("--ours", action="append", required=True, help="substring of our frames")
    args = ap.parse_args(argv)

    files = sorted(p for p in args.log_dir.iterdir() if p.is_file())
    leaks: List[Record] = []
    errors: List[Record] = []
    warnings: List[str] = []
    for path in files + [args.pytest_log]:
        if not path.exists():
            continue
        lk, er, wa = parse_lines(path.read_text(errors="replace").splitlines(), path.name)
        if path == args.pytest_log:
            lk = []  # LSan never writes there; a test's own output might quote a report
        leaks += lk
        errors += er
        warnings += wa
    ours = [r for r in leaks if any(p in f for f in r.frames for p in args.ours)]
    others = collections.Counter(r.allocating_module() for r in leaks if r not in ours)

    executed, summary = tests_executed(args.pytest_log)
    print(f"tests executed: {executed} (pytest: {summary}; exit status {args.pytest_rc})")
    print(f"report files: {len(files)} (one per process that reported)")
    print(f"ASan/UBSan errors: {len(errors)}")
    for r in errors:
        print(r.text())
    total_bytes = sum(r.bytes for r in leaks)
    print(f"leak records: {len(leaks)} total ({total_bytes} bytes), in attn_ext code: {len(ours)}")
    if others:
        top = ", ".join(f"{m} {n}" for m, n in others.most_common(8))
        print(f"  not ours, by allocating module: {top}")
    for r in ours:
        print(r.text())
    for w, n in collections.Counter(warnings).most_common(5):
        print(f"sanitizer warning ({n}x): {w}")
    failed = bool(errors or ours or args.pytest_rc != 0 or executed == 0)
    print("result:", "FAIL" if failed else "clean")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
