#!/usr/bin/env python
"""Side-by-side attention benchmark: attn_ext vs torch vs the document's reference.

Candidates, in one process on the same inputs (B, H, S, D), Sq = Sk:

* ``attn_ext`` -- ``attn_ext.attention(q, k, v, causal=...)``;
* ``sdpa``     -- ``F.scaled_dot_product_attention`` (whatever backend torch picks);
* ``doc``      -- document 000's ``scaled_dot_product_attention`` / ``causal_attention``
                  (``attn_ext.testing.documents``); it materializes the S x S scores, so it runs
                  only up to ``--doc-max-s``.

Modes ``fwd`` and ``fwd+bwd`` (backward of ``(out * grad).sum()`` to q, k, v, fixed ``grad``).
Ratios ``sdpa / attn_ext`` and ``doc / attn_ext`` (> 1: attn_ext faster), plus the max abs
difference between attn_ext and sdpa; on CUDA also TFLOP/s. When the first two candidates are
within ``--close-margin`` they run at least ``--close-repeats`` rounds. Timing and output:
``attn_ext.testing.harness`` (table ``attention_<device>.md``, history.csv, PNG).

``--small`` times short sequences instead (B=1, H=8, D=64, S 8-128: the per-call overhead that
decides small models' and unit tests' speed; table ``attention_small_<device>.md``). A call
shorter than ``ROUND_S`` is repeated back to back within each timed round (``--calls-per-round``,
automatic by default), and its time is the round's divided by the calls.

``--memory`` instead measures the peak extra memory of one long sequence (S=32768, D=64,
B=H=1, float32) forward and forward+backward, each candidate in a fresh process
(``attention_memory_<device>.md``); exit status 1 when attn_ext exceeds ``--memory-target-mb``.

    python benchmarks/bench_attention.py --quick          # smoke test, seconds
    python benchmarks/bench_attention.py                  # full CPU grid
    python benchmarks/bench_attention.py --seqlens 512,2048 --dtypes float32
    python benchmarks/bench_attention.py --device cuda    # adds TFLOP/s columns
    python benchmarks/bench_attention.py --small          # per-call overhead, short sequences
    python benchmarks/bench_attention.py --memory
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

import attn_ext
from attn_ext.testing import harness
from attn_ext.testing.documents import doc000

CANDIDATES = ("attn_ext", "sdpa", "doc")
MODES = ("fwd", "fwd+bwd")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The document-reference ratios are summarized at this S (or the largest S it ran at).
DOC_SUMMARY_S = 2048
# A timed round lasts at least this long: shorter calls are repeated back to back (one timer
# read per call would time the timer and the device synchronization).
ROUND_S = 2e-3
# --small: the grid of short sequences.
SMALL_GRID = dict(batch=1, heads=8, head_dims=[64], seqlens=[8, 32, 128])


def calls_per_round(requested: int, step, device) -> int:
    """``requested``, or (0) enough back-to-back calls of ``step`` for a round of ROUND_S, from
    the fastest of three warm calls."""
    if requested:
        return requested
    step()
    fastest = min(harness.call_seconds(step, device)[0] for _ in range(3))
    return max(1, round(ROUND_S / max(fastest, 1e-9)))


def candidate_fn(name: str, causal: bool):
    return {
        "attn_ext": lambda q, k, v: attn_ext.attention(q, k, v, causal=causal),
        "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
        "doc": doc000.causal_attention if causal else doc000.scaled_dot_product_attention,
    }[name]


def sweep(bench: harness.Bench, args) -> list:
    """Times every cell; returns (params, Timing, tflops per candidate, max diff) per cell."""
    cuda = bench.device.type == "cuda"
    grid = [
        (dt, d, s, c, m)
        for dt in args.dtypes
        for d in args.head_dims
        for s in args.seqlens
        for c in args.causal
        for m in args.modes
    ]
    bar = harness.progress(len(grid), "attention")
    cells = []
    for dt, d, s, causal, mode in grid:
        torch.manual_seed(args.seed)  # drawn on the CPU so every device sees the same inputs
        q, k, v, grad = (
            torch.randn(args.batch, args.heads, s, d).to(bench.device, DTYPES[dt]) for _ in range(4)
        )
        notes = {"doc": "skip"} if "doc" in args.candidates and s > args.doc_max_s else {}
        steps = {
            n: harness.make_step(candidate_fn(n, causal), mode, (q, k, v), grad)
            for n in args.candidates
            if n not in notes
        }
        calls = calls_per_round(args.calls_per_round, next(iter(steps.values())), bench.device)
        runs = {n: harness.repeated(step, calls) for n, step in steps.items()}
        timing = harness.divided(
            bench.time(runs, close_margin=args.close_margin, close_rounds=args.close_repeats),
            calls,
        )
        flops = harness.attention_flops(args.batch, args.heads, s, s, d, causal, mode)
        figures = {
            n: {"tflops": flops / timing.median_s(n) / 1e12}
            for n in timing.results
            if cuda and timing.median_s(n)
        }
        res = timing.results
        diff = (
            harness.max_abs_diff(res["attn_ext"], res["sdpa"])
            if {"attn_ext", "sdpa"} <= set(res)
            else None
        )
        params = dict(dtype=dt, B=args.batch, H=args.heads, S=s, D=d, causal=causal, mode=mode)
        if calls > 1:
            params["calls_per_round"] = calls
        bench.record_timing(timing, "attn_ext", figures, notes, **params)
        cells.append((params, timing, figures, notes, diff))
        bar.write(
            f"{dt:8s} D={d:<3d} S={s:<5d} causal={causal!s:5s} {mode:7s} | "
            + "  ".join(f"{n} {ms_cell(timing, notes, n)}" for n in runs)
            + f" | sdpa/attn_ext {harness.fmt(timing.ratio('sdpa', 'attn_ext'))}"
        )
        bar.update(1)
        timing.results.clear()  # the outputs and grads of big cells: free them now
    bar.close()
    return cells


def ms_cell(timing, notes, name):
    if name in notes:
        return notes[name]
    # three significant digits: the short calls of --small take hundredths of a millisecond
    return "error" if name in timing.errors else harness.fmt(timing.ms(name), ".3g")


def table(cells, cuda: bool) -> str:
    head = (
        ["dtype", "D", "S", "causal", "mode"]
        + [f"ms {n}" for n in CANDIDATES]
        + ["sdpa/attn_ext", "doc/attn_ext", "max abs diff vs sdpa"]
        + ([f"TFLOP/s {n}" for n in CANDIDATES] if cuda else [])
    )
    rows = []
    for p, t, fig, notes, diff in cells:
        row = [p["dtype"], p["D"], p["S"], p["causal"], p["mode"]]
        row += [ms_cell(t, notes, n) for n in CANDIDATES]
        row += [harness.fmt_ratio(t.ratio(n, "attn_ext")) for n in ("sdpa", "doc")]
        row.append(harness.fmt(diff, ".1e"))
        if cuda:
            row += [harness.fmt(fig.get(n, {}).get("tflops"), ".1f") for n in CANDIDATES]
        rows.append(row)
    return harness.markdown_table(head, rows)


def ratio_stats(ratios) -> str:
    if not ratios:
        return "n/a"
    return (
        f"min {min(ratios):.2f}x, median {statistics.median(ratios):.2f}x over {len(ratios)} cells"
    )


def summary(cells, args) -> list:
    subsets = [("all", cells)] + [(m, [c for c in cells if c[0]["mode"] == m]) for m in args.modes]
    lines = ["speedup vs torch SDPA (sdpa/attn_ext, >1 = attn_ext faster):"]
    for label, sub in subsets:
        lines.append(
            f"  {label:8s} {ratio_stats([r for c in sub if (r := c[1].ratio('sdpa', 'attn_ext'))])}"
        )
    doc_s = [c[0]["S"] for c in cells if c[1].ratio("doc", "attn_ext")]
    if doc_s:
        s_ref = DOC_SUMMARY_S if DOC_SUMMARY_S in doc_s else max(doc_s)
        lines.append(f"speedup vs document reference at S={s_ref} (doc/attn_ext):")
        for label, sub in subsets:
            rs = [r for c in sub if c[0]["S"] == s_ref and (r := c[1].ratio("doc", "attn_ext"))]
            lines.append(f"  {label:8s} {ratio_stats(rs)}")
    diffs = [c[4] for c in cells if c[4] is not None]
    if diffs:
        lines.append(f"max |attn_ext - sdpa| over all cells: {max(diffs):.2e}")
    for p, t, _, _, _ in cells:
        lines += [
            f"ERROR {n} {p['dtype']} D={p['D']} S={p['S']} causal={p['causal']} {p['mode']}: {e}"
            for n, e in t.errors.items()
        ]
    return lines


# --------------------------------------------------------------------------- memory mode


def memory_child(args) -> dict:
    """In a fresh process: peak extra MB of one forward and of forward+backward."""
    device = torch.device(args.device)
    fn = candidate_fn(args.memory_child, args.memory_causal)
    d = args.memory_head_dim
    tiny = [torch.randn(1, 1, 64, d, device=device, requires_grad=True) for _ in range(3)]
    fn(*tiny).sum().backward()  # one-time initialisation is not counted
    del tiny
    torch.manual_seed(args.seed)
    shape = (1, 1, args.memory_seqlen, d)
    q, k, v = (torch.randn(shape, device=device, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device=device)
    meter = harness.PeakMeter(device)
    meter.reset()
    fwd_s, out = harness.call_seconds(lambda: fn(q, k, v), device)
    fwd_mb = meter.peak_mb()
    bwd_s, _ = harness.call_seconds(lambda: (out * grad).sum().backward(), device)
    return {"fwd_mb": fwd_mb, "fwd_bwd_mb": meter.peak_mb(), "fwd_s": fwd_s, "bwd_s": bwd_s}


def memory_mode(args) -> int:
    bench = harness.Bench("attention_memory", args, __file__)
    s, d = args.memory_seqlen, args.memory_head_dim
    rows, failed = [], False
    for name in args.memory_candidates:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        argv = [
            __file__,
            "--memory-child",
            name,
            "--device",
            args.device,
            "--seed",
            args.seed,
            "--memory-seqlen",
            s,
            "--memory-head-dim",
            d,
            "--threads",
            args.threads,
        ]
        try:
            info = harness.run_child(argv + (["--memory-causal"] if args.memory_causal else []))
        except RuntimeError as e:
            rows.append([name, "error", "error", "-", "-", str(e)])
            failed |= name == "attn_ext"
            continue
        verdict = "-"
        if name == "attn_ext":
            ok = max(info["fwd_mb"], info["fwd_bwd_mb"]) < args.memory_target_mb
            verdict, failed = ("PASS" if ok else "FAIL"), failed or not ok
        rows.append(
            [
                name,
                f"{info['fwd_mb']:.1f}",
                f"{info['fwd_bwd_mb']:.1f}",
                f"{info['fwd_s']:.2f}",
                f"{info['bwd_s']:.2f}",
                verdict,
            ]
        )
        for mode, mb, secs in (
            ("fwd", info["fwd_mb"], info["fwd_s"]),
            ("fwd+bwd", info["fwd_bwd_mb"], info["fwd_s"] + info["bwd_s"]),
        ):
            bench.record(
                name,
                1e3 * secs,
                peak_mb=mb,
                dtype="float32",
                B=1,
                H=1,
                S=s,
                D=d,
                causal=args.memory_causal,
                mode=mode,
                note=verdict if verdict != "-" else "",
            )
    what = "VmHWM growth" if bench.device.type == "cpu" else "max_memory_allocated growth"
    head = (
        f"B=1 H=1 S={s} D={d} float32 causal={args.memory_causal}; peak extra MB ({what}) above "
        f"the inputs, each candidate in a fresh process; one S x S float32 score matrix would be "
        f"{s * s * 4 / 2**20:.0f} MB; target for attn_ext < {args.memory_target_mb:.0f} MB"
    )
    bench.finish(
        "attention peak memory",
        [
            head,
            harness.markdown_table(
                [
                    "candidate",
                    "fwd peak extra MB",
                    "fwd+bwd peak extra MB",
                    "fwd s",
                    "bwd s",
                    "target",
                ],
                rows,
            ),
        ],
    )
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
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    harness.add_common_args(p, min_repeats=2, max_repeats=50, target_time=1.5)
    g = p.add_argument_group("grid")
    g.add_argument("--dtypes", type=csv_list(str), default=["float32", "bfloat16"])
    g.add_argument("--head-dims", type=csv_list(int), default=[64, 128])
    g.add_argument("--seqlens", type=csv_list(int), default=[512, 2048, 8192], help="Sq = Sk")
    g.add_argument("--causal", type=csv_list(parse_bool), default=[False, True])
    g.add_argument("--modes", type=csv_list(str), default=list(MODES), help="fwd,fwd+bwd")
    g.add_argument("--batch", type=int, default=1)
    g.add_argument("--heads", type=int, default=16)
    g.add_argument("--candidates", type=csv_list(str), default=list(CANDIDATES))
    g.add_argument(
        "--doc-max-s",
        type=int,
        default=2048,
        help="run the document reference (which materializes Sq x Sk scores) only up to this S",
    )
    g.add_argument(
        "--close-margin",
        type=float,
        default=0.15,
        help="the first two candidates' medians within this fraction are a close call",
    )
    g.add_argument(
        "--close-repeats",
        type=int,
        default=7,
        help="rounds the two candidates of a close call run at least (0: none extra)",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--calls-per-round",
        type=int,
        default=0,
        help=f"back-to-back calls per timed round (0: enough for {ROUND_S * 1e3:g} ms)",
    )
    g.add_argument(
        "--small",
        action="store_true",
        help="short sequences (B=1, H=8, D=64, S=8,32,128): per-call overhead; "
        "table attention_small_<device>.md",
    )
    m = p.add_argument_group("memory mode")
    m.add_argument("--memory", action="store_true", help="peak memory of one long sequence instead")
    m.add_argument("--memory-seqlen", type=int, default=32768)
    m.add_argument("--memory-head-dim", type=int, default=64)
    m.add_argument("--memory-causal", action="store_true")
    m.add_argument("--memory-candidates", type=csv_list(str), default=["attn_ext", "sdpa"])
    m.add_argument("--memory-target-mb", type=float, default=1024.0)
    m.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.calls_per_round < 0:
        p.error(f"--calls-per-round: expected 0 (automatic) or more, got {args.calls_per_round}")
    if args.small:
        for name, value in SMALL_GRID.items():
            setattr(args, name, value)
    if args.quick:
        args.dtypes, args.head_dims, args.seqlens = ["float32", "bfloat16"], [64], [128, 256]
        args.heads, args.target_time, args.max_repeats = min(args.heads, 4), 0.1, 5
        args.memory_seqlen = min(args.memory_seqlen, 4096)
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
    if args.memory_child:
        return harness.child_main(args, lambda: memory_child(args))
    if args.memory:
        return memory_mode(args)
    bench = harness.Bench("attention_small" if args.small else "attention", args, __file__)
    cells = sweep(bench, args)
    grid = (
        f"B={args.batch} H={args.heads}, Sq=Sk; doc reference up to S={args.doc_max_s}; median of "
        f">= {args.min_repeats} interleaved rounds after {args.warmup} warm-up (>= "
        f"{args.close_repeats} when the first two candidates are within {args.close_margin:.0%}); "
        f"a round repeats calls shorter than {ROUND_S * 1e3:g} ms back to back (ms per call); "
        "ratios = candidate time / attn_ext time (> 1: attn_ext faster)"
    )
    bench.finish(
        "attention benchmark",
        [
            grid,
            table(cells, bench.device.type == "cuda"),
            "```\n" + "\n".join(summary(cells, args)) + "\n```",
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
