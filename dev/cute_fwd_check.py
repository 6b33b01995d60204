#!/usr/bin/env python
"""GPU check of the CuTe forward (csrc/attention/cuda/flash/flash_fwd_cute.cuh) in one call,
with its FoldScale exp2 step (the default where scale > 0 since 2026-11-27: 1.06-1.18x the
ScaleFirst step it replaced, dev/gpu_notes.md): which kernel ran (profiler), error vs a float64
reference beside the older tensor-core kernel's on the same inputs, finite outputs, identical
bits twice, then a timing against the older kernel and torch's flash backend. The kernel is
chosen per call by ATTN_EXT_CUDA_FWD_KERNEL (read at each call), so all of them run in one
process.

    python dev/cute_fwd_check.py            # prints a table per part; exit 1 on a failure

Measured: dev/gpu_notes.md (2026-11-26 and 2026-11-27, H100).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

import attn_ext
from attn_ext.testing.harness import cuda_kernel_names

DEV = "cuda"
FLAG = "ATTN_EXT_CUDA_FWD_KERNEL"
# ATTN_EXT_CUDA_FWD_KERNEL value -> the part of the kernel's name that says it ran (on an H100
# the unset default is the Hopper kernel, so the CuTe one is asked for by name)
CUTE_KERNELS = {"cute": "FoldScale"}


def run(kernel: str, *args, **kw):
    os.environ[FLAG] = kernel
    return attn_ext.attention(*args, **kw)


def kernels_of(fn) -> list:
    return sorted({n for n in cuda_kernel_names(fn) if "flash" in n})


def reference(q, k, v, causal, window):
    """float64 attention with the op's bottom-right band (CPU-free: on the GPU in float64)."""
    qd, kd, vd = (t.double() for t in (q, k, v))
    h, hk = q.shape[1], k.shape[1]
    kd = kd.repeat_interleave(h // hk, dim=1)
    vd = vd.repeat_interleave(h // hk, dim=1)
    s = qd @ kd.transpose(-1, -2) / q.shape[-1] ** 0.5
    sq, sk = q.shape[2], k.shape[2]
    i = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=q.device)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    left, right = window
    if causal:
        right = 0
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ vd


CASES = [
    # (B, H, Hkv, Sq, Sk, D, causal, window, layout)
    (2, 4, 4, 128, 128, 64, False, (-1, -1), "bhsd"),
    (2, 4, 4, 128, 128, 128, False, (-1, -1), "bhsd"),
    (1, 2, 2, 256, 256, 256, False, (-1, -1), "bhsd"),
    (1, 3, 3, 1, 1, 128, False, (-1, -1), "bhsd"),
    (1, 3, 3, 17, 300, 64, False, (-1, -1), "bhsd"),
    (1, 3, 3, 129, 127, 128, True, (-1, -1), "bhsd"),
    (1, 3, 3, 300, 1000, 128, True, (-1, -1), "bhsd"),
    (1, 3, 3, 1000, 300, 64, True, (-1, -1), "bhsd"),
    (1, 2, 2, 333, 333, 256, True, (-1, -1), "bhsd"),
    (2, 32, 8, 200, 513, 128, False, (-1, -1), "bhsd"),
    (2, 32, 1, 200, 513, 64, True, (-1, -1), "bhsd"),
    (1, 4, 4, 700, 700, 128, False, (100, 0), "bhsd"),
    (1, 4, 4, 700, 900, 64, False, (31, 64), "bhsd"),
    (1, 4, 4, 700, 700, 128, False, (0, 0), "bhsd"),
    (1, 4, 4, 500, 700, 128, False, (-1, 33), "bhsd"),
    (2, 8, 2, 257, 257, 128, True, (-1, -1), "bshd"),
    (2, 8, 8, 257, 300, 64, False, (-1, -1), "bshd"),
]


def make(B, H, Hkv, Sq, Sk, D, layout, dtype):
    def one(h, s):
        if layout == "bshd":  # (B, S, H, D) memory, viewed as (B, H, S, D)
            return torch.randn(B, s, h, D, device=DEV, dtype=dtype).transpose(1, 2)
        return torch.randn(B, h, s, D, device=DEV, dtype=dtype)

    return one(H, Sq), one(Hkv, Sk), one(Hkv, Sk)


def check_case(case, dtype, kernel) -> bool:
    B, H, Hkv, Sq, Sk, D, causal, window, layout = case
    torch.manual_seed(Sq * 1000 + Sk)
    q, k, v = make(B, H, Hkv, Sq, Sk, D, layout, dtype)
    kw = dict(causal=causal, window_size=window, return_lse=True)
    names = kernels_of(lambda: run(kernel, q, k, v, **kw))
    o1, lse1 = run(kernel, q, k, v, **kw)
    o2, lse2 = run(kernel, q, k, v, **kw)
    om, lsem = run("mma", q, k, v, **kw)
    ref = reference(q, k, v, causal, window)

    def err(o):
        return ((o.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()

    ec, em = err(o1), err(om)
    same = torch.equal(o1, o2) and torch.equal(lse1, lse2)
    lse_err = (lse1 - lsem).abs().nan_to_num(0.0).max().item()
    finite = torch.isfinite(o1).all().item()
    used = any("cute" in n and CUTE_KERNELS[kernel] in n for n in names)
    # the same error as the older kernel (same algorithm, fp32 accumulation), within rounding
    good = finite and same and used and ec <= 1.5 * em + 1e-3 and lse_err < 1e-2
    ran = kernel if used else "NOT CUTE: " + ",".join(names)
    print(
        f"{str(case):58s} {str(dtype)[6:]:9s} {ec:9.2e} {em:9.2e} {ec / max(em, 1e-30):5.2f}"
        f"  {'same' if same else 'DIFF'}  {ran}{'' if good else '  <-- FAIL'}"
        f" lse {lse_err:.1e}"
    )
    return good


def check_correctness() -> bool:
    print(f"{'case':58s} {'dtype':9s} {'cute err':>9s} {'mma err':>9s} ratio  bits  kernel")
    results = [
        check_case(c, d, kernel)
        for kernel in CUTE_KERNELS
        for c in CASES
        for d in (torch.bfloat16, torch.float16)
    ]
    return all(results)


def median_ms(fn, reps=20):
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def time_cell(D, S, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, H = 16384 // S, 2048 // D
    q, k, v = (torch.randn(B, H, S, D, device=DEV, dtype=torch.bfloat16) for _ in "qkv")
    flops = 4 * B * H * S * S * D / (2 if causal else 1)

    def flash():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    t_c = median_ms(lambda: run("cute", q, k, v, causal=causal))
    t_m = median_ms(lambda: run("mma", q, k, v, causal=causal))
    t_f = median_ms(flash)
    tf = [flops / t / 1e9 for t in (t_c, t_m, t_f)]
    print(
        f"{D:4d} {S:6d} {str(causal):6s} {tf[0]:9.1f} {tf[1]:9.1f} {tf[2]:10.1f}"
        f"  {t_f / t_c:10.2f} {t_m / t_c:8.2f}"
    )


def timing():
    print(f"\n{'D':>4s} {'S':>6s} causal  cute TF/s  mma TF/s  flash TF/s  cute/flash  cute/mma")
    for D in (64, 128):
        for S in (512, 2048, 8192, 16384):
            for causal in (False, True):
                time_cell(D, S, causal)


def main() -> int:
    if not torch.cuda.is_available():
        print("cute_fwd_check: no GPU")
        return 0
    print(torch.cuda.get_device_name(), torch.__version__)
    ok = check_correctness()
    timing()
    print("CUTE CHECK", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
