"""Shapes past 2^31 elements (issue 24, item 3): every offset a kernel forms must be 64-bit.

Each test puts the data a kernel must find *beyond* element 2^31 of a tensor (or of a product
like B*H*S*D or Sq*Sk) and checks the answer there: a 32-bit offset would wrap and read or
write the wrong rows. bf16 with small heads keeps each test within ~10 GiB; the answers are
known in closed form or come from the reference run on a small slice.

Opt-in (each test allocates 4-10 GiB and runs for seconds to minutes on 2 cores):
``ATTN_EXT_HUGE_TESTS=1 python -m pytest tests/test_huge_shapes.py``. CPU only for now: the
same shapes on a GPU are the next GPU session's (dev/gpu_notes.md).
"""

import math
import os

import pytest
import torch

import attn_ext
from attn_ext.testing.attention import attention_reference
from attn_ext.testing.decoding import rope_reference

pytestmark = pytest.mark.skipif(
    os.environ.get("ATTN_EXT_HUGE_TESTS") != "1",
    reason="set ATTN_EXT_HUGE_TESTS=1: tensors past 2^31 elements (4-10 GiB each test)",
)

INT32_LIMIT = 2**31
BF16 = torch.bfloat16
# bf16 outputs: one rounding of a value in [0, 1] (8 bits of mantissa) plus float32 sums.
BF16_TOL = dict(rtol=2**-7, atol=2**-7)


def past_int32(*shape):
    n = math.prod(shape)
    assert n > INT32_LIMIT, (shape, n)
    return shape


def spike_keys(n_keys, dim, logit):
    """Keys and values that are zero except the last row: q = e_0 then scores 0 for every key
    but the last (score `logit`), whose value row is all ones. out = p, lse = log(n-1+e^L)."""
    k = torch.zeros(*past_int32(1, 1, n_keys, dim), dtype=BF16)
    v = torch.zeros(1, 1, n_keys, dim, dtype=BF16)
    k[0, 0, -1, 0] = logit
    v[0, 0, -1] = 1
    p = math.exp(logit) / (n_keys - 1 + math.exp(logit))
    return k, v, p, math.log(n_keys - 1 + math.exp(logit))


def test_attention_keys_past_int32():
    d, logit = 16, 20.0
    n = INT32_LIMIT // d + 17
    k, v, p, lse_want = spike_keys(n, d, logit)
    q = torch.zeros(1, 1, 1, d, dtype=BF16)
    q[..., 0] = 1
    out, lse = attn_ext.attention(q, k, v, scale=1.0, return_lse=True)
    torch.testing.assert_close(out.float(), torch.full_like(out.float(), p), **BF16_TOL)
    torch.testing.assert_close(
        lse.double(), torch.full_like(lse.double(), lse_want), rtol=1e-6, atol=0
    )


