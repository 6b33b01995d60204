"""Float8 KV caches (CPU): kv_cache_append quantizes to float8_e4m3fn / float8_e5m2 with
saturation, decode_attention attends to k_scale * k_cache and v_scale * v_cache. The references
are the dense decode reference on the dequantized cache (attn_ext/testing/decoding.py) and
torch's own float8 conversions."""

import os
import subprocess
import sys

import pytest
import torch

import attn_ext
from attn_ext.testing.decoding import decode_reference, gather_pages, page_out
from attn_ext.testing.numerics import (
    ALL_DTYPES,
    assert_error_rule,
    assert_lse_close,
    ground_truth,
    rand,
)

ops = torch.ops.attn_ext
FLOAT8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# Powers of two: the dequantized cache (float8 value * scale) is then exact in every q dtype,
# so the reference in q's dtype sees the values the kernel sees.
K_SCALE, V_SCALE = 2.0**-4, 2.0**-6


def _quantize(x, dtype, scale):
    """torch's conversion of x / scale, saturated at the format's largest finite value."""
    big = torch.finfo(dtype).max
    return (x.double() / scale).clamp(-big, big).to(dtype)


def _dequantize(cache, scale, dtype):
    return (cache.double() * scale).to(dtype)


def _bits(t):
    return t.view(torch.uint8)


# ------------------------------------------------------------------------------------- append


@pytest.mark.parametrize("fp8", FLOAT8)
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("paged", [False, True])
def test_append_quantizes_as_torch_converts(fp8, dtype, paged):
    B, Hkv, L, D, Dv = 3, 2, 40, 24, 16
    k = rand((B, Hkv, 21, D), dtype, "cpu", scale=8.0)
    v = rand((B, Hkv, 21, Dv), dtype, "cpu", layout="bshd", scale=0.5)
    if paged:
        c = attn_ext.PagedKVCache(
            12,
            8,
            Hkv,
            D,
            Dv,
            max_batch=B,
            max_pages_per_seq=5,
            dtype=fp8,
            k_scale=K_SCALE,
            v_scale=V_SCALE,
        )
    else:
        c = attn_ext.KVCache(B, Hkv, L, D, Dv, dtype=fp8, k_scale=K_SCALE, v_scale=V_SCALE)
    c.append(k[:, :, :13], v[:, :, :13])
    c.append(k[:, :, 13:], v[:, :, 13:], new_lengths=torch.tensor([8, 3, 0]))
    assert c.k.dtype == fp8 and c.lengths.tolist() == [21, 16, 13]
    for b, n in enumerate([21, 16, 13]):
        rows = list(range(13)) + list(range(21 - (n - 13), 21))
        got_k, got_v = c.k, c.v
        if paged:
            table = c.block_table[b : b + 1]
            got_k = gather_pages(c.k, table, 8)[0]
            got_v = gather_pages(c.v, table, 8)[0]
        else:
            got_k, got_v = c.k[b], c.v[b]
        assert torch.equal(_bits(got_k[:, :n]), _bits(_quantize(k[b][:, rows], fp8, K_SCALE)))
        assert torch.equal(_bits(got_v[:, :n]), _bits(_quantize(v[b][:, rows], fp8, V_SCALE)))


@pytest.mark.parametrize("fp8", FLOAT8)
def test_append_saturates_and_keeps_nan(fp8):
    big = torch.finfo(fp8).max
    x = torch.tensor([1e30, -1e30, float("inf"), float("-inf"), float("nan"), 3.0, -0.0])
    k = x.view(1, 1, -1, 1).expand(1, 1, -1, 4).contiguous()
    c = attn_ext.KVCache(1, 1, 8, 4, dtype=fp8, k_scale=0.5, v_scale=2.0)
    c.append(k, k)
    got_k, got_v = c.k[0, 0, :7, 0].float(), c.v[0, 0, :7, 0].float()
    assert got_k[:4].tolist() == [big, -big, big, -big]
    assert got_v[:4].tolist() == [big, -big, big, -big]
    assert torch.isnan(got_k[4]) and torch.isnan(got_v[4])
    assert got_k[5].item() == 6.0 and got_v[5].item() == 1.5
    assert _bits(c.k[0, 0, 6, :1]).item() == 0x80  # -0 stays negative zero


