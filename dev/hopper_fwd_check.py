#!/usr/bin/env python
"""GPU check of the Hopper forward (csrc/attention/cuda/flash/flash_fwd_hopper.cuh) in one call:
which kernel ran (profiler), error vs a float64 reference beside the sm_80 CuTe kernel's on the
same inputs, finite outputs, identical bits twice, lse against the CuTe kernel's, then a timing
of Hopper vs CuTe vs torch's default SDPA. ATTN_EXT_CUDA_FWD_KERNEL picks the kernel per call
(read at each call; the Hopper one is the default on compute capability 9.x since it ran green
here on 2026-11-27), so both run in one process.

    python dev/hopper_fwd_check.py           # cases, then timing; exit 1 on a failure
    python dev/hopper_fwd_check.py --small   # a small case per head dim (compute-sanitizer;
                                             # no profiler: which kernel ran is not checked)
    python dev/hopper_fwd_check.py --profile 128 8192   # one D, S cell (ncu), no checks

The cases and the float64 reference are dev/cute_fwd_check.py's (the same semantics).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cute_fwd_check as cute  # noqa: E402

import attn_ext  # noqa: E402

DEV = "cuda"
KERNEL = "ATTN_EXT_CUDA_FWD_KERNEL"
SMALL = [
    (1, 2, 1, 200, 300, 64, True, (-1, -1), "bhsd"),
    (1, 2, 2, 130, 129, 128, False, (-1, -1), "bshd"),
    (1, 2, 2, 100, 100, 256, False, (17, 5), "bhsd"),
]


def run(hopper: bool, *args, **kw):
    os.environ[KERNEL] = "hopper" if hopper else "cute"
    return attn_ext.attention(*args, **kw)


def check_case(case, dtype, profile=True) -> bool:
    B, H, Hkv, Sq, Sk, D, causal, window, layout = case
    torch.manual_seed(Sq * 1000 + Sk)
    q, k, v = cute.make(B, H, Hkv, Sq, Sk, D, layout, dtype)
    kw = dict(causal=causal, window_size=window, return_lse=True)
    # (not under compute-sanitizer: --small skips the profiler)
    names = cute.kernels_of(lambda: run(True, q, k, v, **kw)) if profile else ["hopper?"]
    o1, lse1 = run(True, q, k, v, **kw)
    o2, lse2 = run(True, q, k, v, **kw)
    oc, lsec = run(False, q, k, v, **kw)
    ref = cute.reference(q, k, v, causal, window)

    def err(o):
        return ((o.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()

    eh, ec = err(o1), err(oc)
    same = torch.equal(o1, o2) and torch.equal(lse1, lse2)
    lse_err = (lse1 - lsec).abs().nan_to_num(0.0).max().item()
    finite = torch.isfinite(o1).all().item()
    used = any("hopper" in n for n in names)
    # the CuTe kernel's error within rounding (same algorithm, fp32 accumulation, P rounded
    # to 16 bits before P V in both)
    good = finite and same and used and eh <= 1.5 * ec + 1e-3 and lse_err < 1e-2
    kernel = "hopper" if used else "NOT HOPPER: " + ",".join(names)
    print(
        f"{str(case):58s} {str(dtype)[6:]:9s} {eh:9.2e} {ec:9.2e} {eh / max(ec, 1e-30):5.2f}"
        f"  {'same' if same else 'DIFF'}  {kernel}{'' if good else '  <-- FAIL'}"
        f" lse {lse_err:.1e}"
    )
    return good


def check(cases, profile) -> bool:
    print(f"{'case':58s} {'dtype':9s} {'hop err':>9s} {'cute err':>9s} ratio  bits  kernel")
    dtypes = (torch.bfloat16, torch.float16)
    return all([check_case(c, d, profile) for c in cases for d in dtypes])


def inputs(D, S):
    """The FlashAttention grid's cell: B * S = 16k tokens, H * D = 2048."""
    B, H = 16384 // S, 2048 // D
    return [torch.randn(B, H, S, D, device=DEV, dtype=torch.bfloat16) for _ in "qkv"]


def time_cell(D, S, causal):
    q, k, v = inputs(D, S)
    flops = 4 * q.shape[0] * q.shape[1] * S * S * D / (2 if causal else 1)
    t_h = cute.median_ms(lambda: run(True, q, k, v, causal=causal))
    t_c = cute.median_ms(lambda: run(False, q, k, v, causal=causal))
    t_s = cute.median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
    tf = [flops / t / 1e9 for t in (t_h, t_c, t_s)]
    print(
        f"{D:4d} {S:6d} {str(causal):6s} {tf[0]:9.1f} {tf[1]:9.1f} {tf[2]:10.1f}"
        f"  {t_s / t_h:8.2f}  {t_c / t_h:8.2f}"
    )


def timing():
    print(f"\n{'D':>4s} {'S':>6s} causal  hop TF/s  cute TF/s  sdpa TF/s  sdpa/hop  cute/hop")
    for D in (64, 128):
        for S in (4096, 8192, 16384):
            for causal in (False, True):
                time_cell(D, S, causal)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--profile", type=int, nargs=2, metavar=("D", "S"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("hopper_fwd_check: no GPU")
        return 0
    print(torch.cuda.get_device_name(), torch.cuda.get_device_capability(), torch.__version__)
    if args.profile:
        q, k, v = inputs(*args.profile)
        run(True, q, k, v)
        torch.cuda.synchronize()
        return 0
    ok = check(SMALL if args.small else cute.CASES + SMALL, profile=not args.small)
    if not args.small:
        timing()
    print("HOPPER CHECK", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
