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

from attn_ext.testing import harness

HAS_AVX512 = "avx512f" in set(harness.isa_flags())
# auto takes the AMX bf16 forward where the CPU has the tiles (tests/test_amx.py checks it), else
# the AVX512-BF16 one where the CPU has that (tests/test_avx512bf16.py).
HAS_AVX512BF16 = HAS_AVX512 and "avx512_bf16" in set(harness.isa_flags())
HAS_AMX = HAS_AVX512BF16 and {"amx_tile", "amx_bf16"} <= set(harness.isa_flags())
pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64"), reason="the block products are x86-64 kernels"
)

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
    return subprocess.run(
        [sys.executable, "-c", _SCRIPT, *args], env=env, capture_output=True, text=True
    )


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
        assert torch.equal(a, b), (
            f"case {i // 4} {names[i % 4]}: max diff {(a.float() - b.float()).abs().max()}"
        )


def test_unknown_kernel_choice_raises(tmp_path):
    proc = _run("avx1024", str(tmp_path / "x.pt"))
    assert proc.returncode != 0
    assert (
        "ATTN_EXT_CPU_KERNELS: expected auto, avx2, avx512, avx512bf16 or amx, got 'avx1024'"
        in proc.stderr
    )


@pytest.mark.skipif(HAS_AVX512, reason="this CPU has AVX-512F")
def test_avx512_choice_without_avx512_raises(tmp_path):
    proc = _run("avx512", str(tmp_path / "x.pt"))
    assert proc.returncode != 0
    assert "ATTN_EXT_CPU_KERNELS=avx512, but this CPU reports no AVX-512F" in proc.stderr


# ---- the AVX-512 source on any x86-64 CPU: compiled against scalar stand-ins for its
# intrinsics (tests/avx512_emulation.h) next to the AVX2 kernels, and compared bit for bit on
# every row remainder, panel-pair tail and partial-panel width. What this cannot check is the
# intrinsics themselves; test_avx512_products_match_avx2_bitwise does that on AVX-512 CPUs.