@pytest.mark.parametrize("fp8", FLOAT8)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_append_rope_rotates_before_quantizing(fp8, interleaved, dtype):
    """Keys rotated in fp32 (not rounded to q's dtype first), then quantized once: within one
    float8 step of the exactly rotated key; bit-equal to quantizing attn_ext.rope's fp32
    rotation of the same keys."""
    B, Hkv, D = 2, 2, 32
    k = rand((B, Hkv, 9, D), dtype, "cpu", scale=4.0)
    v = rand((B, Hkv, 9, D), dtype, "cpu")
    c = attn_ext.KVCache(B, Hkv, 16, D, dtype=fp8, k_scale=K_SCALE, v_scale=V_SCALE)
    c.append(k[:, :, :4], v[:, :, :4], rope=True, rope_interleaved=interleaved)
    c.append(k[:, :, 4:], v[:, :, 4:], rope=True, rope_interleaved=interleaved)
    rotated = attn_ext.rope(k.float(), interleaved=interleaved)
    assert torch.equal(_bits(c.k[:, :, :9]), _bits(_quantize(rotated, fp8, K_SCALE)))
    exact = attn_ext.rope(k.double(), interleaved=interleaved)
    step = 2.0 ** -(3 if fp8 == torch.float8_e4m3fn else 2)  # one unit in the last place, relative
    err = (c.k[:, :, :9].double() * K_SCALE - exact).abs()
    assert (err <= step * exact.abs() + 2.0**-9 * K_SCALE).all()


# ------------------------------------------------------------------------------------- decode

CASES = [
    # B, H, Hkv, Sq, L, D, Dv, lengths, extra: in-place rows (G * Sq <= 8) and BLAS blocks
    (3, 8, 2, 1, 700, 64, 64, [700, 517, 1], {}),
    (2, 8, 1, 1, 600, 64, 48, [0, 600], {}),
    (2, 4, 4, 3, 300, 32, 32, [300, 2], dict(window_left=20)),
    (1, 32, 8, 1, 2100, 128, 128, [2050], {}),
    (2, 6, 3, 5, 257, 16, 16, [257, 256], dict(softcap=3.0)),
    (2, 16, 1, 2, 90, 40, 40, [90, 33], dict(causal=False)),
    (2, 4, 2, 130, 200, 16, 16, [200, 140], {}),
]


def _case(fp8, dtype, case, device="cpu"):
    B, H, Hkv, Sq, L, D, Dv, lengths, extra = CASES[case]
    kc = _quantize(rand((B, Hkv, L, D), torch.float32, device, scale=3.0), fp8, K_SCALE)
    vc = _quantize(rand((B, Hkv, L, Dv), torch.float32, device), fp8, V_SCALE)
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    q = rand((B, H, Sq, D), dtype, device, layout="bshd")
    return q, kc, vc, lens, dict(extra)


@pytest.mark.parametrize("fp8", FLOAT8)
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("num_splits", [0, 1, 3])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_decode_equals_attention_on_the_dequantized_cache(fp8, dtype, num_splits, case):
    q, kc, vc, lens, extra = _case(fp8, dtype, case)
    out, lse = attn_ext.decode_attention(
        q,
        kc,
        vc,
        lens,
        num_splits=num_splits,
        return_lse=True,
        k_scale=K_SCALE,
        v_scale=V_SCALE,
        **extra,
    )
    k, v = _dequantize(kc, K_SCALE, dtype), _dequantize(vc, V_SCALE, dtype)
    ref_out, ref_lse = decode_reference(q, k, v, lens, **extra)
    t_out, t_lse = ground_truth(decode_reference, q, k, v, lens, **extra)
    assert out.dtype == dtype
    assert_error_rule(out, ref_out, t_out, name="float8 decode out")
    assert_lse_close(lse, ref_lse, t_lse, name="float8 decode lse")


