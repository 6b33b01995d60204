"""The self-check of ``python -m attn_ext``: every public op on every local device, at float32
and bfloat16, forward and backward, against a float64 ground truth computed on the same (rounded)
inputs. A check passes when attn_ext's max abs error is at most twice the error of the plain
PyTorch reference run at the input dtype (FlashAttention's rule), plus a floor of a few float32
ulps. The references are the suite's own (:mod:`attn_ext.testing.attention` and the other family
modules); this module only declares the cases and runs them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

import attn_ext
from attn_ext.testing.attention import (
    attention_reference,
    attention_varlen_reference,
    attention_weights_reference,
    paged_varlen_kv,
    sdpa_reference,
)
from attn_ext.testing.decoding import ROPE_SCALING_EXAMPLES, decode_reference, rope_reference
from attn_ext.testing.harness import unverified_cuda
from attn_ext.testing.linear import linear_attention_quadratic
from attn_ext.testing.spatial import cbam_spatial, channel_pool, spatial_gate
from attn_ext.testing.tpa import tpa_decode_reference, tpa_expand_reference

NEG_INF = float("-inf")
CHECK_DTYPES = (torch.float32, torch.bfloat16)
# Flash-style kernels recompute probabilities from the float32 lse and take the softmax
# backward's row term from the rounded output; in float32 that costs a few ulps that the
# materializing reference does not pay, so the tolerance has a floor of this many float32
# ulps at the result's magnitude (negligible next to the reference's bfloat16 error).
ACC_ULPS = 4


# --------------------------------------------------------------------------- checks


@dataclass
class Case:
    """One check: inputs, the attn_ext call and the same math written plainly.

    ``make`` returns float64 tensors by name; ``grads`` names those that get a
    gradient. ``ext`` and ``ref`` take the inputs as keyword arguments and
    return a tuple of outputs; the loss for backward uses the first one only.
    ``truth`` (default ``ref``) is the float64 ground truth.
    """

    name: str
    make: Callable[[torch.device], Dict[str, torch.Tensor]]
    ext: Callable[..., Tuple[torch.Tensor, ...]]
    ref: Callable[..., Tuple[torch.Tensor, ...]]
    grads: Tuple[str, ...] = ("q", "k", "v")
    truth: Optional[Callable[..., Tuple[torch.Tensor, ...]]] = None
    devices: Tuple[str, ...] = ("cpu", "cuda")  # device types the op supports


def randn(*shape, device):
    return torch.randn(*shape, device=device, dtype=torch.float64)


def qkv(b=2, h=4, hkv=None, sq=37, sk=53, d=64, dv=None, device="cpu"):
    hkv, dv = hkv or h, dv or d
    return {
        "q": randn(b, h, sq, d, device=device),
        "k": randn(b, hkv, sk, d, device=device),
        "v": randn(b, hkv, sk, dv, device=device),
    }


def strided_qkv(device, b=2, h=4, s=45, d=64):
    """(B, S, H, D).transpose(1, 2) views: last dim contiguous, heads strided."""
    return {n: randn(b, s, h, d, device=device).transpose(1, 2) for n in ("q", "k", "v")}


def with_mask(inputs, mask_fn):
    q, k = inputs["q"], inputs["k"]
    inputs["attn_mask"] = mask_fn(q.shape[0], q.shape[-3], q.shape[-2], k.shape[-2], q.device)
    return inputs


def bool_mask(b, h, sq, sk, device):
    m = torch.rand(b, 1, sq, sk, device=device) < 0.7
    m[..., 0] = True  # no empty rows, so torch's SDPA (NaN there) is a fair ground truth
    return m


def float_mask(b, h, sq, sk, device):
    m = torch.randn(1, h, sq, sk, device=device, dtype=torch.float64)
    return m.masked_fill(torch.rand(1, h, sq, sk, device=device) < 0.2, NEG_INF).index_fill(
        -1, torch.tensor([0], device=device), 0.0
    )


def attention_case(name, make, grads=("q", "k", "v"), **opts):
    """attn_ext.attention(q, k, v, **opts) against attention_reference."""

    def ref(q, k, v, attn_mask=None):
        return (attention_reference(q, k, v, attn_mask=attn_mask, **opts),)

    def ext(q, k, v, attn_mask=None):
        return (attn_ext.attention(q, k, v, attn_mask=attn_mask, **opts),)

    return Case(name, make, ext, ref, grads)


def _modifier_inputs(dev):
    """The modifier cases' inputs: GQA 8/2 and a sink logit per head."""
    inputs = qkv(h=8, hkv=2, device=dev)
    inputs["sinks"] = randn(8, device=dev)
    return inputs


