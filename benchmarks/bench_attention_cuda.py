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
{fwd, bwd}. ``bwd`` times the backward alone (``autograd.grad(out, ..., retain_graph=True)``
after one forward). TFLOP/s: forward ``4 B H S^2 D`` (halved when causal), backward 2.5x that.
Ratios are ``candidate time / attn_ext time`` (> 1: attn_ext faster). Timing and output:
``attn_ext.testing.harness`` (table ``attention_cuda.md``, history.csv, PNG); exits 0 with a
note when no GPU is visible.

    python benchmarks/bench_attention_cuda.py
    python benchmarks/bench_attention_cuda.py --quick              # S 512, 2k; D 64, 128
    python benchmarks/bench_attention_cuda.py --seqlens 2048 16384 --head-dims 128
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

import attn_ext
from attn_ext.testing import harness

CANDIDATES = ("attn_ext", "sdpa", "sdpa_flash", "flex")
HIDDEN = 2048
TOKENS = 16384
# The summary's "long sequences" start here.
LONG_S = 2048


def candidate(name: str, s: int, causal: bool):
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
            block_mask = create_block_mask(
                lambda b, h, qi, kj: qi >= kj, None, None, s, s, device="cuda"
            )
        return lambda q, k, v: compiled(q, k, v, block_mask=block_mask)
    raise ValueError(name)


def runner(name, s, causal, pass_, q, k, v, grad):
    """The zero-argument call of one candidate: a forward, or the backward of one forward."""
    fn = candidate(name, s, causal)
    if pass_ == "fwd":
        return harness.make_step(fn, "fwd", (q, k, v))
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
    out = fn(*leaves)
    return lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True)


def run_cell(bench, names, s, d, causal, pass_):
    b, h = max(1, TOKENS // s), HIDDEN // d
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, grad = (
        torch.randn((b, h, s, d), device="cuda", dtype=torch.bfloat16, generator=gen)
        for _ in range(4)
    )
    runs, notes = {}, {}
    for name in names:
        try:
            runs[name] = runner(name, s, causal, pass_, q, k, v, grad)
        except Exception as e:  # a backend that does not serve this cell: reported, not fatal
            notes[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
    timing = bench.time(runs)
    timing.results.clear()
    flops = harness.attention_flops(b, h, s, s, d, causal, pass_)
    tflops = {n: flops / timing.median_s(n) / 1e12 for n in runs if timing.median_s(n)}
    notes.update(timing.errors)
    bench.record_timing(
        timing,
        "attn_ext",
        {n: {"tflops": t} for n, t in tflops.items()},
        notes,
        dtype="bfloat16",
        B=b,
        H=h,
        S=s,
        D=d,
        causal=causal,
        mode=pass_,
    )
    torch.cuda.empty_cache()
    return dict(
        s=s, d=d, causal=causal, pass_=pass_, b=b, h=h, timing=timing, tflops=tflops, notes=notes
    )


def table(cells, names) -> str:
    others = [n for n in names if n != "attn_ext"]
    head = (
        ["S", "D", "causal", "pass", "B x H"]
        + [f"{n} TFLOP/s" for n in names]
        + [f"{n}/attn_ext" for n in others]
    )
    rows = [
        [c["s"], c["d"], "yes" if c["causal"] else "no", c["pass_"], f"{c['b']} x {c['h']}"]
        + [harness.fmt(c["tflops"].get(n), ".1f") for n in names]
        + [harness.fmt(c["timing"].ratio(n, "attn_ext")) for n in others]
        for c in cells
    ]
    return harness.markdown_table(head, rows)


def summary(cells) -> str:
    """Geometric-mean ratio sdpa_flash / attn_ext per (D, pass), and the minimum over S >= 2k."""
    rows = []
    for d in sorted({c["d"] for c in cells}):
        for pass_ in ("fwd", "bwd"):
            rs = [
                (c["s"], c["timing"].ratio("sdpa_flash", "attn_ext"))
                for c in cells
                if c["d"] == d and c["pass_"] == pass_
            ]
            rs = [(s, r) for s, r in rs if r is not None]
            if rs:
                big = [r for s, r in rs if s >= LONG_S]
                rows.append(
                    [
                        d,
                        pass_,
                        f"{statistics.geometric_mean([r for _, r in rs]):.2f}",
                        harness.fmt(min(big) if big else None),
                    ]
                )
    return harness.markdown_table(
        ["D", "pass", "sdpa_flash/attn_ext (geo-mean, all S)", f"min over S >= {LONG_S}"], rows
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    harness.add_common_args(ap, warmup=3, min_repeats=10, max_repeats=10)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--causal", choices=["both", "no", "yes"], default="both")
    ap.add_argument("--passes", nargs="+", choices=["fwd", "bwd"], default=["fwd", "bwd"])
    ap.add_argument("--candidates", nargs="+", choices=CANDIDATES, default=list(CANDIDATES))
    args = ap.parse_args(argv)
    args.device = "cuda"
    if not torch.cuda.is_available():
        print("bench_attention_cuda: no CUDA device visible; nothing to measure")
        return 0
    if args.quick:
        args.seqlens, args.head_dims, args.min_repeats, args.max_repeats = (
            [512, 2048],
            [64, 128],
            5,
            5,
        )
    bench = harness.Bench("attention", args, __file__)
    names = ["attn_ext"] + [n for n in args.candidates if n != "attn_ext"]
    causals = {"both": [False, True], "no": [False], "yes": [True]}[args.causal]
    grid = [
        (s, d, c, p)
        for d in args.head_dims
        for s in args.seqlens
        for c in causals
        for p in args.passes
    ]
    bar = harness.progress(len(grid), "attention cuda")
    cells = []
    for s, d, causal, pass_ in grid:
        cells.append(run_cell(bench, names, s, d, causal, pass_))
        bar.write(
            f"S={s} D={d} causal={causal} {pass_}: TFLOP/s "
            + "  ".join(f"{n} {harness.fmt(cells[-1]['tflops'].get(n), '.1f')}" for n in names)
        )
        bar.update(1)
    bar.close()
    notes = sorted({f"- {n}: {msg}" for c in cells for n, msg in c["notes"].items()})
    head = (
        f"bf16, hidden {HIDDEN}, {TOKENS} tokens (B = {TOKENS} / S), median of {args.min_repeats} "
        f"interleaved rounds after {args.warmup} warm-up; ratios = candidate time / attn_ext time "
        "(> 1: attn_ext faster)."
    )
    bench.finish(
        f"attn_ext vs torch attention on {torch.cuda.get_device_name()}",
        [head, table(cells, names)]
        + (["Failures:\n\n" + "\n".join(notes)] if notes else [])
        + ["## Summary", summary(cells)],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
