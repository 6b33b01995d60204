"""The bad-input matrix (issue 24, item 7): every public op x every class of bad input.

Each op is described once (`OPS`): a valid call, its floating-point data arguments, its index
arguments, the arguments it writes, and its own bad shapes and bad lengths. The classes are
generic and run over every op:

- wrong dtype (an integer tensor), mixed dtypes, wrong device (CUDA machines), mismatched
  shapes, a last dimension that is not contiguous, negative or oversized lengths:
  an error (RuntimeError/ValueError) whose message names the argument, and every argument the
  op writes is left bit-for-bit as it was;
- NaN/Inf values: the documented result, NaN/Inf where the float64 reference has them;
- empty tensors (a zero-size batch, head or sequence dimension): the documented empty or zero
  result, never an error or a crash;
- requires_grad on an argument that has no gradient: an error naming it, or (where the op
  is inference-only and says so) a result that carries no gradient.

The README's table "What bad input gets" summarizes these outcomes.
"""

import re
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

import pytest
import torch

import attn_ext
from attn_ext.testing.attention import (
    attention_reference,
    attention_varlen_reference,
    attention_weights_reference,
)
from attn_ext.testing.decoding import decode_reference, rope_reference
from attn_ext.testing.linear import linear_attention_quadratic
from attn_ext.testing.spatial import channel_pool as channel_pool_reference
from attn_ext.testing.spatial import spatial_gate as spatial_gate_reference

ERRORS = (RuntimeError, ValueError)
# Float arguments of any float dtype, converted: a float mask like SDPA's, and the score
# modifiers, which the kernels read in float32 whatever the data's dtype.
CONVERTED = ("attn_mask", "alibi_slopes", "sinks")
ops = torch.ops.attn_ext


def names(arg):
    """Regex: the message names `arg` as a word (e.g. 'k' but not inside 'mask')."""
    return rf"(?<![A-Za-z0-9_]){re.escape(arg)}(?![A-Za-z0-9_])"


@dataclass
class Op:
    """One public op: `make(dtype, device)` returns the keyword arguments of a valid call,
    `call(**args)` runs it and returns its tensor result(s)."""

    make: Callable
    call: Callable
    float_args: Tuple[str, ...]
    index_args: Tuple[str, ...] = ()
    writes: Tuple[str, ...] = ()
    # label -> (argument the message must name, edit of the valid arguments)
    bad_shapes: Dict[str, Tuple[str, Callable]] = field(default_factory=dict)
    bad_lengths: Dict[str, Tuple[str, Callable]] = field(default_factory=dict)
    # float64 reference on the same arguments (NaN/Inf propagation); None: compare with the op
    # itself in float64 where no separate reference exists
    reference: Optional[Callable] = None
    # label -> edit making a zero-size dimension, and the expected result check
    empty: Dict[str, Callable] = field(default_factory=dict)
    # float arguments that have no gradient
    no_grad_args: Tuple[str, ...] = ()
    # True: the op is not differentiable at all (inference only)
    inference_only: bool = False


def rnd(*shape, dtype, device):
    return torch.randn(*shape, dtype=dtype, device=device)


def with_(name, value):
    def edit(a):
        a = dict(a)
        a[name] = value(a) if callable(value) else value
        return a

    return edit


def reshape(name, shape):
    return with_(name, lambda a: torch.randn(shape, dtype=a[name].dtype, device=a[name].device))


def ints(name, values):
    return with_(name, lambda a: torch.tensor(values, dtype=a[name].dtype, device=a[name].device))


# ------------------------------------------------------------------------------- the ops


def attention_args(dtype, device):
    return dict(
        q=rnd(2, 4, 5, 8, dtype=dtype, device=device),
        k=rnd(2, 2, 6, 8, dtype=dtype, device=device),
        v=rnd(2, 2, 6, 8, dtype=dtype, device=device),
        attn_mask=rnd(2, 4, 5, 6, dtype=dtype, device=device),
        alibi_slopes=torch.rand(4, dtype=dtype, device=device),
        sinks=rnd(4, dtype=dtype, device=device),
    )


