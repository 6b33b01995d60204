"""``python -m attn_ext``: environment report, self-check and a quick timing.

1. Prints the attn_ext and torch versions, the local devices, and which
   ``attn_ext::*`` operators have a kernel for CPU and for CUDA.
2. Checks every public function on every local device, at float32 and
   bfloat16, forward and backward, against a float64 ground truth computed on
   the same (rounded) inputs. A check passes when attn_ext's max abs error is
   at most twice the error of the plain PyTorch reference run at the input
   dtype (FlashAttention's rule), plus a floor of a few float32 ulps.
3. Checks every class and function of ``attn_ext.compat`` against its document's code
   (reproduced in :mod:`attn_ext.testing.documents`): both built with the same arguments,
   ours loaded strictly from the document's state dict, forward output and the gradients of
   every input and parameter compared in float64 (to the document in float64) and in float32
   (to the document in float64, within twice the document's own float32 error).
4. Times attn_ext against ``torch.nn.functional.scaled_dot_product_attention``
   at a moderate size, and the fused CBAM spatial gate against the same gate in plain torch,
   and prints the ratios.

Exit status is 1 when any check fails. ``--no-bench`` skips the timing,
``--device cpu`` restricts to one device.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

import attn_ext
from attn_ext.compat import attention_zoo, llms_from_scratch, textbook, torchcode
from attn_ext.testing import harness
from attn_ext.testing.documents import doc000, doc001, doc003, doc004, plain_state_dict, plain_to
from attn_ext.testing.spatial import cbam_spatial

NEG_INF = float("-inf")
CHECK_DTYPES = (torch.float32, torch.bfloat16)
# Flash-style kernels recompute probabilities from the float32 lse and take the softmax
# backward's row term from the rounded output; in float32 that costs a few ulps that the
# materializing reference does not pay, so the tolerance has a floor of this many float32
# ulps at the result's magnitude (negligible next to the reference's bfloat16 error).
ACC_ULPS = 4


# --------------------------------------------------------------------------- environment


def local_devices() -> List[torch.device]:
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.append(torch.device("cuda"))
    return devices


def print_environment(devices: Sequence[torch.device]) -> None:
    print(f"attn_ext {getattr(attn_ext, '__version__', 'unknown')}  ({attn_ext.__file__})")
    print(f"torch    {torch.__version__}  (CUDA build: {torch.version.cuda or 'no'})")
    for dev in devices:
        if dev.type == "cuda":
            for i in range(torch.cuda.device_count()):
                print(f"device   cuda:{i}  {torch.cuda.get_device_name(i)}")
        else:
            print(f"device   cpu  ({torch.get_num_threads()} threads, "
                  f"{attn_ext._C.cpu_block_kernels()} block products)")


def registered_ops() -> List[str]:
    return sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("attn_ext::"))


def print_ops() -> None:
    ops = registered_ops()
    if not ops:
        print("\nno attn_ext::* operators are registered (is attn_ext._C built?)")
        return
    width = max(len(op) for op in ops)
    print(f"\n{'operator'.ljust(width)}  CPU  CUDA")
    for op in ops:
        # computed: what the key runs, a CompositeExplicitAutograd kernel included
        has = [torch._C._dispatch_has_computed_kernel_for_dispatch_key(op, key)
               for key in ("CPU", "CUDA")]
        print(f"{op.ljust(width)}  " + "  ".join(("yes" if h else "-").ljust(4) for h in has))


# --------------------------------------------------------------------------- reference


def keep_mask(sq: int, sk: int, device, causal=False, window=(-1, -1), top_left=False):
    """Bool (Sq, Sk) mask of the keys each query may see (True = keep).

    attn_ext.attention aligns causal/window bottom-right (query i sits at key
    i + Sk - Sq); torch's SDPA aligns is_causal top-left.
    """
    i = torch.arange(sq, device=device).unsqueeze(1) + (0 if top_left else sk - sq)
    j = torch.arange(sk, device=device).unsqueeze(0)
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    keep = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    return keep


def reference_scores(q, k, *, scale=None, keep=None, attn_mask=None):
    """Scaled scores with -inf where masked, and which rows can see any key."""
    h, hkv = q.shape[-3] if q.dim() == 4 else 1, k.shape[-3] if k.dim() == 4 else 1
    if h != hkv:
        k = k.repeat_interleave(h // hkv, dim=-3)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        keep = attn_mask if keep is None else keep & attn_mask
    elif attn_mask is not None:
        scores = scores + attn_mask
    if keep is not None:
        scores = scores.masked_fill(~keep, NEG_INF)
    return scores, (scores != NEG_INF).any(dim=-1, keepdim=True)


def reference_weights(q, k, **kw):
    """softmax with fully masked rows set to zero (and zero gradient, no NaN)."""
    scores, has_key = reference_scores(q, k, **kw)
    weights = torch.softmax(scores.masked_fill(~has_key, 0.0), dim=-1)
    return weights * has_key


def reference_attention(q, k, v, *, dropout_keep=None, dropout_p=0.0, **kw):
    weights = reference_weights(q, k, **kw)
    if dropout_keep is not None:
        weights = weights * dropout_keep / (1.0 - dropout_p)
    h, hkv = weights.shape[-3] if weights.dim() == 4 else 1, v.shape[-3] if v.dim() == 4 else 1
    if h != hkv:
        v = v.repeat_interleave(h // hkv, dim=-3)
    return weights @ v


def reference_lse(q, k, **kw):
    scores, _ = reference_scores(q, k, **kw)
    return torch.logsumexp(scores.float() if scores.dtype != torch.float64 else scores, dim=-1)


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


def randn(*shape, device):
    return torch.randn(*shape, device=device, dtype=torch.float64)


def qkv(b=2, h=4, hkv=None, sq=37, sk=53, d=64, dv=None, device="cpu"):
    hkv, dv = hkv or h, dv or d
    return {"q": randn(b, h, sq, d, device=device), "k": randn(b, hkv, sk, d, device=device),
            "v": randn(b, hkv, sk, dv, device=device)}


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
        -1, torch.tensor([0], device=device), 0.0)


def attention_case(name, make, grads=("q", "k", "v"), **opts):
    """attn_ext.attention(q, k, v, **opts) against reference_attention."""
    causal, window = opts.get("causal", False), opts.get("window_size", (-1, -1))
    scale = opts.get("scale")

    def ref(q, k, v, attn_mask=None):
        keep = keep_mask(q.shape[-2], k.shape[-2], q.device, causal, window)
        return (reference_attention(q, k, v, scale=scale, keep=keep, attn_mask=attn_mask),)

    def ext(q, k, v, attn_mask=None):
        return (attn_ext.attention(q, k, v, attn_mask=attn_mask, **opts),)

    return Case(name, make, ext, ref, grads)


def lse_case():
    def ref(q, k, v):
        keep = keep_mask(q.shape[-2], k.shape[-2], q.device, causal=True)
        return (reference_attention(q, k, v, keep=keep), reference_lse(q, k, keep=keep))

    def ext(q, k, v):
        return tuple(attn_ext.attention(q, k, v, causal=True, return_lse=True))

    return Case("attention return_lse causal Sq>Sk", lambda dev: qkv(sq=40, sk=24, device=dev), ext, ref)


def dropout_case():
    p, seed, shape = 0.2, 1234, dict(b=2, h=4, sq=37, sk=53)

    def make(dev):
        inputs = qkv(device=dev, **shape)
        keep = attn_ext.dropout_keep_mask(2, 4, 37, 53, p, generator=torch.Generator().manual_seed(seed))
        inputs["dropout_keep"] = keep.to(dev)
        return inputs

    def ref(q, k, v, dropout_keep):
        return (reference_attention(q, k, v, dropout_keep=dropout_keep, dropout_p=p),)

    def ext(q, k, v, dropout_keep):
        g = torch.Generator().manual_seed(seed)
        return (attn_ext.attention(q, k, v, dropout_p=p, generator=g),)

    return Case(f"attention dropout p={p} vs dropout_keep_mask", make, ext, ref)


def sdpa_case(name, make, **opts):
    """attn_ext.scaled_dot_product_attention against torch's own in float64."""
    causal, scale = opts.get("is_causal", False), opts.get("scale")

    def ref(q, k, v, attn_mask=None):
        keep = keep_mask(q.shape[-2], k.shape[-2], q.device, causal, top_left=True)
        return (reference_attention(q, k, v, scale=scale, keep=keep, attn_mask=attn_mask),)

    def truth(q, k, v, attn_mask=None):
        return (F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **opts),)

    def ext(q, k, v, attn_mask=None):
        return (attn_ext.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **opts),)

    return Case(name, make, ext, ref, truth=truth)


