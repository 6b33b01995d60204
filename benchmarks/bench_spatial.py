#!/usr/bin/env python
"""Spatial (CBAM) and temporal attention benchmark (issue 8), one process, same inputs and
weights for every candidate.

Spatial: the CBAM spatial gate ``x * sigmoid(conv7x7([mean_c x; max_c x]))`` on x (32, 256, 56, 56)
and (8, 64, 224, 224), NCHW and channels-last, float32 and bfloat16, ``fwd`` and ``fwd+bwd``
(gradients of x and the conv weight):

* ``ours`` -- ``attn_ext.nn.SpatialAttention`` (fused pooling, ATen conv, fused gate; one-pass
  backward), loaded with the document's conv weight;
* ``doc``  -- document 004's ``SpatialAttention`` (attn_ext.testing.documents) used as the
  document's script uses it: ``x * attn_map``.

The ratio is ``doc / ours`` (> 1: attn_ext is faster). ``GB/s`` is ours' achieved bandwidth over
the bytes a fused implementation must move (fwd: read x twice, write out = 3|x|; fwd+bwd adds
read grad, read x, write grad_x = 6|x|).

Temporal: document 004's ``TemporalAttention(768, 64, 32)`` against the drop-in
``attn_ext.compat.attention_zoo.TemporalAttention`` with the weights (as the document returns)
and without them (``need_weights=False``), B=4, S in {256, 1024, 4096}, float32, fwd and fwd+bwd.
Peak memory (CPU: growth of ``VmHWM`` above the baseline after building the module and inputs;
CUDA: ``max_memory_allocated`` growth; one fresh subprocess per candidate and S, one fwd+bwd)
shows the no-weights path is linear in S.

Done criteria on the CPU (printed at the end): the spatial gate's fwd+bwd at least 2x faster than
the document's in every cell; temporal attention faster than the document's at every S.

    python benchmarks/bench_spatial.py --quick     # smoke test (small shapes), ~1 minute
    python benchmarks/bench_spatial.py             # the issue's grid
    python benchmarks/bench_spatial.py --device cuda

Results go to stdout and ``benchmarks/results/spatial_<device>[_quick].md``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import Timer, import_attn_ext, measure, progress_bar  # noqa: E402
from bench_modules import _peak_rss_mb, _reset_peak_rss  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
SPATIAL_SHAPES = [(32, 256, 56, 56), (8, 64, 224, 224)]
QUICK_SPATIAL_SHAPES = [(4, 64, 28, 28), (2, 16, 56, 56)]
LAYOUTS = ("nchw", "channels_last")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MODES = ("fwd", "fwd+bwd")
TEMPORAL_SEQLENS = (256, 1024, 4096)
QUICK_TEMPORAL_SEQLENS = (64, 256)
TEMPORAL_ARGS = (768, 64, 32)  # document 004's script: input_dim, d_k, time_emb_dim
TEMPORAL_BATCH = 4
# Bytes a fused spatial gate must move, in units of |x|.
SPATIAL_TRAFFIC = {"fwd": 3, "fwd+bwd": 6}
# Criteria of issue 8 (CPU).
SPATIAL_FWD_BWD_TARGET = 2.0


@dataclass
class Row:
    label: str
    mode: str
    ms: Dict[str, float] = field(default_factory=dict)
    extra: Dict[str, str] = field(default_factory=dict)

    def ratio(self, a: str, b: str) -> Optional[float]:
        if a in self.ms and b in self.ms and self.ms[b] > 0:
            return self.ms[a] / self.ms[b]
        return None


# ------------------------------------------------------------------------------- spatial


def spatial_candidates(attn_ext, doc004, dtype, device):
    doc = doc004.SpatialAttention().to(device=device, dtype=dtype)
    ours = attn_ext.nn.SpatialAttention().to(device=device, dtype=dtype)
    ours.conv.weight.data.copy_(doc.conv1.weight.data)
    return {"ours": (ours, ours.conv.weight), "doc": (lambda x: x * doc(x), doc.conv1.weight)}


def spatial_runner(fn, weight, x, grad, mode):
    if mode == "fwd":
        def run():
            with torch.no_grad():
                return fn(x)
        return run
    leaf = x.detach().requires_grad_()

    def run():
        out = fn(leaf)
        return torch.autograd.grad(out, (leaf, weight), grad)
    return run


def spatial_sweep(args, attn_ext, doc004, device, timer) -> List[Row]:
    shapes = QUICK_SPATIAL_SHAPES if args.quick else SPATIAL_SHAPES
    cells = [(s, lay, dt, m) for s in shapes for lay in LAYOUTS for dt in args.dtypes for m in MODES]
    rows = []
    bar = progress_bar(len(cells), "spatial")
    for shape, layout, dtname, mode in cells:
        dtype = DTYPES[dtname]
        torch.manual_seed(0)
        x = torch.randn(shape, device=device, dtype=dtype)
        if layout == "channels_last":
            x = x.contiguous(memory_format=torch.channels_last)
        grad = torch.randn_like(x)
        row = Row(f"{'x'.join(map(str, shape))} {layout} {dtname}", mode)
        for name, (fn, weight) in spatial_candidates(attn_ext, doc004, dtype, device).items():
            row.ms[name] = 1e3 * measure(spatial_runner(fn, weight, x, grad, mode), timer, args).median_s
        gbytes = SPATIAL_TRAFFIC[mode] * x.numel() * x.element_size() / 1e9
        row.extra["GB/s"] = f"{gbytes / (row.ms['ours'] / 1e3):.1f}"
        rows.append(row)
        bar.update(1)
        bar.write(f"  {row.label:34s} {mode:7s} ours {row.ms['ours']:9.2f} ms  doc {row.ms['doc']:9.2f} ms  "
                  f"doc/ours {row.ratio('doc', 'ours'):5.2f}x  {row.extra['GB/s']} GB/s")
        del x, grad
    bar.close()
    return rows


# ------------------------------------------------------------------------------ temporal


def temporal_candidates(zoo, doc004, device):
    doc = doc004.TemporalAttention(*TEMPORAL_ARGS).to(device)
    ours = zoo.TemporalAttention(*TEMPORAL_ARGS).to(device)
    ours.load_state_dict(doc.state_dict(), strict=True)
    return {
        "doc": lambda x, t: doc(x, t),
        "ours": lambda x, t: ours(x, t),
        "ours_no_weights": lambda x, t: ours(x, t, need_weights=False),
    }


def temporal_runner(fn, x, tp, grad, mode):
    if mode == "fwd":
        def run():
            with torch.no_grad():
                return fn(x, tp)
        return run
    leaf = x.detach().requires_grad_()

    def run():
        out, _ = fn(leaf, tp)
        return torch.autograd.grad(out, leaf, grad)
    return run


def temporal_inputs(s, device):
    torch.manual_seed(0)
    x = torch.randn(TEMPORAL_BATCH, s, TEMPORAL_ARGS[0], device=device)
    tp = torch.randn(TEMPORAL_BATCH, 1, TEMPORAL_ARGS[2], device=device)
    grad = torch.randn(TEMPORAL_BATCH, s, TEMPORAL_ARGS[1], device=device)
    return x, tp, grad


def temporal_sweep(args, attn_ext, zoo, doc004, device, timer) -> List[Row]:
    seqlens = QUICK_TEMPORAL_SEQLENS if args.quick else TEMPORAL_SEQLENS
    cells = [(s, m) for s in seqlens for m in MODES]
    rows = []
    bar = progress_bar(len(cells), "temporal")
    for s, mode in cells:
        x, tp, grad = temporal_inputs(s, device)
        row = Row(f"B={TEMPORAL_BATCH} S={s}", mode)
        for name, fn in temporal_candidates(zoo, doc004, device).items():
            row.ms[name] = 1e3 * measure(temporal_runner(fn, x, tp, grad, mode), timer, args).median_s
        if mode == "fwd+bwd" and not args.no_memory:
            for name in row.ms:
                row.extra[f"{name} MB"] = f"{run_memory_child(name, s, args):.0f}"
        rows.append(row)
        bar.update(1)
        bar.write(f"  {row.label:14s} {mode:7s} " + "  ".join(f"{k} {v:8.2f} ms" for k, v in row.ms.items())
                  + f"  doc/ours {row.ratio('doc', 'ours'):5.2f}x  doc/no_weights "
                    f"{row.ratio('doc', 'ours_no_weights'):5.2f}x")
    bar.close()
    return rows


def memory_child(name: str, s: int, device: str) -> dict:
    """One fwd+bwd of a temporal candidate; peak memory above the inputs (MB)."""
    attn_ext = import_attn_ext()
    from attn_ext.testing.documents import doc004
    dev = torch.device(device)
    fn = temporal_candidates(attn_ext.compat.attention_zoo, doc004, dev)[name]
    x, tp, grad = temporal_inputs(s, dev)
    leaf = x.requires_grad_()
    # one untimed call first: library workspaces and thread pools are not the candidate's memory
    torch.autograd.grad(fn(leaf, tp)[0], leaf, grad)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        _reset_peak_rss()
        base = _peak_rss_mb()
    out, _ = fn(leaf, tp)
    torch.autograd.grad(out, leaf, grad)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        peak = _peak_rss_mb() - base
    return {"peak_mb": peak}


def run_memory_child(name: str, s: int, args) -> float:
    cmd = [sys.executable, __file__, "--memory-child", name, str(s), "--device", args.device]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT)
    if proc.returncode != 0:
        return float("nan")
    return json.loads(proc.stdout.strip().splitlines()[-1])["peak_mb"]


# ------------------------------------------------------------------------------- output


def render(rows: List[Row], names: List[str], ratios: List[tuple], extras: List[str]) -> str:
    head = ["case", "mode"] + [f"{n} ms" for n in names] + [f"{a}/{b}" for a, b in ratios] + extras
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r.label, r.mode] + [f"{r.ms.get(n, float('nan')):.2f}" for n in names]
        cells += [f"{r.ratio(a, b):.2f}x" if r.ratio(a, b) is not None else "-" for a, b in ratios]
        cells += [r.extra.get(e, "-") for e in extras]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(spatial: List[Row], temporal: List[Row]) -> List[str]:
    out = []
    fb = [r.ratio("doc", "ours") for r in spatial if r.mode == "fwd+bwd"]
    if fb:
        ok = all(x >= SPATIAL_FWD_BWD_TARGET for x in fb)
        out.append(f"spatial gate fwd+bwd doc/ours: min {min(fb):.2f}x, max {max(fb):.2f}x -> "
                   f"{'PASS' if ok else 'FAIL'} (target >= {SPATIAL_FWD_BWD_TARGET}x in every cell)")
    for cand in ("ours", "ours_no_weights"):
        rs = [r.ratio("doc", cand) for r in temporal]
        if rs:
            ok = all(x > 1.0 for x in rs)
            out.append(f"temporal doc/{cand}: min {min(rs):.2f}x -> {'PASS' if ok else 'FAIL'} "
                       "(target > 1 at every S and mode)")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--min-repeats", type=int, default=3)
    ap.add_argument("--max-repeats", type=int, default=20)
    ap.add_argument("--target-time", type=float, default=2.0)
    ap.add_argument("--skip", default="", help="comma list of parts to skip: spatial,temporal")
    ap.add_argument("--no-memory", action="store_true", help="skip the temporal peak-memory subprocesses")
    ap.add_argument("--out", default=None)
    ap.add_argument("--memory-child", nargs=2, metavar=("CANDIDATE", "S"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_child:
        print(json.dumps(memory_child(args.memory_child[0], int(args.memory_child[1]), args.device)))
        return 0

    attn_ext = import_attn_ext()
    from attn_ext.compat import attention_zoo as zoo
    from attn_ext.testing.documents import doc004
    device = torch.device(args.device)
    timer = Timer(device)
    skip = set(args.skip.split(","))
    spatial = [] if "spatial" in skip else spatial_sweep(args, attn_ext, doc004, device, timer)
    temporal = [] if "temporal" in skip else temporal_sweep(args, attn_ext, zoo, doc004, device, timer)

    env = [f"date {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, "
           f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, device {device}"
           + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")]
    parts = ["# Spatial (CBAM) and temporal attention benchmark", "", *env, ""]
    if spatial:
        parts += ["## CBAM spatial gate: attn_ext.nn.SpatialAttention vs document 004 (x * attn_map)", "",
                  render(spatial, ["ours", "doc"], [("doc", "ours")], ["GB/s"]), ""]
    if temporal:
        mem = [] if args.no_memory else ["doc MB", "ours MB", "ours_no_weights MB"]
        parts += ["## Temporal attention: attention_zoo.TemporalAttention vs document 004", "",
                  render(temporal, ["doc", "ours", "ours_no_weights"],
                         [("doc", "ours"), ("doc", "ours_no_weights")], mem), ""]
    summ = summary(spatial, temporal)
    parts += ["## Summary", "", *[f"- {line}" for line in summ], ""]
    text = "\n".join(parts)
    print("\n" + text)
    out = Path(args.out) if args.out else (
        REPO_ROOT / "benchmarks" / "results" / f"spatial_{device.type}{'_quick' if args.quick else ''}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
