"""The one benchmark harness: the timer, device sync, copy bandwidth, the peak-memory child
process, the environment header, a progress bar and the output (Markdown table, CSV history,
PNG plot) of ``benchmarks/bench_*.py`` and of ``python -m attn_ext``'s timing table.

Timing rule (the developers' guide): candidates are timed in interleaved rounds in one process,
each round calling every candidate once (in alternating order), after warm-up calls; a
candidate's time is the median of its rounds and the ratio of two candidates the median of their
per-round ratios, so that a slow phase of a shared machine lands on both alike. A ratio within
``PARITY_BAND`` of 1 is parity.

Output of a driver run (``Bench.finish``), in its results folder:

- ``<family>_<device>.md``: the current table of that family on that device (overwritten);
- ``history.csv``: one row per candidate and cell appended (columns ``HISTORY_COLUMNS``, the same
  for every family);
- ``<family>_<device>.png``: ratio vs S, the newest measurement of each cell on the newest run's
  machine (``python -m attn_ext.testing.harness plot`` redraws every family from the history).

Plain PyTorch and the standard library; tqdm (progress bar) and matplotlib (PNG) are optional and
imported when used: without them the bar or the plot is skipped with a one-line notice.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import torch

PARITY_BAND = 0.05
# Columns of history.csv. The cell's parameters every family shares have their own column (S is
# the sequence, prompt or context length); the others go to ``params`` as ``key=value;...``.
# ratio = this candidate's time / ratio_to's time (> 1: ratio_to is faster), the median of the
# per-round ratios.
PARAM_COLUMNS = ("case", "dtype", "B", "H", "S", "D", "causal", "mode")
FIGURE_COLUMNS = ("tflops", "gbps", "peak_mb")
HISTORY_COLUMNS = (
    ("date", "machine", "threads", "commit", "family", "device")
    + PARAM_COLUMNS
    + ("candidate", "ms", "ratio_to", "ratio")
    + FIGURE_COLUMNS
    + ("params", "note")
)
HISTORY_FILE = "history.csv"
# ISA flags of /proc/cpuinfo that decide which CPU kernels can run.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
# Bytes copied per repeat when measuring the device's copy bandwidth: large enough to leave
# every cache, small enough for any GPU.
COPY_BYTES = 1 << 30
COPY_REPEATS = 5
# Calls run on a side stream before a CUDA graph captures fn (lazy initialization, workspaces).
CUDA_GRAPH_WARMUP = 3


# --------------------------------------------------------------------------- timing


def sync(device) -> None:
    """Waits for the device's queued work (CUDA kernels run asynchronously)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def cuda_kernel_names(fn: Callable[[], object]) -> List[str]:
    """The names of the CUDA kernels that fn() launched (torch.profiler's CUDA activity): how the
    GPU tests and dev/ checks tell which kernel served a call."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.key for e in prof.key_averages()]


# The environment variable that lets compiled-but-unverified CUDA kernels serve calls
# (csrc/common/cuda/unverified.h): read by the ops at each call (and at a CUDA graph's capture).
UNVERIFIED_CUDA = "ATTN_EXT_UNVERIFIED_CUDA"


@contextlib.contextmanager
def unverified_cuda():
    """ATTN_EXT_UNVERIFIED_CUDA=1 inside the block (restored after): the self-check's cases and
    the benchmark candidates that run kernel code not yet verified on a GPU."""
    before = os.environ.get(UNVERIFIED_CUDA)
    os.environ[UNVERIFIED_CUDA] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[UNVERIFIED_CUDA]
        else:
            os.environ[UNVERIFIED_CUDA] = before


def with_unverified_cuda(fn: Callable[..., object]) -> Callable[..., object]:
    """fn with ATTN_EXT_UNVERIFIED_CUDA=1 set during each call: a benchmark candidate that times
    a gated kernel beside the default one in the same process."""

    def call(*args, **kwargs):
        with unverified_cuda():
            return fn(*args, **kwargs)

    return call


def cuda_graph_replay(fn: Callable[[], object], reps: int) -> Callable[[], object]:
    """A zero-argument call that replays one CUDA graph of ``reps`` back-to-back calls of fn and
    returns the last call's result: timed, its time / reps is the device time of one call without
    the host's launch and dispatch overhead (which decides a small call's wall time: a decode step
    at batch 1). fn must be capturable (no host synchronization); it is warmed up on a side stream
    first, as capture requires."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(CUDA_GRAPH_WARMUP):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            out = fn()

    def replay():
        graph.replay()
        return out

    return replay


