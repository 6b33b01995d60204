#!/usr/bin/env python
"""Side-by-side attention benchmark: attn_ext vs torch vs the document's reference.

Three candidates run in one process on the same inputs:

* ``attn_ext``  -- ``attn_ext.attention(q, k, v, causal=...)``
* ``sdpa``      -- ``torch.nn.functional.scaled_dot_product_attention`` (whatever
                   backend torch picks for the device)
* ``doc``       -- the plain reference of document 000 (``softmax(Q K^T / sqrt(d)) V``,
                   causal via ``torch.triu`` of ``-inf``); it materializes the
                   ``Sq x Sk`` score matrix, so it only runs up to ``--doc-max-s``.

Modes: ``fwd`` (forward only, inputs without grad) and ``fwd+bwd`` (forward, then
``loss = (out * grad).sum()`` with a fixed random ``grad`` and backward to q, k, v).
With Sq == Sk, attn_ext's bottom-right causal mask equals torch's top-left one.

The candidates of a cell are timed in interleaved rounds (each round runs each candidate
once), so a slow phase of a shared machine slows them alike. Every cell prints the median
time per candidate, the ratios ``sdpa / attn_ext``
("speedup vs torch", > 1 means attn_ext is faster) and ``doc / attn_ext``, and
the max abs difference between attn_ext and sdpa (output, plus q/k/v grads in
``fwd+bwd``) as a sanity check. The table goes to stdout, to a markdown file
(``--out``) and to a CSV next to it.

``--memory`` instead measures the peak extra memory of one long sequence
(S=32768, D=64, B=H=1, float32) forward and backward, each candidate in a fresh
subprocess (CPU: ``ru_maxrss`` delta; CUDA: ``max_memory_allocated`` delta).

Examples::

    python benchmarks/bench_attention.py --quick          # smoke test, seconds
    python benchmarks/bench_attention.py                  # full CPU grid
    python benchmarks/bench_attention.py --seqlens 512,2048 --dtypes float32
    python benchmarks/bench_attention.py --device cuda    # adds TFLOP/s columns
    python benchmarks/bench_attention.py --memory
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parent.parent
CANDIDATES = ("attn_ext", "sdpa", "doc")
MODES = ("fwd", "fwd+bwd")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def import_attn_ext():
    """Import attn_ext, falling back to the in-place build of this checkout."""
    try:
        import attn_ext
    except ImportError:
        sys.path.insert(0, str(REPO_ROOT))
        import attn_ext
    return attn_ext


# --------------------------------------------------------------------------- candidates


def doc_reference(q, k, v, causal: bool):
    """Document 000's ``scaled_dot_product_attention`` / ``causal_attention``."""
    d_k = q.shape[-1]
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(d_k)
    if causal:
        mask = torch.triu(torch.full_like(scores, float("-inf")), diagonal=1)
        scores = scores + mask
    weights = torch.softmax(scores, dim=-1)
    return weights @ v


def candidate_fn(name: str) -> Callable:
    if name == "attn_ext":
        attn_ext = import_attn_ext()
        return lambda q, k, v, causal: attn_ext.attention(q, k, v, causal=causal)
    if name == "sdpa":
        return lambda q, k, v, causal: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if name == "doc":
        return doc_reference
    raise ValueError(f"unknown candidate {name!r}")


# --------------------------------------------------------------------------- timing


