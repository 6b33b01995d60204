"""The CPU flash kernels' block products are chosen per CPU (AVX-512 where it has it, else
AVX2; ATTN_EXT_CPU_KERNELS pins the choice). Both sum every output element with the same
fused multiply-adds in the same order, so forward and backward must agree bit for bit; the
rest of the suite checks whichever set this CPU picks against the references. The wide sources
(AVX-512, AVX512-BF16, AMX) also run here on any x86-64 CPU through scalar stand-ins for their
intrinsics (the second half of this file)."""

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
# The decode step's few-row blocks (G * Sq = 1, 4, 6, 8 rows; P V on 16 lanes in the AVX-512
# sets; Q K^T too for float8 caches): value widths 41 and 128, lengths across 32-row runs, and
# 16-row pages.
lens = torch.tensor([70, 1, 300], dtype=torch.int32)
for group, sq, dv, dtype, cache in [
        (1, 1, 128, torch.float32, None), (4, 1, 41, torch.bfloat16, None),
        (3, 2, 128, torch.float16, None), (8, 1, 64, torch.float32, None),
        (4, 1, 128, torch.bfloat16, torch.float8_e4m3fn),
        (3, 1, 41, torch.float32, torch.float8_e5m2)]:
    q = torch.randn(3, 2 * group, sq, 64).to(dtype)
    k = torch.randn(3, 2, 304, 64).to(cache or dtype)
    v = torch.randn(3, 2, 304, dv).to(cache or dtype)
    kw = dict(k_scale=0.5, v_scale=0.25) if cache else {}
    table = torch.arange(3 * 19, dtype=torch.int32).flip(0).view(3, 19)
    pages = lambda x: x.view(3, 2, 19, 16, -1).transpose(1, 2).reshape(57, 2, 16, -1).flip(0)
    results += [attn_ext.decode_attention(q, k, v, lens, **kw),
                attn_ext.decode_attention(q, pages(k), pages(v), lens, block_table=table, **kw)]
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
    grads = [f"case {c} {name}" for c in range(5) for name in ("out", "dq", "dk", "dv")]
    steps = [f"decode {c} {cache}" for c in range(6) for cache in ("contiguous", "paged")]
    assert len(outputs["avx2"]) == len(grads) + len(steps)
    for name, a, b in zip(grads + steps, outputs["avx2"], outputs["avx512"]):
        assert torch.equal(a, b), f"{name}: max diff {(a.float() - b.float()).abs().max()}"


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


# ---- the wide sources on any x86-64 CPU: the AVX-512 block products and row passes, and the
# bf16-operand products (AVX512-BF16 and AMX) with their packing, compiled against scalar
# stand-ins for their intrinsics (tests/avx512_emulation.h) next to the AVX2 kernels. The
# AVX-512 fp32 products and row passes are compared with AVX2 bit for bit on every row
# remainder, panel-pair tail and partial-panel width; the bf16 products, whose roundings are
# their own, against float64 sums of the same bf16 operands, and their packed layouts element
# by element. What this cannot check is the instructions themselves: the tests on CPUs with
# them do (test_avx512_products_match_avx2_bitwise, tests/test_amx.py, tests/test_avx512bf16.py).