_WRAPPER = r"""
#include "attention/cpu/avx2_block_products.h"
#include "attention/cpu/avx512_block_products.h"
using namespace attn_ext::cpu;
extern "C" {
void pack_keys(const float* k, int64_t ld, int64_t n, int64_t d, float* dst) {
  avx2::pack_key_panels(k, ld, n, d, dst);
}
void pack_keys_bf16(const c10::BFloat16* k, int64_t ld, int64_t n, int64_t d, float* dst) {
  avx2::pack_key_panels(k, ld, n, d, dst);
}
void pack_values(const float* v, int64_t ld, int64_t n, int64_t dv, float* dst, int64_t stride) {
  avx2::pack_value_panels(v, ld, n, dv, dst, stride);
}
void scores(int wide, const float* q, int64_t ldq, int64_t m, const float* kp, int64_t n,
            int64_t d, float scale, float* s, int64_t lds) {
  (wide ? avx512::scores_tile : avx2::scores_tile)(q, ldq, m, kp, n, d, scale, s, lds);
}
void pv(int wide, const float* p, int64_t ldp, int64_t m, const float* vp, int64_t stride,
        int64_t n, int64_t dv, const float* factor, float* o, int64_t ldo) {
  (wide ? avx512::pv_tile : avx2::pv_tile)(p, ldp, m, vp, stride, n, dv, factor, o, ldo);
}
void atb(int wide, const float* a, int64_t lda, int64_t m, int64_t n, const float* bp,
         int64_t stride, int64_t dc, float* c, int64_t ldc) {
  (wide ? avx512::atb_tile : avx2::atb_tile)(a, lda, m, n, bp, stride, dc, c, ldc);
}
}
"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    import ctypes
    import shutil

    from torch.utils import cpp_extension

    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    csrc = os.path.join(root, "csrc")  # includes are relative to csrc/
    work = tmp_path_factory.mktemp("avx512_emulation")
    (work / "wrapper.cpp").write_text(_WRAPPER)
    lib = work / "libemulated.so"
    shim = os.path.join(root, "tests", "avx512_emulation.h")
    cmd = [
        cxx,
        "-O2",
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-mavx2",
        "-mfma",
        "-mf16c",
        "-ffp-contract=off",
        f'-DATTN_EXT_AVX512_EMULATION="{shim}"',
        f"-I{csrc}",
    ]
    cmd += [f"-I{p}" for p in cpp_extension.include_paths()]
    cmd += [
        os.path.join(csrc, "attention", "cpu", "avx512_block_products.cpp"),
        str(work / "wrapper.cpp"),
        "-o",
        str(lib),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return ctypes.CDLL(str(lib))


def _ptr(t):
    import ctypes

    return ctypes.c_void_p(t.data_ptr())


def _i(x):
    import ctypes

    return ctypes.c_int64(x)


_ROWS = (1, 2, 3, 4, 5, 7, 11, 12, 13, 14, 15, 16, 25, 37, 128)
_COLS = (1, 8, 16, 17, 24, 31, 32, 33, 40, 48, 80, 128)


def _round16(n):
    return (n + 15) // 16 * 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_key_panels_layout(emulated, dtype):
    """Panel g holds, feature by feature, keys 16g .. 16g + 15, zero past n. Whole panels go
    through 8 x 8 register transposes, partial panels and features past a multiple of 8
    element by element: every split between the two is here, with rows wider than d."""
    pack = emulated.pack_keys if dtype == torch.float32 else emulated.pack_keys_bf16
    g = torch.Generator().manual_seed(3)
    for d in (1, 7, 8, 13, 64, 72):
        for n in (1, 15, 16, 17, 40, 64):
            k = torch.randn(n, d + 3, generator=g).to(dtype)
            kp = torch.full((_round16(n) * d,), float("nan"))
            pack(_ptr(k), _i(d + 3), _i(n), _i(d), _ptr(kp))
            ref = torch.zeros(_round16(n), d)
            ref[:n] = k[:, :d].float()
            ref = ref.view(-1, 16, d).transpose(1, 2).reshape(-1)
            assert torch.equal(kp, ref), f"n={n} d={d}"


@pytest.mark.parametrize("d", [5, 64])
def test_emulated_avx512_scores_match_avx2(emulated, d):
    import ctypes

    g = torch.Generator().manual_seed(d)
    for n in (1, 16, 17, 32, 33, 77, 256):
        k = torch.randn(n, d + 2, generator=g)  # rows with a stride wider than d
        kp = torch.empty(_round16(n) * d)
        emulated.pack_keys(_ptr(k), _i(d + 2), _i(n), _i(d), _ptr(kp))
        for m in _ROWS:
            q = torch.randn(m, d + 1, generator=g)
            lds = _round16(n) + 5
            out = [torch.full((m, lds), 12345.0) for _ in range(2)]
            for wide in (0, 1):
                emulated.scores(
                    wide,
                    _ptr(q),
                    _i(d + 1),
                    _i(m),
                    _ptr(kp),
                    _i(n),
                    _i(d),
                    ctypes.c_float(0.37),
                    _ptr(out[wide]),
                    _i(lds),
                )
            assert torch.equal(out[0], out[1]), f"scores m={m} n={n} d={d}"


@pytest.mark.parametrize("with_factor", [False, True])
def test_emulated_avx512_pv_matches_avx2(emulated, with_factor):
    g = torch.Generator().manual_seed(int(with_factor))
    for n in (1, 17, 100):
        for dv in _COLS:
            v = torch.randn(n, dv, generator=g)
            stride = _round16(n) * 16
            vp = torch.zeros(_round16(dv) // 16 * stride)
            emulated.pack_values(_ptr(v), _i(dv), _i(n), _i(dv), _ptr(vp), _i(stride))
            for m in _ROWS:
                p = torch.rand(m, n + 3, generator=g)
                factor = torch.rand(m, generator=g) if with_factor else None
                o0 = torch.randn(m, dv + 3, generator=g)
                out = [o0.clone(), o0.clone()]
                for wide in (0, 1):
                    emulated.pv(
                        wide,
                        _ptr(p),
                        _i(n + 3),
                        _i(m),
                        _ptr(vp),
                        _i(stride),
                        _i(n),
                        _i(dv),
                        _ptr(factor) if factor is not None else None,
                        _ptr(out[wide]),
                        _i(dv + 3),
                    )
                assert torch.equal(out[0], out[1]), f"pv m={m} n={n} dv={dv}"


def test_emulated_avx512_atb_matches_avx2(emulated):
    g = torch.Generator().manual_seed(2)
    for m in (1, 9, 64):  # the reduction length
        for dc in _COLS:
            b = torch.randn(m, dc, generator=g)
            stride = _round16(m) * 16
            bp = torch.zeros(_round16(dc) // 16 * stride)
            emulated.pack_values(_ptr(b), _i(dc), _i(m), _i(dc), _ptr(bp), _i(stride))
            for n in _ROWS:  # output rows
                a = torch.randn(m, n + 2, generator=g)
                c0 = torch.randn(n, dc + 1, generator=g)
                out = [c0.clone(), c0.clone()]
                for wide in (0, 1):
                    emulated.atb(
                        wide,
                        _ptr(a),
                        _i(n + 2),
                        _i(m),
                        _i(n),
                        _ptr(bp),
                        _i(stride),
                        _i(dc),
                        _ptr(out[wide]),
                        _i(dc + 1),
                    )
                assert torch.equal(out[0], out[1]), f"atb m={m} n={n} dc={dc}"


def test_reports_the_kernels_it_runs():
    import attn_ext

    wanted = os.environ.get("ATTN_EXT_CPU_KERNELS") or "auto"
    expected = "avx512" if HAS_AVX512 and wanted != "avx2" else "avx2"
    if wanted in ("auto", "amx") and HAS_AMX:
        expected = "amx"
    elif wanted == "avx512bf16" and HAS_AVX512BF16:
        expected = "avx512bf16"
    assert attn_ext._C.cpu_block_kernels() == expected


def test_report_raises_for_an_unknown_choice():
    code = (
        "import attn_ext\ntry:\n    attn_ext._C.cpu_block_kernels()\n"
        "except RuntimeError as e:\n    print(e)\n"
    )
    env = dict(os.environ, ATTN_EXT_CPU_KERNELS="sse")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (
        "ATTN_EXT_CPU_KERNELS: expected auto, avx2, avx512, avx512bf16 or amx, got 'sse'"
        in proc.stdout
    )
