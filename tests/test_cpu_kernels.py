"""The CPU flash kernels' block products are chosen per CPU (AVX-512 where it has it, else
AVX2; ATTN_EXT_CPU_KERNELS pins the choice). Both sum every output element with the same
fused multiply-adds in the same order, so forward and backward must agree bit for bit; the
rest of the suite checks whichever set this CPU picks against the references."""

import os
import platform
import subprocess
import sys

import pytest
import torch


def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


HAS_AVX512 = "avx512f" in _cpu_flags()
pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                                reason="the block products are x86-64 kernels")

# Shapes that reach every tile path: query blocks whose rows end in each micro-tile remainder
# (37 = 24 + 7 + 6 on AVX-512, 131 = 128 + 3), key counts that end mid-panel and mid panel
# pair (77, 300), and value widths that end in a partial panel, a partial panel pair and a
# lone panel (24, 40, 48, 80) for both P V and the backward's dK / dV.
_SCRIPT = r"""
import sys, torch, attn_ext
torch.manual_seed(0)
cases = [(37, 77, 64, 64, False, torch.float32), (131, 300, 40, 24, True, torch.float32),
         (131, 77, 96, 48, False, torch.float32), (64, 300, 128, 80, True, torch.bfloat16),
         (200, 131, 16, 40, False, torch.float32)]
results = []
for sq, sk, d, dv, causal, dtype in cases:
    q = torch.randn(2, 3, sq, d, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 3, sk, d, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 3, sk, dv, dtype=dtype, requires_grad=True)
    out = attn_ext.attention(q, k, v, causal=causal)
    out.backward(torch.randn_like(out))
    results += [out.detach(), q.grad, k.grad, v.grad]
torch.save(results, sys.argv[1])
"""


def _run(kernels, *args):
    env = dict(os.environ, ATTN_EXT_CPU_KERNELS=kernels)
    return subprocess.run([sys.executable, "-c", _SCRIPT, *args], env=env, capture_output=True, text=True)


@pytest.mark.skipif(not HAS_AVX512, reason="needs a CPU with AVX-512F")
def test_avx512_products_match_avx2_bitwise(tmp_path):
    outputs = {}
    for kernels in ("avx2", "avx512"):
        path = str(tmp_path / f"{kernels}.pt")
        proc = _run(kernels, path)
        assert proc.returncode == 0, proc.stderr
        outputs[kernels] = torch.load(path)
    names = ("out", "dq", "dk", "dv")
    for i, (a, b) in enumerate(zip(outputs["avx2"], outputs["avx512"])):
        assert torch.equal(a, b), f"case {i // 4} {names[i % 4]}: max diff {(a.float() - b.float()).abs().max()}"


def test_unknown_kernel_choice_raises(tmp_path):
    proc = _run("avx1024", str(tmp_path / "x.pt"))
    assert proc.returncode != 0
    assert "ATTN_EXT_CPU_KERNELS: expected auto, avx2 or avx512, got 'avx1024'" in proc.stderr


@pytest.mark.skipif(HAS_AVX512, reason="this CPU has AVX-512F")
def test_avx512_choice_without_avx512_raises(tmp_path):
    proc = _run("avx512", str(tmp_path / "x.pt"))
    assert proc.returncode != 0
    assert "ATTN_EXT_CPU_KERNELS=avx512, but this CPU reports no AVX-512F" in proc.stderr