def varlen_args(dtype, device):
    cu = torch.tensor([0, 3, 7], dtype=torch.int32, device=device)
    return dict(
        q=rnd(7, 4, 8, dtype=dtype, device=device),
        k=rnd(7, 2, 8, dtype=dtype, device=device),
        v=rnd(7, 2, 8, dtype=dtype, device=device),
        cu_seqlens_q=cu,
        cu_seqlens_k=cu.clone(),
        max_seqlen_q=4,
        max_seqlen_k=4,
    )


def varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    return attn_ext.attention_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True
    )


def varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    return attention_varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=True)


def decode_args(dtype, device):
    return dict(
        q=rnd(2, 4, 1, 8, dtype=dtype, device=device),
        k_cache=rnd(2, 2, 9, 8, dtype=dtype, device=device),
        v_cache=rnd(2, 2, 9, 8, dtype=dtype, device=device),
        cache_seqlens=torch.tensor([5, 9], dtype=torch.int32, device=device),
    )


def kv_append_args(dtype, device):
    return dict(
        k_cache=rnd(2, 2, 9, 8, dtype=dtype, device=device),
        v_cache=rnd(2, 2, 9, 8, dtype=dtype, device=device),
        cache_seqlens=torch.tensor([2, 5], dtype=torch.int32, device=device),
        k=rnd(2, 2, 3, 8, dtype=dtype, device=device),
        v=rnd(2, 2, 3, 8, dtype=dtype, device=device),
    )


def kv_append_call(k_cache, v_cache, cache_seqlens, k, v):
    ops.kv_cache_append(k_cache, v_cache, cache_seqlens, k, v, rope=True)
    return k_cache, v_cache


def latent_append_args(dtype, device):
    return dict(
        cache=rnd(2, 1, 9, 12, dtype=dtype, device=device),
        cache_seqlens=torch.tensor([2, 5], dtype=torch.int32, device=device),
        c_kv=rnd(2, 1, 3, 8, dtype=dtype, device=device),
        k_rope=rnd(2, 1, 3, 4, dtype=dtype, device=device),
    )


def latent_append_call(cache, cache_seqlens, c_kv, k_rope):
    ops.latent_cache_append(cache, cache_seqlens, c_kv, k_rope)
    return cache


def tpa_decode_args(dtype, device):
    return dict(
        q=rnd(2, 4, 1, 8, dtype=dtype, device=device),
        a_k=rnd(2, 9, 2, 4, dtype=dtype, device=device),
        b_k=rnd(2, 9, 2, 8, dtype=dtype, device=device),
        a_v=rnd(2, 9, 2, 4, dtype=dtype, device=device),
        b_v=rnd(2, 9, 2, 8, dtype=dtype, device=device),
        cache_seqlens=torch.tensor([5, 9], dtype=torch.int32, device=device),
    )


def tpa_decode_reference(q, a_k, b_k, a_v, b_v, cache_seqlens):
    rank = a_k.shape[2]
    k = torch.einsum("bsrh,bsrd->bhsd", a_k, b_k) / rank
    v = torch.einsum("bsrh,bsrd->bhsd", a_v, b_v) / rank
    return decode_reference(q, k, v, cache_seqlens)


def linear_args(dtype, device):
    return dict(
        q=rnd(2, 4, 6, 8, dtype=dtype, device=device),
        k=rnd(2, 4, 6, 8, dtype=dtype, device=device),
        v=rnd(2, 4, 6, 8, dtype=dtype, device=device),
    )


def spatial_gate_args(dtype, device):
    return dict(
        x=rnd(2, 3, 4, 5, dtype=dtype, device=device),
        gate=rnd(2, 1, 4, 5, dtype=dtype, device=device),
    )