def _modifiers(q, sinks, slopes_dtype=None):
    """The modifier cases' keywords: causal, softcap 4, ALiBi slopes (B = 2, H = 8), sinks."""
    slopes = torch.linspace(0.05, 0.4, 2 * 8, device=q.device).view(2, 8)
    slopes = slopes if slopes_dtype is None else slopes.to(slopes_dtype)
    return dict(causal=True, softcap=4.0, alibi_slopes=slopes, sinks=sinks)


def modifiers_case():
    """softcap, ALiBi (B, H) and attention sinks (with their gradient), GQA, causal."""

    def ref(q, k, v, sinks):
        return (attention_reference(q, k, v, **_modifiers(q, sinks)),)

    def ext(q, k, v, sinks):
        with unverified_cuda():
            return (attn_ext.attention(q, k, v, **_modifiers(q, sinks, torch.float32)),)

    return Case(
        "attention softcap + ALiBi + sinks",
        _modifier_inputs,
        ext,
        ref,
        grads=("q", "k", "v", "sinks"),
    )


def weights_modifiers_case():
    """attention_with_weights' per-head weights and output with softcap, ALiBi (B, H) and sinks
    (rows summing to one less the sink's share), GQA, causal; gradients of q, k and the sinks
    through both."""

    def ref(q, k, v, sinks):
        kw = _modifiers(q, sinks)
        return attention_weights_reference(q, k, **kw), attention_reference(q, k, v, **kw)

    def ext(q, k, v, sinks):
        with unverified_cuda():
            out, w = attn_ext.attention_with_weights(q, k, v, **_modifiers(q, sinks, torch.float32))
            return w, out

    return Case(
        "attention_with_weights softcap + ALiBi + sinks",
        _modifier_inputs,
        ext,
        ref,
        grads=("q", "k", "sinks"),
    )


VARLEN_LENGTHS = (37, 0, 1, 90, 12)


def _varlen_inputs(dev):
    total = sum(VARLEN_LENGTHS)
    cu = torch.tensor([0, *torch.tensor(VARLEN_LENGTHS).cumsum(0).tolist()], device=dev)
    return {
        "q": randn(total, 8, 64, device=dev),
        "k": randn(total, 2, 64, device=dev),
        "v": randn(total, 2, 64, device=dev),
        "cu": cu.to(torch.int32),
    }


def _varlen_ref(q, k, v, cu):
    return (attention_varlen_reference(q, k, v, cu, cu, causal=True, window_size=(24, 0)),)


def varlen_case():
    """attention_varlen against the per-sequence reference: empty and one-token sequences."""
    make, ref = _varlen_inputs, _varlen_ref

    def ext(q, k, v, cu):
        longest = max(VARLEN_LENGTHS)
        with unverified_cuda():
            out = attn_ext.attention_varlen(
                q, k, v, cu, cu, longest, longest, causal=True, window_size=(24, 0)
            )
        return (out,)

    return Case("attention_varlen GQA causal window, lengths 0-90", make, ext, ref)


VARLEN_PAGE_SIZE = 16


def paged_varlen_case():
    """The same batch with its keys in shuffled 16-row pages (a view of heads-first pages),
    read in place through a block table: CPU, forward."""

    def ext(q, k, v, cu):
        longest = max(VARLEN_LENGTHS)
        k_pages, v_pages, table = paged_varlen_kv(
            k, v, list(VARLEN_LENGTHS), VARLEN_PAGE_SIZE, layout="heads_first"
        )
        out = attn_ext.attention_varlen(
            q, k_pages, v_pages, cu, cu, longest, longest, causal=True, window_size=(24, 0),
            block_table=table,
        )  # fmt: skip
        return (out,)

    return Case(
        "attention_varlen paged keys (16-row pages), GQA causal window",
        _varlen_inputs,
        ext,
        _varlen_ref,
        grads=(),
        devices=("cpu",),
    )


