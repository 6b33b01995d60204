#!/usr/bin/env python
"""Side-by-side linear-attention benchmark (issue 6), one process, same inputs for everyone.

Candidates on (B, H, S, D) inputs, Sq = Sk = S:

* ``linear``            -- ``attn_ext.linear_attention(q, k, v)`` (non-causal)
* ``doc``               -- document 000's ``linear_attention`` (elu+1, ``torch.bmm``, non-causal;
                           ``attn_ext.testing.documents``)
* ``linear_causal``     -- ``attn_ext.linear_attention(q, k, v, causal=True)``
* ``quadratic_causal``  -- the masked quadratic causal reference ``tril(phi(Q) phi(K)^T)``
                           (``attn_ext.testing.linear``);
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
at any S and faster at S >= 4096. Timing and output: ``attn_ext.testing.harness``
(``linear_cpu.md``; ``--memory``: ``linear_memory_cpu.md``).

On ``--device cuda`` (defaults B=2, H=16, D=128, bfloat16, S in {4096, 16384}) the candidates are
instead, on (B, S, H, D) inputs (attn_ext reads the ``transpose(1, 2)`` views in place):

* ``linear_causal`` / ``linear`` -- attn_ext with ``ATTN_EXT_UNVERIFIED_CUDA=1``: the fused CUDA
                           kernels (csrc/linear/cuda/) where they serve the shape: the forward,
                           and the backward when causal (non-causal: the ATen composite's)
* ``composite_causal`` / ``composite`` -- attn_ext with the gate off: the ATen composite
* ``fla_causal``        -- flash-linear-attention's ``chunk_linear_attn`` (Triton; ``fla-core``)
                           on elu+1 features with ``scale=1.0, normalize=True``; skipped, and
                           said so, where the package is not installed (it has no non-causal
                           kernel)

with the ratios ``composite / linear`` and ``fla_causal / linear_causal`` (> 1: the fused kernels
are faster); output ``linear_cuda.md``.

``--memory`` instead measures the peak extra memory (one fresh process per candidate and length;
VmHWM growth) of one causal forward+backward at B=H=1, D=64, float32 for several S, to
show that linear attention's memory grows linearly in S.

Examples::

    python benchmarks/bench_linear.py --quick     # smoke test, well under a minute
    python benchmarks/bench_linear.py             # full grid (S = 1k .. 64k)
    python benchmarks/bench_linear.py --memory
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Dict, List, Optional

import torch

import attn_ext
from attn_ext.testing import harness
from attn_ext.testing.documents import doc000
from attn_ext.testing.linear import feature, linear_attention_quadratic

try:  # flash-linear-attention's Triton kernels (package fla-core), the CUDA comparison
    from fla.ops.linear_attn import chunk_linear_attn
except ImportError:
    chunk_linear_attn = None

CANDIDATES = ("linear", "doc", "linear_causal", "quadratic_causal", "softmax_causal")
# Each candidate's ratio is taken against attn_ext's linear attention of the same causality.
RATIO_TO = {"doc": "linear", "quadratic_causal": "linear_causal", "softmax_causal": "linear_causal"}
MODES = ("fwd", "fwd+bwd")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Peak memory of the quadratic reference in units of one (B, H, S, S) score tensor: forward holds
# the scores and their lower triangle; the backward adds the saved triangle's gradient and a
# temporary.
QUADRATIC_TENSORS = {"fwd": 3, "fwd+bwd": 5}
# Criteria of issue 6 (CPU).
CAUSAL_SPEEDUP_S, CAUSAL_SPEEDUP_TARGET = 8192, 10.0
NONCAUSAL_FASTER_FROM_S = 4096


def candidate_fn(name: str):
    return {
        "linear": lambda q, k, v: attn_ext.linear_attention(q, k, v),
        "doc": lambda q, k, v: doc000.linear_attention(
            q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
        ).unflatten(0, q.shape[:2]),
        "linear_causal": lambda q, k, v: attn_ext.linear_attention(q, k, v, causal=True),
        "quadratic_causal": lambda q, k, v: linear_attention_quadratic(q, k, v, causal=True),
        "softmax_causal": lambda q, k, v: attn_ext.attention(q, k, v, causal=True),
    }[name]


def skip_reason(name: str, s: int, mode: str, args) -> Optional[str]:
    if name == "quadratic_causal":
        elem = torch.finfo(DTYPES[args.dtype]).bits // 8
        gb = QUADRATIC_TENSORS[mode] * args.batch * args.heads * s * s * elem / 2**30
        if gb > args.quadratic_max_gb:
            return f"skip (~{gb:.0f} GB)"
    if name == "softmax_causal" and s > args.softmax_max_s:
        return "skip (time)"
    return None


def sweep(bench, seqlens: List[int], candidates, args, desc: str) -> List[dict]:
    bar = harness.progress(len(seqlens) * len(args.modes), desc)
    cells = []
    for s in seqlens:
        torch.manual_seed(args.seed)
        q, k, v, grad = (
            torch.randn(args.batch, args.heads, s, args.head_dim).to(DTYPES[args.dtype])
            for _ in range(4)
        )
        for mode in args.modes:
            notes = {n: r for n in candidates if (r := skip_reason(n, s, mode, args))}
            timing = bench.time(
                {
                    n: harness.make_step(candidate_fn(n), mode, (q, k, v), grad)
                    for n in candidates
                    if n not in notes
                }
            )
            res = timing.results
            diff = {
                ours: harness.max_abs_diff(res[ours], res[ref])
                for ours, ref in (("linear", "doc"), ("linear_causal", "quadratic_causal"))
                if ours in res and ref in res
            }
            res.clear()
            bench.record_timing(
                timing,
                RATIO_TO,
                notes=notes,
                dtype=args.dtype,
                B=args.batch,
                H=args.heads,
                S=s,
                D=args.head_dim,
                mode=mode,
            )
            cell = dict(s=s, mode=mode, timing=timing, notes={**notes, **timing.errors}, diff=diff)
            cells.append(cell)
            bar.write(
                f"S={s:<6d} {mode:7s} | " + "  ".join(f"{n} {ms_text(cell, n)}" for n in candidates)
            )
            bar.update(1)
        del q, k, v, grad
    bar.close()
    return cells


def ms_text(cell, name: str) -> str:
    if name in cell["notes"]:
        note = cell["notes"][name]
        return note if note.startswith("skip") else "error"
    return harness.fmt(cell["timing"].ms(name), ".2f", "-")


def ratio(cell, name: str) -> Optional[float]:
    return cell["timing"].ratio(name, RATIO_TO[name])


COLUMNS = [
    ("S", lambda c: c["s"]),
    ("mode", lambda c: c["mode"]),
    ("ms linear", lambda c: ms_text(c, "linear")),
    ("ms doc", lambda c: ms_text(c, "doc")),
    ("doc/linear", lambda c: harness.fmt_ratio(ratio(c, "doc"))),
    ("ms linear_causal", lambda c: ms_text(c, "linear_causal")),
    ("ms quadratic_causal", lambda c: ms_text(c, "quadratic_causal")),
    ("quadratic/linear_causal", lambda c: harness.fmt_ratio(ratio(c, "quadratic_causal"))),
    ("ms softmax_causal", lambda c: ms_text(c, "softmax_causal")),
    ("softmax/linear_causal", lambda c: harness.fmt_ratio(ratio(c, "softmax_causal"))),
    ("max diff vs ref", lambda c: " / ".join(f"{v:.1e}" for v in c["diff"].values()) or "-"),
]


def render(cells, columns=COLUMNS) -> str:
    return harness.markdown_table(
        [h for h, _ in columns], [[f(c) for _, f in columns] for c in cells]
    )


def crossover(cells, mode: str) -> str:
    """Smallest measured S from which causal linear beats causal softmax at every larger S."""
    pts = sorted((c["s"], ratio(c, "softmax_causal")) for c in cells if c["mode"] == mode)
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


def summary_lines(cells, cross_cells, args) -> List[str]:
    lines = []
    for mode in args.modes:
        c8 = [c for c in cells if c["mode"] == mode and c["s"] == CAUSAL_SPEEDUP_S]
        r = ratio(c8[0], "quadratic_causal") if c8 else None
        verdict = "n/a" if r is None else ("PASS" if r >= CAUSAL_SPEEDUP_TARGET else "FAIL")
        lines.append(
            f"causal {mode} at S={CAUSAL_SPEEDUP_S}: quadratic/linear_causal "
            f"{harness.fmt_ratio(r)} "
            f"(target >= {CAUSAL_SPEEDUP_TARGET:.0f}x on fwd+bwd) "
            f"{verdict if mode == 'fwd+bwd' else ''}"
        )
    for mode in args.modes:
        pts = [(c["s"], ratio(c, "doc")) for c in cells if c["mode"] == mode and ratio(c, "doc")]
        if not pts:
            continue
        worst = min(pts, key=lambda p: p[1])
        long = [r for s, r in pts if s >= NONCAUSAL_FASTER_FROM_S]
        ok = worst[1] >= 1.0 and all(r > 1.0 for r in long)
        lines.append(
            f"non-causal {mode}: doc/linear min {worst[1]:.2f}x (S={worst[0]}), "
            f"min at S >= {NONCAUSAL_FASTER_FROM_S}: "
            f"{harness.fmt_ratio(min(long) if long else None)} "
            f"(target >= 1x everywhere, > 1x from S={NONCAUSAL_FASTER_FROM_S}) "
            f"{'PASS' if ok else 'FAIL'}"
        )
    for mode in args.modes:
        lines.append(
            f"crossover causal linear vs softmax ({mode}): {crossover(cells + cross_cells, mode)}"
        )
    lines += [
        f"ERROR {n} S={c['s']} {c['mode']}: {msg}"
        for c in cells + cross_cells
        for n, msg in c["notes"].items()
        if not msg.startswith("skip")
    ]
    return lines


# --------------------------------------------------------------------------- CUDA mode

CUDA_CANDIDATES = ("linear_causal", "composite_causal", "fla_causal", "linear", "composite")
CUDA_RATIO_TO = {
    "composite_causal": "linear_causal",
    "fla_causal": "linear_causal",
    "composite": "linear",
}
# The CUDA grid's defaults (issue 28): a training-sized head count and head dim.
CUDA_DEFAULTS = dict(batch=2, heads=16, head_dim=128, dtype="bfloat16", seqlens=[4096, 16384])
CPU_DEFAULTS = dict(
    batch=1,
    heads=4,
    head_dim=64,
    dtype="float32",
    seqlens=[1024, 2048, 4096, 8192, 16384, 32768, 65536],
)
UNVERIFIED_GATE = "ATTN_EXT_UNVERIFIED_CUDA"  # csrc/common/cuda/unverified.h


@contextlib.contextmanager
def unverified_cuda(on: bool):
    """The gate of the unverified CUDA kernels, set or cleared for one call (the op reads the
    variable at every call)."""
    old = os.environ.get(UNVERIFIED_GATE)
    if on:
        os.environ[UNVERIFIED_GATE] = "1"
    else:
        os.environ.pop(UNVERIFIED_GATE, None)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(UNVERIFIED_GATE, None)
        else:
            os.environ[UNVERIFIED_GATE] = old


def cuda_candidate_fn(name: str):
    """fn(q, k, v) on (B, S, H, D) inputs returning (B, S, H, Dv)."""

    def ours(causal: bool, fused: bool):
        def fn(q, k, v):
            with unverified_cuda(fused):
                out = attn_ext.linear_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal
                )
            return out.transpose(1, 2)

        return fn

    def fla(q, k, v):
        phi_q, phi_k = feature(q, "elu+1"), feature(k, "elu+1")
        return chunk_linear_attn(phi_q, phi_k, v, scale=1.0, normalize=True)[0]

    return {
        "linear_causal": ours(True, True),
        "composite_causal": ours(True, False),
        "fla_causal": fla,
        "linear": ours(False, True),
        "composite": ours(False, False),
    }[name]


def cuda_sweep(bench, args) -> List[dict]:
    notes = {} if chunk_linear_attn is not None else {"fla_causal": "skip (fla not installed)"}
    cells = []
    for s in args.seqlens:
        torch.manual_seed(args.seed)
        q, k, v = (
            torch.randn(args.batch, s, args.heads, args.head_dim, device=args.device).to(
                DTYPES[args.dtype]
            )
            for _ in range(3)
        )
        for mode in args.modes:
            timing = bench.time(
                {
                    n: harness.make_step(cuda_candidate_fn(n), mode, (q, k, v))
                    for n in CUDA_CANDIDATES
                    if n not in notes
                }
            )
            res = timing.results
            diff = {
                f"{a} vs {b}": harness.max_abs_diff(res[a], res[b])
                for a, b in (
                    ("linear_causal", "composite_causal"),
                    ("linear_causal", "fla_causal"),
                    ("linear", "composite"),
                )
                if a in res and b in res
            }
            res.clear()
            bench.record_timing(
                timing,
                CUDA_RATIO_TO,
                notes=notes,
                dtype=args.dtype,
                B=args.batch,
                H=args.heads,
                S=s,
                D=args.head_dim,
                mode=mode,
            )
            cell = dict(s=s, mode=mode, timing=timing, notes={**notes, **timing.errors}, diff=diff)
            cells.append(cell)
            print(
                f"S={s:<6d} {mode:7s} | "
                + "  ".join(f"{n} {ms_text(cell, n)}" for n in CUDA_CANDIDATES),
                flush=True,
            )
        del q, k, v
    return cells


def cuda_ratio(cell, name: str) -> Optional[float]:
    return cell["timing"].ratio(name, CUDA_RATIO_TO[name])


CUDA_COLUMNS = [
    ("S", lambda c: c["s"]),
    ("mode", lambda c: c["mode"]),
    *((f"ms {n}", lambda c, n=n: ms_text(c, n)) for n in CUDA_CANDIDATES),
    *(
        (f"{n}/{to}", lambda c, n=n: harness.fmt_ratio(cuda_ratio(c, n)))
        for n, to in CUDA_RATIO_TO.items()
    ),
    ("max diff", lambda c: " / ".join(f"{k} {v:.1e}" for k, v in c["diff"].items()) or "-"),
]


def cuda_main(args) -> int:
    bench = harness.Bench("linear", args, __file__)
    cells = cuda_sweep(bench, args)
    grid = (
        f"B={args.batch} H={args.heads} D=Dv={args.head_dim} {args.dtype}, (B, S, H, D) inputs; "
        f"median of >= {args.min_repeats} interleaved rounds after {args.warmup} warm-up; "
        f"linear*: {UNVERIFIED_GATE}=1 (the fused kernels: forward, causal backward), "
        f"composite*: the gate off"
        + ("" if chunk_linear_attn is not None else "; fla_causal: fla (fla-core) not installed")
    )
    errors = [
        f"ERROR {n} S={c['s']} {c['mode']}: {msg}"
        for c in cells
        for n, msg in c["notes"].items()
        if not msg.startswith("skip")
    ]
    sections = [grid, render(cells, CUDA_COLUMNS)]
    if errors:
        sections.append("```\n" + "\n".join(errors) + "\n```")
    bench.finish("linear attention benchmark (CUDA)", sections)
    return 0


# --------------------------------------------------------------------------- memory mode


def memory_child(args) -> Dict[str, float]:
    """In a fresh process: peak extra MB of one causal forward+backward."""
    fn = candidate_fn(args.memory_child)
    s, d = args.memory_child_s, args.head_dim
    tiny = [torch.randn(1, 1, 64, d, requires_grad=True) for _ in range(3)]
    fn(*tiny).sum().backward()  # one-time initialisation is not counted
    del tiny
    torch.manual_seed(args.seed)
    q, k, v = (torch.randn(1, 1, s, d, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, 1, s, d)
    meter = harness.PeakMeter("cpu")
    meter.reset()
    secs, _ = harness.call_seconds(lambda: (fn(q, k, v) * grad).sum().backward(), "cpu")
    return {"peak_extra_mb": meter.peak_mb(), "s": secs}


def memory_mode(args) -> int:
    bench = harness.Bench("linear_memory", args, __file__)
    rows = []
    for name in ("linear_causal", "quadratic_causal"):
        for s in args.memory_seqlens:
            # B = H = 1 here: the quadratic reference's peak is QUADRATIC_TENSORS scores of S x S
            if (
                name == "quadratic_causal"
                and QUADRATIC_TENSORS["fwd+bwd"] * s * s * 4 / 2**30 > args.quadratic_max_gb
            ):
                rows.append([name, s, "skip", "-", "-"])
                continue
            print(f"running {name} S={s} ...", file=sys.stderr, flush=True)
            try:
                info = harness.run_child(
                    [
                        __file__,
                        "--memory-child",
                        name,
                        "--memory-child-s",
                        s,
                        "--head-dim",
                        args.head_dim,
                        "--seed",
                        args.seed,
                    ]
                )
            except RuntimeError as e:
                rows.append([name, s, "error", str(e), "-"])
                continue
            mb = info["peak_extra_mb"]
            rows.append([name, s, f"{mb:.1f}", f"{mb / s * 1024:.2f}", f"{info['s']:.2f}"])
            bench.record(
                name,
                1e3 * info["s"],
                peak_mb=mb,
                dtype="float32",
                B=1,
                H=1,
                S=s,
                D=args.head_dim,
                causal=True,
                mode="fwd+bwd",
            )
    head = (
        f"causal forward+backward, B=H=1, D={args.head_dim}, float32; peak extra MB (VmHWM growth) "
        f"above the inputs, one fresh process per cell; the inputs q, k, v, grad take "
        f"4 x S x {args.head_dim} x 4 bytes"
    )
    bench.finish(
        "linear attention peak memory",
        [
            head,
            harness.markdown_table(
                ["candidate", "S", "peak extra MB", "MB per 1k positions", "s"], rows
            ),
        ],
    )
    return 0


# --------------------------------------------------------------------------- CLI


def csv_list(kind):
    return lambda s: [kind(x) for x in s.split(",") if x.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    harness.add_common_args(p, min_repeats=2, max_repeats=20, target_time=1.0)
    p.add_argument(
        "--seqlens",
        type=csv_list(int),
        default=None,
        help="default: 1k .. 64k on the CPU, 4096,16384 on CUDA",
    )
    p.add_argument(
        "--crossover-seqlens",
        type=csv_list(int),
        default=[128, 256, 512],
        help="extra short lengths for the linear vs softmax crossover (causal only)",
    )
    p.add_argument("--modes", type=csv_list(str), default=list(MODES))
    p.add_argument("--batch", type=int, default=None, help="default: 1 on the CPU, 2 on CUDA")
    p.add_argument("--heads", type=int, default=None, help="default: 4 on the CPU, 16 on CUDA")
    p.add_argument("--head-dim", type=int, default=None, help="default: 64 on the CPU, 128 on CUDA")
    p.add_argument(
        "--dtype",
        default=None,
        choices=list(DTYPES),
        help="default: float32 on the CPU, bfloat16 on CUDA",
    )
    p.add_argument("--quadratic-max-gb", type=float, default=8.0)
    p.add_argument("--softmax-max-s", type=int, default=16384)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--memory", action="store_true", help="peak memory of causal fwd+bwd over S instead"
    )
    p.add_argument(
        "--memory-seqlens", type=csv_list(int), default=[4096, 8192, 16384, 32768, 65536]
    )
    p.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--memory-child-s", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device not in ("cpu", "cuda"):
        p.error(f"--device: cpu or cuda, got {args.device!r}")
    for name, value in (CUDA_DEFAULTS if args.device == "cuda" else CPU_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.quick and args.device == "cuda":
        args.seqlens, args.target_time, args.max_repeats = [4096], 0.2, 5
    elif args.quick:
        args.seqlens, args.crossover_seqlens = [1024, 4096, 8192], [256]
        args.target_time, args.max_repeats = 0.2, 5
        args.memory_seqlens = [4096, 16384]
    for mode in args.modes:
        if mode not in MODES:
            p.error(f"--modes: unknown mode {mode!r} (choose from {', '.join(MODES)})")
    if args.device == "cuda" and args.memory:
        p.error("--memory measures the CPU kernels (--device cpu)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.memory_child:
        return harness.child_main(args, lambda: memory_child(args))
    if args.memory:
        return memory_mode(args)
    if args.device == "cuda":
        return cuda_main(args)
    bench = harness.Bench("linear", args, __file__)
    cells = sweep(bench, args.seqlens, CANDIDATES, args, "linear")
    cross = sweep(
        bench, args.crossover_seqlens, ("linear_causal", "softmax_causal"), args, "crossover"
    )
    cross_cols = [
        c
        for c in COLUMNS
        if c[0] in ("S", "mode", "ms linear_causal", "ms softmax_causal", "softmax/linear_causal")
    ]
    grid = (
        f"B={args.batch} H={args.heads} D={args.head_dim} {args.dtype}; median of >= "
        f"{args.min_repeats} "
        f"interleaved rounds after {args.warmup} warm-up; quadratic reference where its peak is <= "
        f"{args.quadratic_max_gb:g} GB, softmax up to S={args.softmax_max_s}"
    )
    bench.finish(
        "linear attention benchmark (CPU)",
        [
            grid,
            render(cells),
            "## crossover: causal linear vs causal softmax attention",
            render(sorted(cross + cells, key=lambda c: (c["mode"], c["s"])), cross_cols),
            "```\n" + "\n".join(summary_lines(cells, cross, args)) + "\n```",
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