def weights_case(name, make, **opts):
    causal, window = opts.get("causal", False), opts.get("window_size", (-1, -1))

    def ref(q, k, v=None, attn_mask=None):
        keep = keep_mask(q.shape[-2], k.shape[-2], q.device, causal, window)
        return (reference_weights(q, k, keep=keep, attn_mask=attn_mask),)

    def ext(q, k, v=None, attn_mask=None):
        return (attn_ext.attention_weights(q, k, attn_mask=attn_mask, **opts),)

    return Case(name, make, ext, ref, grads=("q", "k"))


def reference_rope(x, positions, interleaved, exact):
    """RoPE with fp32 angles. exact=False: the plain float32 way (torch's fp32 frequencies,
    cos/sin cast to x's dtype, as HuggingFace computes it); exact=True: the float64 truth from
    the correctly rounded fp32 frequencies attn_ext defines."""
    d = x.shape[-1]
    exponent = torch.arange(0, d, 2, device=x.device).float() / d
    inv = (1.0 / 10000.0 ** exponent.double()).float() if exact else 1.0 / (10000.0 ** exponent)
    ang = positions.float()[:, None, :, None] * inv  # (B, 1, S, D/2) float32
    dt = torch.float64 if exact else x.dtype
    cos, sin = (torch.cos(ang.double()) if exact else torch.cos(ang)).to(dt), \
        (torch.sin(ang.double()) if exact else torch.sin(ang)).to(dt)
    x = x.to(dt)
    if interleaved:
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)
    half = d // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * torch.cat([cos, cos], -1) + rotated * torch.cat([sin, sin], -1)


