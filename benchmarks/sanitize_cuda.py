#!/usr/bin/env python
"""A few small attn_ext.attention calls (forward and backward) covering every CUDA kernel path,
sized for compute-sanitizer: tensor-core forward at head dims 64 / 128 / 256 and a padded one,
the generic forward and backward in every dtype, masks (bool, additive, broadcast), causal and
window bands, fully masked rows, GQA, Dv != D, dropout, strided and misaligned inputs.

    compute-sanitizer --tool memcheck  python benchmarks/sanitize_cuda.py
    compute-sanitizer --tool racecheck python benchmarks/sanitize_cuda.py
    compute-sanitizer --tool synccheck python benchmarks/sanitize_cuda.py

Exits 0 after every case ran (printing one line per case), 0 with a note without a GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
try:
    import attn_ext
except ImportError:
    sys.path.insert(0, str(REPO_ROOT))
    import attn_ext

# (name, dtype, B, H, Hkv, Sq, Sk, D, Dv, options)
CASES = [
    ("mma d64", torch.bfloat16, 1, 2, 2, 70, 90, 64, 64, {}),
    ("mma d128 causal", torch.float16, 1, 2, 1, 90, 70, 128, 128, dict(causal=True)),
    ("mma d256 window", torch.bfloat16, 1, 2, 2, 65, 65, 256, 256, dict(window_size=(9, 3))),
    ("mma padded d40/dv72", torch.bfloat16, 2, 2, 2, 33, 17, 40, 72, {}),
    ("mma bool mask + dropout", torch.bfloat16, 2, 4, 2, 67, 75, 64, 64, dict(mask="bool", dropout_p=0.3)),
    ("mma additive broadcast", torch.float16, 2, 2, 2, 64, 64, 128, 128, dict(mask="float_b")),
    ("generic f32", torch.float32, 1, 2, 2, 40, 50, 64, 48, dict(causal=True)),
    ("generic f64 dropout", torch.float64, 1, 2, 1, 21, 33, 32, 32, dict(dropout_p=0.2, mask="bool")),
    ("generic bf16 d320", torch.bfloat16, 1, 1, 1, 20, 24, 320, 320, {}),
    ("empty rows", torch.bfloat16, 1, 2, 2, 40, 20, 64, 64, dict(causal=True)),
    ("misaligned rows", torch.float16, 1, 2, 2, 50, 50, 64, 64, dict(misaligned=True)),
    ("sq=1", torch.float32, 2, 4, 2, 1, 17, 64, 64, {}),
]


def make(shape, dtype, misaligned):
    if misaligned:
        return torch.randn(*shape[:-1], shape[-1] + 1, device="cuda").to(dtype)[..., 1:]
    return torch.randn(shape, device="cuda").to(dtype)


def run_case(name, dtype, B, H, Hkv, Sq, Sk, D, Dv, opts):
    opts = dict(opts)
    mis = opts.pop("misaligned", False)
    mask = opts.pop("mask", None)
    if mask == "bool":
        opts["attn_mask"] = torch.rand(B, H, Sq, Sk, device="cuda") < 0.7
    elif mask == "float_b":
        opts["attn_mask"] = torch.randn(1, 1, Sq, Sk, device="cuda").to(dtype)
    q = make((B, H, Sq, D), dtype, mis).requires_grad_(True)
    k = make((B, Hkv, Sk, D), dtype, mis).requires_grad_(True)
    v = make((B, Hkv, Sk, Dv), dtype, mis).requires_grad_(True)
    out = attn_ext.attention(q, k, v, **opts)
    out.float().square().sum().backward()
    torch.cuda.synchronize()
    finite = all(torch.isfinite(t).all().item() for t in (out, q.grad, k.grad, v.grad))
    print(f"{'ok ' if finite else 'NON-FINITE'} {name}")
    return finite


def main() -> int:
    if not torch.cuda.is_available():
        print("sanitize_cuda: no CUDA device visible; nothing to check")
        return 0
    torch.manual_seed(0)
    results = [run_case(*c) for c in CASES]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