OPS = {
    "attention": Op(
        make=attention_args,
        call=lambda q, k, v, attn_mask, alibi_slopes, sinks: attn_ext.attention(
            q, k, v, attn_mask=attn_mask, alibi_slopes=alibi_slopes, sinks=sinks
        ),
        float_args=("q", "k", "v", "attn_mask", "alibi_slopes", "sinks"),
        bad_shapes={
            "k_batch": ("k", reshape("k", (3, 2, 6, 8))),
            "v_seq": ("v", reshape("v", (2, 2, 7, 8))),
            "k_head_dim": ("k", reshape("k", (2, 2, 6, 16))),
            "gqa": ("k", reshape("k", (2, 3, 6, 8))),
            "mask": ("attn_mask", reshape("attn_mask", (2, 4, 5, 7))),
            "sinks": ("sinks", reshape("sinks", (3,))),
            "alibi": ("alibi_slopes", reshape("alibi_slopes", (3, 4))),
        },
        reference=lambda q, k, v, attn_mask, alibi_slopes, sinks: attention_reference(
            q, k, v, attn_mask=attn_mask, alibi_slopes=alibi_slopes, sinks=sinks
        ),
        empty={
            "batch": lambda a: {**a, **{n: a[n][:0] for n in ("q", "k", "v", "attn_mask")}},
            "sq": lambda a: {**a, "q": a["q"][:, :, :0], "attn_mask": a["attn_mask"][:, :, :0]},
            "sk": lambda a: {
                **a,
                "k": a["k"][:, :, :0],
                "v": a["v"][:, :, :0],
                "attn_mask": a["attn_mask"][..., :0],
            },
        },
        no_grad_args=("attn_mask", "alibi_slopes"),
    ),
    "attention_varlen": Op(
        make=varlen_args,
        call=varlen_call,
        float_args=("q", "k", "v"),
        index_args=("cu_seqlens_q", "cu_seqlens_k"),
        bad_shapes={
            "k_heads": ("k", reshape("k", (7, 3, 8))),
            "v_tokens": ("v", reshape("v", (6, 2, 8))),
            "cu_len": ("cu_seqlens_k", ints("cu_seqlens_k", [0, 7])),
        },
        bad_lengths={
            "decreasing": ("cu_seqlens_q", ints("cu_seqlens_q", [0, 5, 3])),
            "past_total": ("cu_seqlens_k", ints("cu_seqlens_k", [0, 3, 9])),
            "negative_start": ("cu_seqlens_q", ints("cu_seqlens_q", [-1, 3, 7])),
            "max_too_small": ("max_seqlen_q", with_("max_seqlen_q", 2)),
            "max_negative": ("max_seqlen_k", with_("max_seqlen_k", -1)),
        },
        reference=varlen_reference,
        empty={
            "tokens": lambda a: {
                **a,
                **{n: a[n][:0] for n in ("q", "k", "v")},
                "cu_seqlens_q": torch.zeros_like(a["cu_seqlens_q"]),
                "cu_seqlens_k": torch.zeros_like(a["cu_seqlens_k"]),
                "max_seqlen_q": 0,
                "max_seqlen_k": 0,
            },
        },
    ),
    "attention_weights": Op(
        make=lambda dtype, device: {
            k: v for k, v in attention_args(dtype, device).items() if k in ("q", "k", "attn_mask")
        },
        call=lambda q, k, attn_mask: attn_ext.attention_weights(q, k, attn_mask=attn_mask),
        float_args=("q", "k", "attn_mask"),
        bad_shapes={
            "k_batch": ("k", reshape("k", (3, 2, 6, 8))),
            "k_head_dim": ("k", reshape("k", (2, 2, 6, 16))),
            "mask": ("attn_mask", reshape("attn_mask", (2, 4, 6, 6))),
        },
        reference=lambda q, k, attn_mask: attention_weights_reference(q, k, attn_mask=attn_mask),
        empty={"sq": lambda a: {**a, "q": a["q"][:, :, :0], "attn_mask": a["attn_mask"][:, :, :0]}},
        no_grad_args=("attn_mask",),
    ),
    "attention_with_weights": Op(
        make=lambda dtype, device: {
            k: v
            for k, v in attention_args(dtype, device).items()
            if k in ("q", "k", "v", "attn_mask")
        },
        call=lambda q, k, v, attn_mask: attn_ext.attention_with_weights(
            q, k, v, attn_mask=attn_mask
        ),
        float_args=("q", "k", "v", "attn_mask"),
        bad_shapes={
            "k_batch": ("k", reshape("k", (3, 2, 6, 8))),
            "v_seq": ("v", reshape("v", (2, 2, 7, 8))),
            "k_head_dim": ("k", reshape("k", (2, 2, 6, 16))),
            "gqa": ("k", reshape("k", (2, 3, 6, 8))),
            "mask": ("attn_mask", reshape("attn_mask", (2, 4, 5, 7))),
        },
        reference=lambda q, k, v, attn_mask: (
            attention_reference(q, k, v, attn_mask=attn_mask),
            attention_weights_reference(q, k, attn_mask=attn_mask),
        ),
        empty={
            "batch": lambda a: {**a, **{n: a[n][:0] for n in ("q", "k", "v", "attn_mask")}},
            "sq": lambda a: {**a, "q": a["q"][:, :, :0], "attn_mask": a["attn_mask"][:, :, :0]},
            "sk": lambda a: {
                **a,
                "k": a["k"][:, :, :0],
                "v": a["v"][:, :, :0],
                "attn_mask": a["attn_mask"][..., :0],
            },
        },
        no_grad_args=("attn_mask",),
    ),
    "rope": Op(
        make=lambda dtype, device: dict(
            x=rnd(2, 3, 5, 8, dtype=dtype, device=device),
            positions=torch.tensor([[0, 1, 2, 3, 9]] * 2, device=device),
        ),
        call=lambda x, positions: attn_ext.rope(x, positions=positions),
        float_args=("x",),
        index_args=("positions",),
        bad_shapes={
            # an odd head dim can hold no rotation pairs: the message names rotary_dim,
            # which defaults to the head dim
            "odd_dim": ("rotary_dim", reshape("x", (2, 3, 5, 7))),
            "positions": ("positions", ints("positions", [[0, 1, 2]] * 2)),
        },
        reference=lambda x, positions: rope_reference(x, positions=positions),
        empty={"seq": lambda a: {**a, "x": a["x"][:, :, :0], "positions": a["positions"][:, :0]}},
    ),
    "decode_attention": Op(
        make=decode_args,
        call=lambda q, k_cache, v_cache, cache_seqlens: attn_ext.decode_attention(
            q, k_cache, v_cache, cache_seqlens
        ),
        float_args=("q", "k_cache", "v_cache"),
        index_args=("cache_seqlens",),
        bad_shapes={
            "k_batch": ("k_cache", reshape("k_cache", (3, 2, 9, 8))),
            "v_len": ("v_cache", reshape("v_cache", (2, 2, 8, 8))),
            "seqlens": ("cache_seqlens", ints("cache_seqlens", [5, 9, 1])),
        },
        bad_lengths={
            "negative": ("cache_seqlens", ints("cache_seqlens", [-1, 9])),
            "past_cache": ("cache_seqlens", ints("cache_seqlens", [5, 10])),
        },
        reference=lambda q, k_cache, v_cache, cache_seqlens: decode_reference(
            q, k_cache, v_cache, cache_seqlens
        ),
        empty={"batch": lambda a: {n: t[:0] for n, t in a.items()}},
        inference_only=True,
    ),
    "kv_cache_append": Op(
        make=kv_append_args,
        call=kv_append_call,
        float_args=("k_cache", "v_cache", "k", "v"),
        index_args=("cache_seqlens",),
        writes=("k_cache", "v_cache", "cache_seqlens"),
        bad_shapes={
            "k_heads": ("k", reshape("k", (2, 3, 3, 8))),
            "v_tokens": ("v", reshape("v", (2, 2, 2, 8))),
            "k_dim": ("k", reshape("k", (2, 2, 3, 4))),
        },
        bad_lengths={
            "negative": ("cache_seqlens", ints("cache_seqlens", [-1, 5])),
            "overflow": ("cache_seqlens", ints("cache_seqlens", [2, 7])),
        },
        empty={"tokens": lambda a: {**a, "k": a["k"][:, :, :0], "v": a["v"][:, :, :0]}},
        inference_only=True,
    ),
    "latent_cache_append": Op(
        make=latent_append_args,
        call=latent_append_call,
        float_args=("cache", "c_kv", "k_rope"),
        index_args=("cache_seqlens",),
        writes=("cache", "cache_seqlens"),
        bad_shapes={
            "width": ("k_rope", reshape("k_rope", (2, 1, 3, 6))),
            "tokens": ("c_kv", reshape("k_rope", (2, 1, 2, 4))),
        },
        bad_lengths={
            "negative": ("cache_seqlens", ints("cache_seqlens", [-1, 5])),
            "overflow": ("cache_seqlens", ints("cache_seqlens", [2, 7])),
        },
        empty={
            "tokens": lambda a: {**a, "c_kv": a["c_kv"][:, :, :0], "k_rope": a["k_rope"][:, :, :0]}
        },
        inference_only=True,
    ),
    "tpa_expand": Op(
        make=lambda dtype, device: dict(
            a=rnd(2, 5, 3, 4, dtype=dtype, device=device),
            b=rnd(2, 5, 3, 8, dtype=dtype, device=device),
        ),
        call=lambda a, b: attn_ext.tpa_expand(a, b),
        float_args=("a", "b"),
        bad_shapes={
            "rank": ("b", reshape("b", (2, 5, 2, 8))),
            "seq": ("b", reshape("b", (2, 4, 3, 8))),
        },
        reference=lambda a, b: torch.einsum("bsrh,bsrd->bshd", a, b) / a.shape[2],
        empty={"seq": lambda a: {"a": a["a"][:, :0], "b": a["b"][:, :0]}},
    ),
    "tpa_decode_attention": Op(
        make=tpa_decode_args,
        call=lambda q, a_k, b_k, a_v, b_v, cache_seqlens: attn_ext.tpa_decode_attention(
            q, a_k, b_k, a_v, b_v, cache_seqlens
        ),
        float_args=("q", "a_k", "b_k", "a_v", "b_v"),
        index_args=("cache_seqlens",),
        bad_shapes={
            "a_k_heads": ("a_k", reshape("a_k", (2, 9, 2, 3))),
            "b_v_len": ("b_v", reshape("b_v", (2, 8, 2, 8))),
        },
        bad_lengths={
            "negative": ("cache_seqlens", ints("cache_seqlens", [-1, 9])),
            "past_cache": ("cache_seqlens", ints("cache_seqlens", [5, 10])),
        },
        reference=tpa_decode_reference,
        empty={"batch": lambda a: {n: t[:0] for n, t in a.items()}},
    ),
    "linear_attention": Op(
        make=linear_args,
        call=lambda q, k, v: attn_ext.linear_attention(q, k, v, causal=True),
        float_args=("q", "k", "v"),
        bad_shapes={
            "k_seq": ("k", reshape("k", (2, 4, 5, 8))),
            "v_heads": ("v", reshape("v", (2, 3, 6, 8))),
        },
        reference=lambda q, k, v: linear_attention_quadratic(q, k, v, causal=True),
        empty={"seq": lambda a: {n: t[:, :, :0] for n, t in a.items()}},
    ),
    "channel_pool": Op(
        make=lambda dtype, device: dict(x=rnd(2, 3, 4, 5, dtype=dtype, device=device)),
        call=lambda x: attn_ext.channel_pool(x),
        float_args=("x",),
        bad_shapes={"rank": ("x", reshape("x", (3, 4, 5)))},
        reference=channel_pool_reference,
        empty={"batch": lambda a: {"x": a["x"][:0]}},
    ),
    "spatial_gate": Op(
        make=spatial_gate_args,
        call=lambda x, gate: attn_ext.spatial_gate(x, gate),
        float_args=("x", "gate"),
        bad_shapes={
            "gate_channels": ("gate", reshape("gate", (2, 2, 4, 5))),
            "gate_hw": ("gate", reshape("gate", (2, 1, 4, 4))),
        },
        reference=lambda x, gate: spatial_gate_reference(x, gate),
        empty={"batch": lambda a: {"x": a["x"][:0], "gate": a["gate"][:0]}},
    ),
}


