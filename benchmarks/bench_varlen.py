#!/usr/bin/env python
"""Mixed-length batches: varlen attention vs padding to the longest sequence.

A batch of sequences with lengths drawn uniformly from [L/10, L], ``--total-tokens`` tokens in
all (the last length trimmed to hit the total), H heads of head dim D, for L in ``--max-lens``.
Candidates, in one process on the same tokens:

* ``varlen``        -- ``attn_ext.attention_varlen`` on the packed (total, H, D) tokens;
* ``attn_ext_pad``  -- ``attn_ext.attention`` on the batch padded to (B, H, L, D), with a
                      (B, 1, 1, L) key-padding keep mask;
* ``sdpa_pad``      -- ``F.scaled_dot_product_attention`` on the same padded batch, with the
                      (B, 1, L, L) bool mask a padded causal batch needs (what Hugging Face
                      builds for ``sdpa``).

Padding and unpadding the inputs are not timed (a padded pipeline has its tensors padded
already). Modes ``fwd`` and ``fwd+bwd``; ratios ``<padded> / varlen`` (> 1: varlen faster).
``--memory`` adds the peak memory of one fwd and one fwd+bwd step of each candidate (its q, k,
v, packed or padded, plus the step's peak growth above them), each in a fresh process
(harness.PeakMeter). Output: ``attn_ext.testing.harness`` (``varlen_<device>.md``,
history.csv, PNG).

    python benchmarks/bench_varlen.py --quick
    python benchmarks/bench_varlen.py                       # L = 512 ... 8192, 16k tokens
    python benchmarks/bench_varlen.py --memory
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

import attn_ext
from attn_ext.testing import harness

CANDIDATES = ("varlen", "attn_ext_pad", "sdpa_pad")
MODES = ("fwd", "fwd+bwd")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def draw_lengths(max_len: int, total: int, seed: int) -> list:
    """Lengths uniform in [max_len / 10, max_len] summing to ``total`` (the last one trimmed,
    kept >= 1)."""
    gen = torch.Generator().manual_seed(seed)
    lo = max(1, max_len // 10)
    lens = []
    while sum(lens) < total:
        lens.append(int(torch.randint(lo, max_len + 1, (1,), generator=gen)))
    lens[-1] -= sum(lens) - total
    if lens[-1] < 1:
        lens.pop()
        lens[-1] += total - sum(lens)
    return lens


class Batch:
    """The packed tokens of one batch and the padded view of the same tokens."""

    def __init__(self, lens, heads, head_dim, dtype, device, seed):
        torch.manual_seed(seed)
        self.lens, self.max_len = lens, max(lens)
        total, B, L = sum(lens), len(lens), max(lens)
        self.packed = [
            torch.randn(total, heads, head_dim).to(device, dtype) for _ in range(3)
        ]  # q, k, v
        self.cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        self.cu = self.cu.to(device)
        valid = torch.arange(L).view(1, L) < torch.tensor(lens).view(B, 1)  # (B, L)
        self.valid = valid.to(device)
        self.padded = []
        for x in self.packed:
            p = x.new_zeros(B, L, heads, head_dim)
            p[self.valid] = x
            self.padded.append(p.transpose(1, 2))  # (B, H, L, D) view of (B, L, H, D)
        self.key_keep = self.valid.view(B, 1, 1, L)

    def full_mask(self, causal: bool) -> torch.Tensor:
        keep = self.key_keep.expand(-1, 1, self.max_len, -1)
        if causal:
            tri = torch.ones(self.max_len, self.max_len, dtype=torch.bool, device=keep.device)
            keep = keep & tri.tril()
        # a padded query row must see some key, or SDPA returns NaN there (and in its grads)
        return keep | ~self.valid.view(-1, 1, self.max_len, 1)


def candidate_step(name, batch: Batch, causal: bool, mode: str):
    if name == "varlen":
        L = batch.max_len

        def fn(q, k, v):
            return attn_ext.attention_varlen(q, k, v, batch.cu, batch.cu, L, L, causal=causal)

        return harness.make_step(fn, mode, batch.packed)
    if name == "attn_ext_pad":

        def fn(q, k, v):
            return attn_ext.attention(q, k, v, causal=causal, attn_mask=batch.key_keep)

        return harness.make_step(fn, mode, batch.padded)
    if name == "sdpa_pad":
        mask = batch.full_mask(causal)

        def fn(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

        return harness.make_step(fn, mode, batch.padded)
    raise ValueError(name)


def packed_out(name, batch: Batch, result):
    """The candidate's output as packed (total, H, D) tokens, for the sanity check."""
    out = result[0]
    return out if name == "varlen" else out.transpose(1, 2)[batch.valid]