def lse_case():
    def ref(q, k, v):
        return attention_reference(q, k, v, causal=True, return_lse=True)

    def ext(q, k, v):
        return tuple(attn_ext.attention(q, k, v, causal=True, return_lse=True))

    return Case(
        "attention return_lse causal Sq>Sk", lambda dev: qkv(sq=40, sk=24, device=dev), ext, ref
    )


def dropout_case():
    p, seed, shape = 0.2, 1234, dict(b=2, h=4, sq=37, sk=53)

    def make(dev):
        inputs = qkv(device=dev, **shape)
        keep = attn_ext.dropout_keep_mask(
            2, 4, 37, 53, p, generator=torch.Generator().manual_seed(seed)
        )
        inputs["dropout_keep"] = keep.to(dev)
        return inputs

    def ref(q, k, v, dropout_keep):
        return (attention_reference(q, k, v, dropout_keep=dropout_keep, dropout_p=p),)

    def ext(q, k, v, dropout_keep):
        g = torch.Generator().manual_seed(seed)
        return (attn_ext.attention(q, k, v, dropout_p=p, generator=g),)

    return Case(f"attention dropout p={p} vs dropout_keep_mask", make, ext, ref)


def sdpa_case(name, make, **opts):
    """attn_ext.scaled_dot_product_attention against torch's own in float64."""

    def ref(q, k, v, attn_mask=None):
        return (sdpa_reference(q, k, v, attn_mask=attn_mask, **opts),)

    def truth(q, k, v, attn_mask=None):
        return (F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **opts),)

    def ext(q, k, v, attn_mask=None):
        return (attn_ext.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **opts),)

    return Case(name, make, ext, ref, truth=truth)


def weights_case(name, make, **opts):
    def ref(q, k, v=None, attn_mask=None):
        return (attention_weights_reference(q, k, attn_mask=attn_mask, **opts),)

    def ext(q, k, v=None, attn_mask=None):
        return (attn_ext.attention_weights(q, k, attn_mask=attn_mask, **opts),)

    return Case(name, make, ext, ref, grads=("q", "k"))


def with_weights_case(name, make, **opts):
    """attention_with_weights' mean over heads (first: the backward runs through it) and out."""

    def ref(q, k, v, attn_mask=None):
        w = attention_weights_reference(q, k, attn_mask=attn_mask, **opts)
        return w.mean(1), attention_reference(q, k, v, attn_mask=attn_mask, **opts)

    def ext(q, k, v, attn_mask=None):
        out, w = attn_ext.attention_with_weights(
            q, k, v, attn_mask=attn_mask, mean_heads=True, **opts
        )
        return w, out

    return Case(name, make, ext, ref, grads=("q", "k"))


def rope_case(interleaved):
    def make(dev):
        return {
            "x": randn(2, 4, 37, 64, device=dev).transpose(1, 2).contiguous().transpose(1, 2),
            "positions": torch.randint(0, 8192, (2, 37), device=dev),
        }

    def ext(x, positions):
        return (attn_ext.rope(x, positions=positions, interleaved=interleaved),)

    def ref(x, positions):
        return (rope_reference(x, positions=positions, interleaved=interleaved),)

    def truth(x, positions):
        return (
            rope_reference(
                x, positions=positions, interleaved=interleaved, compute_dtype=torch.float64
            ),
        )

    layout = "pairs (2i, 2i+1)" if interleaved else "halves (LLaMA)"
    return Case(f"rope {layout}, positions < 8192", make, ext, ref, grads=("x",), truth=truth)


def scaled_rope_case():
    """rope with Llama 3.1's frequencies and YaRN's cos / sin factor (attn_ext.rope_parameters),
    against the reference with the same table and factor."""
    inv, _ = attn_ext.rope_parameters(64, 500000.0, ROPE_SCALING_EXAMPLES["llama3"])
    scaling = 1.25

    def make(dev):
        positions = torch.randint(0, 100_000, (2, 37), device=dev)
        return {"x": randn(2, 4, 37, 64, device=dev), "positions": positions}

    def kw(x):
        return dict(base=500000.0, inv_freq=inv.to(x.device), attention_scaling=scaling)

    def ext(x, positions):
        with unverified_cuda():  # compiled, not yet run on a GPU
            return (attn_ext.rope(x, positions=positions, **kw(x)),)

    def ref(x, positions):
        return (rope_reference(x, positions=positions, **kw(x)),)

    def truth(x, positions):
        return (rope_reference(x, positions=positions, compute_dtype=torch.float64, **kw(x)),)

    # no gradient here: on CUDA the backward would run outside the opt-in (tests cover it)
    name = "rope, Llama 3.1 frequencies x 1.25, positions < 100k"
    return Case(name, make, ext, ref, grads=(), truth=truth)