# ----------------------------------------------------------------------------- helpers


def valid(name, device, dtype=torch.float32):
    return OPS[name].make(dtype, device)


def snapshot(op, args):
    return {n: args[n].clone() for n in op.writes}


def assert_untouched(op, args, before):
    for n in op.writes:
        assert torch.equal(args[n], before[n]) or (
            args[n].is_floating_point() and torch.equal(args[n].isnan(), before[n].isnan())
        ), f"{n} was written by a call that raised"


def assert_refused(name, args, arg):
    op = OPS[name]
    before = snapshot(op, args)
    with pytest.raises(ERRORS, match=names(arg)):
        op.call(**args)
    assert_untouched(op, args, before)


def tensors(result):
    if isinstance(result, torch.Tensor):
        return [result]
    return [t for t in result if isinstance(t, torch.Tensor)]


def cases(kind):
    return [
        pytest.param(name, label, id=f"{name}-{label}")
        for name, op in OPS.items()
        for label in getattr(op, kind)
    ]


def float_arg_cases(filter_fn=lambda op, arg: True):
    return [
        pytest.param(name, arg, id=f"{name}-{arg}")
        for name, op in OPS.items()
        for arg in op.float_args
        if filter_fn(op, arg)
    ]


# ------------------------------------------------------------------------------ classes