def rope_case(interleaved):
    def make(dev):
        return {"x": randn(2, 4, 37, 64, device=dev).transpose(1, 2).contiguous().transpose(1, 2),
                "positions": torch.randint(0, 8192, (2, 37), device=dev)}

    def ext(x, positions):
        return (attn_ext.rope(x, positions=positions, interleaved=interleaved),)

    def ref(x, positions):
        return (reference_rope(x, positions, interleaved, exact=False),)

    def truth(x, positions):
        return (reference_rope(x, positions, interleaved, exact=True),)

    layout = "pairs (2i, 2i+1)" if interleaved else "halves (LLaMA)"
    return Case(f"rope {layout}, positions < 8192", make, ext, ref, grads=("x",), truth=truth)


def decode_case(name, h=8, hkv=2, sq=1, lengths=(300, 57, 0), splits=0):
    def make(dev):
        b, cap = len(lengths), max(lengths) + 5
        return {"q": randn(b, h, sq, 64, device=dev), "k_cache": randn(b, hkv, cap, 64, device=dev),
                "v_cache": randn(b, hkv, cap, 64, device=dev),
                "lengths": torch.tensor(lengths, dtype=torch.int32, device=dev)}

    def ext(q, k_cache, v_cache, lengths):
        return tuple(attn_ext.decode_attention(q, k_cache, v_cache, lengths, num_splits=splits,
                                               return_lse=True))

    def ref(q, k_cache, v_cache, lengths):
        outs, lses = [], []
        for b, n in enumerate(lengths.tolist()):
            q_b, k_b, v_b = q[b:b + 1], k_cache[b:b + 1, :, :n], v_cache[b:b + 1, :, :n]
            keep = keep_mask(sq, n, q.device, causal=True)
            outs.append(reference_attention(q_b, k_b, v_b, keep=keep))
            lses.append(reference_lse(q_b, k_b, keep=keep))
        return torch.cat(outs), torch.cat(lses)

    return Case(name, make, ext, ref, grads=())


def mla_decode_case():
    """The absorbed MLA step: 16 query heads on one 576-wide latent head whose values are the
    first 512 columns of the same cache (a strided view), scale 1/sqrt(128 + 64)."""
    scale = 1.0 / math.sqrt(192)

    def make(dev):
        cache = randn(2, 1, 305, 576, device=dev)
        return {"q": randn(2, 16, 1, 576, device=dev), "k_cache": cache, "v_cache": cache[..., :512],
                "lengths": torch.tensor([300, 41], dtype=torch.int32, device=dev)}

    def ext(q, k_cache, v_cache, lengths):
        return (attn_ext.decode_attention(q, k_cache, k_cache[..., :512], lengths, scale=scale),)

    def ref(q, k_cache, v_cache, lengths):
        outs = []
        for b, n in enumerate(lengths.tolist()):
            q_b, k_b, v_b = q[b:b + 1], k_cache[b:b + 1, :, :n], v_cache[b:b + 1, :, :n]
            outs.append(reference_attention(q_b, k_b, v_b, scale=scale))
        return (torch.cat(outs),)

    return Case("decode_attention MLA absorbed (576-wide latent, 512-col value view)", make, ext, ref,
                grads=())


def tpa_expand_case(rope):
    def make(dev):
        return {"a": randn(2, 29, 6, 16, device=dev), "b": randn(2, 6, 29, 64, device=dev).transpose(1, 2),
                "positions": torch.randint(0, 8192, (2, 29), device=dev)}

    def ext(a, b, positions):
        return (attn_ext.tpa_expand(a, b, positions=positions if rope else None, rope=rope,
                                    rope_interleaved=False),)

    def plain(a, b, positions, exact):
        if rope:
            b = reference_rope(b.transpose(1, 2), positions, False, exact=exact).transpose(1, 2)
        return ((a.unsqueeze(-1) * b.unsqueeze(-2)).sum(2) / a.size(2),)

    name = "tpa_expand (1/R) sum a_r x b_r" + (", RoPE on b" if rope else "")
    return Case(name, make, ext, lambda **t: plain(**t, exact=False), grads=("a", "b"),
                truth=lambda **t: plain(**t, exact=True))