_WRAPPER = r"""
#include "attention/cpu/avx2_block_products.h"
#include "attention/cpu/avx512_block_products.h"
#include "attention/cpu/avx512_softmax_rows.h"
#include "attention/cpu/amx_block_products.h"
#include "attention/cpu/avx512bf16_block_products.h"
#include "common/cpu/vec_math.h"
#include "decoding/cpu/avx512_decode_rows.h"
#include "decoding/cpu/decode_rows.h"
using namespace attn_ext::cpu;
template <typename T>
void decode_pv_typed(int wide, int64_t m, const float* p, int64_t ldp, const void* const* rows,
                     int64_t n, int64_t dv, float* o) {
  const T* const* values = reinterpret_cast<const T* const*>(rows);
  if (wide) return avx512::decode_pv(m, p, ldp, values, n, dv, o);
  auto kernel = [&](auto rows_, int64_t) {
    avx2::decode_pv<decltype(rows_)::value>(p, ldp, values, n, dv, o, dv);
  };
  detail::call_rows(m, kernel, 0, std::make_integer_sequence<int, avx2::kMaxDecodeRows>{});
}
template <typename T>
void decode_scores_typed(int wide, int64_t m, const float* q, int64_t ldq, const void* const* rows,
                         int64_t n, int64_t d, float* s, int64_t lds) {
  const T* const* keys = reinterpret_cast<const T* const*>(rows);
  if (wide) return avx512::decode_scores(m, q, ldq, keys, n, d, s, lds, keys, d);
  auto kernel = [&](auto rows_, int64_t) {
    avx2::decode_scores<decltype(rows_)::value>(q, ldq, keys, n, d, s, lds, keys, d, false);
  };
  detail::call_rows(m, kernel, 0, std::make_integer_sequence<int, avx2::kMaxDecodeRows>{});
}
extern "C" {
// dtype 0: fp32 rows, 1: bf16, 2: fp16, 3: float8_e4m3fn, 4: float8_e5m2.
void decode_pv_(int wide, int dtype, int64_t m, const float* p, int64_t ldp,
                const void* const* rows, int64_t n, int64_t dv, float* o) {
  if (dtype == 0) return decode_pv_typed<float>(wide, m, p, ldp, rows, n, dv, o);
  if (dtype == 1) return decode_pv_typed<c10::BFloat16>(wide, m, p, ldp, rows, n, dv, o);
  if (dtype == 3) return decode_pv_typed<c10::Float8_e4m3fn>(wide, m, p, ldp, rows, n, dv, o);
  if (dtype == 4) return decode_pv_typed<c10::Float8_e5m2>(wide, m, p, ldp, rows, n, dv, o);
  decode_pv_typed<c10::Half>(wide, m, p, ldp, rows, n, dv, o);
}
// Float8 key rows only (dtype 3 / 4): the wide scores exist for those.
void decode_scores_(int wide, int dtype, int64_t m, const float* q, int64_t ldq,
                    const void* const* rows, int64_t n, int64_t d, float* s, int64_t lds) {
  if (dtype == 3)
    return decode_scores_typed<c10::Float8_e4m3fn>(wide, m, q, ldq, rows, n, d, s, lds);
  decode_scores_typed<c10::Float8_e5m2>(wide, m, q, ldq, rows, n, d, s, lds);
}
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
float row_max_(int wide, const float* x, int64_t n) {
  return wide ? avx512::row_max(x, n) : row_max<float>(x, n);
}
float exp2_shift_sum_(int wide, float* x, int64_t n, float shift) {
  return wide ? avx512::exp2_shift_sum(x, n, shift) : exp2_shift_sum<float>(x, n, shift);
}
void exp2_scale_shift2_(int wide, float* x, int64_t n, float a, float hi, float lo) {
  (wide ? avx512::exp2_scale_shift2 : exp2_scale_shift2<float>)(x, n, a, hi, lo);
}
void softmax_grad_row_(int wide, const float* p, float* dp, int64_t n, float delta) {
  (wide ? avx512::softmax_grad_row : softmax_grad_row<float>)(p, dp, n, delta);
}
void scale_row_(int wide, float* x, int64_t n, float a) {
  (wide ? avx512::scale_row : scale_row<float>)(x, n, a);
}
float exp2_shift_sum_bf16(const float* x, int64_t n, float scale, float shift, uint16_t* dst,
                          int64_t n_pad) {
  return avx512::exp2_shift_sum_bf16(x, n, scale, shift, dst, n_pad);
}
void amx_pack_keys(const uint16_t* k, int64_t ld, int64_t n, int64_t d, uint16_t* dst) {
  amx::pack_keys(k, ld, n, d, dst);
}
void amx_pack_values(const uint16_t* v, int64_t ld, int64_t n, int64_t dv, uint16_t* dst) {
  amx::pack_values(v, ld, n, dv, dst);
}
void amx_round_rows(const float* src, int64_t ld, int64_t m, int64_t n, uint16_t* dst,
                    int64_t ldd) {
  amx::round_rows(src, ld, m, n, dst, ldd);
}
void amx_pack_row_pairs(const float* src, int64_t ld, int64_t m, int64_t n, uint16_t* dst) {
  amx::pack_row_pairs(src, ld, m, n, dst);
}
void amx_pad_rows(const uint16_t* src, int64_t ld, int64_t m, int64_t n, uint16_t* dst,
                  int64_t ldd, int64_t rows) {
  amx::pad_rows(src, ld, m, n, dst, ldd, rows);
}
void amx_transpose_rows(const uint16_t* src, int64_t ld, int64_t m, int64_t n, uint16_t* dst,
                        int64_t ldd, int64_t rows) {
  amx::transpose_rows(src, ld, m, n, dst, ldd, rows);
}
// set 0: AVX512-BF16, 1: AMX (tiles configured for the call, as a worker holds them).
void bf16_scores(int set, const uint16_t* q, int64_t ldq, int64_t m, const uint16_t* kt,
                 int64_t n, int64_t d, float scale, float* s, int64_t lds) {
  if (!set) return avx512bf16::scores(q, ldq, m, kt, n, d, scale, s, lds);
  amx::ThreadTiles tiles;
  amx::scores(q, ldq, m, kt, n, d, scale, s, lds);
}
void amx_scores_unscaled(const uint16_t* q, int64_t ldq, int64_t m, const uint16_t* kt,
                         int64_t n, int64_t d, float* s, int64_t lds) {
  amx::ThreadTiles tiles;
  amx::scores_unscaled(q, ldq, m, kt, n, d, s, lds);
}
void bf16_pv(int set, const uint16_t* p, int64_t ldp, int64_t m, const uint16_t* vt, int64_t n,
             int64_t dv, const float* factor, float* o, int64_t ldo, uint16_t* v_tail) {
  if (!set) return avx512bf16::pv(p, ldp, m, vt, n, dv, factor, o, ldo);
  amx::ThreadTiles tiles;
  amx::pv(p, ldp, m, vt, n, dv, factor, o, ldo, v_tail);
}
}
"""

