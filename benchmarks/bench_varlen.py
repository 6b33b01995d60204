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

``--paged`` times chunked prefill against a paged cache instead (vLLM's step: each of B
sequences attends with a chunk of ``--chunks`` new queries to its ``--contexts`` keys, which lie in
pages of ``--page-sizes`` rows in shuffled order, FlashAttention's (num_pages, page_size, Hkv, D)
layout; forward only, causal):

* ``paged``     -- ``attn_ext.attention_varlen(..., block_table=)``, the pages read in place;
* ``gathered``  -- the pages gathered into packed (total_k, Hkv, D) rows, then the same op (what
                  ``flash_attn_varlen_func`` with a block_table does on CUDA and for training);
* ``packed``    -- the op on keys that already lie packed (the cost of the attention alone).

Ratios ``<candidate> / paged`` (> 1: paged faster).
``--memory`` adds the peak memory of one fwd and one fwd+bwd step of each candidate (its q, k,
v, packed or padded, plus the step's peak growth above them), each in a fresh process
(harness.PeakMeter). Output: ``attn_ext.testing.harness`` (``varlen_<device>.md``,
history.csv, PNG).

    python benchmarks/bench_varlen.py --quick
    python benchmarks/bench_varlen.py                       # L = 512 ... 8192, 16k tokens
    python benchmarks/bench_varlen.py --memory
    python benchmarks/bench_varlen.py --paged --dtypes bfloat16
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


# --------------------------------------------------------------------------- paged prefill

PAGED_CANDIDATES = ("paged", "gathered", "packed")


class PagedBatch:
    """B sequences of `context` keys (chunk of them new queries) in shuffled pages."""

    def __init__(self, args, dtype, context, chunk, page, device):
        gen = torch.Generator().manual_seed(args.seed)
        B, Hkv, D = args.paged_batch, args.kv_heads, args.head_dim
        pages_per_seq = (context + page - 1) // page
        num_pages = B * pages_per_seq
        self.q = torch.randn(B * chunk, args.heads, D, generator=gen).to(device, dtype)
        self.pages = [
            torch.randn(num_pages, page, Hkv, D, generator=gen).to(device, dtype) for _ in range(2)
        ]
        order = torch.randperm(num_pages, generator=gen)
        self.table = order.view(B, pages_per_seq).to(device, torch.int32)
        self.cu_q = torch.arange(B + 1, dtype=torch.int32, device=device) * chunk
        self.cu_k = torch.arange(B + 1, dtype=torch.int32, device=device) * context
        self.chunk, self.context = chunk, context
        self.packed = self.gather()  # the same keys, packed once (not timed)

    def gather(self):
        return [x[self.table.long()].flatten(1, 2)[:, : self.context].flatten(0, 1)
                for x in self.pages]  # fmt: skip

    def attend(self, k, v, block_table=None):
        return attn_ext.attention_varlen(
            self.q, k, v, self.cu_q, self.cu_k, self.chunk, self.context, causal=True,
            block_table=block_table,
        )  # fmt: skip


def paged_step(name, batch: PagedBatch):
    def step():
        with torch.no_grad():
            if name == "paged":
                return (batch.attend(*batch.pages, block_table=batch.table),)
            if name == "gathered":
                return (batch.attend(*batch.gather()),)
            return (batch.attend(*batch.packed),)

    return step


def paged_sweep(bench: harness.Bench, args) -> list:
    grid = [(dt, c, q, p) for dt in args.dtypes for c in args.contexts for q in args.chunks
            for p in args.page_sizes]  # fmt: skip
    bar = harness.progress(len(grid), "paged")
    cells = []
    for dt, context, chunk, page in grid:
        batch = PagedBatch(args, DTYPES[dt], context, chunk, page, bench.device)
        runs = {n: paged_step(n, batch) for n in PAGED_CANDIDATES}
        timing = bench.time(runs, close_margin=args.close_margin, close_rounds=args.close_repeats)
        outs = timing.results
        diff = max(harness.max_abs_diff(outs["paged"], outs[n]) for n in PAGED_CANDIDATES[1:])
        params = dict(dtype=dt, B=args.paged_batch, H=args.heads, Hkv=args.kv_heads,
                      D=args.head_dim, context=context, chunk=chunk, page=page,
                      mode="fwd")  # fmt: skip
        bench.record_timing(timing, {n: "paged" for n in PAGED_CANDIDATES[1:]}, **params)
        cells.append((params, timing, diff))
        bar.write(f"{dt:8s} context={context:<6d} chunk={chunk:<4d} page={page:<4d} | "
                  + "  ".join(f"{n} {harness.fmt(timing.ms(n))}" for n in runs))  # fmt: skip
        bar.update(1)
        timing.results.clear()
    bar.close()
    return cells


def paged_table(cells) -> str:
    head = ["dtype", "context", "chunk", "page"] + [f"ms {n}" for n in PAGED_CANDIDATES]
    head += [f"{n}/paged" for n in PAGED_CANDIDATES[1:]] + ["max abs diff"]
    rows = []
    for p, t, diff in cells:
        row = [p["dtype"], p["context"], p["chunk"], p["page"]]
        row += [harness.fmt(t.ms(n)) for n in PAGED_CANDIDATES]
        row += [harness.fmt_ratio(t.ratio(n, "paged")) for n in PAGED_CANDIDATES[1:]]
        rows.append(row + [harness.fmt(diff, ".1e")])
    return harness.markdown_table(head, rows)


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
    pg = p.add_argument_group("paged prefill (--paged)")
    pg.add_argument("--paged", action="store_true", help="time chunked prefill on pages")
    pg.add_argument("--paged-batch", type=int, default=4)
    pg.add_argument("--kv-heads", type=int, default=2)
    pg.add_argument("--contexts", type=csv_list(int), default=[2048, 8192])
    pg.add_argument("--chunks", type=csv_list(int), default=[16, 128, 512])
    pg.add_argument("--page-sizes", type=csv_list(int), default=[16, 256])
    m = p.add_argument_group("memory")
    m.add_argument("--memory", action="store_true", help="also measure peak memory")
    m.add_argument("--memory-causal", action="store_true", default=True)
    m.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    m.add_argument("--memory-child-len", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.max_lens, args.total_tokens, args.heads = [128, 256], 1024, 2
        args.contexts, args.chunks, args.page_sizes = [256], [16], [16]
        args.min_repeats, args.max_repeats, args.target_time = 1, 2, 0.1
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.memory_child:
        return harness.child_main(args, lambda: memory_child(args))
    if args.paged:
        bench = harness.Bench("varlen_paged", args, __file__)
        cells = paged_sweep(bench, args)
        head = (
            f"Chunked prefill on a paged cache: B={args.paged_batch} sequences, each a chunk of "
            f"new queries attending (causal) to its context's keys in shuffled pages, "
            f"H={args.heads}, Hkv={args.kv_heads}, D={args.head_dim}; forward; candidates "
            f"interleaved in one process, median of rounds per cell"
        )
        bench.finish("paged varlen prefill", [head, paged_table(cells)])
        return 0
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