def tpa_decode_case():
    """Factor-cache attention against attention over the keys / values formed from the factors."""
    lengths = (300, 57, 0)

    def make(dev):
        b, n, h, d = len(lengths), max(lengths) + 5, 8, 64
        return {"q": randn(b, h, 2, d, device=dev), "a_k": randn(b, n, 2, h, device=dev),
                "b_k": randn(b, n, 2, d, device=dev), "a_v": randn(b, n, 3, h, device=dev),
                "b_v": randn(b, n, 3, d, device=dev),
                "lengths": torch.tensor(lengths, dtype=torch.int32, device=dev)}

    def ext(q, a_k, b_k, a_v, b_v, lengths):
        return tuple(attn_ext.tpa_decode_attention(q, a_k, b_k, a_v, b_v, lengths, return_lse=True))

    def ref(q, a_k, b_k, a_v, b_v, lengths):
        k = torch.einsum("bnrh,bnrd->bhnd", a_k, b_k) / a_k.size(2)
        v = torch.einsum("bnrh,bnrd->bhnd", a_v, b_v) / a_v.size(2)
        outs, lses = [], []
        for b, n in enumerate(lengths.tolist()):
            keep = keep_mask(q.size(2), n, q.device, causal=True)
            q_b, k_b, v_b = q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n]
            outs.append(reference_attention(q_b, k_b, v_b, keep=keep))
            lses.append(reference_lse(q_b, k_b, keep=keep))
        return torch.cat(outs), torch.cat(lses)

    return Case("tpa_decode_attention (factor cache, ranks 2/3, ragged lengths)", make, ext, ref,
                grads=("q", "a_k", "b_k", "a_v", "b_v"))


def reference_linear(q, k, v, causal, eps=1e-6):
    """Document 000's linear attention with phi = elu + 1; causal as the masked quadratic form."""
    fq, fk = F.elu(q) + 1, F.elu(k) + 1
    if not causal:
        return (fq @ (fk.transpose(-1, -2) @ v)) / (fq @ fk.sum(-2, keepdim=True).transpose(-1, -2) + eps)
    w = (fq @ fk.transpose(-1, -2)).tril()
    return (w @ v) / (w.sum(-1, keepdim=True) + eps)


def linear_case(causal):
    def ext(q, k, v):
        return (attn_ext.linear_attention(q, k, v, causal=causal),)

    def ref(q, k, v):
        return (reference_linear(q, k, v, causal),)

    name = "linear_attention " + ("causal (chunked)" if causal else "non-causal")
    return Case(name, lambda d: qkv(sq=150, sk=150, dv=48, device=d), ext, ref)


def reference_channel_pool(x):
    return torch.cat([x.mean(dim=1, keepdim=True), torch.max(x, dim=1, keepdim=True).values], dim=1)


def spatial_cases() -> List[Case]:
    """CBAM's channel pooling and sigmoid gate (NCHW and channels-last), and the whole spatial
    gate x * sigmoid(conv7x7(pool(x)))."""
    def maps(device, channels_last=False, c=37):
        x = randn(2, c, 9, 11, device=device)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return {"x": x, "gate": randn(2, 1, 9, 11, device=device), "w": 0.2 * randn(1, 2, 7, 7, device=device)}

    def pool_ext(x, gate, w):
        return (attn_ext.channel_pool(x),)

    def pool_ref(x, gate, w):
        return (reference_channel_pool(x),)

    def gate_ext(x, gate, w):
        return (attn_ext.spatial_gate(x, gate),)

    def gate_ref(x, gate, w):
        return (x * torch.sigmoid(gate),)

    def cbam_ext(x, gate, w):
        return (attn_ext.spatial_gate(x, F.conv2d(attn_ext.channel_pool(x), w, padding=3)),)

    def cbam_ref(x, gate, w):
        return (x * torch.sigmoid(F.conv2d(reference_channel_pool(x), w, padding=3)),)

    return [
        Case("channel_pool (mean, max over C)", maps, pool_ext, pool_ref, grads=("x",)),
        Case("channel_pool channels-last", lambda d: maps(d, True), pool_ext, pool_ref, grads=("x",)),
        Case("spatial_gate x * sigmoid(gate)", maps, gate_ext, gate_ref, grads=("x", "gate")),
        Case("spatial_gate channels-last", lambda d: maps(d, True), gate_ext, gate_ref, grads=("x", "gate")),
        Case("CBAM spatial gate (pool, conv7x7, gate)", lambda d: maps(d, True, 64), cbam_ext, cbam_ref,
             grads=("x", "w")),
    ]


