#!/usr/bin/env python
"""KV-cache compression benchmark: cache bytes per token and decode step time of one attention
layer for MHA, GQA, MLA and TPA at one model width (default d_model 2048, 16 heads).

Candidates (one process, same inputs; each step is a whole layer: projections, cache write,
attention, output projection, one new token per sequence):

* ``mha`` / ``gqa`` -- :class:`attn_ext.nn.DecoderAttention` (head dim d_model / H; GQA with
  ``--kv-heads``) over an :class:`attn_ext.KVCache`;
* ``mla`` -- :class:`attn_ext.nn.MultiHeadLatentAttention` (DeepSeek-V2 dims: kv_lora_rank 512,
  qk_nope 128, qk_rope 64, v 128) decoding in the weight-absorbed form over its
  :class:`attn_ext.LatentKVCache` (576 values per token);
* ``mla_naive`` -- the same layer and cache, decompressing every cached latent into per-head
  keys and values at every step (``absorb=False``);
* ``mla_kernel`` -- the absorbed step's attention alone (``decode_attention`` with 16 query heads
  on the one 576-wide latent head, values a 512-column view); on CUDA also its GB/s;
* ``tpa`` -- :class:`attn_ext.nn.TensorProductAttention` (head dim 128, ranks 6/2/2) decoding
  over its factor cache (A_K, B_K, A_V, B_V);
* ``tpa_kv`` -- the same layer forming K and V and decoding over a materialized KV cache.

The caches are filled with ``P`` random rows (the prefill is not timed), then ``step`` is the
median time of a decode step at context P. Ratios: ``mla_naive / mla`` and ``tpa_kv / tpa``
(> 1: the compressed form is faster). Writes stdout and
``benchmarks/results/kv_compression_<device>.md``.

    python benchmarks/bench_kv_compression.py --quick
    python benchmarks/bench_kv_compression.py                   # CPU: contexts 1k..32k
    python benchmarks/bench_kv_compression.py --device cuda --batch 1 64 --contexts 8192
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
CANDIDATES = ("mha", "gqa", "mla", "mla_naive", "mla_kernel", "tpa", "tpa_kv")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

try:
    import attn_ext
except ImportError:
    sys.path.insert(0, str(REPO_ROOT))
    import attn_ext

try:
    from tqdm import tqdm
except ImportError:
    tqdm = None


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device, nbytes=1 << 30):
    """Measured device copy bandwidth in GB/s (read + write of a large buffer)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / min(times) / 1e9


# ------------------------------------------------------------------------------- candidates


def build_layer(name, args, device, dtype):
    d, H = args.d_model, args.heads
    kw = dict(device=device, dtype=dtype)
    if name == "mha":
        return attn_ext.nn.DecoderAttention(d, H, **kw)
    if name == "gqa":
        return attn_ext.nn.DecoderAttention(d, H, args.kv_heads, **kw)
    if name.startswith("mla"):
        return attn_ext.nn.MultiHeadLatentAttention(d, H, q_lora_rank=args.q_lora_rank, **kw)
    return attn_ext.nn.TensorProductAttention(d, H, args.tpa_head_dim, r_q=args.tpa_ranks[0],
                                              r_k=args.tpa_ranks[1], r_v=args.tpa_ranks[2], **kw)


def cache_bytes(name, args, dtype):
    """KV-cache bytes per token per layer of a candidate, from attn_ext.kv_cache_bytes."""
    H, hd = args.heads, args.d_model // args.heads
    if name == "mha":
        return attn_ext.kv_cache_bytes("mha", num_heads=H, head_dim=hd, dtype=dtype)
    if name == "gqa":
        return attn_ext.kv_cache_bytes("gqa", num_heads=H, num_kv_heads=args.kv_heads, head_dim=hd,
                                       dtype=dtype)
    if name.startswith("mla"):
        return attn_ext.kv_cache_bytes("mla", kv_lora_rank=512, qk_rope_head_dim=64, dtype=dtype)
    if name == "tpa_kv":
        return attn_ext.kv_cache_bytes("mha", num_heads=H, head_dim=args.tpa_head_dim, dtype=dtype)
    return attn_ext.kv_cache_bytes("tpa", num_heads=H, head_dim=args.tpa_head_dim,
                                   r_k=args.tpa_ranks[1], r_v=args.tpa_ranks[2], dtype=dtype)


def filled_cache(name, layer, B, P, max_len, gen):
    """A cache of ``layer`` holding P random rows per sequence."""
    cache = layer.new_cache(B, max_len, **({"materialize": True} if name == "tpa_kv" else {}))
    tensors = ([cache.a_k, cache.b_k, cache.a_v, cache.b_v] if name == "tpa"
               else [cache.kv] if name.startswith("mla") else [cache.k, cache.v])
    for t in tensors:
        rows = t[:, :P] if name == "tpa" else t[:, :, :P]
        rows.copy_(torch.randn(rows.shape, generator=gen).to(rows.dtype))
    cache.lengths.fill_(P)
    if hasattr(cache, "_empty"):  # LatentKVCache: filled behind its back
        cache._empty = False
    if hasattr(cache, "_host_lengths"):  # a GPU cache's host copy of its lengths
        cache._host_lengths = [P] * B
    return cache


def make_step(name, layer, cache):
    if name == "mla_naive":
        return lambda x: layer(x, cache, absorb=False)
    if name == "mla_kernel":
        H, D = layer.num_heads, layer.kv_lora_rank + layer.qk_rope_head_dim
        q = torch.randn(cache.kv.size(0), H, 1, D, dtype=cache.kv.dtype, device=cache.kv.device)
        return lambda x: attn_ext.decode_attention(q, cache.k, cache.v, cache.lengths,
                                                   scale=layer.softmax_scale)
    return lambda x: layer(x, cache)