def decode_case(name, h=8, hkv=2, sq=1, lengths=(300, 57, 0), splits=0):
    def make(dev):
        b, cap = len(lengths), max(lengths) + 5
        return {
            "q": randn(b, h, sq, 64, device=dev),
            "k_cache": randn(b, hkv, cap, 64, device=dev),
            "v_cache": randn(b, hkv, cap, 64, device=dev),
            "lengths": torch.tensor(lengths, dtype=torch.int32, device=dev),
        }

    def ext(q, k_cache, v_cache, lengths):
        return tuple(
            attn_ext.decode_attention(
                q, k_cache, v_cache, lengths, num_splits=splits, return_lse=True
            )
        )

    def ref(q, k_cache, v_cache, lengths):
        return decode_reference(q, k_cache, v_cache, lengths)

    return Case(name, make, ext, ref, grads=())


def float8_decode_case(fmt: torch.dtype):
    """decode_attention over a float8 cache: the inputs hold float8 values times power-of-two
    scales (exact in every checked dtype), quantized without loss inside ``ext``; the reference
    attends to those values."""
    k_scale, v_scale = 2.0**-4, 2.0**-6
    lengths = (300, 57, 0)

    def as_float8_values(t, scale):
        big = torch.finfo(fmt).max
        return (t * 4 / scale).clamp(-big, big).to(fmt).double() * scale

    def make(dev):
        b, cap = len(lengths), max(lengths) + 5
        return {
            "q": randn(b, 8, 1, 64, device=dev),
            "k_cache": as_float8_values(randn(b, 2, cap, 64, device=dev), k_scale),
            "v_cache": as_float8_values(randn(b, 2, cap, 64, device=dev), v_scale),
            "lengths": torch.tensor(lengths, dtype=torch.int32, device=dev),
        }

    def ext(q, k_cache, v_cache, lengths):
        kc, vc = ((t.double() / s).to(fmt) for t, s in ((k_cache, k_scale), (v_cache, v_scale)))
        out = attn_ext.decode_attention(
            q, kc, vc, lengths, k_scale=k_scale, v_scale=v_scale, return_lse=True
        )
        return tuple(out)

    def ref(q, k_cache, v_cache, lengths):
        return decode_reference(q, k_cache, v_cache, lengths)

    name = f"decode_attention {str(fmt).replace('torch.', '')} cache, GQA 8/2"
    return Case(name, make, ext, ref, grads=(), devices=("cpu",))


def mla_decode_case():
    """The absorbed MLA step: 16 query heads on one 576-wide latent head whose values are the
    first 512 columns of the same cache (a strided view), scale 1/sqrt(128 + 64)."""
    scale = 1.0 / math.sqrt(192)

    def make(dev):
        cache = randn(2, 1, 305, 576, device=dev)
        return {
            "q": randn(2, 16, 1, 576, device=dev),
            "k_cache": cache,
            "v_cache": cache[..., :512],
            "lengths": torch.tensor([300, 41], dtype=torch.int32, device=dev),
        }

    def ext(q, k_cache, v_cache, lengths):
        return (attn_ext.decode_attention(q, k_cache, k_cache[..., :512], lengths, scale=scale),)

    def ref(q, k_cache, v_cache, lengths):
        return (decode_reference(q, k_cache, v_cache, lengths, scale=scale, causal=False)[0],)

    return Case(
        "decode_attention MLA absorbed (576-wide latent, 512-col value view)",
        make,
        ext,
        ref,
        grads=(),
    )