@pytest.mark.parametrize("name, arg", float_arg_cases())
def test_wrong_dtype(device, name, arg):
    args = valid(name, device)
    args[arg] = args[arg].to(torch.int32)
    assert_refused(name, args, arg)


@pytest.mark.parametrize(
    "name, arg", float_arg_cases(lambda op, arg: arg != op.float_args[0] and arg not in CONVERTED)
)
def test_mixed_dtypes(device, name, arg):
    args = valid(name, device)
    args[arg] = args[arg].double()
    assert_refused(name, args, arg)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "name, arg",
    [
        pytest.param(name, arg, id=f"{name}-{arg}")
        for name, op in OPS.items()
        for arg in op.float_args[1:] + op.index_args
    ],
)
def test_wrong_device(name, arg):
    args = valid(name, "cuda")
    args[arg] = args[arg].cpu()
    assert_refused(name, args, arg)


@pytest.mark.parametrize("name, label", cases("bad_shapes"))
def test_mismatched_shapes(device, name, label):
    arg, edit = OPS[name].bad_shapes[label]
    assert_refused(name, edit(valid(name, device)), arg)


# Bad lengths that only the values of a device tensor reveal (max_seqlen_q too small needs
# cu_seqlens_q's values too). A CUDA op cannot read them without synchronizing, so there the
# kernels clamp instead of refusing (README, "What bad input gets"); the CPU ops refuse them.
DEVICE_VALUE_LENGTHS = {
    ("decode_attention", "negative"),
    ("decode_attention", "past_cache"),
    ("tpa_decode_attention", "negative"),
    ("tpa_decode_attention", "past_cache"),
    ("attention_varlen", "decreasing"),
    ("attention_varlen", "past_total"),
    ("attention_varlen", "negative_start"),
    ("attention_varlen", "max_too_small"),
}
# The ops whose CUDA kernels clamp each sequence's length into [0, cache capacity]: the result
# is the reference's at the clamped lengths.
CLAMPED_CACHE_LENGTHS = {"decode_attention", "tpa_decode_attention"}


