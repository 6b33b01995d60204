#!/usr/bin/env python
"""Generation-loop benchmark: attention of one new token per step against a growing KV cache.

Three candidates run in one process on the same inputs (B sequences, H query heads, Hkv KV
heads, head dim D), each step taking the new token's q, k, v (k already rotated: RoPE costs the
same everywhere):

* ``attn_ext`` -- :class:`attn_ext.KVCache` (preallocated) + ``kv_cache_append`` +
  ``decode_attention`` (GQA heads share each cache read; split-KV when B * Hkv is small);
* ``sdpa``     -- a preallocated cache written with ``copy_`` and
  ``F.scaled_dot_product_attention(q, k[:, :, :L], v[:, :, :L], enable_gqa=True)``;
* ``doc``      -- document 000's ``KVCacheAttention`` cache (``torch.cat`` of the past and the new
  keys/values every step) with document 003's ``repeat_kv`` for the grouped heads and plain
  ``softmax(q k^T / sqrt(D)) v``.

For each prompt length P the cache is filled with P random tokens (the prefill is not
timed), then:

* ``step``: the median time of one step at context P (``--step-repeats`` steps);
* ``gen``: the time of a whole generation of ``--new-tokens`` (512) steps after the prompt
  (up to ``--gen-max-context``; above it the cell says "skip").

Ratios ``doc / attn_ext`` and ``sdpa / attn_ext`` (> 1: attn_ext faster). On CUDA also the
achieved bandwidth of a step (bytes of K and V read / time) against the device's measured copy
bandwidth. Writes stdout and ``benchmarks/results/decode_<device>.md``.

    python benchmarks/bench_decode.py --quick
    python benchmarks/bench_decode.py                      # CPU: prompts 512..32k
    python benchmarks/bench_decode.py --device cuda --batch 1 16 64
"""

from __future__ import annotations

import argparse
import datetime
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parent.parent
CANDIDATES = ("attn_ext", "sdpa", "doc")
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


def repeat_kv(x, n_rep):
    """Document 003: each KV head repeated for the query heads that share it."""
    if n_rep == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


class DocCache:
    """Document 000's tuple cache, grown by torch.cat every step."""

    def __init__(self, k, v):
        self.k, self.v = k, v

    def step(self, q, k_new, v_new):
        self.k = torch.cat([self.k, k_new], dim=2)
        self.v = torch.cat([self.v, v_new], dim=2)
        n_rep = q.size(1) // self.k.size(1)
        k, v = repeat_kv(self.k, n_rep), repeat_kv(self.v, n_rep)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
        return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


class SdpaCache:
    """A preallocated cache and torch's SDPA over its valid prefix (one length for the batch)."""

    def __init__(self, k, v, max_len):
        B, Hkv, P, D = k.shape
        self.k = k.new_zeros(B, Hkv, max_len, D)
        self.v = v.new_zeros(B, Hkv, max_len, v.size(3))
        self.k[:, :, :P] = k
        self.v[:, :, :P] = v
        self.length = P

    def step(self, q, k_new, v_new):
        L = self.length
        self.k[:, :, L:L + 1].copy_(k_new)
        self.v[:, :, L:L + 1].copy_(v_new)
        self.length = L + 1
        return F.scaled_dot_product_attention(q, self.k[:, :, :L + 1], self.v[:, :, :L + 1],
                                              enable_gqa=True)


class AttnExtCache:
    def __init__(self, k, v, max_len):
        B, Hkv, P, D = k.shape
        self.cache = attn_ext.KVCache(B, Hkv, max_len, D, v.size(3), dtype=k.dtype, device=k.device)
        self.cache.append(k, v)

    def step(self, q, k_new, v_new):
        self.cache.append(k_new, v_new)
        return self.cache.attend(q)


MAKERS = {"attn_ext": lambda k, v, L: AttnExtCache(k, v, L),
          "sdpa": lambda k, v, L: SdpaCache(k, v, L),
          "doc": lambda k, v, L: DocCache(k, v)}


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


def run_candidate(name, prompt_kv, new_tokens, steps, max_len, device):
    """(median step time at context P, whole-generation time or None)."""
    k0, v0 = prompt_kv
    cache = MAKERS[name](k0, v0, max_len)
    q_new, k_new, v_new = new_tokens
    # warmup step (allocations, lazy init)
    cache.step(q_new[0], k_new[0], v_new[0])
    sync(device)
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        out = cache.step(q_new[i % len(q_new)], k_new[i % len(k_new)], v_new[i % len(v_new)])
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def run_generation(name, prompt_kv, new_tokens, n_new, max_len, device):
    k0, v0 = prompt_kv
    cache = MAKERS[name](k0, v0, max_len)
    q_new, k_new, v_new = new_tokens
    sync(device)
    t0 = time.perf_counter()
    for i in range(n_new):
        cache.step(q_new[i % len(q_new)], k_new[i % len(k_new)], v_new[i % len(v_new)])
    sync(device)
    return time.perf_counter() - t0