def tpa_expand_case(rope):
    def make(dev):
        return {
            "a": randn(2, 29, 6, 16, device=dev),
            "b": randn(2, 6, 29, 64, device=dev).transpose(1, 2),
            "positions": torch.randint(0, 8192, (2, 29), device=dev),
        }

    def ext(a, b, positions):
        return (
            attn_ext.tpa_expand(
                a, b, positions=positions if rope else None, rope=rope, rope_interleaved=False
            ),
        )

    def plain(a, b, positions, exact):
        return (
            tpa_expand_reference(
                a, b, positions=positions, rope=rope, compute_dtype=torch.float64 if exact else None
            ),
        )

    name = "tpa_expand (1/R) sum a_r x b_r" + (", RoPE on b" if rope else "")
    return Case(
        name,
        make,
        ext,
        lambda **t: plain(**t, exact=False),
        grads=("a", "b"),
        truth=lambda **t: plain(**t, exact=True),
    )


def tpa_decode_case():
    """Factor-cache attention against attention over the keys / values formed from the factors."""
    lengths = (300, 57, 0)

    def make(dev):
        b, n, h, d = len(lengths), max(lengths) + 5, 8, 64
        return {
            "q": randn(b, h, 2, d, device=dev),
            "a_k": randn(b, n, 2, h, device=dev),
            "b_k": randn(b, n, 2, d, device=dev),
            "a_v": randn(b, n, 3, h, device=dev),
            "b_v": randn(b, n, 3, d, device=dev),
            "lengths": torch.tensor(lengths, dtype=torch.int32, device=dev),
        }

    def ext(q, a_k, b_k, a_v, b_v, lengths):
        return tuple(attn_ext.tpa_decode_attention(q, a_k, b_k, a_v, b_v, lengths, return_lse=True))

    def ref(q, a_k, b_k, a_v, b_v, lengths):
        # the output at the inputs' dtype (as the op returns it); the lse in float32 or float64,
        # as the op returns it
        out, _ = tpa_decode_reference(q, a_k, b_k, a_v, b_v, lengths, compute_dtype=q.dtype)
        return out, tpa_decode_reference(q, a_k, b_k, a_v, b_v, lengths)[1]

    return Case(
        "tpa_decode_attention (factor cache, ranks 2/3, ragged lengths)",
        make,
        ext,
        ref,
        grads=("q", "a_k", "b_k", "a_v", "b_v"),
    )


def linear_case(causal):
    def ext(q, k, v):
        return (attn_ext.linear_attention(q, k, v, causal=causal),)

    def ref(q, k, v):
        return (linear_attention_quadratic(q, k, v, causal=causal),)

    name = "linear_attention " + ("causal (chunked)" if causal else "non-causal")
    return Case(name, lambda d: qkv(sq=150, sk=150, dv=48, device=d), ext, ref)


def spatial_cases() -> List[Case]:
    """CBAM's channel pooling and sigmoid gate (NCHW and channels-last), and the whole spatial
    gate x * sigmoid(conv7x7(pool(x)))."""

    def maps(device, channels_last=False, c=37):
        x = randn(2, c, 9, 11, device=device)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return {
            "x": x,
            "gate": randn(2, 1, 9, 11, device=device),
            "w": 0.2 * randn(1, 2, 7, 7, device=device),
        }

    def pool_ext(x, gate, w):
        return (attn_ext.channel_pool(x),)

    def pool_ref(x, gate, w):
        return (channel_pool(x),)

    def gate_ext(x, gate, w):
        return (attn_ext.spatial_gate(x, gate),)

    def gate_ref(x, gate, w):
        return (spatial_gate(x, gate),)

    def cbam_ext(x, gate, w):
        return (attn_ext.spatial_gate(x, F.conv2d(attn_ext.channel_pool(x), w, padding=3)),)

    def cbam_ref(x, gate, w):
        return (cbam_spatial(x, w),)

    return [
        Case("channel_pool (mean, max over C)", maps, pool_ext, pool_ref, grads=("x",)),
        Case(
            "channel_pool channels-last", lambda d: maps(d, True), pool_ext, pool_ref, grads=("x",)
        ),
        Case("spatial_gate x * sigmoid(gate)", maps, gate_ext, gate_ref, grads=("x", "gate")),
        Case(
            "spatial_gate channels-last",
            lambda d: maps(d, True),
            gate_ext,
            gate_ref,
            grads=("x", "gate"),
        ),
        Case(
            "CBAM spatial gate (pool, conv7x7, gate)",
            lambda d: maps(d, True, 64),
            cbam_ext,
            cbam_ref,
            grads=("x", "w"),
        ),
    ]