def time_steps(step, xs, repeats, budget_s, device):
    """Median seconds of a step; at least 3 steps, then until `repeats` or the time budget."""
    step(xs[0])  # warmup (allocations, lazy init)
    sync(device)
    times = []
    start = time.perf_counter()
    for i in range(repeats):
        t0 = time.perf_counter()
        step(xs[i % len(xs)])
        sync(device)
        times.append(time.perf_counter() - t0)
        if len(times) >= 3 and time.perf_counter() - start > budget_s:
            break
    return statistics.median(times)


# -------------------------------------------------------------------------------------- main


def fmt_ms(s):
    return "-" if s is None else f"{s * 1e3:.2f}"


def ratio(a, b):
    return "-" if a is None or b is None else f"{a / b:.2f}x"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                    help="default float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4, help="GQA's key/value heads")
    ap.add_argument("--q-lora-rank", type=int, default=None, help="MLA's query compression (None: full)")
    ap.add_argument("--tpa-head-dim", type=int, default=128)
    ap.add_argument("--tpa-ranks", type=int, nargs=3, default=[6, 2, 2], metavar=("R_Q", "R_K", "R_V"))
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--step-repeats", type=int, default=20)
    ap.add_argument("--budget", type=float, default=4.0,
                    help="seconds per cell after which a slow candidate stops at 3 steps")
    ap.add_argument("--candidates", nargs="+", default=list(CANDIDATES), choices=CANDIDATES)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="small contexts, a few steps")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.contexts, args.step_repeats, args.budget = [512, 2048], 3, 1.0
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    elt = torch.finfo(dtype).bits // 8
    bw = copy_bandwidth(device) if device.type == "cuda" else None
    torch.manual_seed(0)

    layers = {name: build_layer(name, args, device, dtype) for name in args.candidates}
    cells = [(B, P) for B in args.batch for P in args.contexts]
    bar = tqdm(total=len(cells) * len(args.candidates), desc="kv compression", leave=False) if tqdm else None
    rows = []
    with torch.no_grad():
        for B, P in cells:
            gen = torch.Generator().manual_seed(P)
            xs = [torch.randn(B, 1, args.d_model, generator=gen).to(device=device, dtype=dtype)
                  for _ in range(4)]
            row = {"B": B, "P": P}
            for name in args.candidates:
                cache = filled_cache(name, layers[name], B, P, P + args.step_repeats + 2, gen)
                row[name] = time_steps(make_step(name, layers[name], cache), xs, args.step_repeats,
                                       args.budget, device)
                del cache
                if bar:
                    bar.update(1)
            if bw is not None and "mla_kernel" in row:
                # bytes of the latent cache read per step (keys and values share the rows)
                row["gbps"] = B * (P + 1) * 576 * elt / row["mla_kernel"] / 1e9
            rows.append(row)
    if bar:
        bar.close()

    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cmd = "python benchmarks/bench_kv_compression.py" + (" " + " ".join(argv if argv is not None else sys.argv[1:])
                                                          if (argv or sys.argv[1:]) else "")
    head = [f"# KV-cache compression benchmark ({device.type})", "",
            f"Generated {now} by `{cmd.strip()}` on {platform.node()} ({platform.machine()}), "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads"
            + (f", {torch.cuda.get_device_name()}" if bw else "") + ".", "",
            f"d_model={args.d_model}, H={args.heads}, {str(dtype).replace('torch.', '')}; GQA Hkv={args.kv_heads}; "
            f"MLA kv_lora_rank=512, qk_nope=128, qk_rope=64, v=128, q_lora_rank={args.q_lora_rank}; "
            f"TPA head_dim={args.tpa_head_dim}, ranks (R_Q, R_K, R_V)={tuple(args.tpa_ranks)}.", "",
            "## KV cache per token per layer", "",
            "| candidate | bytes/token/layer (" + str(dtype).replace("torch.", "") + ") | bf16 | vs MHA |",
            "|---|---|---|---|"]
    mha_bytes = cache_bytes("mha", args, dtype)
    for name in args.candidates:
        if name == "mla_kernel":
            continue
        nb = cache_bytes(name, args, dtype)
        head.append(f"| {name} | {nb} | {cache_bytes(name, args, torch.bfloat16)} | {mha_bytes / nb:.1f}x smaller |")
    head += ["", "## Decode step time (ms, median; one new token per sequence, whole layer)", "",
             "`mla_naive/mla` and `tpa_kv/tpa` > 1: the compressed cache decodes faster."
             + (f" Copy bandwidth {bw:.0f} GB/s." if bw else ""), ""]
    cols = ["B", "context"] + list(args.candidates)
    pairs = [(a, b) for a, b in (("mla_naive", "mla"), ("tpa_kv", "tpa"), ("mha", "mla"))
             if a in args.candidates and b in args.candidates]
    cols += [f"{a}/{b}" for a, b in pairs]
    if bw:
        cols += ["mla_kernel GB/s", "% of copy bw"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells_ = [str(r["B"]), str(r["P"])] + [fmt_ms(r.get(c)) for c in args.candidates]
        cells_ += [ratio(r.get(a), r.get(b)) for a, b in pairs]
        if bw and "gbps" in r:
            cells_ += [f"{r['gbps']:.0f}", f"{100 * r['gbps'] / bw:.0f}%"]
        lines.append("| " + " | ".join(cells_) + " |")
    text = "\n".join(head + lines) + "\n"
    print(text)
    out = Path(args.out) if args.out else REPO_ROOT / "benchmarks" / "results" / (
        f"kv_compression_{device.type}{'_quick' if args.quick else ''}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)


if __name__ == "__main__":
    main()
