#!/usr/bin/env python
"""Leak and stability check: every op family called N times (forward + backward where it has
one) with the resident set size (RSS) read after a warm-up and at the end, and a KVCache
generation loop of N steps. Prints one row per op: RSS after warm-up, at the end, and the
growth per 1,000 calls; exits 1 when an op grows past --max-growth-mb.

    python tools/leak_check.py                  # N = 10,000 (the figure the README reports)
    python tools/leak_check.py --calls 500      # quick

tests/test_leaks.py runs it in-process at a few hundred calls.
"""

from __future__ import annotations

import argparse
import gc
import sys
from typing import Callable, Dict, List, Tuple

import torch

import attn_ext

WARMUP = 50  # calls before the baseline (allocator pools, thread pools, first-call caches)


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _leaves(*xs):
    return [x.clone().requires_grad_(True) for x in xs]


def cases() -> List[Tuple[str, Callable[[], None]]]:
    """(name, one call) per op family, small shapes (the check is about growth, not speed)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 40, 32), torch.randn(2, 2, 50, 32), torch.randn(2, 2, 50, 32)
    sinks = torch.randn(4)
    lens = [7, 0, 33, 1]
    cu = torch.tensor([0, 7, 7, 40, 41], dtype=torch.int32)
    qv, kv, vv = torch.randn(41, 4, 32), torch.randn(41, 2, 32), torch.randn(41, 2, 32)
    assert sum(lens) == 41
    kc, vc = torch.randn(2, 2, 128, 32), torch.randn(2, 2, 128, 32)
    lengths = torch.tensor([128, 9], dtype=torch.int32)
    x = torch.randn(2, 8, 14, 14)
    gate = torch.randn(2, 1, 14, 14)

    def attention():
        a, b, c, s = _leaves(q, k, v, sinks)
        attn_ext.attention(a, b, c, causal=True, softcap=5.0, sinks=s).sum().backward()

    def varlen():
        a, b, c = _leaves(qv, kv, vv)
        attn_ext.attention_varlen(a, b, c, cu, cu, 33, 33, causal=True).sum().backward()

    def weights():
        a, b = _leaves(q, k)
        attn_ext.attention_weights(a, b, causal=True).sum().backward()

    def sdpa():
        a, b, c = _leaves(q, k[:, :1].expand(2, 4, 50, 32), v[:, :1].expand(2, 4, 50, 32))
        attn_ext.scaled_dot_product_attention(a, b, c, is_causal=True).sum().backward()

    def decode():
        attn_ext.decode_attention(q[:, :, :1], kc, vc, lengths, num_splits=2)

    def rope():
        (a,) = _leaves(q)
        attn_ext.rope(a, offset=3).sum().backward()

    def linear():
        a, b, c = _leaves(q, q, q)
        attn_ext.linear_attention(a, b, c, causal=True).sum().backward()

    def spatial():
        (a,) = _leaves(x)
        attn_ext.spatial_gate(a, gate).sum().backward()
        attn_ext.channel_pool(x)

    return [
        ("attention (softcap, sinks) fwd+bwd", attention),
        ("attention_varlen fwd+bwd", varlen),
        ("attention_weights fwd+bwd", weights),
        ("scaled_dot_product_attention fwd+bwd", sdpa),
        ("decode_attention (split-KV)", decode),
        ("rope fwd+bwd", rope),
        ("linear_attention fwd+bwd", linear),
        ("spatial_gate + channel_pool", spatial),
    ]


def generation_loop(steps: int, dtype=None, scale: float = 1.0) -> Callable[[], None]:
    """One KVCache decoding step per call: append one token, attend; the cache wraps around
    (reset) when full, so any number of steps runs on one allocation. ``dtype`` / ``scale``: a
    float8 cache (its quantizing append and widening decode)."""
    cache = attn_ext.KVCache(
        batch_size=2,
        num_kv_heads=2,
        max_len=256,
        head_dim=32,
        dtype=dtype,
        k_scale=scale,
        v_scale=scale,
    )
    q = torch.randn(2, 4, 1, 32)
    k, v = torch.randn(2, 2, 1, 32), torch.randn(2, 2, 1, 32)

    def step():
        if int(cache.lengths.max()) >= cache.max_len:
            cache.reset()
        cache.append(k, v, rope=True)
        cache.attend(q)

    return step


def generation_loops(calls: int) -> List[Tuple[str, Callable[[], None]]]:
    """The KVCache loops: a cache of the inputs' dtype and a float8 one."""
    return [
        ("KVCache generation loop", generation_loop(calls)),
        ("float8 KVCache generation loop", generation_loop(calls, torch.float8_e4m3fn, 2**-6)),
    ]


def measure(fn: Callable[[], None], calls: int) -> Dict[str, float]:
    for _ in range(WARMUP):
        fn()
    gc.collect()
    start = rss_mb()
    for _ in range(calls):
        fn()
    gc.collect()
    end = rss_mb()
    return {"start": start, "end": end, "per_1000": (end - start) * 1000 / calls}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=10_000)
    p.add_argument(
        "--max-growth-mb",
        type=float,
        default=8.0,
        help="RSS growth over all the calls an op may show (allocator noise)",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # the check is about memory; one thread keeps it quick and steady
    rows, failed = [], False
    for name, fn in cases() + generation_loops(args.calls):
        r = measure(fn, args.calls)
        ok = r["end"] - r["start"] <= args.max_growth_mb
        failed |= not ok
        rows.append((name, r, ok))
        print(
            f"{'ok  ' if ok else 'GROW'} {name:40s} RSS {r['start']:8.1f} -> {r['end']:8.1f} MB "
            f"over {args.calls} calls ({r['per_1000']:+.2f} MB / 1000)",
            flush=True,
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