@pytest.mark.parametrize("name, label", cases("bad_lengths"))
def test_bad_lengths(device, name, label):
    if device == "cuda" and name in ("kv_cache_append", "latent_cache_append"):
        # Checking a device tensor's values would synchronize: the CUDA cache ops refuse an
        # overflow through KVCache's host-side lengths (tests/test_decoding.py).
        pytest.skip("value checks of device lengths are the cache classes' job on CUDA")
    arg, edit = OPS[name].bad_lengths[label]
    args = edit(valid(name, device))
    if device == "cpu" or (name, label) not in DEVICE_VALUE_LENGTHS:
        assert_refused(name, args, arg)
        return
    # CUDA, lengths on the device: no error, no fault (the synchronize below surfaces an
    # illegal address), finite results; the decode ops give the clamped lengths' result
    # (float64: equal to the reference up to summation order).
    args = edit(valid(name, device, torch.float64))
    got = tensors(OPS[name].call(**valid_copy(args)))
    torch.cuda.synchronize()
    assert all(t.isfinite().all() for t in got)
    if name in CLAMPED_CACHE_LENGTHS:
        # decode: k_cache (B, Hkv, L, D); tpa: a_k (B, L, R, H)
        capacity = args["k_cache"].shape[2] if name == "decode_attention" else args["a_k"].shape[1]
        clamped = {**args, "cache_seqlens": args["cache_seqlens"].clamp(0, capacity)}
        want = tensors(OPS[name].reference(**valid_copy(clamped)))[0]
        torch.testing.assert_close(got[0], want, rtol=1e-10, atol=1e-10)