@pytest.mark.parametrize("fp8", FLOAT8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16, 256])
@pytest.mark.parametrize("case", [0, 3, 4])
def test_paged_float8_equals_contiguous_bit_for_bit(fp8, dtype, page_size, case):
    q, kc, vc, lens, extra = _case(fp8, dtype, case)
    kw = dict(k_scale=K_SCALE, v_scale=V_SCALE, return_lse=True, **extra)
    dense = attn_ext.decode_attention(q, kc, vc, lens, **kw)
    kp, vp, table = page_out(kc.view(torch.uint8), vc.view(torch.uint8), page_size)
    paged = attn_ext.decode_attention(q, kp.view(fp8), vp.view(fp8), lens, block_table=table, **kw)
    assert torch.equal(dense[0], paged[0]) and torch.equal(dense[1], paged[1])


# Every byte of each format once: 256 features of one key and one value row.
WIDEN_SCRIPT = r"""
import sys, torch, attn_ext
fp8 = getattr(torch, sys.argv[1])
torch.set_flush_denormal(True)  # DAZ / FTZ on: the subnormal bytes must still widen exactly
every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8)
want = every.float()
# Rows in place and BLAS blocks; fp64 queries widen the bytes one by one (c10's conversion).
for H, Sq, dtype in ((1, 1, torch.float32), (1, 8, torch.float32), (16, 1, torch.float32),
                     (4, 16, torch.float32), (1, 1, torch.float64)):
    kc = every.view(1, 1, 1, 256).clone()
    q = torch.zeros(1, H, Sq, 256, dtype=dtype)
    # The single key's value row comes back times v_scale (its probability is 1).
    zero_key = torch.zeros_like(kc)
    out = attn_ext.decode_attention(q, zero_key, kc, torch.tensor([1]), v_scale=0.5)
    got = out[0, 0, -1].float() * 2  # the last query sits at the key (causal)
    assert torch.equal(torch.isnan(got), torch.isnan(want)), (H, Sq)
    ok = ~torch.isnan(want)
    assert torch.equal(got[ok], want[ok]), (H, Sq, (got - want)[ok].abs().max())
    # lse of one key is its score: one-hot queries read the key's features one by one (the
    # non-finite features zeroed: 0 * NaN would make every score NaN).
    kc = torch.where(torch.isfinite(want), every.view(torch.uint8), 0).view(fp8).view(1, 1, 1, 256)
    for j0 in range(0, 256, Sq):
        q = torch.zeros(1, H, Sq, 256, dtype=dtype)
        for i in range(Sq):
            q[0, :, i, j0 + i] = 1.0
        _, lse = attn_ext.decode_attention(
            q, kc, kc, torch.tensor([1]), scale=1.0, causal=False, k_scale=0.25, return_lse=True
        )
        got, ref = lse[0, 0].double() * 4, kc.double().flatten()[j0 : j0 + Sq]
        # lse goes through the log2 domain and back: a few float32 roundings of the score.
        assert ((got - ref).abs() <= 1e-6 * ref.abs()).all(), (H, Sq, j0, got - ref)
print("ok")
"""