def all_cases() -> List[Case]:
    return [
        attention_case("attention", lambda d: qkv(device=d)),
        attention_case(
            "attention 3-D (B,S,D)", lambda d: {n: t[:, 0] for n, t in qkv(device=d).items()}
        ),
        attention_case("attention strided (B,S,H,D).transpose", strided_qkv),
        attention_case("attention Dv!=D, scale=0.3", lambda d: qkv(dv=32, device=d), scale=0.3),
        attention_case(
            "attention causal Sq<Sk", lambda d: qkv(sq=24, sk=53, device=d), causal=True
        ),
        attention_case(
            "attention causal Sq>Sk (empty rows)",
            lambda d: qkv(sq=40, sk=24, device=d),
            causal=True,
        ),
        attention_case("attention window (8, 4)", lambda d: qkv(device=d), window_size=(8, 4)),
        attention_case(
            "attention causal + window (16, 0)",
            lambda d: qkv(device=d),
            causal=True,
            window_size=(16, 0),
        ),
        attention_case("attention bool mask", lambda d: with_mask(qkv(device=d), bool_mask)),
        attention_case("attention float mask", lambda d: with_mask(qkv(device=d), float_mask)),
        attention_case(
            "attention GQA H=8 Hkv=2 causal", lambda d: qkv(h=8, hkv=2, device=d), causal=True
        ),
        attention_case("attention MQA H=4 Hkv=1", lambda d: qkv(h=4, hkv=1, device=d)),
        lse_case(),
        dropout_case(),
        modifiers_case(),
        varlen_case(),
        paged_varlen_case(),
        sdpa_case("sdpa", lambda d: qkv(device=d)),
        sdpa_case(
            "sdpa is_causal Sq<Sk (top-left)", lambda d: qkv(sq=24, sk=53, device=d), is_causal=True
        ),
        sdpa_case(
            "sdpa is_causal Sq>Sk (top-left)", lambda d: qkv(sq=40, sk=24, device=d), is_causal=True
        ),
        sdpa_case("sdpa bool mask", lambda d: with_mask(qkv(device=d), bool_mask)),
        sdpa_case(
            "sdpa float mask, scale=0.2", lambda d: with_mask(qkv(device=d), float_mask), scale=0.2
        ),
        sdpa_case(
            "sdpa enable_gqa H=8 Hkv=2", lambda d: qkv(h=8, hkv=2, device=d), enable_gqa=True
        ),
        weights_case("attention_weights", lambda d: qkv(device=d)),
        weights_case(
            "attention_weights causal Sq>Sk", lambda d: qkv(sq=40, sk=24, device=d), causal=True
        ),
        weights_case(
            "attention_weights window + bool mask",
            lambda d: with_mask(qkv(device=d), bool_mask),
            window_size=(8, 8),
        ),
        with_weights_case(
            "attention_with_weights mean over heads, GQA 8/2, causal",
            lambda d: qkv(h=8, hkv=2, device=d),
            causal=True,
        ),
        weights_modifiers_case(),
        rope_case(interleaved=True),
        rope_case(interleaved=False),
        scaled_rope_case(),
        decode_case("decode_attention GQA 8/2, ragged lengths"),
        decode_case(
            "decode_attention MQA, Sq=3, split-KV x4", h=4, hkv=1, sq=3, lengths=(700, 3), splits=4
        ),
        float8_decode_case(torch.float8_e4m3fn),
        float8_decode_case(torch.float8_e5m2),
        mla_decode_case(),
        tpa_expand_case(rope=False),
        tpa_expand_case(rope=True),
        tpa_decode_case(),
        linear_case(causal=False),
        linear_case(causal=True),
        *spatial_cases(),
    ]


def max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max abs difference; matching infinities count as equal, NaN as infinite."""
    got, want = got.double(), want.double()
    diff = (got - want).abs().masked_fill(got == want, 0.0)
    return float("inf") if diff.isnan().any() else diff.max().item() if diff.numel() else 0.0


def accumulation_floor(truth: torch.Tensor) -> float:
    """ACC_ULPS float32 ulps at the result's magnitude (kernels accumulate in float32)."""
    finite = truth.abs().masked_fill(truth.isinf(), 0)
    scale = max(1.0, finite.max().item() if finite.numel() else 0.0)
    return ACC_ULPS * torch.finfo(torch.float32).eps * scale