def sweep(bench: harness.Bench, args) -> list:
    grid = [(dt, L, c, m) for dt in args.dtypes for L in args.max_lens for c in args.causal
            for m in args.modes]  # fmt: skip
    bar = harness.progress(len(grid), "varlen")
    cells = []
    for dt, L, causal, mode in grid:
        lens = draw_lengths(L, args.total_tokens, args.seed)
        batch = Batch(lens, args.heads, args.head_dim, DTYPES[dt], bench.device, args.seed)
        runs = {n: candidate_step(n, batch, causal, mode) for n in args.candidates}
        timing = bench.time(runs, close_margin=args.close_margin, close_rounds=args.close_repeats)
        outs = {n: packed_out(n, batch, r) for n, r in timing.results.items()}
        diff = max(
            (harness.max_abs_diff([outs["varlen"]], [outs[n]]) for n in outs if n != "varlen"),
            default=None,
        )
        params = dict(
            dtype=dt, B=len(lens), H=args.heads, S=L, D=args.head_dim, causal=causal, mode=mode
        )
        ratio_to = {n: "varlen" for n in args.candidates if n != "varlen"}
        bench.record_timing(timing, ratio_to, **params)
        cells.append((params, lens, timing, diff))
        bar.write(
            f"{dt:8s} L={L:<5d} B={len(lens):<3d} causal={causal!s:5s} {mode:7s} | "
            + "  ".join(f"{n} {harness.fmt(timing.ms(n))}" for n in runs)
        )
        bar.update(1)
        timing.results.clear()
    bar.close()
    return cells


def useful_fraction(lens, causal: bool) -> float:
    """Share of the padded batch's score entries that a varlen call computes."""
    pairs = (lambda n: n * (n + 1) / 2) if causal else (lambda n: n * n)
    return sum(pairs(n) for n in lens) / (len(lens) * pairs(max(lens)))


def table(cells) -> str:
    head = ["dtype", "L", "B", "causal", "mode", "useful share of padded"]
    head += [f"ms {n}" for n in CANDIDATES] + [f"{n}/varlen" for n in CANDIDATES[1:]]
    head += ["max abs diff"]
    rows = []
    for p, lens, t, diff in cells:
        row = [p["dtype"], p["S"], p["B"], p["causal"], p["mode"]]
        row.append(f"{useful_fraction(lens, p['causal']):.2f}")
        row += [harness.fmt(t.ms(n)) for n in CANDIDATES]
        row += [harness.fmt_ratio(t.ratio(n, "varlen")) for n in CANDIDATES[1:]]
        row.append(harness.fmt(diff, ".1e"))
        rows.append(row)
    return harness.markdown_table(head, rows)


def summary(cells) -> list:
    lines = ["speedup of varlen over padding (median of rounds per cell; > 1 = varlen faster):"]
    for name in CANDIDATES[1:]:
        for mode in MODES:
            rs = [r for p, _, t, _ in cells if p["mode"] == mode and (r := t.ratio(name, "varlen"))]
            if rs:
                lines.append(
                    f"  {name}/varlen {mode:7s} min {min(rs):.2f}x, median "
                    f"{statistics.median(rs):.2f}x over {len(rs)} cells"
                )
    return lines


# --------------------------------------------------------------------------- memory


def memory_child(args) -> dict:
    device = torch.device(args.device)
    L, causal = args.memory_child_len, args.memory_causal
    tiny = Batch([3, 5], args.heads, args.head_dim, DTYPES[args.dtypes[0]], device, 1)
    candidate_step(args.memory_child, tiny, causal, "fwd+bwd")()  # one-time initialisation
    del tiny
    lens = draw_lengths(L, args.total_tokens, args.seed)
    batch = Batch(lens, args.heads, args.head_dim, DTYPES[args.dtypes[0]], device, args.seed)
    fwd = candidate_step(args.memory_child, batch, causal, "fwd")
    step = candidate_step(args.memory_child, batch, causal, "fwd+bwd")
    # The candidate's own inputs count too: a padded pipeline holds padded activations.
    inputs = batch.packed if args.memory_child == "varlen" else batch.padded
    input_mb = sum(x.numel() * x.element_size() for x in inputs) / 2**20
    meter = harness.PeakMeter(device)
    meter.reset()
    fwd()  # the high-water mark keeps the peak after the result is freed
    fwd_mb = meter.peak_mb()
    meter.reset()
    step()
    return {"fwd_mb": input_mb + fwd_mb, "fwd_bwd_mb": input_mb + meter.peak_mb()}