def fmt_ms(s):
    return "skip" if s is None else f"{s * 1e3:.2f}"


def ratio(a, b):
    return "-" if a is None or b is None else f"{a / b:.2f}x"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                    help="default float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--prompts", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--step-repeats", type=int, default=20)
    ap.add_argument("--gen-max-context", type=int, default=32768,
                    help="whole generations only for prompts up to this length")
    ap.add_argument("--candidates", nargs="+", default=list(CANDIDATES), choices=CANDIDATES)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="small shapes, a few steps")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.new_tokens, args.step_repeats = [256, 1024], 16, 4
        args.heads, args.kv_heads, args.head_dim = 8, 2, 64
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    H, Hkv, D = args.heads, args.kv_heads, args.head_dim
    elt = torch.finfo(dtype).bits // 8
    bw = copy_bandwidth(device) if device.type == "cuda" else None

    cells = [(B, P) for B in args.batch for P in args.prompts]
    bar = tqdm(total=len(cells), desc="decode", leave=False) if tqdm else None
    rows = []
    for B, P in cells:
        gen = torch.Generator(device="cpu").manual_seed(0)

        def rnd(*shape):
            return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)

        prompt = (rnd(B, Hkv, P, D), rnd(B, Hkv, P, D))
        n_tok = 8
        new = ([rnd(B, H, 1, D) for _ in range(n_tok)], [rnd(B, Hkv, 1, D) for _ in range(n_tok)],
               [rnd(B, Hkv, 1, D) for _ in range(n_tok)])
        max_len = P + args.new_tokens + args.step_repeats + 2
        row = {"B": B, "P": P}
        outs = {}
        for name in args.candidates:
            step_s, outs[name] = run_candidate(name, prompt, new, args.step_repeats, max_len, device)
            row[f"{name}_step"] = step_s
            row[f"{name}_gen"] = (run_generation(name, prompt, new, args.new_tokens, max_len, device)
                                  if P <= args.gen_max_context else None)
        if "attn_ext" in outs and len(outs) > 1:
            other = outs["sdpa" if "sdpa" in outs else "doc"]
            row["maxdiff"] = (outs["attn_ext"].float() - other.float()).abs().max().item()
        if bw is not None and "attn_ext_step" in row:
            # bytes of K and V read per step at context P (+1 new token)
            row["gbps"] = B * Hkv * (P + 1) * 2 * D * elt / row["attn_ext_step"] / 1e9
        rows.append(row)
        if bar:
            bar.update(1)
    if bar:
        bar.close()

    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    head = [f"# Decode benchmark ({device.type})", "",
            f"Generated {now} by `python benchmarks/bench_decode.py{' --quick' if args.quick else ''}` "
            f"on {platform.node()} ({platform.machine()}), torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads" + (f", {torch.cuda.get_device_name()}" if bw else "") + ".",
            "",
            f"H={H}, Hkv={Hkv}, D={D}, {str(dtype).replace('torch.', '')}; one new token per step. "
            f"`step` = median ms of one step at context P; `gen` = ms for {args.new_tokens} new tokens "
            "after the prompt. Ratios > 1: attn_ext faster."
            + (f" Copy bandwidth {bw:.0f} GB/s." if bw else ""), ""]
    cols = ["B", "prompt"]
    for kind in ("step", "gen"):
        cols += [f"{c} {kind} (ms)" for c in args.candidates]
        cols += [f"{c}/attn_ext {kind}" for c in args.candidates if c != "attn_ext"]
    if bw:
        cols += ["attn_ext GB/s", "% of copy bw"]
    cols.append("max abs diff")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells_ = [str(r["B"]), str(r["P"])]
        for kind in ("step", "gen"):
            cells_ += [fmt_ms(r.get(f"{c}_{kind}")) for c in args.candidates]
            cells_ += [ratio(r.get(f"{c}_{kind}"), r.get(f"attn_ext_{kind}"))
                       for c in args.candidates if c != "attn_ext"]
        if bw:
            cells_ += [f"{r['gbps']:.0f}", f"{100 * r['gbps'] / bw:.0f}%"]
        cells_.append(f"{r.get('maxdiff', float('nan')):.1e}")
        lines.append("| " + " | ".join(cells_) + " |")
    text = "\n".join(head + lines) + "\n"
    print(text)
    out = Path(args.out) if args.out else REPO_ROOT / "benchmarks" / "results" / (
        f"decode_{device.type}{'_quick' if args.quick else ''}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)


if __name__ == "__main__":
    main()
