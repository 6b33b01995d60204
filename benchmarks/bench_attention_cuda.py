#!/usr/bin/env python
"""GPU attention benchmark on the FlashAttention grid: attn_ext vs torch, one process.

Candidates, all on the same bf16 inputs (B, H, S, D) with H * D = 2048 (hidden size) and
B * S = 16384 tokens:

* ``attn_ext``   -- ``attn_ext.attention(q, k, v, causal=...)``;
* ``sdpa``       -- ``F.scaled_dot_product_attention`` with torch's default backend choice;
* ``sdpa_flash`` -- the same, restricted to the flash backend (``sdpa_kernel(FLASH_ATTENTION)``);
* ``flex``       -- ``torch.compile(flex_attention)`` with a causal block mask where causal
                    (skipped where it fails to compile, e.g. too little shared memory).

Grid: S in {512, 1k, 2k, 4k, 8k, 16k} x D in {64, 128, 256} x causal {no, yes} x pass
{fwd, bwd}. ``bwd`` times the backward alone (``out.backward(grad, retain_graph=True)`` after
one forward). TFLOP/s: forward ``4 B H S^2 D`` (halved when causal), backward 2.5x that.
Ratios are ``candidate time / attn_ext time`` (> 1: attn_ext faster). Writes stdout and
``benchmarks/results/attention_cuda.md``; exits 0 with a note when no GPU is visible.

    python benchmarks/bench_attention_cuda.py
    python benchmarks/bench_attention_cuda.py --quick              # S 512, 2k; D 64, 128
    python benchmarks/bench_attention_cuda.py --seqlens 2048 16384 --head-dims 128
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parent.parent
CANDIDATES = ("attn_ext", "sdpa", "sdpa_flash", "flex")
HIDDEN = 2048
TOKENS = 16384

try:
    import attn_ext
except ImportError:
    sys.path.insert(0, str(REPO_ROOT))
    import attn_ext


def flops(b, h, s, d, causal, pass_):
    fwd = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
    return fwd if pass_ == "fwd" else 2.5 * fwd


def candidate(name: str, s: int, causal: bool) -> Optional[Callable]:
    if name == "attn_ext":
        return lambda q, k, v: attn_ext.attention(q, k, v, causal=causal)
    if name == "sdpa":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if name == "sdpa_flash":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def run(q, k, v):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return run
    if name == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        compiled = torch.compile(flex_attention, dynamic=False)
        block_mask = None
        if causal:
            block_mask = create_block_mask(lambda b, h, qi, kj: qi >= kj, None, None, s, s, device="cuda")
        return lambda q, k, v: compiled(q, k, v, block_mask=block_mask)
    raise ValueError(name)


def time_call(fn: Callable, warmup: int, repeats: int) -> float:
    """Median seconds of `repeats` calls (CUDA events), after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


@dataclass
class Cell:
    s: int
    d: int
    causal: bool
    pass_: str
    b: int
    h: int
    secs: Dict[str, Optional[float]] = field(default_factory=dict)
    notes: Dict[str, str] = field(default_factory=dict)

    def tflops(self, name) -> Optional[float]:
        t = self.secs.get(name)
        return None if t is None else flops(self.b, self.h, self.s, self.d, self.causal, self.pass_) / t / 1e12

    def ratio(self, name) -> Optional[float]:
        a, o = self.secs.get("attn_ext"), self.secs.get(name)
        return None if a is None or o is None else o / a