@pytest.mark.parametrize("fp8", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("kernels", ["auto", "avx2"])
def test_every_byte_widens_exactly(fp8, kernels):
    """The 8- and 16-lane widening (16 where `auto` picks AVX-512) and the scalar one of all 256
    bytes, NaN and subnormals included, with denormals-are-zero set, against torch's
    conversion."""
    env = dict(os.environ, ATTN_EXT_CPU_KERNELS=kernels)
    r = subprocess.run(
        [sys.executable, "-c", WIDEN_SCRIPT, fp8], env=env, capture_output=True, text=True
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_kv_cache_class_round_trip_and_repr():
    torch.manual_seed(0)
    B, H, Hkv, D = 2, 8, 2, 64
    c = attn_ext.KVCache(B, Hkv, 64, D, dtype=torch.float8_e4m3fn, k_scale=0.02, v_scale=0.01)
    full = attn_ext.KVCache(B, Hkv, 64, D, dtype=torch.float32)
    for s in (20, 1, 1):
        k, v = torch.randn(B, Hkv, s, D), torch.randn(B, Hkv, s, D)
        c.append(k, v, rope=True)
        full.append(k, v, rope=True)
    q = torch.randn(B, H, 1, D)
    out, ref = c.attend(q), full.attend(q)
    # e4m3's 3 mantissa bits: each key and value within 2^-4 relative; the output of 22 keys
    # stays within a few percent of its magnitude.
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()
    assert "float8_e4m3fn" in repr(c) and c.k.element_size() == 1


def test_bad_arguments():
    fp8 = torch.float8_e4m3fn
    q = torch.randn(1, 2, 1, 8)
    kc = torch.zeros(1, 2, 4, 8, dtype=fp8)
    lens = torch.tensor([2])
    bad = [
        ((q, kc, kc.float(), lens), {}, "v_cache must have k_cache's dtype"),
        ((q, kc, kc, lens), dict(k_scale=0.0), "k_scale must be positive and finite, got 0"),
        ((q, kc, kc, lens), dict(v_scale=float("nan")), "v_scale must be positive and finite"),
        ((q, kc.float(), kc.float(), lens), dict(k_scale=2.0), "k_scale applies to float8"),
        ((q.to(fp8), kc, kc, lens), {}, "q must be float32, float64, bfloat16 or float16"),
        (
            (q, kc.to(torch.int8), kc.to(torch.int8), lens),
            {},
            "k_cache must be float32, float64, bfloat16, float16, float8_e4m3fn or float8_e5m2, "
            "got Char",
        ),
    ]
    for args, kw, msg in bad:
        with pytest.raises(RuntimeError, match=msg):
            ops.decode_attention(*args, **kw)
    k = torch.randn(1, 2, 1, 8)
    with pytest.raises(RuntimeError, match="k must be float32, float64, bfloat16 or float16"):
        ops.kv_cache_append(kc, kc.clone(), lens.clone(), k.to(fp8), k.to(fp8))
    with pytest.raises(RuntimeError, match="v_scale must be positive and finite, got -1"):
        ops.kv_cache_append(kc, kc.clone(), lens.clone(), k, k, v_scale=-1.0)
    with pytest.raises(RuntimeError, match="v_scale applies to float8"):
        ops.kv_cache_append(kc.float(), kc.float(), lens.clone(), k, k, v_scale=3.0)
    with pytest.raises(ValueError, match="KVCache: k_scale applies to float8"):
        attn_ext.KVCache(1, 2, 4, 8, k_scale=2.0)
    with pytest.raises(ValueError, match="PagedKVCache: v_scale must be positive and finite"):
        attn_ext.PagedKVCache(4, 2, 2, 8, max_batch=1, max_pages_per_seq=2, dtype=fp8, v_scale=0)
    latent = torch.zeros(1, 1, 4, 12)
    c_kv, k_rope = torch.randn(1, 1, 1, 8), k[:, :1, :, :4]
    with pytest.raises(RuntimeError, match="kv_scale applies to float8"):
        ops.latent_cache_append(latent, lens.clone(), c_kv, k_rope, kv_scale=0.5)
    with pytest.raises(RuntimeError, match="kv_scale must be positive and finite, got inf"):
        ops.latent_cache_append(latent.to(fp8), lens.clone(), c_kv, k_rope, kv_scale=float("inf"))
    with pytest.raises(RuntimeError, match="c_kv must be float32, float64, bfloat16 or float16"):
        ops.latent_cache_append(latent.to(fp8), lens.clone(), c_kv.to(fp8), k_rope)
    with pytest.raises(ValueError, match="LatentKVCache: kv_scale applies to float8"):
        attn_ext.LatentKVCache(1, 4, kv_lora_rank=8, rope_dim=4, kv_scale=2.0)
    with pytest.raises(ValueError, match="PagedLatentKVCache: kv_scale must be positive"):
        attn_ext.PagedLatentKVCache(
            4, 2, 8, 4, max_batch=1, max_pages_per_seq=2, dtype=fp8, kv_scale=-2.0
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_refuses_float8_caches():
    kc = torch.zeros(1, 2, 4, 8, dtype=torch.float8_e4m3fn, device="cuda")
    q = torch.randn(1, 2, 1, 8, device="cuda")
    lens = torch.tensor([2], dtype=torch.int32, device="cuda")
    with pytest.raises(NotImplementedError, match="supported on the CPU only"):
        ops.decode_attention(q, kc, kc, lens)
    with pytest.raises(NotImplementedError, match="supported on the CPU only"):
        ops.kv_cache_append(kc, kc.clone(), lens.clone(), q[:, :, :1], q[:, :, :1])
    latent = torch.zeros(1, 1, 4, 12, dtype=torch.float8_e4m3fn, device="cuda")
    with pytest.raises(NotImplementedError, match="supported on the CPU only"):
        ops.latent_cache_append(
            latent, lens.clone(), torch.randn(1, 1, 1, 8, device="cuda"), q[:, :1, :1, :4]
        )


def test_opcheck():
    fp8 = torch.float8_e5m2
    kc = _quantize(torch.randn(2, 2, 16, 8), fp8, 0.25)
    vc = _quantize(torch.randn(2, 2, 16, 8), fp8, 0.5)
    lens = torch.tensor([16, 5], dtype=torch.int32)
    q = torch.randn(2, 4, 1, 8)
    kw = dict(k_scale=0.25, v_scale=0.5)
    # opcheck's schema check compares the inputs before and after with arithmetic torch does
    # not implement for float8 ("mul_cpu_reduced_float"); the mutations it would check are
    # checked on the bytes below instead.
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    before = [_bits(kc).clone(), _bits(vc).clone()]
    torch.library.opcheck(ops.decode_attention.default, (q, kc, vc, lens), kw, test_utils=utils)
    assert torch.equal(before[0], _bits(kc)) and torch.equal(before[1], _bits(vc))
    k, v = torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8)
    args = (kc.clone(), vc.clone(), lens.clone() - 1, k, v)
    torch.library.opcheck(ops.kv_cache_append.default, args, kw, test_utils=utils)
    ops.kv_cache_append(*args, **kw)
    assert args[2].tolist() == [16, 5]  # the lengths advanced once more by the call above
    # (opcheck ran the op on copies; the call above wrote row 4 of sequence 1)
    assert torch.equal(_bits(args[0][1, :, 4]), _bits(_quantize(k[1, :, 0], fp8, 0.25)))
    assert torch.equal(_bits(args[1][1, :, 4]), _bits(_quantize(v[1, :, 0], fp8, 0.5)))


def test_compile_a_decode_step():
    torch.manual_seed(0)
    c = attn_ext.KVCache(2, 2, 32, 16, dtype=torch.float8_e4m3fn, k_scale=0.05, v_scale=0.05)
    c.append(torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 16))

    def step(cache, k, v, q):
        cache.append(k, v, rope=True)
        return cache.attend(q)

    compiled = torch.compile(step, fullgraph=True)
    twin = attn_ext.KVCache(2, 2, 32, 16, dtype=torch.float8_e4m3fn, k_scale=0.05, v_scale=0.05)
    twin.k.copy_(c.k), twin.v.copy_(c.v), twin.lengths.copy_(c.lengths)
    twin._host_lengths = list(c._host_lengths)
    for _ in range(3):
        k, v, q = torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16), torch.randn(2, 4, 1, 16)
        assert torch.equal(compiled(c, k, v, q), step(twin, k, v, q))
    assert torch.equal(_bits(c.k), _bits(twin.k))