def test_attention_heads_past_int32():
    # B * H * Sq * D past 2^31 in q and out (grouped heads: k and v stay small).
    b, h, sq, sk, d = 2, 2**16, 1025, 16, 16
    q = torch.randn(*past_int32(b, h, sq, d), dtype=BF16)
    k, v = (torch.randn(b, 1, sk, d, dtype=BF16) for _ in range(2))
    out, lse = attn_ext.attention(q, k, v, causal=True, return_lse=True)
    for bi, hi in ((0, 0), (b - 1, h - 1), (b - 1, h // 2)):
        want, want_lse = attention_reference(
            q[bi : bi + 1, hi : hi + 1].double(),
            k[bi : bi + 1].double(),
            v[bi : bi + 1].double(),
            causal=True,
            return_lse=True,
        )
        torch.testing.assert_close(out[bi, hi].double(), want[0, 0], **BF16_TOL)
        torch.testing.assert_close(lse[bi, hi].double(), want_lse[0, 0], rtol=1e-5, atol=1e-5)


def test_attention_mask_past_int32():
    # Sq * Sk past 2^31 in a bool mask, read through its strides. (attention_weights' output
    # has that size too, but it is an ATen composite whose float32 intermediates need ~21 GiB
    # at this size: its offsets are ATen's.)
    sq, sk, d = 2**16, 2**15 + 16, 8
    q = torch.randn(1, 1, sq, d, dtype=BF16)
    k, v = (torch.randn(1, 1, sk, d, dtype=BF16) for _ in range(2))
    mask = torch.ones(*past_int32(1, 1, sq, sk), dtype=torch.bool)
    mask[0, 0, -1, : sk - 3] = False  # the last row sees its last three keys only
    out = attn_ext.attention(q, k, v, attn_mask=mask)
    want = attention_reference(
        q[:, :, -2:].double(), k.double(), v.double(), attn_mask=mask[:, :, -2:]
    )
    torch.testing.assert_close(out[:, :, -2:].double(), want, **BF16_TOL)


def test_kv_cache_append_and_decode_past_int32():
    # The cache's B * Hkv * L * D past 2^31: append at its last rows, then decode all of it.
    d, logit = 16, 20.0
    length = INT32_LIMIT // (2 * d) + 8
    k_cache = torch.zeros(*past_int32(2, 1, length, d), dtype=BF16)
    v_cache = torch.zeros(2, 1, length, d, dtype=BF16)
    seqlens = torch.tensor([3, length - 1], dtype=torch.int32)
    k_new = torch.zeros(2, 1, 1, d, dtype=BF16)
    k_new[1, 0, 0, 0] = logit
    v_new = torch.zeros(2, 1, 1, d, dtype=BF16)
    v_new[1] = 1
    torch.ops.attn_ext.kv_cache_append(k_cache, v_cache, seqlens, k_new, v_new)
    assert seqlens.tolist() == [4, length]
    assert torch.equal(k_cache[1, 0, -1], k_new[1, 0, 0]) and torch.equal(
        v_cache[1, 0, -1], v_new[1, 0, 0]
    )
    assert not k_cache[1, 0, :-1].any(), "a write landed outside the appended row"
    q = torch.zeros(2, 4, 1, d, dtype=BF16)
    q[..., 0] = 1
    out, lse = attn_ext.decode_attention(q, k_cache, v_cache, seqlens, scale=1.0, return_lse=True)
    p = math.exp(logit) / (length - 1 + math.exp(logit))
    torch.testing.assert_close(out[1].float(), torch.full_like(out[1].float(), p), **BF16_TOL)
    torch.testing.assert_close(
        lse[1].double(),
        torch.full_like(lse[1].double(), math.log(length - 1 + math.exp(logit))),
        rtol=1e-6,
        atol=0,
    )
    assert not out[0].any()  # sequence 0: four zero keys and values


def test_rope_past_int32():
    s, d = INT32_LIMIT // 16 + 5, 16
    x = torch.randn(*past_int32(1, 1, s, d), dtype=BF16)
    positions = torch.arange(s) % 4096
    y = attn_ext.rope(x, positions=positions)
    for rows in (slice(0, 4), slice(s - 4, s)):
        want = rope_reference(x[:, :, rows].double(), positions=positions[rows])
        torch.testing.assert_close(y[:, :, rows].double(), want, **BF16_TOL)


def test_linear_attention_keys_past_int32():
    d, n = 16, INT32_LIMIT // 16 + 64
    k = torch.zeros(*past_int32(1, 1, n, d), dtype=BF16)
    v = torch.zeros(1, 1, n, d, dtype=BF16)
    k[0, 0, -1, 0] = 1
    v[0, 0, -1] = 2
    q = torch.rand(1, 1, 8, d, dtype=BF16) + 0.5  # relu(q) . z = q_0 > 0
    out = attn_ext.linear_attention(q, k, v, feature_map="relu", eps=1e-6)
    torch.testing.assert_close(out.float(), torch.full_like(out.float(), 2.0), **BF16_TOL)


def test_spatial_ops_past_int32():
    x = torch.randn(*past_int32(2, 17, 8192, 8192), dtype=BF16)
    pooled = attn_ext.channel_pool(x)
    torch.testing.assert_close(
        pooled[1, :, -1, -4:].float(),
        torch.stack([x[1, :, -1, -4:].float().mean(0), x[1, :, -1, -4:].float().max(0).values]),
        **BF16_TOL,
    )
    del pooled
    gate = torch.randn(2, 1, 8192, 8192, dtype=BF16)
    out = attn_ext.spatial_gate(x, gate)
    want = x[1, :, -1, -4:].float() * torch.sigmoid(gate[1, :, -1, -4:].float())
    torch.testing.assert_close(out[1, :, -1, -4:].float(), want, **BF16_TOL)


def test_tpa_expand_past_int32():
    s, r, h, d = INT32_LIMIT // 128 + 1, 1, 8, 16
    a = torch.randn(1, s, r, h, dtype=BF16)
    b = torch.randn(1, s, r, d, dtype=BF16)
    out = attn_ext.tpa_expand(a, b)
    assert out.shape == past_int32(1, s, h, d)
    want = torch.einsum("bsrh,bsrd->bshd", a[:, -3:].float(), b[:, -3:].float())
    torch.testing.assert_close(out[:, -3:].float(), want, **BF16_TOL)