def call_seconds(fn: Callable[[], object], device, clock: Callable[[], float] = time.perf_counter):
    """(seconds, result) of one call of ``fn``, the device synchronized before and after."""
    sync(device)
    t0 = clock()
    result = fn()
    sync(device)
    return clock() - t0, result


@dataclass
class Timing:
    """What ``time_interleaved`` measured: per round, the seconds of each candidate that ran in
    it; per candidate, the result of its first warm-up call or the error that stopped it."""

    rounds: List[Dict[str, float]] = field(default_factory=list)
    results: Dict[str, object] = field(default_factory=dict)
    errors: Dict[str, str] = field(default_factory=dict)

    def times(self, name: str) -> List[float]:
        return [r[name] for r in self.rounds if name in r]

    def median_s(self, name: str) -> Optional[float]:
        ts = self.times(name)
        return statistics.median(ts) if ts else None

    def ms(self, name: str) -> Optional[float]:
        s = self.median_s(name)
        return None if s is None else 1e3 * s

    def ratio(self, name: str, to: str) -> Optional[float]:
        """Median over the rounds both ran of time(name) / time(to): > 1 means ``to`` is faster."""
        rs = [r[name] / r[to] for r in self.rounds if name in r and to in r and r[to] > 0]
        return statistics.median(rs) if rs else None


def divided(timing: Timing, calls: int, errors: Optional[Dict[str, str]] = None) -> Timing:
    """``timing`` per unit of a timed call: every time divided by the ``calls`` (layers, steps,
    graph replays, repeated calls) it went through, with ``errors`` added to its own."""
    if calls == 1 and not errors:
        return timing
    return Timing(
        rounds=[{n: t / calls for n, t in r.items()} for r in timing.rounds],
        results=timing.results,
        errors={**timing.errors, **(errors or {})},
    )


def repeated(fn: Callable[[], object], calls: int) -> Callable[[], object]:
    """A zero-argument call running ``fn`` ``calls`` times back to back (calls too short for one
    timer read each: time them together and take :func:`divided`); returns the last result."""
    if calls < 1:
        raise ValueError(f"calls must be >= 1, got {calls}")

    def run():
        for _ in range(calls - 1):
            fn()
        return fn()

    return run


def error_text(e: BaseException) -> str:
    """An exception as one short line: its type and the first line of its message."""
    first = str(e).splitlines()[0][:120] if str(e) else ""
    return f"{type(e).__name__}: {first}"