def test_decoder_layer_generates_through_a_float8_cache():
    """DecoderAttention's prefill + decode steps through a float8 cache stay within e4m3's
    precision of the same steps through an fp32 cache."""
    torch.manual_seed(0)
    layer = attn_ext.nn.DecoderAttention(256, 8, num_kv_heads=2).eval()
    x = torch.randn(2, 12, 256)
    fp8 = layer.new_cache(2, 32, dtype=torch.float8_e4m3fn, k_scale=2.0**-5, v_scale=2.0**-6)
    full = layer.new_cache(2, 32)
    with torch.no_grad():
        outs = [layer(x, c) for c in (fp8, full)]
        for _ in range(4):
            step = torch.randn(2, 1, 256)
            outs += [layer(step, c) for c in (fp8, full)]
    assert fp8.k.dtype == torch.float8_e4m3fn and fp8.lengths.tolist() == [16, 16]
    for got, want in zip(outs[0::2], outs[1::2]):
        assert (got - want).abs().max() < 0.08 * want.abs().max()


# ------------------------------------------------------------------------- MLA's latent cache
LATENT_SCALE = 2.0**-5  # a power of two: the dequantized rows are exact in every q dtype


@pytest.mark.parametrize("fp8", FLOAT8)
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("paged", [False, True])
def test_latent_append_quantizes_as_torch_converts(fp8, dtype, paged):
    """The latent append writes [c_kv, RoPE(k_rope)] / kv_scale: c_kv as torch converts the
    saturated quotient, k_rope rotated in fp32 first (as the rotation alone gives it)."""
    B, Dc, Dr = 2, 24, 8
    c_kv = rand((B, 1, 9, Dc), dtype, "cpu", scale=4.0)
    k_rope = rand((B, 1, 9, Dr), dtype, "cpu")
    kw = dict(dtype=fp8, kv_scale=LATENT_SCALE)
    if paged:
        c = attn_ext.PagedLatentKVCache(8, 4, Dc, Dr, max_batch=B, max_pages_per_seq=4, **kw)
    else:
        c = attn_ext.LatentKVCache(B, 16, Dc, Dr, **kw)
    c.append(c_kv, k_rope, rope_interleaved=True, new_lengths=torch.tensor([9, 4]))
    assert c.kv_scale == LATENT_SCALE and c.lengths.tolist() == [9, 4]
    rows = c.rows(9)
    assert rows.dtype == fp8
    acc = torch.float64 if dtype == torch.float64 else torch.float32  # the rotation's type
    for b, n in enumerate([9, 4]):  # sequence b's last n tokens, at positions 0 .. n - 1
        want_c = _quantize(c_kv[b, :, 9 - n :], fp8, LATENT_SCALE)
        rotated = attn_ext.rope(k_rope[b : b + 1, :, 9 - n :].to(acc), interleaved=True)[0]
        want_r = _quantize(rotated, fp8, LATENT_SCALE)
        assert torch.equal(_bits(rows[b, :, :n, :Dc]), _bits(want_c))
        assert torch.equal(_bits(rows[b, :, :n, Dc:]), _bits(want_r))
    deq = c.rows(9, dtype=torch.float64)
    assert torch.equal(deq, rows.double() * LATENT_SCALE)