def run_cell(cell: Cell, names, args) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (cell.b, cell.h, cell.s, cell.d)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    for name in names:
        try:
            fn = candidate(name, cell.s, cell.causal)
            if cell.pass_ == "fwd":
                with torch.no_grad():
                    cell.secs[name] = time_call(lambda: fn(q, k, v), args.warmup, args.repeats)
            else:
                qg, kg, vg = (x.detach().requires_grad_(True) for x in (q, k, v))
                out = fn(qg, kg, vg)
                cell.secs[name] = time_call(lambda: torch.autograd.grad(out, (qg, kg, vg), grad, retain_graph=True),
                                            args.warmup, args.repeats)
                del out
        except Exception as e:  # a backend that does not serve this cell: reported, not fatal
            cell.secs[name] = None
            cell.notes[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
        torch.cuda.empty_cache()


def fmt(x: Optional[float], spec: str) -> str:
    return "-" if x is None else format(x, spec)


def render(cells: List[Cell], names) -> List[str]:
    head = ["S", "D", "causal", "pass", "B x H"] + [f"{n} TFLOP/s" for n in names] + \
           [f"{n}/attn_ext" for n in names if n != "attn_ext"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cells:
        row = [str(c.s), str(c.d), "yes" if c.causal else "no", c.pass_, f"{c.b} x {c.h}"]
        row += [fmt(c.tflops(n), ".1f") for n in names]
        row += [fmt(c.ratio(n), ".2f") for n in names if n != "attn_ext"]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def summary(cells: List[Cell]) -> List[str]:
    """Geometric-mean ratio sdpa_flash / attn_ext per (D, pass), and the cells S >= 2k."""
    out = ["| D | pass | sdpa_flash/attn_ext (geo-mean, all S) | min over S >= 2k |", "|---|---|---|---|"]
    for d in sorted({c.d for c in cells}):
        for pass_ in ("fwd", "bwd"):
            rs = [(c.s, c.ratio("sdpa_flash")) for c in cells if c.d == d and c.pass_ == pass_]
            rs = [(s, r) for s, r in rs if r is not None]
            if not rs:
                continue
            geo = statistics.geometric_mean([r for _, r in rs])
            big = [r for s, r in rs if s >= 2048]
            out.append(f"| {d} | {pass_} | {geo:.2f} | {fmt(min(big) if big else None, '.2f')} |")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--causal", choices=["both", "no", "yes"], default="both")
    ap.add_argument("--passes", nargs="+", choices=["fwd", "bwd"], default=["fwd", "bwd"])
    ap.add_argument("--candidates", nargs="+", choices=CANDIDATES, default=list(CANDIDATES))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="S 512, 2048; D 64, 128; 5 repeats")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "attention_cuda.md")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention_cuda: no CUDA device visible; nothing to measure")
        return 0
    if args.quick:
        args.seqlens, args.head_dims, args.repeats = [512, 2048], [64, 128], 5
    names = ["attn_ext"] + [n for n in args.candidates if n != "attn_ext"]
    causals = {"both": [False, True], "no": [False], "yes": [True]}[args.causal]
    grid = [(s, d, c, p) for d in args.head_dims for s in args.seqlens for c in causals for p in args.passes]
    cells = []
    for idx, (s, d, causal, pass_) in enumerate(grid, 1):
        cell = Cell(s, d, causal, pass_, b=max(1, TOKENS // s), h=HIDDEN // d)
        run_cell(cell, names, args)
        cells.append(cell)
        bits = "  ".join(f"{n} {fmt(cell.tflops(n), '.1f')}" for n in names)
        print(f"[{idx}/{len(grid)}] S={s} D={d} causal={causal} {pass_}: TFLOP/s {bits}", file=sys.stderr, flush=True)

    dev = torch.cuda.get_device_name()
    header = [f"# attn_ext vs torch attention on {dev}", "",
              f"{datetime.date.today()}, torch {torch.__version__}, CUDA {torch.version.cuda}, bf16, "
              f"hidden {HIDDEN}, {TOKENS} tokens (B = {TOKENS} / S), median of {args.repeats} after "
              f"{args.warmup} warmup; ratios = candidate time / attn_ext time (> 1: attn_ext faster).", ""]
    notes = sorted({f"- {n}: {msg}" for c in cells for n, msg in c.notes.items()})
    text = header + render(cells, names) + [""] + (["Failures:"] + notes + [""] if notes else []) + \
        ["## Summary", ""] + summary(cells)
    print("\n".join(text))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(text) + "\n")
    print(f"\nwritten: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