def time_interleaved(
    candidates: Dict[str, Callable[[], object]],
    device,
    *,
    warmup: int = 1,
    min_rounds: int = 3,
    max_rounds: int = 50,
    target_s: float = 1.0,
    close_margin: float = 0.0,
    close_rounds: int = 0,
    clock: Callable[[], float] = time.perf_counter,
) -> Timing:
    """Times zero-argument callables in interleaved rounds (see the module docstring).

    Each candidate first runs ``warmup`` calls (its first result is kept for sanity checks; an
    exception drops it, recorded in ``errors``). The last warm-up call's time picks how many
    rounds it runs: ``target_s`` worth, clamped to [min_rounds, max_rounds] (``min_rounds``
    without warm-up); a candidate that has done its rounds sits out the rest. Rounds alternate
    the calling order so no candidate always runs right after another. When the first two
    candidates' medians lie within ``close_margin`` of each other, both run further rounds up to
    ``close_rounds``: two samples should not decide which of two close candidates is faster.
    """
    if min_rounds < 1 or max_rounds < min_rounds or warmup < 0:
        raise ValueError(
            f"need 1 <= min_rounds <= max_rounds and warmup >= 0, got "
            f"{min_rounds}, {max_rounds}, {warmup}"
        )
    timing = Timing()
    counts: Dict[str, int] = {}
    for name, fn in candidates.items():
        try:
            t = None
            for i in range(warmup):
                t, result = call_seconds(fn, device, clock)
                if i == 0:
                    timing.results[name] = result
                del result
        except Exception as e:  # a candidate that cannot run this cell: reported, not fatal
            timing.errors[name] = error_text(e)
            continue
        counts[name] = (
            min_rounds
            if t is None
            else max(min_rounds, min(max_rounds, int(target_s / max(t, 1e-9))))
        )

    def one_round(names: Sequence[str]) -> None:
        order = list(names) if len(timing.rounds) % 2 == 0 else list(reversed(names))
        times = {}
        for name in order:
            try:
                times[name], _ = call_seconds(candidates[name], device, clock)
            except Exception as e:
                timing.errors[name] = error_text(e)
                counts.pop(name)
        timing.rounds.append(times)

    for r in range(max(counts.values(), default=0)):
        one_round([n for n in candidates if counts.get(n, 0) > r])
    pair = [n for n in candidates if n in counts][:2]
    while (
        close_rounds
        and len(pair) == 2
        and all(n in counts for n in pair)
        and min(len(timing.times(n)) for n in pair) < close_rounds
        and abs(timing.median_s(pair[0]) / timing.median_s(pair[1]) - 1.0) < close_margin
    ):
        one_round(pair)
    return timing


