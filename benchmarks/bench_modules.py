#!/usr/bin/env python
"""Module-level benchmark: attn_ext.nn.MultiheadAttention vs torch.nn.MultiheadAttention.

Both modules run in one process on the same inputs with the same weights (ours loads torch's
state dict): self attention, ``batch_first=True``, ``need_weights=False``, default shape
embed 768, 12 heads, batch 8, 1024 tokens, float32 and bfloat16. The canonical
``attn_ext.nn.MultiHeadAttention`` (same math, separate q/k/v projections) is timed alongside.

Modes:

* ``fwd``     -- inference: ``eval()`` and ``torch.no_grad()`` (torch may take its fused
                 inference fast path, ``torch._native_multi_head_attention``);
* ``fwd+bwd`` -- ``train()`` (dropout 0), forward then backward of ``(out * grad).sum()``
                 to the input and every parameter.

Each cell is the median of timed calls after a warmup; the table shows times, the ratio
``torch / attn_ext`` (> 1 means attn_ext is faster) and the max abs difference of the
outputs as a sanity check. Written to stdout and ``benchmarks/results/modules_<device>.md``
(``--quick``: ``modules_<device>_quick.md``, small shapes, one repeat).

    python benchmarks/bench_modules.py --quick
    python benchmarks/bench_modules.py                 # full (minutes on 2 CPU cores)
    python benchmarks/bench_modules.py --device cuda
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import attn_ext  # noqa: E402
import attn_ext.nn  # noqa: E402,F401

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MODES = ("fwd", "fwd+bwd")


def _sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _time(fn, device, repeats, target_time):
    fn()  # warmup
    _sync(device)
    times = []
    start = time.perf_counter()
    while len(times) < repeats or (time.perf_counter() - start < target_time and len(times) < 50):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _modules(embed, heads, device, dtype):
    theirs = torch.nn.MultiheadAttention(embed, heads, batch_first=True, device=device, dtype=dtype)
    ours = attn_ext.nn.MultiheadAttention(embed, heads, batch_first=True, device=device, dtype=dtype)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    canonical = attn_ext.nn.MultiHeadAttention(embed, heads, device=device, dtype=dtype)
    return {"torch": theirs, "attn_ext": ours, "attn_ext canonical": canonical}


def _call(name, mod, x):
    if name == "attn_ext canonical":
        return mod(x)
    return mod(x, x, x, need_weights=False)[0]


def run_cell(embed, heads, batch, seq, dtype, mode, device, repeats, target_time):
    torch.manual_seed(0)
    mods = _modules(embed, heads, device, dtype)
    x = torch.randn(batch, seq, embed, device=device, dtype=dtype)
    grad = torch.randn(batch, seq, embed, device=device, dtype=dtype)
    row, outs = {}, {}
    for name, mod in mods.items():
        if mode == "fwd":
            mod.eval()

            def fn(name=name, mod=mod):
                with torch.no_grad():
                    return _call(name, mod, x)
        else:
            mod.train()
            xg = x.clone().requires_grad_(True)

            def fn(name=name, mod=mod, xg=xg):
                out = _call(name, mod, xg)
                (out * grad).sum().backward()
                xg.grad = None
                mod.zero_grad(set_to_none=True)
                return out
        row[name] = _time(fn, device, repeats, target_time)
        if name != "attn_ext canonical":
            with torch.no_grad():
                mod.eval()
                outs[name] = _call(name, mod, x).float()
    diff = (outs["attn_ext"] - outs["torch"]).abs().max().item()
    return row, diff


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small shapes, one repeat (smoke test)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--embed", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--repeats", type=int, default=3, help="minimum timed calls per cell")
    ap.add_argument("--target-time", type=float, default=2.0, help="keep timing a cell up to this many seconds")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.batch, args.seq, args.repeats, args.target_time = 2, 128, 1, 0.0
    dtypes = [d for d in args.dtypes.split(",") if d]
    modes = [m for m in args.modes.split(",") if m]
    dev_name = "cuda" if args.device.startswith("cuda") else "cpu"
    out = Path(args.out) if args.out else REPO_ROOT / "benchmarks" / "results" / (
        f"modules_{dev_name}{'_quick' if args.quick else ''}.md")

    header = (f"| dtype | mode | torch nn.MultiheadAttention (ms) | attn_ext.nn.MultiheadAttention (ms) | "
              f"torch / attn_ext | attn_ext.nn.MultiHeadAttention (ms) | torch / canonical | max abs diff |")
    lines = [header, "|" + "---|" * 8]
    print(f"embed {args.embed}, heads {args.heads}, batch {args.batch}, seq {args.seq}, device {args.device}, "
          f"threads {torch.get_num_threads()}, need_weights=False, self attention")
    print(header)
    print(lines[1])
    for dt in dtypes:
        for mode in modes:
            row, diff = run_cell(args.embed, args.heads, args.batch, args.seq, DTYPES[dt], mode, args.device,
                                 args.repeats, args.target_time)
            t, o, c = row["torch"] * 1e3, row["attn_ext"] * 1e3, row["attn_ext canonical"] * 1e3
            line = f"| {dt} | {mode} | {t:.2f} | {o:.2f} | {t / o:.2f}x | {c:.2f} | {t / c:.2f}x | {diff:.2e} |"
            lines.append(line)
            print(line, flush=True)

    out.parent.mkdir(parents=True, exist_ok=True)
    meta = (f"Generated {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} by "
            f"`python benchmarks/bench_modules.py{' --quick' if args.quick else ''}` on {platform.node()} "
            f"({platform.processor() or platform.machine()}), torch {torch.__version__}, device {args.device}, "
            f"{torch.get_num_threads()} threads.\n\n"
            f"Self attention, batch_first, need_weights=False: embed {args.embed}, heads {args.heads}, "
            f"batch {args.batch}, seq {args.seq}. `fwd` = eval + no_grad (torch may use its fused inference "
            f"fast path); `fwd+bwd` = train mode, backward to the input and all parameters. Median times; "
            f"ratios > 1 mean attn_ext is faster. Max abs diff = attn_ext vs torch output (eval).\n\n")
    out.write_text("# Module benchmark: nn.MultiheadAttention\n\n" + meta + "\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