def memory_rows(bench, args) -> list:
    rows = []
    for L in args.max_lens:
        mbs = {}
        for name in args.candidates:
            argv = [__file__, "--memory-child", name, "--memory-child-len", L, "--device",
                    args.device, "--threads", args.threads, "--heads", args.heads,
                    "--head-dim", args.head_dim, "--total-tokens", args.total_tokens,
                    "--seed", args.seed, "--dtypes", args.dtypes[0]]  # fmt: skip
            if args.memory_causal:
                argv.append("--memory-causal")
            try:
                mbs[name] = harness.run_child(argv)
            except RuntimeError as e:
                mbs[name] = {"error": str(e)}
            for mode, key in (("fwd", "fwd_mb"), ("fwd+bwd", "fwd_bwd_mb")):
                mb = mbs[name].get(key)
                bench.record(name, None, peak_mb=mb, dtype=args.dtypes[0], H=args.heads,
                             S=L, D=args.head_dim, causal=args.memory_causal, mode=mode,
                             note=mbs[name].get("error", ""))  # fmt: skip
        row = [L]
        for key in ("fwd_mb", "fwd_bwd_mb"):
            row += [harness.fmt(mbs[n].get(key), ".0f") for n in CANDIDATES]
            v = mbs.get("varlen", {}).get(key)
            row += [
                harness.fmt_ratio(mbs[n][key] / v) if v and mbs[n].get(key) else "-"
                for n in CANDIDATES[1:]
            ]
        rows.append(row)
    head = ["L"]
    for mode in ("fwd", "fwd+bwd"):
        head += [f"{mode} MB {n}" for n in CANDIDATES]
        head += [f"{mode} {n}/varlen" for n in CANDIDATES[1:]]
    return [
        f"Peak memory (MB): the candidate's q, k, v (packed or padded) plus the peak growth "
        f"of one step above them (CPU: VmHWM), each candidate in a fresh process, "
        f"{args.dtypes[0]}, causal={args.memory_causal}:",
        "",
        harness.markdown_table(head, rows),
    ]


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
    harness.add_common_args(p, min_repeats=3, max_repeats=20, target_time=1.0)
    g = p.add_argument_group("grid")
    g.add_argument("--dtypes", type=csv_list(str), default=["float32"])
    g.add_argument("--max-lens", type=csv_list(int), default=[512, 1024, 2048, 4096, 8192])
    g.add_argument("--total-tokens", type=int, default=16384)
    g.add_argument("--heads", type=int, default=8)
    g.add_argument("--head-dim", type=int, default=64)
    g.add_argument("--causal", type=csv_list(parse_bool), default=[True])
    g.add_argument("--modes", type=csv_list(str), default=list(MODES))
    g.add_argument("--candidates", type=csv_list(str), default=list(CANDIDATES))
    g.add_argument("--close-margin", type=float, default=0.15)
    g.add_argument("--close-repeats", type=int, default=5)
    g.add_argument("--seed", type=int, default=0)
    m = p.add_argument_group("memory")
    m.add_argument("--memory", action="store_true", help="also measure peak memory")
    m.add_argument("--memory-causal", action="store_true", default=True)
    m.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    m.add_argument("--memory-child-len", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.max_lens, args.total_tokens, args.heads = [128, 256], 1024, 2
        args.min_repeats, args.max_repeats, args.target_time = 1, 2, 0.1
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.memory_child:
        return harness.child_main(args, lambda: memory_child(args))
    bench = harness.Bench("varlen", args, __file__)
    cells = sweep(bench, args)
    head = (
        f"{args.total_tokens} tokens per batch, lengths uniform in [L/10, L], H={args.heads}, "
        f"D={args.head_dim}; candidates interleaved in one process, median of rounds per cell"
    )
    sections = [head, table(cells), "\n".join(summary(cells))]
    if args.memory:
        sections += memory_rows(bench, args)
    bench.finish("varlen attention vs padding", sections)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
