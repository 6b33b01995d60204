#!/usr/bin/env python
"""Side-by-side linear-attention benchmark (issue 6), one process, same inputs for everyone.

Candidates on (B, H, S, D) inputs, Sq = Sk = S:

* ``linear``            -- ``attn_ext.linear_attention(q, k, v)`` (non-causal)
* ``doc``               -- document 000's ``linear_attention`` (elu+1, ``torch.bmm``, non-causal)
* ``linear_causal``     -- ``attn_ext.linear_attention(q, k, v, causal=True)``
* ``quadratic_causal``  -- the masked quadratic causal reference ``tril(phi(Q) phi(K)^T)``;
                           materializes S x S per head, skipped where its estimated peak memory
                           exceeds ``--quadratic-max-gb``
* ``softmax_causal``    -- ``attn_ext.attention(q, k, v, causal=True)`` (flash softmax attention),
                           run up to ``--softmax-max-s`` (it is O(S^2) in time)

Modes ``fwd`` and ``fwd+bwd`` (backward of ``(out * grad).sum()`` to q, k, v). The table shows
the median times and the ratios ``doc / linear``, ``quadratic_causal / linear_causal`` and
``softmax_causal / linear_causal`` (> 1: attn_ext's linear attention is faster). A second short
sweep finds the crossover length from which causal linear attention beats causal softmax
attention. The summary checks issue 6's done criteria on the CPU: causal fwd+bwd at S=8192 at
least 10x faster than the quadratic reference; non-causal no slower than the document's function
at any S and faster at S >= 4096.

``--memory`` instead measures the peak extra memory (``ru_maxrss`` delta, one fresh subprocess per
candidate and length) of one causal forward+backward at B=H=1, D=64, float32 for several S, to
show that linear attention's memory grows linearly in S.

Examples::

    python benchmarks/bench_linear.py --quick     # smoke test, well under a minute
    python benchmarks/bench_linear.py             # full grid (S = 1k .. 64k)
    python benchmarks/bench_linear.py --memory
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import Timer, csv_list, import_attn_ext, max_rss_mb, measure, progress_bar  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
CANDIDATES = ("linear", "doc", "linear_causal", "quadratic_causal", "softmax_causal")
MODES = ("fwd", "fwd+bwd")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Peak memory of the quadratic reference in units of one (B, H, S, S) score tensor: forward holds
# the scores and their lower triangle; the backward adds the saved triangle's gradient and a
# temporary.
QUADRATIC_TENSORS = {"fwd": 3, "fwd+bwd": 5}
# Criteria of issue 6 (CPU).
CAUSAL_SPEEDUP_S, CAUSAL_SPEEDUP_TARGET = 8192, 10.0
NONCAUSAL_FASTER_FROM_S = 4096


# --------------------------------------------------------------------------- candidates


def doc000_linear_attention(Q, K, V):
    """Document 000, verbatim (3-D inputs)."""
    Q_prime = F.elu(Q) + 1
    K_prime = F.elu(K) + 1
    KV = torch.bmm(K_prime.transpose(1, 2), V)
    numerator = torch.bmm(Q_prime, KV)
    K_sum = K_prime.sum(dim=1, keepdim=True)
    denominator = torch.bmm(Q_prime, K_sum.transpose(1, 2))
    return numerator / (denominator + 1e-6)


def quadratic_causal(q, k, v, eps=1e-6):
    """The masked quadratic form of causal linear attention (S x S per head)."""
    a = ((F.elu(q) + 1) @ (F.elu(k) + 1).transpose(-1, -2)).tril()
    return (a @ v) / (a.sum(-1, keepdim=True) + eps)


def candidate_fn(name: str) -> Callable:
    attn_ext = import_attn_ext()
    return {
        "linear": lambda q, k, v: attn_ext.linear_attention(q, k, v),
        "doc": lambda q, k, v: doc000_linear_attention(q.flatten(0, 1), k.flatten(0, 1),
                                                       v.flatten(0, 1)).unflatten(0, q.shape[:2]),
        "linear_causal": lambda q, k, v: attn_ext.linear_attention(q, k, v, causal=True),
        "quadratic_causal": quadratic_causal,
        "softmax_causal": lambda q, k, v: attn_ext.attention(q, k, v, causal=True),
    }[name]


def make_runner(fn: Callable, mode: str, q, k, v, grad) -> Callable:
    if mode == "fwd":
        def run():
            with torch.no_grad():
                return (fn(q, k, v),)
        return run
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def run():
        out = fn(qg, kg, vg)
        return (out.detach(),) + torch.autograd.grad((out * grad).sum(), (qg, kg, vg))
    return run


# --------------------------------------------------------------------------- sweep


@dataclass
class Cell:
    s: int
    mode: str
    ms: Dict[str, Optional[float]] = field(default_factory=dict)  # None = skipped / failed
    note: Dict[str, str] = field(default_factory=dict)
    diff: Dict[str, float] = field(default_factory=dict)          # sanity: max |ours - reference|

    def ratio(self, slow: str, fast: str) -> Optional[float]:
        a, b = self.ms.get(slow), self.ms.get(fast)
        return a / b if a and b else None


def skip_reason(name: str, s: int, mode: str, args) -> Optional[str]:
    if name == "quadratic_causal":
        elem = torch.finfo(DTYPES[args.dtype]).bits // 8
        gb = QUADRATIC_TENSORS[mode] * args.batch * args.heads * s * s * elem / 2**30
        if gb > args.quadratic_max_gb:
            return f"skip (~{gb:.0f} GB)"
    if name == "softmax_causal" and s > args.softmax_max_s:
        return "skip (time)"
    return None


def sweep(seqlens: List[int], candidates, args, desc: str) -> List[Cell]:
    timer = Timer(torch.device("cpu"))
    fns = {n: candidate_fn(n) for n in candidates}
    bar = progress_bar(len(seqlens) * len(args.modes), desc)
    cells = []
    for s in seqlens:
        torch.manual_seed(args.seed)
        q, k, v, grad = (torch.randn(args.batch, args.heads, s, args.head_dim).to(DTYPES[args.dtype])
                         for _ in range(4))
        for mode in args.modes:
            cell = Cell(s, mode)
            bar.set_postfix_str(f"S={s} {mode}")
            results = {}
            for name, fn in fns.items():
                reason = skip_reason(name, s, mode, args)
                if reason:
                    cell.ms[name], cell.note[name] = None, reason
                    continue
                try:
                    m = measure(make_runner(fn, mode, q, k, v, grad), timer, args)
                except Exception as e:  # keep sweeping; the error lands in the table
                    cell.ms[name], cell.note[name] = None, f"error: {type(e).__name__}: {e}"
                    continue
                cell.ms[name] = m.median_s * 1e3
                results[name] = m.result
            for ours, ref in (("linear", "doc"), ("linear_causal", "quadratic_causal")):
                if ours in results and ref in results:
                    cell.diff[ours] = max((a.float() - b.float()).abs().max().item()
                                          for a, b in zip(results[ours], results[ref]))
            del results
            cells.append(cell)
            bar.write(f"S={s:<6d} {mode:7s} | " + "  ".join(f"{n} {fmt_ms(cell, n)}" for n in fns))
            bar.update(1)
        del q, k, v, grad
    bar.close()
    return cells


# --------------------------------------------------------------------------- report


def fmt_ms(cell: Cell, name: str) -> str:
    if name not in cell.ms:
        return "-"
    if cell.ms[name] is None:
        note = cell.note.get(name, "error")
        return "error" if note.startswith("error") else note
    return f"{cell.ms[name]:.2f}"


def fmt_ratio(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}x"


COLUMNS = [
    ("S", lambda c: str(c.s)),
    ("mode", lambda c: c.mode),
    ("ms linear", lambda c: fmt_ms(c, "linear")),
    ("ms doc", lambda c: fmt_ms(c, "doc")),
    ("doc/linear", lambda c: fmt_ratio(c.ratio("doc", "linear"))),
    ("ms linear_causal", lambda c: fmt_ms(c, "linear_causal")),
    ("ms quadratic_causal", lambda c: fmt_ms(c, "quadratic_causal")),
    ("quadratic/linear_causal", lambda c: fmt_ratio(c.ratio("quadratic_causal", "linear_causal"))),
    ("ms softmax_causal", lambda c: fmt_ms(c, "softmax_causal")),
    ("softmax/linear_causal", lambda c: fmt_ratio(c.ratio("softmax_causal", "linear_causal"))),
    ("max diff vs ref", lambda c: " / ".join(f"{v:.1e}" for v in c.diff.values()) or "-"),
]


def render_table(cells: List[Cell], columns=COLUMNS) -> str:
    rows = [[h for h, _ in columns]] + [[f(c) for _, f in columns] for c in cells]
    widths = [max(len(r[i]) for r in rows) for i in range(len(columns))]
    lines = ["| " + " | ".join(t.rjust(w) for t, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "| " + " | ".join("-" * (w - 1) + ":" for w in widths) + " |")
    return "\n".join(lines)


def crossover(cells: List[Cell], mode: str) -> str:
    """Smallest measured S from which causal linear beats causal softmax at every larger S."""
    pts = sorted((c.s, c.ratio("softmax_causal", "linear_causal")) for c in cells if c.mode == mode)
    pts = [(s, r) for s, r in pts if r is not None]
    if not pts:
        return "n/a"
    from_s = None
    for s, r in reversed(pts):
        if r <= 1.0:
            break
        from_s = s
    if from_s is None:
        return f"not reached up to S={pts[-1][0]}"
    if from_s == pts[0][0]:
        return f"S <= {from_s} (linear already faster at the shortest length measured)"
    prev = max(s for s, _ in pts if s < from_s)
    return f"between S={prev} and S={from_s}"


def summary_lines(cells: List[Cell], cross_cells: List[Cell], args) -> List[str]:
    lines = []
    for mode in args.modes:
        c8 = [c for c in cells if c.mode == mode and c.s == CAUSAL_SPEEDUP_S]
        r = c8[0].ratio("quadratic_causal", "linear_causal") if c8 else None
        verdict = "n/a" if r is None else ("PASS" if r >= CAUSAL_SPEEDUP_TARGET else "FAIL")
        lines.append(f"causal {mode} at S={CAUSAL_SPEEDUP_S}: quadratic/linear_causal {fmt_ratio(r)} "
                     f"(target >= {CAUSAL_SPEEDUP_TARGET:.0f}x on fwd+bwd) {verdict if mode == 'fwd+bwd' else ''}")
    for mode in args.modes:
        pts = [(c.s, c.ratio("doc", "linear")) for c in cells if c.mode == mode and c.ratio("doc", "linear")]
        if not pts:
            continue
        worst = min(pts, key=lambda p: p[1])
        long = [r for s, r in pts if s >= NONCAUSAL_FASTER_FROM_S]
        ok = worst[1] >= 1.0 and all(r > 1.0 for r in long)
        lines.append(f"non-causal {mode}: doc/linear min {worst[1]:.2f}x (S={worst[0]}), "
                     f"min at S >= {NONCAUSAL_FASTER_FROM_S}: {fmt_ratio(min(long) if long else None)} "
                     f"(target >= 1x everywhere, > 1x from S={NONCAUSAL_FASTER_FROM_S}) {'PASS' if ok else 'FAIL'}")
    for mode in args.modes:
        lines.append(f"crossover causal linear vs softmax ({mode}): {crossover(cells + cross_cells, mode)}")
    errors = [(c, n, msg) for c in cells + cross_cells for n, msg in c.note.items() if msg.startswith("error")]
    lines += [f"ERROR {n} S={c.s} {c.mode}: {msg}" for c, n, msg in errors]
    return lines


def environment_lines(args) -> List[str]:
    return [
        f"date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"torch {torch.__version__}, python {platform.python_version()}",
        f"device: cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start)",
        f"B={args.batch} H={args.heads} D={args.head_dim} {args.dtype}; median of >= {args.min_repeats} "
        f"repeats after {args.warmup} warmup; quadratic reference where its peak is <= "
        f"{args.quadratic_max_gb:g} GB, softmax up to S={args.softmax_max_s}",
        "command: " + " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
    ]


# --------------------------------------------------------------------------- memory mode


def memory_child(args) -> dict:
    fn = candidate_fn(args.memory_child)
    s, d = args.memory_child_s, args.head_dim
    tiny = [torch.randn(1, 1, 64, d, requires_grad=True) for _ in range(3)]
    fn(*tiny).sum().backward()  # one-time initialisation is not counted
    del tiny
    torch.manual_seed(args.seed)
    q, k, v = (torch.randn(1, 1, s, d, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, 1, s, d)
    base = max_rss_mb()
    t0 = time.perf_counter()
    (fn(q, k, v) * grad).sum().backward()
    return {"peak_extra_mb": max_rss_mb() - base, "s": time.perf_counter() - t0}


def memory_mode(args) -> int:
    env = environment_lines(args)[:3] + ["command: " + " ".join([Path(sys.argv[0]).name] + sys.argv[1:])]
    header = (f"memory: causal forward+backward, B=H=1, D={args.head_dim}, float32; peak RSS delta "
              f"(ru_maxrss) above the inputs, one fresh subprocess per cell; the inputs q, k, v, grad "
              f"take 4 x S x {args.head_dim} x 4 bytes")
    print("\n".join(env + [header]))
    rows = [["candidate", "S", "peak extra MB", "MB per 1k positions", "s"]]
    for name in ("linear_causal", "quadratic_causal"):
        for s in args.memory_seqlens:
            if name == "quadratic_causal" and 5 * s * s * 4 / 2**30 > args.quadratic_max_gb:
                rows.append([name, str(s), "skip", "-", "-"])
                continue
            print(f"running {name} S={s} ...", file=sys.stderr, flush=True)
            cmd = [sys.executable, str(Path(__file__).resolve()), "--memory-child", name,
                   "--memory-child-s", str(s), "--head-dim", str(args.head_dim), "--seed", str(args.seed)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                rows.append([name, str(s), "error", (proc.stderr.strip().splitlines() or ["?"])[-1], "-"])
                continue
            info = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append([name, str(s), f"{info['peak_extra_mb']:.1f}",
                         f"{info['peak_extra_mb'] / s * 1024:.2f}", f"{info['s']:.2f}"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    table = ["| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    table.insert(1, "| " + " | ".join("-" * (w - 1) + ":" for w in widths) + " |")
    print("\n".join(table))
    out = Path(args.out or REPO_ROOT / "benchmarks" / "results" / "linear_memory_cpu.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(["# linear attention peak memory", ""] + [f"- {x}" for x in env + [header]]
                             + [""] + table + [""]))
    print(f"\nwrote {out}")
    return 0


# --------------------------------------------------------------------------- CLI


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlens", type=csv_list(int), default=[1024, 2048, 4096, 8192, 16384, 32768, 65536])
    p.add_argument("--crossover-seqlens", type=csv_list(int), default=[128, 256, 512],
                   help="extra short lengths for the linear vs softmax crossover (causal only)")
    p.add_argument("--modes", type=csv_list(str), default=list(MODES))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--quadratic-max-gb", type=float, default=8.0)
    p.add_argument("--softmax-max-s", type=int, default=16384)
    p.add_argument("--quick", action="store_true", help="short lengths and few repeats (smoke test)")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0 = torch default)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--min-repeats", type=int, default=2)
    p.add_argument("--max-repeats", type=int, default=20)
    p.add_argument("--target-time", type=float, default=1.0, help="seconds of timed repeats per candidate and cell")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="markdown output (default benchmarks/results/linear_cpu[_quick].md)")
    p.add_argument("--memory", action="store_true", help="peak memory of causal fwd+bwd over S instead")
    p.add_argument("--memory-seqlens", type=csv_list(int), default=[4096, 8192, 16384, 32768, 65536])
    p.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--memory-child-s", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.seqlens, args.crossover_seqlens = [1024, 4096, 8192], [256]
        args.target_time, args.max_repeats = 0.2, 5
        args.memory_seqlens = [4096, 16384]
    for mode in args.modes:
        if mode not in MODES:
            p.error(f"--modes: unknown mode {mode!r} (choose from {', '.join(MODES)})")
    if args.out is None and not args.memory:
        args.out = str(REPO_ROOT / "benchmarks" / "results" / f"linear_cpu{'_quick' if args.quick else ''}.md")
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
    cells = sweep(args.seqlens, CANDIDATES, args, "linear")
    cross = sweep(args.crossover_seqlens, ("linear_causal", "softmax_causal"), args, "crossover")
    summary = summary_lines(cells, cross, args)
    table = render_table(cells)
    cross_cols = [c for c in COLUMNS if c[0] in ("S", "mode", "ms linear_causal", "ms softmax_causal",
                                                  "softmax/linear_causal")]
    cross_table = render_table(sorted(cross + cells, key=lambda c: (c.mode, c.s)), cross_cols)
    print("\n" + table + "\n\ncrossover (causal):\n" + cross_table + "\n\n" + "\n".join(summary))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(["# linear attention benchmark (CPU)", ""] + [f"- {x}" for x in env] + ["", table, "",
                             "## crossover: causal linear vs causal softmax attention", "", cross_table, "",
                             "```"] + summary + ["```", ""]))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
