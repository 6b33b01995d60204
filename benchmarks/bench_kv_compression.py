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
* ``mla_kernel_mma`` -- the same call with ``ATTN_EXT_UNVERIFIED_CUDA=1`` (CUDA only): the
  tensor-core decode kernel (csrc/decoding/cuda/decode_mma.cu), gated until it has run green;
* ``tpa`` -- :class:`attn_ext.nn.TensorProductAttention` (head dim 128, ranks 6/2/2) decoding
  over its factor cache (A_K, B_K, A_V, B_V);
* ``tpa_kv`` -- the same layer forming K and V and decoding over a materialized KV cache.

The caches are filled with ``P`` random rows (the prefill is not timed), then the candidates'
steps at context P are timed in interleaved rounds. Ratios: ``mla_naive / mla``,
``tpa_kv / tpa`` and ``mha / mla`` (> 1: the compressed form is faster). Timing and output:
``attn_ext.testing.harness`` (``kv_compression_<device>.md``).

    python benchmarks/bench_kv_compression.py --quick
    python benchmarks/bench_kv_compression.py                   # CPU: contexts 1k..32k
    python benchmarks/bench_kv_compression.py --device cuda --batch 1 64 --contexts 8192
"""

from __future__ import annotations

import argparse

import torch

import attn_ext
from attn_ext.testing import harness

CANDIDATES = ("mha", "gqa", "mla", "mla_naive", "mla_kernel", "mla_kernel_mma", "tpa", "tpa_kv")
# Candidates that differ from another only on CUDA, left out of the CPU default.
CUDA_ONLY = ("mla_kernel_mma",)
# The candidates that time the latent decode kernel alone (their GB/s is reported on CUDA).
KERNEL_CANDIDATES = ("mla_kernel", "mla_kernel_mma")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# (slower, faster) pairs whose ratio the table shows.
RATIO_PAIRS = (("mla_naive", "mla"), ("tpa_kv", "tpa"), ("mha", "mla"))
MLA_LATENT = 576  # kv_lora_rank 512 + qk_rope_head_dim 64 values per cached token
# Distinct inputs cycled through by the steps.
INPUT_POOL = 4


def build_layer(name, args, device, dtype):
    d, H = args.d_model, args.heads
    kw = dict(device=device, dtype=dtype)
    if name == "mha":
        return attn_ext.nn.DecoderAttention(d, H, **kw)
    if name == "gqa":
        return attn_ext.nn.DecoderAttention(d, H, args.kv_heads, **kw)
    if name.startswith("mla"):
        return attn_ext.nn.MultiHeadLatentAttention(d, H, q_lora_rank=args.q_lora_rank, **kw)
    return attn_ext.nn.TensorProductAttention(
        d,
        H,
        args.tpa_head_dim,
        r_q=args.tpa_ranks[0],
        r_k=args.tpa_ranks[1],
        r_v=args.tpa_ranks[2],
        **kw,
    )


def cache_bytes(name, args, dtype):
    """KV-cache bytes per token per layer of a candidate, from attn_ext.kv_cache_bytes."""
    H, hd = args.heads, args.d_model // args.heads
    if name == "mha":
        return attn_ext.kv_cache_bytes("mha", num_heads=H, head_dim=hd, dtype=dtype)
    if name == "gqa":
        return attn_ext.kv_cache_bytes(
            "gqa", num_heads=H, num_kv_heads=args.kv_heads, head_dim=hd, dtype=dtype
        )
    if name.startswith("mla"):
        return attn_ext.kv_cache_bytes("mla", kv_lora_rank=512, qk_rope_head_dim=64, dtype=dtype)
    if name == "tpa_kv":
        return attn_ext.kv_cache_bytes("mha", num_heads=H, head_dim=args.tpa_head_dim, dtype=dtype)
    return attn_ext.kv_cache_bytes(
        "tpa",
        num_heads=H,
        head_dim=args.tpa_head_dim,
        r_k=args.tpa_ranks[1],
        r_v=args.tpa_ranks[2],
        dtype=dtype,
    )


def filled_cache(name, layer, B, P, max_len, gen):
    """A cache of ``layer`` holding P random rows per sequence."""
    cache = layer.new_cache(B, max_len, **({"materialize": True} if name == "tpa_kv" else {}))
    tensors = (
        [cache.a_k, cache.b_k, cache.a_v, cache.b_v]
        if name == "tpa"
        else [cache.kv]
        if name.startswith("mla")
        else [cache.k, cache.v]
    )
    for t in tensors:
        rows = t[:, :P] if name == "tpa" else t[:, :, :P]
        rows.copy_(torch.randn(rows.shape, generator=gen).to(rows.dtype))
    cache.lengths.fill_(P)
    if hasattr(cache, "_empty"):  # LatentKVCache: filled behind its back
        cache._empty = False
    if hasattr(cache, "_host_lengths"):  # a GPU cache's host copy of its lengths
        cache._host_lengths = [P] * B
    return cache


def make_step(name, layer, cache, xs):
    """A zero-argument decode step, cycling through the inputs ``xs``."""
    i = [0]

    def x():
        i[0] += 1
        return xs[i[0] % len(xs)]

    if name == "mla_naive":
        return lambda: layer(x(), cache, absorb=False)
    if name in ("mla_kernel", "mla_kernel_mma"):
        H, D = layer.num_heads, layer.kv_lora_rank + layer.qk_rope_head_dim
        q = torch.randn(cache.kv.size(0), H, 1, D, dtype=cache.kv.dtype, device=cache.kv.device)

        def attend():
            return attn_ext.decode_attention(
                q, cache.k, cache.v, cache.lengths, scale=layer.softmax_scale
            )

        return harness.with_unverified_cuda(attend) if name == "mla_kernel_mma" else attend
    return lambda: layer(x(), cache)


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    harness.add_common_args(ap, min_repeats=3, max_repeats=20, target_time=4.0)
    ap.add_argument(
        "--dtype",
        default=None,
        choices=sorted(DTYPES),
        help="default float32 on CPU, bfloat16 on CUDA",
    )
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4, help="GQA's key/value heads")
    ap.add_argument(
        "--q-lora-rank", type=int, default=None, help="MLA's query compression (None: full)"
    )
    ap.add_argument("--tpa-head-dim", type=int, default=128)
    ap.add_argument(
        "--tpa-ranks", type=int, nargs=3, default=[6, 2, 2], metavar=("R_Q", "R_K", "R_V")
    )
    ap.add_argument(
        "--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768]
    )
    ap.add_argument(
        "--candidates",
        nargs="+",
        default=None,
        choices=CANDIDATES,
        help="default: all (on the CPU: all but " + ", ".join(CUDA_ONLY) + ")",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.contexts, args.max_repeats, args.target_time = [512, 2048], 3, 1.0
    bench = harness.Bench("kv_compression", args, __file__)
    device = bench.device
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    dt_name = str(dtype).replace("torch.", "")
    elt = torch.finfo(dtype).bits // 8
    bw = harness.copy_bandwidth_gbs(device) if device.type == "cuda" else None
    torch.manual_seed(0)
    names = list(
        args.candidates or [c for c in CANDIDATES if device.type == "cuda" or c not in CUDA_ONLY]
    )
    kernels = [n for n in KERNEL_CANDIDATES if n in names]
    pairs = [(a, b) for a, b in RATIO_PAIRS if a in names and b in names]

    layers = {name: build_layer(name, args, device, dtype) for name in names}
    cells = [(B, P) for B in args.batch for P in args.contexts]
    bar = harness.progress(len(cells), "kv compression")
    rows = []
    with torch.no_grad():
        for B, P in cells:
            gen = torch.Generator().manual_seed(P)
            xs = [
                torch.randn(B, 1, args.d_model, generator=gen).to(device=device, dtype=dtype)
                for _ in range(INPUT_POOL)
            ]
            max_len = P + args.warmup + 2 * args.max_repeats + 2
            caches = {n: filled_cache(n, layers[n], B, P, max_len, gen) for n in names}
            timing = bench.time({n: make_step(n, layers[n], caches[n], xs) for n in names})
            timing.results.clear()
            del caches
            # bytes of the latent cache read per step (keys and values share the rows)
            gbps = {
                n: B * (P + 1) * MLA_LATENT * elt / timing.median_s(n) / 1e9
                for n in kernels
                if bw and timing.median_s(n)
            }
            params = dict(dtype=dt_name, B=B, H=args.heads, S=P, mode="step", d_model=args.d_model)
            for n in names:  # each slower form against its compressed one (RATIO_PAIRS)
                to = dict(pairs).get(n)
                bench.record(
                    n,
                    timing.ms(n),
                    ratio_to=to,
                    ratio=to and timing.ratio(n, to),
                    gbps=gbps.get(n),
                    note=timing.errors.get(n, ""),
                    **params,
                )
            row = [B, P] + [harness.fmt(timing.ms(n)) for n in names]
            row += [harness.fmt_ratio(timing.ratio(a, b)) for a, b in pairs]
            if bw and len(gbps) == len(kernels):
                for n in kernels:
                    row += [f"{gbps[n]:.0f}", f"{100 * gbps[n] / bw:.0f}%"]
            rows.append(row)
            bar.update(1)
    bar.close()

    mha_bytes = cache_bytes("mha", args, dtype)
    sizes = [
        [
            n,
            cache_bytes(n, args, dtype),
            cache_bytes(n, args, torch.bfloat16),
            f"{mha_bytes / cache_bytes(n, args, dtype):.1f}x smaller",
        ]
        for n in names
        if n not in KERNEL_CANDIDATES
    ]
    cols = ["B", "context"] + names + [f"{a}/{b}" for a, b in pairs]
    if bw and kernels and all(len(r) == len(cols) + 2 * len(kernels) for r in rows):
        for n in kernels:
            cols += [f"{n} GB/s", "% of copy bw"]
    dims = (
        f"d_model={args.d_model}, H={args.heads}, {dt_name}; GQA Hkv={args.kv_heads}; MLA "
        "kv_lora_rank=512, "
        f"qk_nope=128, qk_rope=64, v=128, q_lora_rank={args.q_lora_rank}; TPA "
        f"head_dim={args.tpa_head_dim}, "
        f"ranks (R_Q, R_K, R_V)={tuple(args.tpa_ranks)}."
    )
    bench.finish(
        f"KV-cache compression benchmark ({device.type})",
        [
            dims,
            "## KV cache per token per layer",
            harness.markdown_table(
                ["candidate", f"bytes/token/layer ({dt_name})", "bf16", "vs MHA"], sizes
            ),
            "## Decode step time (ms, median; one new token per sequence, whole layer)",
            "`mla_naive/mla` and `tpa_kv/tpa` > 1: the compressed cache decodes faster."
            + (f" Copy bandwidth {bw:.0f} GB/s." if bw else ""),
            harness.markdown_table(cols, rows),
        ],
    )


if __name__ == "__main__":
    main()
