#!/usr/bin/env python
"""GPU check of the CuTe backward's two-stage variant (ATTN_EXT_CUDA_BWD_KERNEL=cute_prefetch,
flash/flash_bwd_cute.cuh with kQStages = 2: the next query block's Q / dO load while this
block's products run) against the one-stage default, in one call.

1. Same results: each block sums dK and dV in registers over the same query blocks in the same
   order in both variants, so their dK / dV bits must be identical; dQ is summed by atomics in
   either, so it may differ by the order of its fp32 adds (held to a few bf16 / fp16 ulps).
   The profiler confirms which kernel ran (its traits name the stages: "<D>, 1>" / "<D>, 2>").
2. Timing: the backward alone on the FlashAttention grid (B S = 16k tokens, H D = 2048), both
   variants and torch's flash backend, interleaved rounds in one process (the kernel is read
   from the environment at each call).

    ATTN_EXT_UNVERIFIED_CUDA=1 python dev/cute_bwd_check.py    # exit 1 on a failure

The opt-in is needed until the variant has run green (dev/gpu_notes.md lists the runs left).
"""

from __future__ import annotations

import os
import statistics
import sys

import torch
import torch.nn.functional as F

import attn_ext
from attn_ext.testing.harness import attention_flops, cuda_kernel_names

DEV = "cuda"
FLAG = "ATTN_EXT_CUDA_BWD_KERNEL"
VARIANTS = {"cute": 1, "cute_prefetch": 2}  # value -> query stages in the kernel's name
ROUNDS = 7  # interleaved timing rounds per cell; the median is reported
# dQ of the two variants: their fp32 atomic sums differ only in order, a few ulps after the
# rounding to bf16 / fp16 (relative to the largest |dQ| of the case)
DQ_RTOL = {torch.bfloat16: 2 * 2.0**-8, torch.float16: 2 * 2.0**-11}

CASES = [
    # (B, H, Hkv, Sq, Sk, D, causal, window): block edges (64 query rows, 128 keys), one query
    # block (no prefetch at all), odd lengths, GQA, long loops (stages alternate many times)
    (2, 4, 4, 64, 128, 64, False, (-1, -1)),
    (1, 4, 2, 129, 257, 128, False, (-1, -1)),
    (1, 8, 1, 1, 300, 64, False, (-1, -1)),
    (2, 4, 4, 200, 200, 128, True, (-1, -1)),
    (1, 4, 2, 65, 300, 64, True, (-1, -1)),
    (1, 2, 2, 333, 333, 64, False, (31, 17)),
    (1, 2, 1, 1000, 700, 128, True, (-1, -1)),
    (2, 16, 4, 2048, 2048, 128, False, (-1, -1)),
    (1, 8, 8, 4097, 4097, 64, True, (-1, -1)),
]


def grads(kernel, q, k, v, g, **kw):
    os.environ[FLAG] = kernel
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = attn_ext.attention(*leaves, **kw)
    return torch.autograd.grad(out, leaves, g)


def ran_stages(kernel, q, k, v, g, **kw) -> bool:
    stages = VARIANTS[kernel]
    names = cuda_kernel_names(lambda: grads(kernel, q, k, v, g, **kw))
    return any("flash_bwd_cute" in n and f"{q.shape[-1]}, {stages}>" in n for n in names)


def check_case(case, dtype) -> bool:
    B, H, Hkv, Sq, Sk, D, causal, window = case
    torch.manual_seed(Sq * 1000 + Sk)
    q = torch.randn(B, H, Sq, D, device=DEV, dtype=dtype)
    k, v = (torch.randn(B, Hkv, Sk, D, device=DEV, dtype=dtype) for _ in "kv")
    g = torch.randn(B, H, Sq, D, device=DEV, dtype=dtype)
    kw = dict(causal=causal, window_size=window)
    dq1, dk1, dv1 = grads("cute", q, k, v, g, **kw)
    dq2, dk2, dv2 = grads("cute_prefetch", q, k, v, g, **kw)
    same_kv = torch.equal(dk1, dk2) and torch.equal(dv1, dv2)
    dq_err = (
        (dq2.float() - dq1.float()).abs().max() / dq1.float().abs().max().clamp_min(1e-30)
    ).item()
    finite = all(torch.isfinite(t).all().item() for t in (dq2, dk2, dv2))
    used = ran_stages("cute", q, k, v, g, **kw) and ran_stages("cute_prefetch", q, k, v, g, **kw)
    good = same_kv and finite and used and dq_err <= DQ_RTOL[dtype]
    print(
        f"{str(case):52s} {str(dtype)[6:]:9s} dK/dV {'same' if same_kv else 'DIFF'}"
        f"  dQ {dq_err:.1e}  {'kernels ok' if used else 'NOT BOTH CUTE'}"
        f"{'' if good else '  <-- FAIL'}"
    )
    return good


def time_cell(D, S, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, H = 16384 // S, 2048 // D
    q, k, v, g = (torch.randn(B, H, S, D, device=DEV, dtype=torch.bfloat16) for _ in range(4))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    outs = {"cute": attn_ext.attention(*leaves, causal=causal)}
    outs["cute_prefetch"] = outs["cute"]  # the forward is the same; only the backward differs
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        outs["flash"] = F.scaled_dot_product_attention(*leaves, is_causal=causal)

    def step(name):
        if name in VARIANTS:
            os.environ[FLAG] = name
        torch.autograd.grad(outs[name], leaves, g, retain_graph=True)

    names = ("cute", "cute_prefetch", "flash")
    for n in names:  # warm-up
        step(n)
    times = {n: [] for n in names}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(ROUNDS):
        for n in names:
            start.record()
            for _ in range(5):
                step(n)
            end.record()
            end.synchronize()
            times[n].append(start.elapsed_time(end) / 5)
    med = {n: statistics.median(t) for n, t in times.items()}
    flops = attention_flops(B, H, S, S, D, causal, "bwd")
    tf = {n: flops / (m * 1e-3) / 1e12 for n, m in med.items()}
    print(
        f"{D:4d} {S:6d} {str(causal):6s} {tf['cute']:8.1f} {tf['cute_prefetch']:9.1f}"
        f" {tf['flash']:9.1f}  {med['cute'] / med['cute_prefetch']:13.2f}"
        f" {med['flash'] / med['cute_prefetch']:14.2f}"
    )


def main() -> int:
    if not torch.cuda.is_available():
        print("cute_bwd_check: no GPU")
        return 0
    print(torch.cuda.get_device_name(), torch.__version__)
    ok = all([check_case(c, d) for c in CASES for d in (torch.bfloat16, torch.float16)])
    print(
        f"\n{'D':>4s} {'S':>6s} causal  cute TF/s  prefetch  flash TF/s"
        "  prefetch/cute  prefetch/flash (time ratios, > 1: prefetch faster)"
    )
    for D in (64, 128):
        for S in (512, 2048, 8192, 16384):
            for causal in (False, True):
                time_cell(D, S, causal)
    print("CUTE BWD CHECK", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