class Timer:
    """Times one call: perf_counter on CPU, CUDA events (plus a synchronize) on GPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def __call__(self, fn: Callable):
        """Returns (seconds, fn's result)."""
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            result = fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3, result
        t0 = time.perf_counter()
        result = fn()
        return time.perf_counter() - t0, result


@dataclass
class Measurement:
    median_s: float
    repeats: int
    result: object  # what the first warmup run returned (for the sanity check)


def measure_interleaved(runs: Dict[str, Callable], timer: Timer, args) -> Dict[str, object]:
    """Warm up every candidate, then time them in rounds, each round running every candidate
    once in turn, so that a slow phase of a shared machine slows all of them alike (timing
    one candidate's repeats after the other's made single cells swing by 2x on the build
    machine). A candidate's result is the median of its rounds, or the exception its warmup
    raised.

    The warmup's duration picks each candidate's repeats: cheap calls repeat until
    ``--target-time`` seconds are spent (at most ``--max-repeats``); expensive ones get the
    minimum (``--min-repeats``, 2 by default). A candidate that has done its repeats sits
    out the remaining rounds. When the first two candidates' medians then lie within
    ``--close-margin`` of each other, the two run further rounds (up to ``--close-repeats``
    each): on a shared machine single calls swing by 10%, and two samples should not decide
    which of two close candidates is faster.
    """
    timer.sync()
    out: Dict[str, object] = {}
    firsts, counts = {}, {}
    for name, run in runs.items():
        try:
            t_est = float("inf")
            for i in range(max(1, args.warmup)):
                t_est, result = timer(run)
                if i == 0:
                    firsts[name] = result
                del result
        except Exception as e:  # keep sweeping; the error lands in the table
            out[name] = e
            continue
        counts[name] = max(args.min_repeats, min(args.max_repeats, int(args.target_time / max(t_est, 1e-9))))
    times: Dict[str, List[float]] = {name: [] for name in counts}
    for r in range(max(counts.values(), default=0)):
        for name in counts:
            if r < counts[name]:
                t, _ = timer(runs[name])
                times[name].append(t)
    pair = list(counts)[:2]

    def close_call() -> bool:
        a, b = (statistics.median(times[name]) for name in pair)
        return abs(a / b - 1.0) < getattr(args, "close_margin", 0.0)

    while (len(pair) == 2 and min(len(times[name]) for name in pair) < getattr(args, "close_repeats", 0)
           and close_call()):
        for name in pair:
            t, _ = timer(runs[name])
            times[name].append(t)
    for name in counts:
        out[name] = Measurement(statistics.median(times[name]), len(times[name]), firsts[name])
    return out


def measure(run: Callable, timer: Timer, args) -> Measurement:
    """One candidate alone (the other drivers' use): warmup, then the median of its repeats."""
    m = measure_interleaved({"run": run}, timer, args)["run"]
    if isinstance(m, Exception):
        raise m
    return m


def make_runner(fn: Callable, mode: str, q, k, v, grad, causal: bool) -> Callable:
    """A zero-argument callable running one forward (or forward+backward)."""
    if mode == "fwd":
        def run():
            with torch.no_grad():
                return (fn(q, k, v, causal),)
        return run

    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def run():
        out = fn(qg, kg, vg, causal)
        dq, dk, dv = torch.autograd.grad((out * grad).sum(), (qg, kg, vg))
        return out.detach(), dq, dk, dv
    return run


def max_abs_diff(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


def attention_flops(b, h, sq, sk, d, causal: bool, mode: str) -> float:
    """Forward 4*B*H*Sq*Sk*D, halved for causal; backward counts 2.5x forward."""
    fwd = 4.0 * b * h * sq * sk * d * (0.5 if causal else 1.0)
    return fwd if mode == "fwd" else fwd * 3.5


# --------------------------------------------------------------------------- progress


class SimpleProgress:
    """Minimal stand-in for tqdm (which is not a dependency), drawn on stderr."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.n = total, desc, 0
        self.postfix = ""
        self.t0 = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self._draw()

    def _draw(self):
        if not self.tty:  # a log file gets only the per-cell lines from write()
            return
        width = 24
        filled = int(width * self.n / max(1, self.total))
        elapsed = time.perf_counter() - self.t0
        line = (f"{self.desc} [{'#' * filled}{'.' * (width - filled)}] "
                f"{self.n}/{self.total} {elapsed:6.0f}s {self.postfix}")
        sys.stderr.write("\r\033[K" + line)
        sys.stderr.flush()

    def set_postfix_str(self, s: str):
        self.postfix = s
        self._draw()

    def update(self, n: int = 1):
        self.n += n
        self._draw()

    def write(self, s: str):
        if self.tty:
            sys.stderr.write("\r\033[K" + s + "\n")
            self._draw()
        else:
            elapsed = time.perf_counter() - self.t0
            sys.stderr.write(f"[{self.n + 1}/{self.total} {elapsed:.0f}s] {s}\n")
            sys.stderr.flush()

    def close(self):
        if self.tty:
            sys.stderr.write("\n")
        sys.stderr.flush()


def progress_bar(total: int, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:
        return SimpleProgress(total, desc)
    bar = tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True)
    bar.write = lambda s: tqdm.write(s, file=sys.stderr)
    return bar


# --------------------------------------------------------------------------- sweep


@dataclass
class Cell:
    dtype: str
    d: int
    s: int
    causal: bool
    mode: str
    ms: Dict[str, Optional[float]] = field(default_factory=dict)  # None = skipped / failed
    note: Dict[str, str] = field(default_factory=dict)            # "skip" / error text
    repeats: Dict[str, int] = field(default_factory=dict)
    max_diff: Optional[float] = None
    tflops: Dict[str, Optional[float]] = field(default_factory=dict)

    def ratio(self, other: str) -> Optional[float]:
        ours, theirs = self.ms.get("attn_ext"), self.ms.get(other)
        return theirs / ours if ours and theirs else None


def make_inputs(b, h, s, d, dtype, device, seed):
    """q, k, v and the fixed upstream grad, drawn on the CPU so every device sees the same."""
    torch.manual_seed(seed)
    q, k, v, grad = (torch.randn(b, h, s, d) for _ in range(4))
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, grad)]


def run_cell(cell: Cell, inputs, fns, timer: Timer, args) -> Cell:
    q, k, v, grad = inputs
    runs = {}
    for name, fn in fns.items():
        if name == "doc" and cell.s > args.doc_max_s:
            cell.ms[name], cell.note[name] = None, "skip"
            continue
        runs[name] = make_runner(fn, cell.mode, q, k, v, grad, cell.causal)
    results = {}
    for name, m in measure_interleaved(runs, timer, args).items():
        if isinstance(m, Exception):
            cell.ms[name], cell.note[name] = None, f"error: {type(m).__name__}: {m}"
            continue
        cell.ms[name], cell.repeats[name] = m.median_s * 1e3, m.repeats
        if name in ("attn_ext", "sdpa"):
            results[name] = m.result
        if timer.cuda:
            flops = attention_flops(args.batch, args.heads, cell.s, cell.s, cell.d, cell.causal, cell.mode)
            cell.tflops[name] = flops / m.median_s / 1e12
    if "attn_ext" in results and "sdpa" in results:
        cell.max_diff = max_abs_diff(results["attn_ext"], results["sdpa"])
    return cell


def sweep(args) -> List[Cell]:
    device = torch.device(args.device)
    timer = Timer(device)
    fns = {name: candidate_fn(name) for name in args.candidates}
    grid = [(dt, d, s) for dt in args.dtypes for d in args.head_dims for s in args.seqlens]
    total = len(grid) * len(args.causal) * len(args.modes)
    bar = progress_bar(total, "attention")
    cells = []
    for dt, d, s in grid:
        inputs = make_inputs(args.batch, args.heads, s, d, DTYPES[dt], device, args.seed)
        for causal in args.causal:
            for mode in args.modes:
                cell = Cell(dt, d, s, causal, mode)
                bar.set_postfix_str(f"{dt} D={d} S={s} causal={causal} {mode}")
                cells.append(run_cell(cell, inputs, fns, timer, args))
                bar.write(format_progress_line(cell))
                bar.update(1)
        del inputs
    bar.close()
    return cells


# --------------------------------------------------------------------------- report


def fmt_ms(cell: Cell, name: str) -> str:
    if name not in cell.ms:
        return "-"
    if cell.ms[name] is None:
        return "skip" if cell.note.get(name) == "skip" else "error"
    return f"{cell.ms[name]:.2f}"


def fmt_ratio(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}x"


def fmt_opt(x: Optional[float], spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_progress_line(cell: Cell) -> str:
    times = "  ".join(f"{n} {fmt_ms(cell, n)}" for n in cell.ms)
    return (f"{cell.dtype:8s} D={cell.d:<3d} S={cell.s:<5d} causal={cell.causal!s:5s} "
            f"{cell.mode:7s} | ms: {times} | sdpa/ext {fmt_ratio(cell.ratio('sdpa'))}")


def table_columns(with_tflops: bool):
    cols = [
        ("dtype", lambda c: c.dtype),
        ("D", lambda c: str(c.d)),
        ("S", lambda c: str(c.s)),
        ("causal", lambda c: str(c.causal)),
        ("mode", lambda c: c.mode),
        ("ms attn_ext", lambda c: fmt_ms(c, "attn_ext")),
        ("ms sdpa", lambda c: fmt_ms(c, "sdpa")),
        ("ms doc", lambda c: fmt_ms(c, "doc")),
        ("sdpa/attn_ext", lambda c: fmt_ratio(c.ratio("sdpa"))),
        ("doc/attn_ext", lambda c: fmt_ratio(c.ratio("doc"))),
        ("max abs diff vs sdpa", lambda c: fmt_opt(c.max_diff, ".1e")),
    ]
    if with_tflops:
        for name in CANDIDATES:
            cols.append((f"TFLOP/s {name}", lambda c, n=name: fmt_opt(c.tflops.get(n), ".1f")))
    return cols


def render_table(cells: List[Cell], with_tflops: bool, markdown: bool) -> str:
    cols = table_columns(with_tflops)
    rows = [[h for h, _ in cols]] + [[f(c) for _, f in cols] for c in cells]
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = []
    for i, row in enumerate(rows):
        cells_txt = [txt.rjust(w) for txt, w in zip(row, widths)]
        lines.append(("| " + " | ".join(cells_txt) + " |") if markdown else "  ".join(cells_txt))
        if i == 0:
            sep = ["-" * (w - 1) + ":" for w in widths]
            lines.append(("| " + " | ".join(sep) + " |") if markdown else "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def ratio_stats(ratios: List[float]) -> str:
    if not ratios:
        return "n/a"
    return f"min {min(ratios):.2f}x, median {statistics.median(ratios):.2f}x over {len(ratios)} cells"


def summary_lines(cells: List[Cell], args) -> List[str]:
    lines = ["speedup vs torch SDPA (sdpa/attn_ext, >1 = attn_ext faster):"]
    for label, subset in [("all", cells)] + [(m, [c for c in cells if c.mode == m]) for m in args.modes]:
        lines.append(f"  {label:8s} {ratio_stats([c.ratio('sdpa') for c in subset if c.ratio('sdpa')])}")
    doc_s = [c.s for c in cells if c.ratio("doc")]
    if doc_s:
        s_ref = 2048 if 2048 in doc_s else max(doc_s)
        lines.append(f"speedup vs document reference at S={s_ref} (doc/attn_ext):")
        for label, subset in [("all", cells)] + [(m, [c for c in cells if c.mode == m]) for m in args.modes]:
            ratios = [c.ratio("doc") for c in subset if c.s == s_ref and c.ratio("doc")]
            lines.append(f"  {label:8s} {ratio_stats(ratios)}")
    diffs = [c.max_diff for c in cells if c.max_diff is not None]
    if diffs:
        lines.append(f"max |attn_ext - sdpa| over all cells: {max(diffs):.2e}")
    errors = [(c, n, msg) for c in cells for n, msg in c.note.items() if msg != "skip"]
    for c, n, msg in errors:
        lines.append(f"ERROR {n} {c.dtype} D={c.d} S={c.s} causal={c.causal} {c.mode}: {msg}")
    return lines


def environment_lines(args) -> List[str]:
    try:
        ext = import_attn_ext()
        ext_version = getattr(ext, "__version__", "unknown")
        cpu_kernels = f"{ext._C.cpu_block_kernels()} block products, "
    except Exception as e:
        ext_version, cpu_kernels = f"not importable ({e})", ""
    device = args.device
    if device.startswith("cuda") and torch.cuda.is_available():
        device += f" ({torch.cuda.get_device_name(torch.device(device))})"
    else:
        device += (f" ({platform.processor() or platform.machine()}, {cpu_kernels}{torch.get_num_threads()} threads, "
                   f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start)")
    lines = [
        f"date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"attn_ext {ext_version}, torch {torch.__version__}, python {platform.python_version()}",
        f"device: {device}",
        "command: " + " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
    ]
    if not args.memory:
        lines.insert(3, f"B={args.batch} H={args.heads}, Sq=Sk; doc reference up to S={args.doc_max_s}; "
                        f"median of >= {args.min_repeats} repeats after {args.warmup} warmup "
                        f"(>= {args.close_repeats} when the first two candidates are within "
                        f"{args.close_margin:.0%})")
    return lines


def write_outputs(cells: List[Cell], args, env: List[str], summary: List[str]):
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with_tflops = args.device.startswith("cuda")
    md = ["# attention benchmark", ""] + [f"- {line}" for line in env] + [""]
    md += [render_table(cells, with_tflops, markdown=True), "", "```"] + summary + ["```", ""]
    out.write_text("\n".join(md))

    csv_path = out.with_suffix(".csv")
    with csv_path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["dtype", "D", "S", "causal", "mode", "B", "H"]
                   + [f"ms_{n}" for n in CANDIDATES] + [f"repeats_{n}" for n in CANDIDATES]
                   + ["speedup_vs_sdpa", "speedup_vs_doc", "max_abs_diff_vs_sdpa"]
                   + [f"tflops_{n}" for n in CANDIDATES] + ["notes"])
        for c in cells:
            w.writerow([c.dtype, c.d, c.s, c.causal, c.mode, args.batch, args.heads]
                       + [c.ms.get(n) for n in CANDIDATES] + [c.repeats.get(n) for n in CANDIDATES]
                       + [c.ratio("sdpa"), c.ratio("doc"), c.max_diff]
                       + [c.tflops.get(n) for n in CANDIDATES]
                       + ["; ".join(f"{n}: {m}" for n, m in c.note.items())])
    print(f"\nwrote {out} and {csv_path}")


# --------------------------------------------------------------------------- memory mode


def current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def max_rss_mb() -> float:
    # ru_maxrss is KiB on Linux (bytes on macOS).
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**20


def memory_child(args) -> dict:
    """Runs in a fresh process: peak extra memory of one forward and one backward."""
    device = torch.device(args.device)
    fn = candidate_fn(args.memory_child)
    s, d, dtype = args.memory_seqlen, args.memory_head_dim, torch.float32
    shape = (1, 1, s, d)

    # Warm up on a tiny problem so one-time initialisation is not counted.
    tiny = [torch.randn(1, 1, 64, d, device=device, requires_grad=True) for _ in range(3)]
    fn(*tiny, args.memory_causal).sum().backward()
    del tiny

    torch.manual_seed(args.seed)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device=device, dtype=dtype)

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
        peak = lambda: torch.cuda.max_memory_allocated() / 2**20  # noqa: E731
    else:
        base = max_rss_mb()
        peak = max_rss_mb
    info = {"candidate": args.memory_child, "baseline_mb": base}
    if device.type == "cpu":
        info["baseline_current_rss_mb"] = current_rss_mb()

    t0 = time.perf_counter()
    out = fn(q, k, v, args.memory_causal)
    if device.type == "cuda":
        torch.cuda.synchronize()
    info["fwd_s"] = time.perf_counter() - t0
    info["fwd_peak_extra_mb"] = peak() - base

    t0 = time.perf_counter()
    (out * grad).sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    info["bwd_s"] = time.perf_counter() - t0
    info["fwd_bwd_peak_extra_mb"] = peak() - base
    return info


def run_memory_subprocess(name: str, args) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--memory-child", name,
           "--device", args.device, "--memory-seqlen", str(args.memory_seqlen),
           "--memory-head-dim", str(args.memory_head_dim), "--seed", str(args.seed)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.memory_causal:
        cmd.append("--memory-causal")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"candidate": name, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def memory_mode(args) -> int:
    s, d = args.memory_seqlen, args.memory_head_dim
    scores_mb = s * s * 4 / 2**20
    what = "peak RSS delta (ru_maxrss)" if args.device == "cpu" else "max_memory_allocated delta"
    env = environment_lines(args)
    header = [f"memory: B=1 H=1 S={s} D={d} float32 causal={args.memory_causal}, {what}, "
              f"baseline after allocating q/k/v/grad; each candidate in a fresh subprocess",
              f"(one materialized S x S float32 score matrix would be {scores_mb:.0f} MB; "
              f"target for attn_ext: < {args.memory_target_mb:.0f} MB)"]
    print("\n".join(env + header))
    rows = [["candidate", "fwd peak extra MB", "fwd+bwd peak extra MB", "fwd s", "bwd s", "target"]]
    failed = False
    for name in args.memory_candidates:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        info = run_memory_subprocess(name, args)
        if "error" in info:
            rows.append([name, "error", "error", "-", "-", info["error"]])
            failed |= name == "attn_ext"
            continue
        peak_mb = max(info["fwd_peak_extra_mb"], info["fwd_bwd_peak_extra_mb"])
        verdict = "-"
        if name == "attn_ext":
            ok = peak_mb < args.memory_target_mb
            verdict, failed = ("PASS" if ok else "FAIL"), failed or not ok
        rows.append([name, f"{info['fwd_peak_extra_mb']:.1f}", f"{info['fwd_bwd_peak_extra_mb']:.1f}",
                     f"{info['fwd_s']:.2f}", f"{info['bwd_s']:.2f}", verdict])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    table = ["| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    table.insert(1, "| " + " | ".join("-" * (w - 1) + ":" for w in widths) + " |")
    print("\n".join(table))

    out = Path(args.out or REPO_ROOT / "benchmarks" / "results" / f"memory_{args.device.split(':')[0]}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(["# attention peak memory", ""] + [f"- {x}" for x in env + header]
                             + [""] + table + [""]))
    print(f"\nwrote {out}")
    return 1 if failed else 0


# --------------------------------------------------------------------------- CLI


def csv_list(kind):
    return lambda s: [kind(x) for x in s.split(",") if x.strip()]


def parse_bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "causal"):
        return True
    if s.lower() in ("0", "false", "no", "full"):
        return False
    raise argparse.ArgumentTypeError(f"not a bool: {s!r}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("grid")
    g.add_argument("--dtypes", type=csv_list(str), default=["float32", "bfloat16"])
    g.add_argument("--head-dims", type=csv_list(int), default=[64, 128])
    g.add_argument("--seqlens", type=csv_list(int), default=[512, 2048, 8192], help="Sq = Sk")
    g.add_argument("--causal", type=csv_list(parse_bool), default=[False, True])
    g.add_argument("--modes", type=csv_list(str), default=list(MODES), help="fwd,fwd+bwd")
    g.add_argument("--batch", type=int, default=1)
    g.add_argument("--heads", type=int, default=16)
    g.add_argument("--candidates", type=csv_list(str), default=list(CANDIDATES))
    g.add_argument("--doc-max-s", type=int, default=2048,
                   help="run the document reference (which materializes Sq x Sk scores) only up to this S")
    g.add_argument("--quick", action="store_true",
                   help="tiny grid for smoke testing (overrides the grid options)")

    t = p.add_argument_group("timing")
    t.add_argument("--device", default="cpu")
    t.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0 = torch default)")
    t.add_argument("--warmup", type=int, default=1)
    t.add_argument("--min-repeats", type=int, default=2)
    t.add_argument("--max-repeats", type=int, default=None, help="default 50 (CPU), 200 (CUDA)")
    t.add_argument("--target-time", type=float, default=None,
                   help="seconds of timed repeats per candidate and cell (default 1.5)")
    t.add_argument("--close-margin", type=float, default=0.15,
                   help="the first two candidates' medians within this fraction of each other "
                        "count as a close call")
    t.add_argument("--close-repeats", type=int, default=7,
                   help="rounds the two candidates of a close call run at least (0: none extra)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--out", default=None,
                   help="markdown output (default benchmarks/results/attention_<device>[_quick].md); "
                        "the CSV goes next to it")

    m = p.add_argument_group("memory mode")
    m.add_argument("--memory", action="store_true", help="measure peak memory of one long sequence instead")
    m.add_argument("--memory-seqlen", type=int, default=32768)
    m.add_argument("--memory-head-dim", type=int, default=64)
    m.add_argument("--memory-causal", action="store_true")
    m.add_argument("--memory-candidates", type=csv_list(str), default=["attn_ext", "sdpa"])
    m.add_argument("--memory-target-mb", type=float, default=1024.0)
    m.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)

    args = p.parse_args(argv)
    if args.quick:
        args.dtypes, args.head_dims, args.seqlens = ["float32", "bfloat16"], [64], [128, 256]
        args.heads = min(args.heads, 4)
        args.target_time = args.target_time or 0.1
        args.max_repeats = args.max_repeats or 5
    cuda = args.device.startswith("cuda")
    args.target_time = args.target_time or 1.5
    args.max_repeats = args.max_repeats or (200 if cuda else 50)
    if args.out is None and not args.memory:
        suffix = "_quick" if args.quick else ""
        args.out = str(REPO_ROOT / "benchmarks" / "results" / f"attention_{args.device.split(':')[0]}{suffix}.md")
    for name in args.dtypes:
        if name not in DTYPES:
            p.error(f"--dtypes: unknown dtype {name!r} (choose from {', '.join(DTYPES)})")
    for name in args.candidates + args.memory_candidates:
        if name not in CANDIDATES:
            p.error(f"unknown candidate {name!r} (choose from {', '.join(CANDIDATES)})")
    for mode in args.modes:
        if mode not in MODES:
            p.error(f"--modes: unknown mode {mode!r} (choose from {', '.join(MODES)})")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_child:
        print(json.dumps(memory_child(args)))
        return 0
    if args.memory:
        return memory_mode(args)

    env = environment_lines(args)
    print("\n".join(env), flush=True)
    cells = sweep(args)
    summary = summary_lines(cells, args)
    print()
    print(render_table(cells, args.device.startswith("cuda"), markdown=False))
    print()
    print("\n".join(summary))
    write_outputs(cells, args, env, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