def all_cases() -> List[Case]:
    return [
        attention_case("attention", lambda d: qkv(device=d)),
        attention_case("attention 3-D (B,S,D)", lambda d: {n: t[:, 0] for n, t in qkv(device=d).items()}),
        attention_case("attention strided (B,S,H,D).transpose", strided_qkv),
        attention_case("attention Dv!=D, scale=0.3", lambda d: qkv(dv=32, device=d), scale=0.3),
        attention_case("attention causal Sq<Sk", lambda d: qkv(sq=24, sk=53, device=d), causal=True),
        attention_case("attention causal Sq>Sk (empty rows)", lambda d: qkv(sq=40, sk=24, device=d), causal=True),
        attention_case("attention window (8, 4)", lambda d: qkv(device=d), window_size=(8, 4)),
        attention_case("attention causal + window (16, 0)", lambda d: qkv(device=d), causal=True, window_size=(16, 0)),
        attention_case("attention bool mask", lambda d: with_mask(qkv(device=d), bool_mask)),
        attention_case("attention float mask", lambda d: with_mask(qkv(device=d), float_mask)),
        attention_case("attention GQA H=8 Hkv=2 causal", lambda d: qkv(h=8, hkv=2, device=d), causal=True),
        attention_case("attention MQA H=4 Hkv=1", lambda d: qkv(h=4, hkv=1, device=d)),
        lse_case(),
        dropout_case(),
        sdpa_case("sdpa", lambda d: qkv(device=d)),
        sdpa_case("sdpa is_causal Sq<Sk (top-left)", lambda d: qkv(sq=24, sk=53, device=d), is_causal=True),
        sdpa_case("sdpa is_causal Sq>Sk (top-left)", lambda d: qkv(sq=40, sk=24, device=d), is_causal=True),
        sdpa_case("sdpa bool mask", lambda d: with_mask(qkv(device=d), bool_mask)),
        sdpa_case("sdpa float mask, scale=0.2", lambda d: with_mask(qkv(device=d), float_mask), scale=0.2),
        sdpa_case("sdpa enable_gqa H=8 Hkv=2", lambda d: qkv(h=8, hkv=2, device=d), enable_gqa=True),
        weights_case("attention_weights", lambda d: qkv(device=d)),
        weights_case("attention_weights causal Sq>Sk", lambda d: qkv(sq=40, sk=24, device=d), causal=True),
        weights_case("attention_weights window + bool mask", lambda d: with_mask(qkv(device=d), bool_mask),
                     window_size=(8, 8)),
        rope_case(interleaved=True),
        rope_case(interleaved=False),
        decode_case("decode_attention GQA 8/2, ragged lengths"),
        decode_case("decode_attention MQA, Sq=3, split-KV x4", h=4, hkv=1, sq=3, lengths=(700, 3), splits=4),
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
    gs = torch.autograd.grad((outs[0] * grad_out.to(outs[0].dtype)).sum(), [leaves[n] for n in grads])
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
        grad_out = torch.randn(out_probe.shape, device=device, dtype=torch.float64).to(dtype).double()
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
    print("\nchecks: max abs error vs float64 ground truth; "
          f"tol = 2 x (plain torch reference at the same dtype) + {ACC_ULPS} float32 ulps")
    results = []
    for device in devices:
        for dtype in CHECK_DTYPES:
            for case in all_cases():
                r = run_case(case, device, dtype)
                results.append(r)
                if verbose or not r.ok:
                    print(format_result(r))
    failed = [r for r in results if not r.ok]
    print(f"{len(results) - len(failed)}/{len(results)} checks passed"
          + ("" if verbose else " (run with -v to list each)"))
    return not failed


# --------------------------------------------------------------------------- compat vs documents

COMPAT_DTYPES = (torch.float64, torch.float32)
# In float64 both sides are exact up to rounding, so a bound this tight (relative to the result's
# magnitude) still catches any semantic difference, e.g. 004's float32 square root in the scale,
# which is 1e-8 relative.
COMPAT_F64_RTOL = 1e-10


@dataclass
class CompatCase:
    """One attn_ext.compat class or function against its document's reproduction.

    A class is built as ``document(*args)`` and ``ours(*args)``, ours loaded strictly from the
    document's state dict, and called with the inputs; a function is called with the inputs and
    ``kwargs(device)``. Inputs are ``0.5 * randn(shape)`` for each of ``shapes``; the output,
    every input's gradient and every parameter's gradient are compared.
    """

    name: str
    document: Callable
    ours: Callable
    shapes: Tuple[Tuple[int, ...], ...]
    args: Tuple = ()
    kwargs: Callable[[torch.device], dict] = lambda device: {}
    # float64 tolerance relative to the magnitude, where the document itself computes part of
    # its float64 result in float32 (default COMPAT_F64_RTOL: the document is exact in float64)
    f64_rtol: Optional[float] = None


def _concat(fn):
    """A function returning a tuple of tensors, as one tensor (the checks compare one output)."""
    return lambda *xs, **kw: torch.cat(fn(*xs, **kw), dim=-1)


def compat_cases() -> List[CompatCase]:
    tc, lfs, tb, zoo = torchcode, llms_from_scratch, textbook, attention_zoo
    x, kv = (2, 7, 16), (2, 9, 16)  # (B, S, embed) for the modules; S_kv != S_q where allowed
    qkv3 = ((2, 7, 8), (2, 9, 8), (2, 9, 5))
    qkv4 = ((2, 3, 7, 8), (2, 3, 9, 8), (2, 3, 9, 5))
    same3 = ((2, 9, 8), (2, 9, 8), (2, 9, 5))
    return [
        CompatCase("torchcode.scaled_dot_product_attention", doc000.scaled_dot_product_attention,
                   tc.scaled_dot_product_attention, qkv4),
        CompatCase("torchcode.MultiHeadAttention", doc000.MultiHeadAttention, tc.MultiHeadAttention,
                   (x, kv, kv), args=(16, 4)),
        CompatCase("torchcode.causal_attention", doc000.causal_attention, tc.causal_attention, qkv3),
        CompatCase("torchcode.MultiHeadCrossAttention", doc000.MultiHeadCrossAttention,
                   tc.MultiHeadCrossAttention, (x, kv), args=(16, 4)),
        CompatCase("torchcode.GroupQueryAttention", doc000.GroupQueryAttention, tc.GroupQueryAttention,
                   (x,), args=(16, 8, 2)),
        CompatCase("torchcode.sliding_window_attention", doc000.sliding_window_attention,
                   tc.sliding_window_attention, same3, kwargs=lambda device: {"window_size": 2}),
        CompatCase("torchcode.flash_attention", doc000.flash_attention, tc.flash_attention,
                   ((2, 37, 8),) * 3, kwargs=lambda device: {"block_size": 16}),
        # The document's cos/sin tables are float32 for any input (angle error ~ position x 2^-24),
        # while attn_ext takes cos/sin of the same fp32 angles in float64 for float64 inputs.
        CompatCase("torchcode.apply_rope (q_rot, k_rot)", _concat(doc000.apply_rope), _concat(tc.apply_rope),
                   ((2, 37, 16), (2, 37, 16)), f64_rtol=37 * 2.0**-22),
        CompatCase("torchcode.linear_attention", doc000.linear_attention, tc.linear_attention,
                   ((2, 37, 8), (2, 37, 8), (2, 37, 5))),
        CompatCase("llms_from_scratch.simplified_self_attention", doc001.simplified_self_attention,
                   lfs.simplified_self_attention, ((6, 3),)),
        CompatCase("llms_from_scratch.SelfAttention_v1", doc001.SelfAttention_v1, lfs.SelfAttention_v1,
                   ((7, 16),), args=(16, 8)),
        CompatCase("llms_from_scratch.SelfAttention_v2", doc001.SelfAttention_v2, lfs.SelfAttention_v2,
                   ((7, 16),), args=(16, 8)),
        CompatCase("llms_from_scratch.CausalAttention", doc001.CausalAttention, lfs.CausalAttention,
                   (x,), args=(16, 8, 12, 0.0)),
        CompatCase("llms_from_scratch.MultiHeadAttentionWrapper", doc001.MultiHeadAttentionWrapper,
                   lfs.MultiHeadAttentionWrapper, (x,), args=(16, 8, 12, 0.0, 3)),
        CompatCase("llms_from_scratch.MultiHeadAttention", doc001.MultiHeadAttention,
                   lfs.MultiHeadAttention, (x,), args=(16, 12, 12, 0.0, 3, True)),
        CompatCase("textbook.attention", doc003.attention, tb.attention, qkv4,
                   kwargs=lambda device: {"mask": torch.ones(7, 9, dtype=torch.bool, device=device).tril(2)}),
        CompatCase("textbook.repeat_kv", doc003.repeat_kv, tb.repeat_kv, ((2, 3, 5, 4),),
                   kwargs=lambda device: {"n_rep": 2}),
        CompatCase("attention_zoo.SelfAttention", doc004.SelfAttention, zoo.SelfAttention, (x,), args=(16, 6)),
        CompatCase("attention_zoo.MultiHeadAttention", doc004.MultiHeadAttention, zoo.MultiHeadAttention,
                   (x,), args=(16, 4, 24)),
        CompatCase("attention_zoo.CrossAttention", doc004.CrossAttention, zoo.CrossAttention, (x, kv),
                   args=(16, 6)),
        CompatCase("attention_zoo.GroupedAttention", doc004.GroupedAttention, zoo.GroupedAttention, (x,),
                   args=(16, 24, 6, 2)),
        CompatCase("attention_zoo.SpatialAttention", doc004.SpatialAttention, zoo.SpatialAttention,
                   ((2, 3, 16, 16),)),
        CompatCase("attention_zoo.TemporalAttention (out, weights)", doc004.TemporalAttention,
                   zoo.TemporalAttention, (x, (2, 1, 8)), args=(16, 12, 8)),
    ]


def compat_candidates(case: CompatCase, device: torch.device, dtype: torch.dtype):
    """(callable, parameters by name) for the document at ``dtype``, the document in float64 (the
    same rounded weights: the ground truth) and ours at ``dtype`` loaded strictly."""
    if not isinstance(case.document, type):
        kw = case.kwargs(device)
        return [((lambda *xs, fn=fn: fn(*xs, **kw)), {}) for fn in (case.document, case.document, case.ours)]
    doc = case.document(*case.args)
    plain = not isinstance(doc, torch.nn.Module)  # document 000's plain classes

    def cast(obj, to):
        return plain_to(obj, device, to) if plain else obj.to(device=device, dtype=to)

    def params(obj):
        return plain_state_dict(obj) if plain else dict(obj.named_parameters())

    doc = cast(doc, dtype)
    exact = cast(copy.deepcopy(doc), torch.float64)
    ours = case.ours(*case.args).to(device=device, dtype=dtype)
    ours.load_state_dict(plain_state_dict(doc) if plain else doc.state_dict(), strict=True)
    if set(params(ours)) != set(params(doc)):
        raise RuntimeError(f"parameters differ: ours {sorted(params(ours))}, document {sorted(params(doc))}")
    return [(obj.forward, params(obj)) for obj in (doc, exact, ours)]


def _one_output(out):
    """A tuple of outputs (e.g. (output, attn_weights)) as one tensor along the last dim."""
    return torch.cat(out, dim=-1) if isinstance(out, tuple) else out


def compat_forward_backward(fn, params, inputs, grad_out) -> Dict[str, torch.Tensor]:
    """The output and the gradients of (out * grad_out).sum(), by label: out, dx<i>, d<param>."""
    xs = [x.detach().requires_grad_() for x in inputs]
    out = _one_output(fn(*xs))
    names = sorted(params)
    grads = torch.autograd.grad((out * grad_out.to(out.dtype)).sum(), xs + [params[n] for n in names])
    labels = ["out"] + [f"dx{i}" for i in range(len(xs))] + [f"d{n}" for n in names]
    return dict(zip(labels, [out.detach(), *grads]))


def run_compat_case(case: CompatCase, device: torch.device, dtype: torch.dtype) -> CheckResult:
    res = CheckResult(case.name, str(device), str(dtype).replace("torch.", ""))
    torch.manual_seed(0)
    try:
        (doc, doc_p), (exact, exact_p), (ours, ours_p) = compat_candidates(case, device, dtype)
        inputs = [0.5 * torch.randn(s, device=device, dtype=dtype) for s in case.shapes]
        exact_inputs = [x.double() for x in inputs]  # ground truth sees the rounded inputs
        with torch.no_grad():
            out_shape = _one_output(exact(*exact_inputs)).shape
        grad_out = torch.randn(out_shape, device=device, dtype=dtype).double()
        want = compat_forward_backward(exact, exact_p, exact_inputs, grad_out)
        base = compat_forward_backward(doc, doc_p, inputs, grad_out)
        got = compat_forward_backward(ours, ours_p, inputs, grad_out)
    except Exception as e:  # a crash (including a failed strict load) is a failed check
        res.exception = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return res
    for label, w in want.items():
        g, b = got[label], base[label]
        if g.shape != b.shape or g.dtype != b.dtype:
            res.exception = f"{label}: {g.dtype} {tuple(g.shape)}, document gives {b.dtype} {tuple(b.shape)}"
            return res
        if dtype == torch.float64:
            finite = w.abs().masked_fill(w.isinf(), 0)
            tol = (case.f64_rtol or COMPAT_F64_RTOL) * max(1.0, finite.max().item() if finite.numel() else 0.0)
        else:
            tol = 2 * max_error(b, w) + accumulation_floor(w)
        res.errors[label] = (max_error(g, w), tol)
    return res


def format_compat_row(by_dtype: Sequence[CheckResult]) -> str:
    """One line per class: per dtype the worst (error, tolerance) pair and what it was for."""
    ok = all(r.ok for r in by_dtype)
    cells = []
    for r in by_dtype:
        if r.exception:
            cells.append(f"{r.dtype} {r.exception}")
            continue
        label = max(r.errors, key=lambda k: r.errors[k][0] / r.errors[k][1] if r.errors[k][1] else math.inf)
        err, tol = r.errors[label]
        cells.append(f"{r.dtype:7s} {err:7.1e} {'<=' if err <= tol else '> '} {tol:7.1e} {label:23s}")
    row = f"{'PASS' if ok else 'FAIL'}  {by_dtype[0].device:4s} {by_dtype[0].name:44s} " + " ".join(cells)
    return row.rstrip()


def run_compat_checks(devices: Sequence[torch.device]) -> bool:
    print("\ncompat: each attn_ext.compat class/function vs its document's code (attn_ext.testing.documents),\n"
          "same arguments, document's state dict loaded strictly; output and input/parameter gradients,\n"
          "the worst of them shown as max abs error <= tolerance (what). float64: vs the document,\n"
          f"tol {COMPAT_F64_RTOL:.0e} x magnitude; float32: vs the document in float64, "
          f"tol 2 x the document's own float32 error + {ACC_ULPS} float32 ulps")
    rows = []
    for device in devices:
        for case in compat_cases():
            rows.append([run_compat_case(case, device, dtype) for dtype in COMPAT_DTYPES])
            print(format_compat_row(rows[-1]), flush=True)
    failed = [r for r in rows if not all(x.ok for x in r)]
    print(f"{len(rows) - len(failed)}/{len(rows)} compat classes/functions passed")
    return not failed


# --------------------------------------------------------------------------- timing


WARMUP_CALLS = 2  # the first call pays one-time costs (kernel load, allocator growth, autotune)


def time_interleaved(fns: dict, device: torch.device, repeats: int) -> harness.Timing:
    """``repeats`` interleaved rounds after the warm-up calls (attn_ext.testing.harness)."""
    return harness.time_interleaved(fns, device, warmup=WARMUP_CALLS, min_rounds=repeats,
                                    max_rounds=repeats)


def run_bench(devices: Sequence[torch.device], seqlen: int, repeats: int) -> None:
    impls = {
        "attn_ext": lambda c: lambda q, k, v: attn_ext.attention(q, k, v, causal=c),
        "sdpa": lambda c: lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=c),
    }
    b, h, d = 1, 16, 64
    print(f"\ntiming: B={b} H={h} S={seqlen} D={d}, median of {repeats} interleaved rounds after "
          f"{WARMUP_CALLS} warmup calls (ratio = sdpa / attn_ext, > 1 means attn_ext is faster)")
    print(f"{'device':6s} {'dtype':8s} {'causal':6s} {'mode':7s} {'attn_ext ms':>11s} {'sdpa ms':>9s} {'ratio':>6s}")
    for device in devices:
        for dtype in CHECK_DTYPES:
            torch.manual_seed(0)
            q, k, v, grad = (torch.randn(b, h, seqlen, d, device=device, dtype=dtype) for _ in range(4))
            for causal in (False, True):
                for mode in ("fwd", "fwd+bwd"):
                    fns = {name: harness.make_step(impl(causal), mode, (q, k, v), grad)
                           for name, impl in impls.items()}
                    t = time_interleaved(fns, device, repeats)
                    for name, err in t.errors.items():
                        print(f"  timing failed: {name}: {err}")
                    print(f"{device.type:6s} {str(dtype)[6:]:8s} {str(causal):6s} {mode:7s} "
                          f"{harness.fmt(t.ms('attn_ext'), '11.2f', 'nan'):>11s} "
                          f"{harness.fmt(t.ms('sdpa'), '9.2f', 'nan'):>9s} "
                          f"{harness.fmt(t.ratio('sdpa', 'attn_ext'), '5.2f', 'nan')}x")