def copy_bandwidth_gbs(device, nbytes: int = COPY_BYTES) -> float:
    """The device's measured copy bandwidth in GB/s (read + write of a large buffer, best of
    ``COPY_REPEATS``): the roof that a memory-bound kernel's achieved GB/s is read against."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(call_seconds(lambda: dst.copy_(src), device)[0] for _ in range(COPY_REPEATS))
    return 2 * nbytes / best / 1e9


def make_step(
    fn: Callable[..., torch.Tensor],
    mode: str,
    inputs: Sequence[torch.Tensor],
    grad: Optional[torch.Tensor] = None,
    params: Sequence[torch.Tensor] = (),
):
    """A zero-argument call of ``fn(*inputs)`` in ``mode``: ``fwd`` under ``no_grad``, returning
    ``(out,)``; ``fwd+bwd`` on leaf copies of the inputs, returning ``(out, *grads)``, the
    gradients of ``(out * grad).sum()`` to the inputs and ``params``. Without ``grad`` a fixed
    random one of the output's shape is drawn at the first call (its own seeded generator, so
    every candidate gets the same)."""
    if mode == "fwd":

        def fwd():
            with torch.no_grad():
                return (fn(*inputs),)

        return fwd
    if mode != "fwd+bwd":
        raise ValueError(f"mode must be 'fwd' or 'fwd+bwd', got {mode!r}")
    leaves = [t.detach().requires_grad_() for t in inputs]
    upstream = [grad]

    def fwd_bwd():
        out = fn(*leaves)
        if upstream[0] is None:
            gen = torch.Generator(device=out.device).manual_seed(0)
            upstream[0] = torch.randn(out.shape, generator=gen, device=out.device, dtype=out.dtype)
        # allow_unused: a parameter a candidate never reads (e.g. a bias it folds) has no grad
        grads = torch.autograd.grad(out, [*leaves, *params], upstream[0], allow_unused=True)
        return (out.detach(), *grads)

    return fwd_bwd


def max_abs_diff(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """Largest |a - b| over pairs of tensors (a sanity check between candidates' results)."""
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


def attention_flops(b: int, h: int, sq: int, sk: int, d: int, causal: bool, mode: str) -> float:
    """Useful FLOPs of attention: forward 4 B H Sq Sk D (halved when causal), backward 2.5x the
    forward (FlashAttention's count); ``mode`` is fwd, bwd or fwd+bwd."""
    fwd = 4.0 * b * h * sq * sk * d * (0.5 if causal else 1.0)
    return {"fwd": fwd, "bwd": 2.5 * fwd, "fwd+bwd": 3.5 * fwd}[mode]


# --------------------------------------------------------------------------- peak memory


def _vm_hwm_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


class PeakMeter:
    """Peak memory above a baseline, in this process. CPU: the growth of the peak resident size
    ``VmHWM``, lowered to the current size at ``reset`` (Linux >= 4.0). Not ``ru_maxrss``: after
    ``subprocess``'s vfork + exec the kernel carries the parent's high-water mark into the
    child's, so a child of a parent that already ran a big candidate would read no growth. CUDA:
    ``max_memory_allocated`` above ``memory_allocated`` at ``reset``. Run it in a fresh process
    (``run_child``) after a small warm-up, so one-time allocations are not counted."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.base = 0.0

    def reset(self) -> None:
        sync(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device) / 2**20
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.base = _vm_hwm_mb()

    def peak_mb(self) -> float:
        sync(self.device)
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20 - self.base
        return _vm_hwm_mb() - self.base


def run_child(argv: Sequence[str]) -> dict:
    """Runs ``python *argv`` in a fresh process and returns the JSON object its last stdout line
    holds (a driver's hidden ``--memory-child`` mode prints one); raises RuntimeError with the
    child's last stderr line when it fails."""
    proc = subprocess.run([sys.executable, *map(str, argv)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError((proc.stderr.strip().splitlines() or ["child failed"])[-1])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def child_main(args: argparse.Namespace, measure: Callable[[], dict]) -> int:
    """The child's side of ``run_child``: ``--threads`` applied, ``measure()``'s dict printed as
    the last stdout line."""
    if getattr(args, "threads", 0):
        torch.set_num_threads(args.threads)
    print(json.dumps(measure()), flush=True)
    return 0


# --------------------------------------------------------------------------- environment


def _cpuinfo_field(name: str) -> Optional[str]:
    """The first value of /proc/cpuinfo's field ``name``; None where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return None


def _cpu_model() -> str:
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id (GenuineIntel, AuthenticAMD); empty where there is none. The
    CPU block products auto takes without AMX follow it (csrc/attention/cpu/block_kernels.cpp)."""
    return _cpuinfo_field("vendor_id") or ""


def isa_flags() -> List[str]:
    """The flags of ISA_FLAGS this CPU reports (/proc/cpuinfo; none elsewhere): also what the
    tests of the CPU kernel sets skip on."""
    flags = (_cpuinfo_field("flags") or "").split()
    return [flag for flag in ISA_FLAGS if flag in flags]


def _git(where: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=where, capture_output=True, text=True, timeout=10)


def _git_commit(where: Path) -> str:
    """Short commit of the checkout holding ``where`` ("+" when it has local changes), or ""."""
    try:
        head = _git(where, "rev-parse", "--short", "HEAD")
        if head.returncode != 0:
            return ""
        dirty = _git(where, "status", "--porcelain", "--untracked-files=no").stdout.strip()
        return head.stdout.strip() + ("+" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return ""


def environment(device, where: Optional[Path] = None) -> Dict[str, str]:
    """What a result depends on: date (UTC), machine, commit, versions, threads, kernels."""
    device = torch.device(device)
    try:
        import attn_ext

        ext = getattr(attn_ext, "__version__", "unknown")
        kernels = attn_ext._C.cpu_block_kernels()
    except Exception as e:  # the header still says what went wrong
        ext, kernels = f"not importable ({error_text(e)})", "-"
    cpu = f"{_cpu_model()}, {os.cpu_count()} cores"
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": f"{gpu}; {cpu}" if gpu else cpu,
        "commit": _git_commit(where or Path.cwd()),
        "device": device.type,
        "isa": " ".join(isa_flags()) or "-",
        "versions": (
            f"attn_ext {ext}, torch {torch.__version__}"
            + (f" (CUDA {torch.version.cuda})" if gpu else "")
            + f", python {platform.python_version()}"
        ),
        "threads": str(torch.get_num_threads()),
        "cpu_kernels": kernels,
        "load": f"{os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "-",
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
    }


def environment_lines(env: Dict[str, str]) -> List[str]:
    return [
        f"date: {env['date']} UTC; commit {env['commit'] or 'unknown'}",
        f"machine: {env['machine']}; ISA {env['isa']}; {env['threads']} threads, CPU block "
        f"products {env['cpu_kernels']}, load average {env['load']} at start",
        env["versions"],
        f"command: {env['command']}",
    ]


# --------------------------------------------------------------------------- progress


class _NoBar:
    """Stands in for tqdm when it is not installed: per-cell lines only."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def write(self, s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def progress(total: int, desc: str):
    """A tqdm bar on stderr with ``update``, ``set_postfix_str``, ``write`` and ``close``."""
    try:
        from tqdm import tqdm
    except ImportError:
        print("tqdm not installed: no progress bar (pip install tqdm)", file=sys.stderr)
        return _NoBar()
    bar = tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=False)
    bar.write = lambda s: tqdm.write(s, file=sys.stderr)
    return bar


# --------------------------------------------------------------------------- output


def fmt(x: Optional[float], spec: str = ".2f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def fmt_ratio(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}x"


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A right-aligned Markdown table, columns padded to their widest cell."""
    body = [[str(c) for c in row] for row in rows]
    if any(len(row) != len(header) for row in body):
        raise ValueError("every row needs one cell per header column")
    widths = [max([3, len(h)] + [len(row[i]) for row in body]) for i, h in enumerate(header)]
    line = lambda cells: "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join(
        [line(list(header)), line(["-" * (w - 1) + ":" for w in widths])]
        + [line(row) for row in body]
    )


def history_row(**fields) -> Dict[str, str]:
    """A history.csv row: the named columns, any other keyword packed into ``params``."""
    extra = {k: fields.pop(k) for k in list(fields) if k not in HISTORY_COLUMNS}
    if extra:
        packed = ";".join(f"{k}={v}" for k, v in sorted(extra.items()))
        fields["params"] = ";".join(p for p in (fields.get("params", ""), packed) if p)
    row = {c: "" for c in HISTORY_COLUMNS}
    for k, v in fields.items():
        row[k] = "" if v is None else (f"{v:.6g}" if isinstance(v, float) else str(v))
    return row


def append_history(rows: Sequence[Dict[str, str]], path: Path) -> None:
    """Appends rows to the CSV history, writing the header when the file is new; refuses a file
    whose header is not ``HISTORY_COLUMNS`` (a schema change needs a migration, not a mix)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    if not new:
        with path.open(newline="") as f:
            header = next(csv.reader(f), [])
        if tuple(header) != HISTORY_COLUMNS:
            raise ValueError(f"{path}: header {header} is not {list(HISTORY_COLUMNS)}")
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=HISTORY_COLUMNS)
        if new:
            w.writeheader()
        w.writerows(rows)


def read_history(path: Path) -> List[Dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _float(s: str) -> Optional[float]:
    try:
        return float(s)
    except (TypeError, ValueError):
        return None


def plot_history(history: Path, family: str, device: str, png: Path) -> Optional[Path]:
    """Ratio vs S of one family on one device: the newest measurement of each cell on the machine
    of the newest row, one panel per (candidate, ratio_to) pair, one line per remaining cell
    parameters. Returns the PNG's path, or None (nothing to plot, or matplotlib missing)."""
    rows = [
        r
        for r in read_history(history)
        if r["family"] == family
        and r["device"] == device
        and _float(r["ratio"]) is not None
        and _float(r["S"]) is not None
    ]
    if not rows:
        return None
    machine = max(rows, key=lambda r: r["date"])["machine"]
    newest: Dict[tuple, Dict[str, str]] = {}
    for r in rows:
        if r["machine"] != machine:
            continue
        key = tuple(r[c] for c in PARAM_COLUMNS + ("threads", "candidate", "ratio_to", "params"))
        if key not in newest or r["date"] > newest[key]["date"]:
            newest[key] = r
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib not installed: no {png.name} (pip install matplotlib)", file=sys.stderr)
        return None
    by_mode = len({r["mode"] for r in newest.values()}) > 1
    panels = sorted(
        {(r["candidate"], r["ratio_to"], r["mode"] if by_mode else "") for r in newest.values()}
    )
    line_cols = [
        c
        for c in ("case", "dtype", "B", "H", "D", "causal", "threads", "params")
        + (() if by_mode else ("mode",))
        if len({r[c] for r in newest.values()}) > 1
    ]
    cols = min(len(panels), 4)
    rows_n = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(5.5 * cols, 4.5 * rows_n), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, (cand, to, mode) in zip(axes.flat, panels):
        lines: Dict[str, List[tuple]] = {}
        for r in newest.values():
            if (r["candidate"], r["ratio_to"], r["mode"] if by_mode else "") == (cand, to, mode):
                label = " ".join(f"{c}={r[c]}" for c in line_cols) or cand
                lines.setdefault(label, []).append((_float(r["S"]), _float(r["ratio"])))
        for label, pts in sorted(lines.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.axhspan(1 - PARITY_BAND, 1 + PARITY_BAND, color="0.85", label="parity")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("S")
        ax.set_ylabel(f"time ratio (> 1: {to} faster)")
        ax.set_title(f"{cand} / {to}" + (f", {mode}" if mode else ""), fontsize=9)
        ax.legend(fontsize=6)
    dates = sorted(r["date"] for r in newest.values())
    fig.suptitle(f"{family} on {device}: {machine}; {dates[0][:10]}..{dates[-1][:10]}", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return png


# --------------------------------------------------------------------------- a driver's run


def add_common_args(
    parser: argparse.ArgumentParser,
    *,
    warmup: int = 1,
    min_repeats: int = 2,
    max_repeats: int = 50,
    target_time: float = 1.0,
) -> None:
    """The options every driver has; the defaults are the driver's."""
    g = parser.add_argument_group("harness")
    g.add_argument("--device", default="cpu")
    g.add_argument(
        "--quick",
        action="store_true",
        help="tiny grid (smoke test); writes to a temporary folder unless --out",
    )
    g.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results folder (default benchmarks/results; --quick: a temporary one)",
    )
    g.add_argument(
        "--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)"
    )
    g.add_argument(
        "--warmup", type=int, default=warmup, help="untimed calls per candidate and cell"
    )
    g.add_argument("--min-repeats", type=int, default=min_repeats, help="timed rounds at least")
    g.add_argument("--max-repeats", type=int, default=max_repeats, help="timed rounds at most")
    g.add_argument(
        "--target-time",
        type=float,
        default=target_time,
        help="seconds of timed rounds per candidate and cell (within the bounds above)",
    )


class Bench:
    """One driver run: its environment, timer settings and records; ``finish`` writes the
    outputs. ``script`` is the driver's ``__file__``: results go to ``results/`` beside it."""

    def __init__(self, family: str, args: argparse.Namespace, script: str):
        if args.threads:
            torch.set_num_threads(args.threads)
        self.family, self.args = family, args
        self.device = torch.device(args.device)
        if args.out is not None:
            self.out = Path(args.out)
        elif args.quick:  # never overwrite the committed tables with a smoke test
            self.out = Path(tempfile.gettempdir()) / "attn_ext_bench_quick"
        else:
            self.out = Path(script).resolve().parent / "results"
        self.env = environment(self.device, Path(script).resolve().parent)
        self.rows: List[Dict[str, str]] = []
        print("\n".join(environment_lines(self.env)), flush=True)

    def time(self, candidates: Dict[str, Callable[[], object]], **overrides) -> Timing:
        a = self.args
        kw = dict(
            warmup=a.warmup,
            min_rounds=a.min_repeats,
            max_rounds=max(a.min_repeats, a.max_repeats),
            target_s=a.target_time,
        )
        kw.update(overrides)
        return time_interleaved(candidates, self.device, **kw)

    def record(self, candidate: str, ms: Optional[float], **fields) -> None:
        """One history row for this run (fields: HISTORY_COLUMNS or extra parameters)."""
        self.rows.append(
            history_row(
                date=self.env["date"],
                machine=self.env["machine"],
                threads=self.env["threads"],
                commit=self.env["commit"],
                family=self.family,
                device=self.device.type,
                candidate=candidate,
                ms=ms,
                **fields,
            )
        )

    def record_timing(
        self,
        timing: Timing,
        ratio_to,
        figures: Optional[Dict[str, Dict]] = None,
        notes: Optional[Dict[str, str]] = None,
        **params,
    ) -> None:
        """One row per candidate of a cell: its median ms, its ratio to ``ratio_to`` (one
        candidate's name, or a dict giving each candidate's), its figures (e.g.
        ``{"attn_ext": {"tflops": 310.0}}``) and a note (skip reason, error)."""
        names = dict.fromkeys(
            [
                *timing.results,
                *(n for r in timing.rounds for n in r),
                *timing.errors,
                *(notes or {}),
            ]
        )
        for name in names:
            to = ratio_to.get(name) if isinstance(ratio_to, dict) else ratio_to
            ratio = timing.ratio(name, to) if to and name != to else None
            note = (notes or {}).get(name) or timing.errors.get(name, "")
            self.record(
                name,
                timing.ms(name),
                ratio_to=to if ratio is not None else "",
                ratio=ratio,
                note=note,
                **(figures or {}).get(name, {}),
                **params,
            )

    def finish(self, title: str, sections: Sequence[str]) -> Path:
        """Prints the Markdown and writes it as the current table, appends the history rows and
        redraws the family's PNG."""
        text = "\n".join(
            [f"# {title}", ""]
            + [f"- {line}" for line in environment_lines(self.env)]
            + [""]
            + [s.rstrip() + "\n" for s in sections]
        )
        print("\n" + text)
        md = self.out / f"{self.family}_{self.device.type}.md"
        md.parent.mkdir(parents=True, exist_ok=True)
        md.write_text(text)
        history = self.out / HISTORY_FILE
        append_history(self.rows, history)
        png = plot_history(
            history,
            self.family,
            self.device.type,
            self.out / f"{self.family}_{self.device.type}.png",
        )
        print(
            f"wrote {md}, {len(self.rows)} rows to {history}" + (f", {png}" if png else ""),
            file=sys.stderr,
        )
        return md


def _main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m attn_ext.testing.harness",
        description="Redraws the PNG of every family and device in a history.",
    )
    p.add_argument("command", choices=["plot"])
    p.add_argument("--history", type=Path, default=Path("benchmarks/results") / HISTORY_FILE)
    p.add_argument("--out", type=Path, default=None, help="PNG folder (default: the history's)")
    args = p.parse_args(argv)
    out = args.out or args.history.parent
    for family, device in sorted({(r["family"], r["device"]) for r in read_history(args.history)}):
        png = plot_history(args.history, family, device, out / f"{family}_{device}.png")
        print(f"{family} {device}: {png or 'no ratio vs S to plot'}")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