@pytest.mark.parametrize("fp8", FLOAT8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("page_size", [None, 16])
def test_latent_decode_equals_attention_on_the_dequantized_cache(fp8, dtype, page_size):
    """The absorbed decode over a float8 latent cache (D 576, the values its 512-column view)
    against the dense reference on the dequantized rows; paged == contiguous bit for bit."""
    torch.manual_seed(0)
    B, L, H = 2, 300, 16
    c_kv, k_rope, n = (
        torch.randn(B, 1, 257, 512),
        torch.randn(B, 1, 257, 64),
        torch.tensor([257, 90]),
    )
    c = attn_ext.LatentKVCache(B, L, 512, 64, dtype=fp8, kv_scale=LATENT_SCALE)
    c.append(c_kv, k_rope, new_lengths=n)
    q = rand((B, H, 2, 576), dtype, "cpu", layout="bshd")
    out, lse = c.attend(q, scale=0.07, return_lse=True)
    k = _dequantize(c.kv, LATENT_SCALE, dtype)
    ref_out, ref_lse = decode_reference(q, k, k[..., :512], c.lengths, scale=0.07)
    t_out, t_lse = ground_truth(decode_reference, q, k, k[..., :512], c.lengths, scale=0.07)
    assert out.shape == (B, H, 2, 512)
    assert_error_rule(out, ref_out, t_out, name="float8 latent decode out")
    assert_lse_close(lse, ref_lse, t_lse, name="float8 latent decode lse")
    if page_size:  # the same appends through pages: the same bytes, the same results
        p = attn_ext.PagedLatentKVCache(
            40,
            page_size,
            512,
            64,
            max_batch=B,
            max_pages_per_seq=20,
            dtype=fp8,
            kv_scale=LATENT_SCALE,
        )
        p.append(c_kv, k_rope, new_lengths=n)
        for b, m in enumerate(n.tolist()):
            assert torch.equal(_bits(p.rows(257)[b, :, :m]), _bits(c.kv[b, :, :m]))
        p_out, p_lse = p.attend(q, scale=0.07, return_lse=True)
        assert torch.equal(p_out, out) and torch.equal(p_lse, lse)


@pytest.mark.parametrize("page_size", [None, 8])
def test_latent_layer_generates_through_a_float8_cache(page_size):
    """MultiHeadLatentAttention's prompt and absorbed / decompressed steps through a float8
    latent cache stay within e4m3's precision of the same steps through an fp32 cache."""
    torch.manual_seed(0)
    mla = attn_ext.nn.MultiHeadLatentAttention(
        256, 4, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32
    ).eval()
    x = torch.randn(2, 12, 256)
    fp8 = mla.new_cache(2, 32, dtype=torch.float8_e4m3fn, kv_scale=2.0**-4, page_size=page_size)
    full = mla.new_cache(2, 32, page_size=page_size)
    with torch.no_grad():
        outs = [mla(x[:, :6], c) for c in (fp8, full)]
        for t in range(6, 12):
            outs += [mla(x[:, t : t + 1], c, absorb=t % 2 == 0) for c in (fp8, full)]
    assert fp8.kv.dtype == torch.float8_e4m3fn and fp8.lengths.tolist() == [12, 12]
    for got, want in zip(outs[0::2], outs[1::2]):
        assert (got - want).abs().max() < 0.08 * want.abs().max()


# ------------------------------------------------------------- FlashAttention's kvcache API
@pytest.mark.parametrize("fp8", FLOAT8)
@pytest.mark.parametrize("where", ["rows", "batch_idx", "paged"])
def test_flash_attn_with_kvcache_descale(fp8, where):
    """flash_attn_with_kvcache with FlashAttention 3's k_descale / v_descale over a float8 cache:
    the new keys / values stored as kv_cache_append quantizes them (by index with
    cache_batch_idx, through the table when paged), the output the decode reference's over the
    dequantized cache."""
    from attn_ext.flash_attn import flash_attn_with_kvcache

    torch.manual_seed(0)
    B, L, Hkv, H, D, S_new = 2, 48, 2, 4, 32, 5
    bf16 = torch.bfloat16  # FlashAttention's k / v have q's dtype; the cache is float8
    k, v = torch.randn(B, S_new, Hkv, D, dtype=bf16), torch.randn(B, S_new, Hkv, D, dtype=bf16)
    q = torch.randn(B, 2, H, D, dtype=bf16)
    lens = torch.tensor([10, 3], dtype=torch.int32)
    rows = dict(rows=B, batch_idx=4, paged=B * 3)[where]
    kc = _quantize(torch.randn(rows, L if where != "paged" else 16, Hkv, D), fp8, K_SCALE)
    vc = _quantize(torch.randn(rows, L if where != "paged" else 16, Hkv, D), fp8, V_SCALE)
    kw = dict(cache_seqlens=lens, causal=True, return_softmax_lse=True)
    if where == "batch_idx":
        kw["cache_batch_idx"] = torch.tensor([3, 1], dtype=torch.int32)
    if where == "paged":
        kw["block_table"] = torch.tensor([[5, 0, 2], [4, 3, 1]], dtype=torch.int32)
    descale = dict(k_descale=torch.full((B, Hkv), K_SCALE), v_descale=V_SCALE)
    out, lse = flash_attn_with_kvcache(q, kc, vc, k, v, **kw, **descale)
    # the cache rows the sequences now hold, dense (B, Hkv, len + S_new, D), dequantized
    if where == "paged":
        dense_k = gather_pages(kc.transpose(1, 2), kw["block_table"], 16)
        dense_v = gather_pages(vc.transpose(1, 2), kw["block_table"], 16)
    else:
        idx = kw.get("cache_batch_idx", torch.arange(B)).long()
        dense_k, dense_v = kc[idx].transpose(1, 2), vc[idx].transpose(1, 2)
    for b, n in enumerate(lens.tolist()):
        new_k = _quantize(k[b].transpose(0, 1), fp8, K_SCALE)
        new_v = _quantize(v[b].transpose(0, 1), fp8, V_SCALE)
        assert torch.equal(_bits(dense_k[b, :, n : n + S_new]), _bits(new_k))
        assert torch.equal(_bits(dense_v[b, :, n : n + S_new]), _bits(new_v))
    deq_k = _dequantize(dense_k, K_SCALE, torch.bfloat16)
    deq_v = _dequantize(dense_v, V_SCALE, torch.bfloat16)
    after = lens + S_new
    qh = q.transpose(1, 2)
    ref_out, ref_lse = decode_reference(qh, deq_k, deq_v, after)
    t_out, t_lse = ground_truth(decode_reference, qh, deq_k, deq_v, after)
    assert_error_rule(out.transpose(1, 2), ref_out, t_out, name="flash_attn float8 out")
    assert_lse_close(lse, ref_lse, t_lse, name="flash_attn float8 lse")


def test_flash_attn_with_kvcache_descale_errors():
    from attn_ext.flash_attn import flash_attn_with_kvcache

    q = torch.randn(2, 1, 4, 8)
    kc = torch.zeros(2, 16, 2, 8, dtype=torch.float8_e4m3fn)
    lens = torch.tensor([3, 1], dtype=torch.int32)
    per_head = torch.tensor([[0.5, 0.25], [0.5, 0.25]])
    with pytest.raises(RuntimeError, match="k_descale must hold one value per cache"):
        flash_attn_with_kvcache(q, kc, kc.clone(), cache_seqlens=lens, k_descale=per_head)
    with pytest.raises(RuntimeError, match="v_cache must have k_cache's dtype"):
        flash_attn_with_kvcache(q, kc, kc.to(torch.float8_e5m2), cache_seqlens=lens)
    with pytest.raises(RuntimeError, match="k_scale applies to float8"):
        flash_attn_with_kvcache(q, kc.float(), kc.float(), cache_seqlens=lens, k_descale=0.5)


def test_latent_append_opcheck():
    """latent_cache_append with kv_scale into a float8 cache: opcheck's fake, autograd and
    dynamic-shape checks (its schema check cannot compare float8 tensors: test_opcheck above),
    and the mutation checked on the bytes."""
    fp8 = torch.float8_e4m3fn
    cache = torch.zeros(2, 1, 8, 12, dtype=fp8)
    lens = torch.tensor([2, 0], dtype=torch.int32)
    c_kv, k_rope = torch.randn(2, 1, 1, 8), torch.randn(2, 1, 1, 4)
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(
        ops.latent_cache_append.default,
        (cache.clone(), lens.clone(), c_kv, k_rope),
        dict(kv_scale=LATENT_SCALE),
        test_utils=utils,
    )
    ops.latent_cache_append(cache, lens, c_kv, k_rope, kv_scale=LATENT_SCALE)
    assert lens.tolist() == [3, 1]
    assert torch.equal(
        _bits(cache[1, :, 0, :8]), _bits(_quantize(c_kv[1, :, 0], fp8, LATENT_SCALE))
    )