def strided_last_dim(x):
    """The same values in a tensor whose last dimension has stride 2."""
    wide = torch.empty(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype, device=x.device)
    wide[..., ::2] = x
    return wide[..., ::2]


@pytest.mark.parametrize("name, arg", float_arg_cases(lambda op, arg: arg not in op.writes))
def test_non_contiguous_last_dim(device, name, arg):
    # Inputs are read through their strides whatever they are: the result is the one of the
    # contiguous tensor (design.md asks only that the common transposed views are not copied).
    args = valid(name, device)
    if args[arg].dim() == 1:
        pytest.skip("a 1-D argument's last dimension is its only one")
    expected = [t.clone() for t in tensors(OPS[name].call(**valid_copy(args)))]
    args[arg] = strided_last_dim(args[arg])
    for got, want in zip(tensors(OPS[name].call(**args)), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def valid_copy(args):
    return {n: t.clone() if isinstance(t, torch.Tensor) else t for n, t in args.items()}


@pytest.mark.parametrize("name, arg", float_arg_cases(lambda op, arg: arg not in op.writes))
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_values(device, name, arg, value):
    op = OPS[name]
    if op.reference is None:
        pytest.skip("no separate reference (the op writes caches: covered by test_decoding.py)")
    args = valid(name, device, torch.float64)
    flat = args[arg].view(-1)
    flat[flat.numel() // 2] = value
    got = tensors(op.call(**valid_copy(args)))[0]
    want = tensors(op.reference(**valid_copy(args)))[0]
    if (name, arg, value) == ("attention", "sinks", float("inf")):
        # Documented: a +inf sink takes all the probability, so its head's rows give out 0
        # (the limit; the eager formula computes inf - inf = NaN there).
        head = flat.numel() // 2
        want = want.clone()
        want[:, head] = 0
    assert got.shape == want.shape
    if (device, name, arg, value) == ("cuda", "tpa_decode_attention", "a_k", float("inf")):
        # Documented (README, "What bad input gets"): on CUDA the scores are formed in factored
        # order, a_k . (b_k . q), so an infinite key factor gives its key the limit score +-inf,
        # where the reference's expanded key row holds +inf and -inf and q . k is NaN. Rows
        # the reference has finite are still equal to it.
        finite = want.isfinite()
        torch.testing.assert_close(got[finite], want[finite])
        return
    # Where the reference is finite we are finite and equal to it; where it is not, so are we.
    assert torch.equal(got.isnan(), want.isnan()), "NaN positions differ from the reference"
    finite = want.isfinite()
    torch.testing.assert_close(got[finite], want[finite])
    assert torch.equal(got[~finite & ~want.isnan()], want[~finite & ~want.isnan()])


@pytest.mark.parametrize("name, label", cases("empty"))
def test_empty_tensors(device, name, label):
    op = OPS[name]
    args = op.empty[label](valid(name, device))
    for t in tensors(op.call(**args)):
        assert t.isfinite().all() or t.numel() == 0


@pytest.mark.parametrize(
    "name, arg",
    [
        pytest.param(name, arg, id=f"{name}-{arg}")
        for name, op in OPS.items()
        for arg in (op.no_grad_args or (op.float_args if op.inference_only else ()))
        if arg not in op.writes
    ],
)
def test_requires_grad_on_non_differentiable(device, name, arg):
    op = OPS[name]
    args = valid(name, device)
    args[arg] = args[arg].requires_grad_()
    if op.inference_only:
        # Inference only (documented): runs, and its result carries no autograd history.
        assert not any(t.requires_grad for t in tensors(op.call(**args)))
    else:
        assert_refused(name, args, arg)