_WIDE_SOURCES = (  # under csrc/
    "attention/cpu/avx512_block_products.cpp",
    "attention/cpu/avx512_softmax_rows.cpp",
    "attention/cpu/avx512bf16_block_products.cpp",
    "attention/cpu/amx_block_products.cpp",
    "decoding/cpu/avx512_decode_rows.cpp",
)


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
        "-fPIC",
        "-mavx2",
        "-mfma",
        "-mf16c",
        "-ffp-contract=off",
        f'-DATTN_EXT_AVX512_EMULATION="{shim}"',
        f"-I{csrc}",
    ]
    cmd += [f"-I{p}" for p in cpp_extension.include_paths()]
    sources = [os.path.join(csrc, *name.split("/")) for name in _WIDE_SOURCES]
    sources.append(str(work / "wrapper.cpp"))
    # One compiler per source, side by side (~75 s in one process on a 2-core machine).
    jobs = [
        subprocess.Popen(
            [*cmd, "-c", src, "-o", str(work / f"{i}.o")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i, src in enumerate(sources)
    ]
    for job in jobs:
        _, err = job.communicate()
        assert job.returncode == 0, err[-4000:]
    objects = [str(work / f"{i}.o") for i in range(len(sources))]
    proc = subprocess.run(
        [cxx, "-shared", *objects, "-o", str(lib)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    emu = ctypes.CDLL(str(lib))
    for name in ("row_max_", "exp2_shift_sum_", "exp2_shift_sum_bf16"):
        getattr(emu, name).restype = ctypes.c_float
    return emu


def _ptr(t):
    import ctypes

    return ctypes.c_void_p(t.data_ptr())


def _i(x):
    import ctypes

    return ctypes.c_int64(x)


_ROWS = (1, 2, 3, 4, 5, 7, 11, 12, 13, 14, 15, 16, 25, 37, 128)
_COLS = (1, 8, 16, 17, 24, 31, 32, 33, 40, 48, 80, 128)


def _round_up(n, to):
    return (n + to - 1) // to * to


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
            kp = torch.full((_round_up(n, 16) * d,), float("nan"))
            pack(_ptr(k), _i(d + 3), _i(n), _i(d), _ptr(kp))
            ref = torch.zeros(_round_up(n, 16), d)
            ref[:n] = k[:, :d].float()
            ref = ref.view(-1, 16, d).transpose(1, 2).reshape(-1)
            assert torch.equal(kp, ref), f"n={n} d={d}"


# d: one chunk of the score sums (5), chunks of kDotChunk = 32 with a last chunk of 1 (33) or 2
# (130) features, whole chunks (64, 96).
@pytest.mark.parametrize("d", [5, 33, 64, 96, 130])
def test_emulated_avx512_scores_match_avx2(emulated, d):

    g = torch.Generator().manual_seed(d)
    for n in (1, 16, 17, 32, 33, 77, 256):
        k = torch.randn(n, d + 2, generator=g)  # rows with a stride wider than d
        kp = torch.empty(_round_up(n, 16) * d)
        emulated.pack_keys(_ptr(k), _i(d + 2), _i(n), _i(d), _ptr(kp))
        for m in _ROWS:
            q = torch.randn(m, d + 1, generator=g)
            lds = _round_up(n, 16) + 5
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
                    _f(0.37),
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
            stride = _round_up(n, 16) * 16
            vp = torch.zeros(_round_up(dv, 16) // 16 * stride)
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
            stride = _round_up(m, 16) * 16
            bp = torch.zeros(_round_up(dc, 16) // 16 * stride)
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


def _f(x):
    import ctypes

    return ctypes.c_float(x)


def _bits(t):
    """float32 values as the bit patterns a float tensor holds (NaN payloads and signed zeros
    compared too)."""
    return t.contiguous().view(torch.int32)


def _row_inputs(n, g):
    """A score row: normal values, a masked (-inf) key, one far below the row max (exp2 under
    the normal range) and one equal to it."""
    x = torch.randn(n, generator=g) * 6
    if n > 2:
        x[n // 3] = float("-inf")
        x[n // 2] = -300.0
        x[-1] = x.max()
    return x


_ROW_LENGTHS = (*range(0, 41), 47, 48, 63, 64, 65, 127, 255, 256, 257)


def test_emulated_avx512_row_passes_match_avx2(emulated):
    """The five row passes on 16 lanes return AVX2's bits (avx512_softmax_rows.h), for every
    length up to 40 (each 16-lane body, 8-lane step and scalar tail) and a few longer rows."""
    g = torch.Generator().manual_seed(5)
    for n in _ROW_LENGTHS:
        x = _row_inputs(n, g)
        p = torch.rand(n, generator=g)
        maxes = [emulated.row_max_(wide, _ptr(x), _i(n)) for wide in (0, 1)]
        assert _bits(torch.tensor(maxes))[0] == _bits(torch.tensor(maxes))[1], f"row_max n={n}"
        shift = maxes[0] if n else 0.0
        rows, sums = [], []
        for wide in (0, 1):
            y = x.clone()
            sums.append(emulated.exp2_shift_sum_(wide, _ptr(y), _i(n), _f(shift)))
            rows.append(y)
        assert torch.equal(_bits(rows[0]), _bits(rows[1])), f"exp2_shift_sum n={n}"
        assert _bits(torch.tensor(sums)).unique().numel() == 1, f"exp2_shift_sum's sum n={n}"
        for fn, args in (
            ("exp2_scale_shift2_", (_f(0.7), _f(1.25), _f(-3e-8))),
            ("scale_row_", (_f(0.37),)),
        ):
            rows = []
            for wide in (0, 1):
                y = x.clone()
                getattr(emulated, fn)(wide, _ptr(y), _i(n), *args)
                rows.append(y)
            assert torch.equal(_bits(rows[0]), _bits(rows[1])), f"{fn} n={n}"
        rows = []
        for wide in (0, 1):
            dp = x.clone()
            emulated.softmax_grad_row_(wide, _ptr(p), _ptr(dp), _i(n), _f(0.3))
            rows.append(dp)
        assert torch.equal(_bits(rows[0]), _bits(rows[1])), f"softmax_grad_row n={n}"


# Value widths through the 16-lane code's 128-column blocks, each width of a last block (1-7
# chunks of 16, in passes of 16 / chunks rows), the 8-column AVX2 chunk and the scalar tail past
# them; row counts across decode_rows.h's 32-row runs.
_DECODE_DV = (1, 7, 8, 15, 16, 24, 33, 41, 48, 64, 80, 96, 112, 128, 129, 200, 256)
_DECODE_N = (0, 1, 31, 32, 33, 70)


_DECODE_CODES = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.float8_e4m3fn: 3,
    torch.float8_e5m2: 4,
}


def _decode_rows(n, width, dtype, g):
    """n rows of `width` features in dtype, each its own tensor (a paged cache's row pointers);
    float8 rows hold every byte value but NaN and the infinities."""
    if dtype.itemsize == 1:
        rows = [torch.randint(0, 256, (width,), generator=g).to(torch.uint8) for _ in range(n)]
        return [torch.where(r.view(dtype).float().isfinite(), r, 0).view(dtype) for r in rows]
    return [torch.randn(width, generator=g).to(dtype) for _ in range(n)]


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]
)
def test_emulated_avx512_decode_pv_matches_avx2(emulated, dtype):
    """The decode step's P V on 16 lanes returns AVX2's bits (avx512_decode_rows.h) for every
    row block height (1-8), value width and row count above, each value row at its own address
    (a paged cache's row pointers), o accumulated onto a nonzero start."""
    import ctypes

    code = _DECODE_CODES[dtype]
    g = torch.Generator().manual_seed(11)
    for m in range(1, 9):
        for dv in _DECODE_DV:
            for n in _DECODE_N:
                values = _decode_rows(n, dv, dtype, g)
                rows = (ctypes.c_void_p * max(n, 1))(*[v.data_ptr() for v in values])
                ldp = n + 3
                p = torch.rand(m, ldp, generator=g)
                o0 = torch.randn(m, dv, generator=g)
                outs = []
                for wide in (0, 1):
                    o = o0.clone()
                    emulated.decode_pv_(
                        wide, code, _i(m), _ptr(p), _i(ldp), rows, _i(n), _i(dv), _ptr(o)
                    )
                    outs.append(o)
                assert torch.equal(_bits(outs[0]), _bits(outs[1])), f"m={m} dv={dv} n={n}"
                if n:
                    v = torch.stack(values).double()
                    want = o0.double() + p[:, :n].double() @ v
                    # float32 sums: within 1e-5 of the terms' magnitude (float8 rows reach
                    # 448 / 57344, so the sum itself may cancel far below it)
                    size = o0.double().abs() + p[:, :n].double().abs() @ v.abs()
                    assert ((outs[1].double() - want).abs() <= 1e-5 * size + 1e-5).all()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_emulated_avx512_decode_scores_match_avx2(emulated, dtype):
    """Q K^T of float8 key rows, two rows per 16-lane register, returns AVX2's bits
    (avx512_decode_rows.h) for every row block height, head dim (8-lane chunks and a tail) and
    row count (odd counts end on AVX2's loop), each key row at its own address."""
    import ctypes

    g = torch.Generator().manual_seed(12)
    for m in range(1, 9):
        for d in (1, 7, 8, 16, 33, 64, 100, 128, 256):
            for n in _DECODE_N:
                keys = _decode_rows(n, d, dtype, g)
                rows = (ctypes.c_void_p * max(n, 1))(*[k.data_ptr() for k in keys])
                ldq, lds = d + 5, n + 3
                q = torch.randn(m, ldq, generator=g)
                outs = []
                for wide in (0, 1):
                    s = torch.full((m, lds), -7.0)
                    emulated.decode_scores_(
                        wide,
                        _DECODE_CODES[dtype],
                        _i(m),
                        _ptr(q),
                        _i(ldq),
                        rows,
                        _i(n),
                        _i(d),
                        _ptr(s),
                        _i(lds),
                    )
                    outs.append(s)
                assert torch.equal(_bits(outs[0]), _bits(outs[1])), f"m={m} d={d} n={n}"
                if n:
                    k = torch.stack(keys).double()
                    want = q[:, :d].double() @ k.T
                    size = q[:, :d].double().abs() @ k.abs().T  # as for P V above
                    assert ((outs[1][:, :n].double() - want).abs() <= 1e-5 * size + 1e-6).all()
                    assert (outs[1][:, n:] == -7.0).all()


def _bf16_round(x):
    """The bf16 roundings of the instructions: nearest even, and values under the normal range
    flushed to zero (torch's conversion keeps bf16 denormals)."""
    tiny = torch.finfo(torch.float32).tiny
    return torch.where(x.abs() < tiny, torch.zeros_like(x), x).to(torch.bfloat16)


def test_emulated_bf16_row_pass(emulated):
    """exp2_shift_sum_bf16 (the amx / avx512bf16 sets' fused row pass): 2^(x * scale - shift)
    rounded to bf16 into dst with zeros up to n_pad, x left alone, the fp32 sum returned. Its
    exp2 is its own (relative error < 1.5e-7), so each value must be the bf16 rounding of the
    true value or a neighbour when the true value lies within 2e-7 of a rounding boundary, and
    the sum within 1e-6 relative of float64's."""
    g = torch.Generator().manual_seed(6)
    scale, shift = 0.125, 0.5
    for n in _ROW_LENGTHS:
        if n == 0:
            continue
        n_pad = _round_up(n, 32)
        x = _row_inputs(n, g) * 8  # scaled back by `scale`
        x_before = x.clone()
        dst = torch.full((n_pad + 3,), -1, dtype=torch.int16)
        total = emulated.exp2_shift_sum_bf16(
            _ptr(x), _i(n), _f(scale), _f(shift), _ptr(dst), _i(n_pad)
        )
        assert torch.equal(_bits(x), _bits(x_before)), f"x changed, n={n}"
        assert (dst[n:n_pad] == 0).all() and (dst[n_pad:] == -1).all(), f"padding n={n}"
        truth = torch.exp2(x.double() * scale - shift)
        got = dst[:n].view(torch.bfloat16).double()
        lo = _bf16_round((truth * (1 - 2e-7)).float()).double()
        hi = _bf16_round((truth * (1 + 2e-7)).float()).double()
        under_normal = truth < 2.0**-126  # zeroed, never computed
        ok = torch.where(under_normal, got == 0, (got >= lo) & (got <= hi))
        assert ok.all(), f"n={n}: {got[~ok][:4].tolist()} vs {truth[~ok][:4].tolist()}"
        expected = truth.where(~under_normal, torch.zeros_like(truth)).sum().item()
        assert abs(total - expected) <= 1e-6 * expected, f"sum n={n}: {total} vs {expected}"


def _bf16_bits(x):
    return x.to(torch.bfloat16).contiguous().view(torch.int16)


def _value_tiles(full):
    """pack_values' layout of a zero-padded (round_up(n, 32), round_up(dv, 16)) block: per chunk
    of 32 keys and block of 16 features, row t = key pair t of the 16 features."""
    return full.view(-1, 16, 2, full.size(1) // 16, 16).permute(0, 3, 1, 4, 2).reshape(-1)


def test_emulated_amx_packing_layouts(emulated):
    """The bf16 operand layouts shared by the AMX and AVX512-BF16 products
    (amx_block_products.h), element by element against their definitions, on whole tiles (the
    register transposes) and every kind of partial tile, zeros past the data included."""
    g = torch.Generator().manual_seed(7)
    for n in (1, 15, 16, 17, 31, 32, 33, 64, 77):
        for d in (1, 16, 31, 32, 33, 64, 80):
            src = torch.randn(n, d + 5, generator=g)
            bits = _bf16_bits(src)
            # pack_keys: per block of 16 keys and chunk of 32 features, row t = feature pair t of
            # the 16 keys, (2t, 2t + 1) adjacent.
            kp = torch.full((_round_up(n, 32) * _round_up(d, 32),), -1, dtype=torch.int16)
            emulated.amx_pack_keys(_ptr(bits), _i(d + 5), _i(n), _i(d), _ptr(kp))
            full = torch.zeros(_round_up(n, 32), _round_up(d, 32), dtype=torch.int16)
            full[:n, :d] = bits[:, :d]
            ref = full.view(-1, 16, _round_up(d, 32) // 32, 16, 2).permute(0, 2, 3, 1, 4)
            assert torch.equal(kp, ref.reshape(-1)), f"pack_keys n={n} d={d}"
            # pack_values
            vp = torch.full((_round_up(n, 32) * _round_up(d, 16),), -1, dtype=torch.int16)
            emulated.amx_pack_values(_ptr(bits), _i(d + 5), _i(n), _i(d), _ptr(vp))
            full = torch.zeros(_round_up(n, 32), _round_up(d, 16), dtype=torch.int16)
            full[:n, :d] = bits[:, :d]
            assert torch.equal(vp, _value_tiles(full)), f"pack_values n={n} d={d}"
            # pack_row_pairs: pack_values' layout of bf16(src) for fp32 rows.
            rp = torch.full_like(vp, -1)
            emulated.amx_pack_row_pairs(_ptr(src), _i(d + 5), _i(n), _i(d), _ptr(rp))
            full = torch.zeros(_round_up(n, 32), _round_up(d, 16), dtype=torch.int16)
            full[:n, :d] = _bf16_bits(_bf16_round(src[:, :d]))
            assert torch.equal(rp, _value_tiles(full)), f"pack_row_pairs n={n} d={d}"
            # round_rows: bf16 rows padded with zeros to 32 columns and 16 rows.
            ldd = _round_up(d, 32) + 8
            rr = torch.full((_round_up(n, 16), ldd), -1, dtype=torch.int16)
            emulated.amx_round_rows(_ptr(src), _i(d + 5), _i(n), _i(d), _ptr(rr), _i(ldd))
            ref = torch.zeros(_round_up(n, 16), _round_up(d, 32), dtype=torch.int16)
            ref[:n, :d] = _bf16_bits(_bf16_round(src[:, :d]))
            assert torch.equal(rr[:, : _round_up(d, 32)], ref), f"round_rows n={n} d={d}"
            assert (rr[:, _round_up(d, 32) :] == -1).all(), f"round_rows wrote past n_pad n={n}"
            # pad_rows: bf16 rows copied, zero to ldd and to `rows` rows.
            ldd, rows = _round_up(d, 32), _round_up(n, 16) + 16
            pr = torch.full((rows + 1, ldd), -1, dtype=torch.int16)
            emulated.amx_pad_rows(_ptr(bits), _i(d + 5), _i(n), _i(d), _ptr(pr), _i(ldd), _i(rows))
            ref = torch.zeros(rows, ldd, dtype=torch.int16)
            ref[:n, :d] = bits[:, :d]
            assert torch.equal(pr[:rows], ref) and (pr[rows] == -1).all(), f"pad_rows n={n} d={d}"
            # transpose_rows: dst[c][r] = src[r][c], zero to ldd columns and `rows` rows.
            ldd, rows = _round_up(n, 32), _round_up(d, 16)
            tr = torch.full((rows + 1, ldd), -1, dtype=torch.int16)
            emulated.amx_transpose_rows(
                _ptr(bits), _i(d + 5), _i(n), _i(d), _ptr(tr), _i(ldd), _i(rows)
            )
            ref = torch.zeros(rows, ldd, dtype=torch.int16)
            ref[:d, :n] = bits[:, :d].t()
            assert torch.equal(tr[:rows], ref) and (tr[rows] == -1).all(), f"transpose n={n} d={d}"


_BF16_SETS = {"avx512bf16": 0, "amx": 1}
_BF16_ROWS = (1, 5, 12, 13, 16, 17, 25, 31, 32, 33, 48, 70)


def _assert_sum_close(got, terms_abs, exact, what):
    """fp32 sums of exact products: recursive summation of k terms errs by at most about
    k * 2^-24 times the sum of their magnitudes; a wrong operand errs by a whole term."""
    bound = (terms_abs.shape[-1] + 2) * 2.0**-24 * terms_abs.sum(-1) + 1e-30
    err = (got.double() - exact).abs()
    assert (err <= bound).all(), f"{what}: max err / bound {(err / bound).max().item():.3g}"


@pytest.mark.parametrize("kernels", sorted(_BF16_SETS))
def test_emulated_bf16_scores(emulated, kernels):
    """scale * Q K^T on bf16 operands (amx::scores / avx512bf16::scores) against the float64
    products of the same bf16 values, over every micro-tile remainder, key counts ending mid
    tile and head dims ending mid pair and mid chunk; columns past n untouched. On AMX,
    scores_unscaled's whole tiles hold the same sums, bit for bit."""

    g = torch.Generator().manual_seed(8)
    scale = 0.37
    for d in (1, 7, 32, 33, 64, 80, 128):
        dp = _round_up(d, 32)
        for n in (1, 16, 17, 31, 32, 33, 77):
            k = _bf16_round(torch.randn(n, d, generator=g)).float()
            k_bits = _bf16_bits(k)  # held: ctypes keeps only the address
            kt = torch.zeros(_round_up(n, 32) * dp, dtype=torch.int16)
            emulated.amx_pack_keys(_ptr(k_bits), _i(d), _i(n), _i(d), _ptr(kt))
            for m in _BF16_ROWS:
                q = _bf16_round(torch.randn(m, d, generator=g)).float()
                qb = torch.zeros(_round_up(m, 16), dp + 4, dtype=torch.int16)
                emulated.amx_round_rows(_ptr(q), _i(d), _i(m), _i(d), _ptr(qb), _i(dp + 4))
                lds = _round_up(n, 16) + 3
                s = torch.full((m, lds), 12345.0)
                emulated.bf16_scores(
                    _BF16_SETS[kernels],
                    _ptr(qb),
                    _i(dp + 4),
                    _i(m),
                    _ptr(kt),
                    _i(n),
                    _i(d),
                    _f(scale),
                    _ptr(s),
                    _i(lds),
                )
                terms = q.double()[:, None, :] * k.double()[None, :, :]
                _assert_sum_close(
                    s[:, :n] / scale, terms.abs(), terms.sum(-1), f"{kernels} m={m} n={n} d={d}"
                )
                assert (s[:, n:] == 12345.0).all(), f"{kernels}: wrote past n={n}"
                if kernels == "amx":
                    whole = torch.full((_round_up(m, 16), lds), 12345.0)
                    emulated.amx_scores_unscaled(
                        _ptr(qb), _i(dp + 4), _i(m), _ptr(kt), _i(n), _i(d), _ptr(whole), _i(lds)
                    )
                    assert torch.equal(whole[:m, :n] * scale, s[:, :n]), f"unscaled m={m} n={n}"
                    assert (whole[m:, : _round_up(n, 16)] == 0).all(), f"unscaled rows m={m}"


@pytest.mark.parametrize("kernels", sorted(_BF16_SETS))
@pytest.mark.parametrize("with_factor", [False, True])
def test_emulated_bf16_pv(emulated, kernels, with_factor):
    """O = O * factor + P V on bf16 operands (amx::pv / avx512bf16::pv) against float64, with
    keys ending mid pair and mid chunk, value widths ending mid block: the values of keys past n
    (packed, but never seen by these rows) are NaN and must reach no output."""
    g = torch.Generator().manual_seed(9 + with_factor)
    for dv in (1, 8, 16, 17, 32, 40, 48, 80):
        for n in (1, 2, 15, 31, 32, 33, 64, 77):
            n_packed = _round_up(n + 1, 32)  # a longer sequence's packed values
            v = _bf16_round(torch.randn(n_packed, dv, generator=g)).float()
            v[n:] = float("nan")
            v_bits = _bf16_bits(v)  # held: ctypes keeps only the address
            vt = torch.zeros(n_packed * _round_up(dv, 16), dtype=torch.int16)
            emulated.amx_pack_values(_ptr(v_bits), _i(dv), _i(n_packed), _i(dv), _ptr(vt))
            v_tail = torch.zeros(32 * _round_up(dv, 16), dtype=torch.int16)
            for m in _BF16_ROWS:
                p = _bf16_round(torch.rand(m, n, generator=g)).float()
                ldp = _round_up(n, 32) + 2
                pb = torch.zeros(_round_up(m, 16), ldp, dtype=torch.int16)
                emulated.amx_round_rows(_ptr(p), _i(n), _i(m), _i(n), _ptr(pb), _i(ldp))
                factor = torch.rand(m, generator=g) if with_factor else None
                o0 = torch.randn(m, dv + 3, generator=g)
                o = o0.clone()
                emulated.bf16_pv(
                    _BF16_SETS[kernels],
                    _ptr(pb),
                    _i(ldp),
                    _i(m),
                    _ptr(vt),
                    _i(n),
                    _i(dv),
                    _ptr(factor) if factor is not None else None,
                    _ptr(o),
                    _i(dv + 3),
                    _ptr(v_tail),
                )
                what = f"{kernels} m={m} n={n} dv={dv}"
                assert torch.equal(o[:, dv:], o0[:, dv:]), f"{what}: wrote past dv"
                assert torch.isfinite(o[:, :dv]).all(), f"{what}: a value past n was read"
                terms = p.double()[:, None, :] * v[:n].double().t()[None, :, :]
                base = o0[:, :dv].double() * (factor.double()[:, None] if with_factor else 1)
                _assert_sum_close(
                    o[:, :dv],
                    torch.cat([terms.abs(), base.abs()[..., None]], -1),
                    terms.sum(-1) + base,
                    what,
                )


def test_reports_the_kernels_it_runs():
    import attn_ext

    wanted = os.environ.get("ATTN_EXT_CPU_KERNELS") or "auto"
    expected = "avx512" if HAS_AVX512 and wanted != "avx2" else "avx2"
    if wanted in ("auto", "amx") and HAS_AMX:
        expected = "amx"
    elif wanted == "avx512bf16" and HAS_AVX512BF16:
        expected = "avx512bf16"
    elif wanted == "auto" and HAS_AVX512BF16 and harness.cpu_vendor() == "AuthenticAMD":
        # vdpbf16ps ran at the FMA's rate on AMD Zen 5 and at a quarter of it on an Intel core
        # (block_kernels.cpp), so auto's choice without AMX follows the vendor.
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