def run_spatial_bench(devices: Sequence[torch.device], repeats: int) -> None:
    """attn_ext.nn.SpatialAttention (fused) vs the same gate in plain torch (document 004's
    x * sigmoid(conv(cat[mean, max])))."""
    n, c, hw = 8, 64, 56
    print(f"\ntiming: CBAM spatial gate, x ({n}, {c}, {hw}, {hw}) channels-last, median of {repeats} "
          f"interleaved rounds after {WARMUP_CALLS} warmup calls (ratio = torch / attn_ext)")
    print(f"{'device':6s} {'dtype':8s} {'mode':7s} {'attn_ext ms':>11s} {'torch ms':>9s} {'ratio':>6s}")
    for device in devices:
        for dtype in CHECK_DTYPES:
            torch.manual_seed(0)
            ours = attn_ext.nn.SpatialAttention().to(device=device, dtype=dtype)
            w = ours.conv.weight
            x = torch.randn(n, c, hw, hw, device=device, dtype=dtype).contiguous(memory_format=torch.channels_last)
            grad = torch.randn_like(x)
            impls = {"attn_ext": ours, "torch": lambda t: cbam_spatial(t, w)}
            for mode in ("fwd", "fwd+bwd"):
                fns = {name: harness.make_step(impl, mode, (x,), grad, [w])
                       for name, impl in impls.items()}
                t = time_interleaved(fns, device, repeats)
                print(f"{device.type:6s} {str(dtype)[6:]:8s} {mode:7s} {t.ms('attn_ext'):11.2f} "
                      f"{t.ms('torch'):9.2f} {t.ratio('torch', 'attn_ext'):5.2f}x")


# --------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m attn_ext", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], help="only this device (default: all local)")
    p.add_argument("--no-bench", action="store_true", help="skip the timing table")
    p.add_argument("--bench-seqlen", type=int, default=1024)
    p.add_argument("--bench-repeats", type=int, default=5)
    p.add_argument("-v", "--verbose", action="store_true", help="print every check, not only failures")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    devices = [d for d in local_devices() if args.device in (None, d.type)]
    print_environment(devices)
    print_ops()
    ok = run_checks(devices, args.verbose)
    ok = run_compat_checks(devices) and ok
    if not args.no_bench:
        run_bench(devices, args.bench_seqlen, args.bench_repeats)
        run_spatial_bench(devices, args.bench_repeats)
    print("\nall checks passed" if ok else "\nSOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