def forward_backward(fn, inputs, grads, grad_out):
    """Runs fn on leaf copies of the inputs; returns (outputs, input grads)."""
    leaves = {n: (t.detach().requires_grad_() if n in grads else t) for n, t in inputs.items()}
    outs = fn(**leaves)
    if not grads:  # inference-only ops (decode)
        return [o.detach() for o in outs], []
    gs = torch.autograd.grad(
        (outs[0] * grad_out.to(outs[0].dtype)).sum(), [leaves[n] for n in grads]
    )
    return [o.detach() for o in outs], list(gs)


def cast_inputs(inputs, dtype):
    """Floating tensors to dtype, keeping their (possibly non-contiguous) strides."""
    return {n: t.to(dtype) if t.is_floating_point() else t for n, t in inputs.items()}


@dataclass
class CheckResult:
    name: str
    device: str
    dtype: str
    errors: Dict[str, Tuple[float, float]] = field(default_factory=dict)  # what -> (ext err, tol)
    exception: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.exception is None and all(e <= tol for e, tol in self.errors.values())


def run_case(case: Case, device: torch.device, dtype: torch.dtype) -> CheckResult:
    res = CheckResult(case.name, str(device), str(dtype).replace("torch.", ""))
    torch.manual_seed(0)
    try:
        low = cast_inputs(case.make(device), dtype)
        exact = cast_inputs(low, torch.float64)  # ground truth sees the rounded inputs
        out_probe = case.ref(**exact)[0]
        grad_out = (
            torch.randn(out_probe.shape, device=device, dtype=torch.float64).to(dtype).double()
        )
        want, want_g = forward_backward(case.truth or case.ref, exact, case.grads, grad_out)
        base, base_g = forward_backward(case.ref, low, case.grads, grad_out)
        got, got_g = forward_backward(case.ext, low, case.grads, grad_out)
    except Exception as e:  # a crash is a failed check, reported with its message
        res.exception = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return res
    labels = ["out", "lse"][: len(want)] + [f"d{n}" for n in case.grads]
    for label, g, b, w in zip(labels, got + got_g, base + base_g, want + want_g):
        tol = 2 * max_error(b, w) + accumulation_floor(w)
        if g.shape != w.shape:
            res.exception = f"{label}: shape {tuple(g.shape)}, expected {tuple(w.shape)}"
            return res
        if g.dtype != b.dtype and label != "lse":
            res.exception = f"{label}: dtype {g.dtype}, expected {b.dtype}"
            return res
        res.errors[label] = (max_error(g, w), tol)
    return res


def format_result(r: CheckResult) -> str:
    head = f"{'PASS' if r.ok else 'FAIL'}  {r.device:4s} {r.dtype:8s} {r.name:42s}"
    if r.exception:
        return f"{head} {r.exception}"
    fwd = [k for k in r.errors if not k.startswith("d")]
    bwd = [k for k in r.errors if k.startswith("d")]
    part = lambda keys: " ".join(f"{k} {r.errors[k][0]:.1e}" for k in keys)  # noqa: E731
    worst = max(e / tol if tol else 0.0 for e, tol in r.errors.values())
    return f"{head} {part(fwd)} | {part(bwd)} | err/tol {worst:.2f}"


def run_checks(devices: Sequence[torch.device], verbose: bool) -> bool:
    print(
        "\nchecks: max abs error vs float64 ground truth; "
        f"tol = 2 x (plain torch reference at the same dtype) + {ACC_ULPS} float32 ulps"
    )
    results = []
    for device in devices:
        for dtype in CHECK_DTYPES:
            for case in all_cases():
                if device.type not in case.devices:
                    continue
                r = run_case(case, device, dtype)
                results.append(r)
                if verbose or not r.ok:
                    print(format_result(r))
    failed = [r for r in results if not r.ok]
    print(
        f"{len(results) - len(failed)}/{len(results)} checks passed"
        + ("" if verbose else " (run with -v to list each)")
    )
    return not failed
