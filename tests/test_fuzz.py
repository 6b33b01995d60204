"""Property fuzzing (hypothesis) of every op family against the float64 references with the
suite's error rule (attn_ext/testing/numerics.py), forward and gradients.

Shapes, dtypes, layouts and options are drawn together: batch, heads and lengths down to 0,
GQA/MQA, D != Dv (odd sizes too), strided, non-contiguous and overlapping (stride-0) layouts,
causal / windows (left and right), bool / additive masks broadcast every way, softcap, ALiBi
(per head and per batch), sinks, dropout (against the reference given the same keep mask, and
bit-identical for the same generator state, forward and backward), varlen batches with empty
and one-token sequences (and their keys in pages of any size), decode against caches with
cache_batch_idx / cache_leftpad / split-KV,
attention_weights / attention_with_weights (the score modifiers too), kv_cache_append /
latent_cache_append (the memory outside the appended rows keeps its bits; an overflow writes
nothing), linear attention (feature maps, initial / returned state), tpa_expand,
tpa_decode_attention, MLA (prefill and decode, attn_ext.nn), channel_pool / spatial_gate (NCHW,
channels-last, strided) and the attn_ext.compat drop-ins against the
documents' code with drawn constructor arguments.

CI runs the "ci" profile (150 derandomized examples per family, 100 for the slowest,
tests/conftest.py); ``pytest tests/test_fuzz.py --fuzz`` runs 10,000 fresh ones per family and
prints the counts. Every failure found becomes a named regression test in the family's own
test file."""

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import attn_ext  # noqa: E402
from attn_ext.compat import attention_zoo, llms_from_scratch, textbook, torchcode  # noqa: E402
from attn_ext.testing import spatial as spatial_ref  # noqa: E402
from attn_ext.testing.attention import (  # noqa: E402
    assert_paged_like_packed,
    attention_reference,
    attention_varlen_reference,
    attention_weights_reference,
    logit_rounding_floor,
    paged_varlen_kv,
    stored_output_grad_floors,
)
from attn_ext.testing.decoding import (  # noqa: E402
    ROPE_SCALING_EXAMPLES,
    decode_reference,
    gather_pages,
    page_out,
    rope_reference,
)
from attn_ext.testing.documents import doc000, doc001, doc003, doc004  # noqa: E402
from attn_ext.testing.linear import (  # noqa: E402
    final_state,
    gradient_term_floors,
    linear_attention_quadratic,
)
from attn_ext.testing.mla import mla_reference, paper_weights  # noqa: E402
from attn_ext.testing.numerics import (  # noqa: E402
    assert_error_rule,
    assert_lse_close,
    autograd_grads,
    ground_truth,
    ground_truth_grads,
    perturbation_floor,
    rand,
)
from attn_ext.testing.selfcheck import format_result  # noqa: E402
from attn_ext.testing.selfcheck_compat import CompatCase, _concat, run_compat_case  # noqa: E402
from attn_ext.testing.tpa import tpa_decode_reference, tpa_expand_reference  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
COUNTS = {}
# Slack floors of the error rule, in ulps of the result's magnitude. The suite's chosen cases
# keep 1 ulp (forward) and grad_slack_ulps (gradients); drawn shapes include ones where the
# plain reference is exact by luck (D = 1, a single key, a group summing one head), and a pure
# 2x rule then demands what a kernel computing exp2 of log2-domain scores and rebuilding P from
# a float32 lse cannot give, a few float32 ulps (found by the --fuzz runs: forward 4.9 ulps,
# gradients 25 ulps at D = 1). Worst are rows that see one key: the reference's gradient of q
# and k is exactly 0 there, the kernel's is the rounding of dS = P (dP - delta), a difference
# of two terms of size |dO| |v| ~ sqrt(Dv) (67 ulps at Dv = 65, window (0, 0)). Hence, in
# float32, the floor of python -m attn_ext's self-check (4 ulps) for outputs and 256 ulps
# (3e-5 relative) for gradients. In bfloat16 / float16 the same rows carry the rounding of the
# stored output O in delta = rowsum(dO * O) (FlashAttention's backward does the same): 4.5
# float16 ulps at Dv = 26 with one key; 16 ulps of the dtype there. Two finds (2026-11-29) went
# past these and got floors from their cause (attn_ext/testing/attention.py): attention's dq / dk
# the stored output's rounding through delta (stored_output_grad_floors: 21 bf16 ulps with
# dropout at Dv 29), attention_weights the logits' own rounding (logit_rounding_floor: 7 float32
# ulps at scale 2.5, D 61). A real defect is orders of magnitude above these.
FWD_ULPS_F32, GRAD_ULPS_F32, GRAD_ULPS_LOW = 4.0, 256.0, 16.0
# channel_pool / spatial_gate: tests/test_spatial.py's floor (the channel mean sums in another
# order than torch's mean).
SPATIAL_ULPS = 4.0


def _fwd_ulps(dtype):
    return FWD_ULPS_F32 if dtype == torch.float32 else 1.0


def _grad_ulps(dtype):
    return GRAD_ULPS_F32 if dtype == torch.float32 else GRAD_ULPS_LOW


@pytest.fixture(scope="session", autouse=True)
def _report_counts(request):
    request.config._attn_ext_fuzz_counts = COUNTS  # printed by tests/conftest.py
    yield


def _count(family):
    COUNTS[family] = COUNTS.get(family, 0) + 1


def _ci_examples(n):
    """A slow family's CI example count (the CI profile's is 150; --fuzz keeps its own), so
    that the whole of test_fuzz.py stays within CI's budget on 2 cores."""
    if settings.get_current_profile_name() == "ci":
        return settings(max_examples=n)
    return lambda test: test


def _seeded(data):
    """A torch generator seeded from hypothesis, so a failing example replays exactly."""
    torch.manual_seed(data.draw(st.integers(0, 2**31 - 1), label="torch seed"))


def _window(data):
    left = data.draw(st.sampled_from([-1, 0, 1, 3, 7, 20]), label="window left")
    right = data.draw(st.sampled_from([-1, 0, 1, 4, 15]), label="window right")
    return left, right


def _mods(data, B, H, dtype):
    kw = {}
    if data.draw(st.booleans(), label="softcap"):
        kw["softcap"] = data.draw(st.sampled_from([0.5, 2.0, 5.0, 50.0]), label="cap")
    alibi = data.draw(st.sampled_from([None, "head", "batch"]), label="alibi")
    if alibi == "head":
        kw["alibi_slopes"] = torch.rand(H)
    elif alibi == "batch":
        kw["alibi_slopes"] = torch.rand(B, H)
    sinks = torch.randn(H).to(dtype) if data.draw(st.booleans(), label="sinks") else None
    return kw, sinks


def _mask(data, B, H, Sq, Sk, dtype):
    """None, or a bool (True = keep) / additive mask broadcastable to (B, H, Sq, Sk): full,
    per batch, per head, 2-D, or per key, some read through stride-0 (expanded) views."""
    kind = data.draw(
        st.sampled_from([None, "bool", "float", "bool_keys", "bool_2d", "float_bh", "float_x"]),
        label="mask",
    )
    if kind == "bool":
        return torch.rand(B, 1, Sq, Sk) < 0.7
    if kind == "float":
        m = torch.randn(1, H, Sq, Sk).masked_fill(torch.rand(1, H, Sq, Sk) < 0.2, float("-inf"))
        return m.to(dtype)
    if kind == "bool_keys":
        return (torch.rand(B, 1, 1, Sk) < 0.8).expand(B, 1, 1, Sk)
    if kind == "bool_2d":
        return torch.rand(Sq, Sk) < 0.6
    if kind == "float_bh":
        return torch.randn(B, H, 1, Sk).to(dtype)
    if kind == "float_x":  # expanded to the full shape: every stride 0 but the keys'
        m = torch.randn(1, 1, 1, Sk).masked_fill(torch.rand(1, 1, 1, Sk) < 0.3, float("-inf"))
        return m.to(dtype).expand(B, H, Sq, Sk)
    return None


def _amax(t):
    """The largest element of a tensor, 0 for an empty one (no keys: no dk)."""
    return t.max().item() if t.numel() else 0.0


def _check_grads(ours, ref, inputs, g, floors=None):
    """``floors``: an absolute slack per input (assert_error_rule's ``floor``), or None."""
    got = autograd_grads(ours, inputs, g)
    reference = autograd_grads(ref, inputs, g)
    truth = ground_truth_grads(ref, inputs, g)
    floors = floors or [0.0] * len(inputs)
    for x, a, r, t, fl in zip(inputs, got, reference, truth, floors):
        assert a.dtype == x.dtype and a.shape == x.shape
        assert_error_rule(a, r, t, name="grad", slack_ulps=_grad_ulps(a.dtype), floor=fl)
    return got


# --------------------------------------------------------------------------- attention
@given(data=st.data())
def test_fuzz_attention(data):
    _seeded(data)
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    B = data.draw(st.integers(0, 3), label="B")
    Hkv = data.draw(st.integers(1, 3), label="Hkv")
    H = Hkv * data.draw(st.integers(1, 3), label="group")
    Sq, Sk = data.draw(st.integers(0, 40), label="Sq"), data.draw(st.integers(0, 40), label="Sk")
    D, Dv = data.draw(st.integers(1, 72), label="D"), data.draw(st.integers(1, 72), label="Dv")
    layout = data.draw(
        st.sampled_from(["contiguous", "bshd", "noncontig", "expand_b"]), label="layout"
    )
    if layout == "expand_b":  # q, k, v overlapping views (batch stride 0) of one batch row
        q, k, v = (
            rand((1, h, s, d), dtype, "cpu")
            for h, s, d in ((H, Sq, D), (Hkv, Sk, D), (Hkv, Sk, Dv))
        )

        def view(x):
            return x.expand(B, *x.shape[1:])
    else:
        q = rand((B, H, Sq, D), dtype, "cpu", layout)
        k = rand((B, Hkv, Sk, D), dtype, "cpu", layout)
        v = rand((B, Hkv, Sk, Dv), dtype, "cpu", layout)

        def view(x):
            return x

    kw = dict(causal=data.draw(st.booleans(), label="causal"), window_size=_window(data))
    mask = _mask(data, B, H, Sq, Sk, dtype)
    if mask is not None:
        kw["attn_mask"] = mask
    mods, sinks = _mods(data, B, H, dtype)
    kw.update(mods)
    p = data.draw(st.sampled_from([0.0, 0.0, 0.3]), label="dropout")
    if p > 0:
        seed = data.draw(st.integers(0, 2**31 - 1), label="dropout seed")
        keep = attn_ext.dropout_keep_mask(B, H, Sq, Sk, p, torch.Generator().manual_seed(seed))
        ref_kw = dict(kw, dropout_p=p, dropout_keep=keep)
        ours_kw = dict(kw, dropout_p=p)
    else:
        seed, ref_kw, ours_kw = None, kw, kw

    def ours(q, k, v, sinks=None):
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        return attn_ext.attention(view(q), view(k), view(v), sinks=sinks, generator=gen, **ours_kw)

    def ref(q, k, v, sinks=None):
        return attention_reference(view(q), view(k), view(v), sinks=sinks, **ref_kw)

    inputs = [q, k, v] + ([sinks] if sinks is not None else [])
    out = ours(*inputs)
    truth = ground_truth(ref, *inputs)
    assert_error_rule(out, ref(*inputs), truth, name="out", slack_ulps=_fwd_ulps(dtype))
    if p == 0:
        q4, k4, v4 = view(q), view(k), view(v)
        _, lse = attn_ext.attention(q4, k4, v4, sinks=sinks, return_lse=True, **kw)
        _, ref_lse = attention_reference(q4, k4, v4, sinks=sinks, return_lse=True, **kw)
        _, tru_lse = ground_truth(
            attention_reference, q4, k4, v4, sinks=sinks, return_lse=True, **kw
        )
        assert_lse_close(lse, ref_lse, tru_lse)
    else:  # dropout: the same generator state gives the same bits, forward and backward
        assert torch.equal(ours(*inputs), out)
    if data.draw(st.booleans(), label="backward") and out.numel() > 0:
        g = torch.randn(out.shape).to(dtype)
        # dq and dk also carry the stored output's rounding (delta = rowsum(dO * O)); the
        # reference's autograd does not, and can be exact where rows see one key
        fq, fk = stored_output_grad_floors(view(q), view(k), out, truth, g, sinks=sinks, **kw)
        if layout == "expand_b":  # the gradients of the one batch row the views repeat
            fq, fk = fq.sum(0), fk.sum(0)
        floors = [2 * _amax(fq), 2 * _amax(fk)] + [0.0] * (len(inputs) - 2)
        got = _check_grads(ours, ref, inputs, g, floors)
        if p > 0:
            again = autograd_grads(ours, inputs, g)
            assert all(torch.equal(a, b) for a, b in zip(got, again))
    _count("attention")


# --------------------------------------------------------------------------- varlen
@given(data=st.data())
def test_fuzz_attention_varlen(data):
    _seeded(data)
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    B = data.draw(st.integers(0, 6), label="B")
    lq = data.draw(st.lists(st.integers(0, 40), min_size=B, max_size=B), label="lengths q")
    same = data.draw(st.booleans(), label="Sk = Sq")
    lk = lq if same else data.draw(st.lists(st.integers(0, 40), min_size=B, max_size=B))
    Hkv = data.draw(st.integers(1, 3), label="Hkv")
    H = Hkv * data.draw(st.integers(1, 3), label="group")
    D, Dv = data.draw(st.integers(1, 72), label="D"), data.draw(st.integers(1, 72), label="Dv")
    q = torch.randn(sum(lq), H, D).to(dtype)
    k = torch.randn(sum(lk), Hkv, D).to(dtype)
    v = torch.randn(sum(lk), Hkv, Dv).to(dtype)
    cq = torch.tensor([0, *torch.tensor(lq, dtype=torch.int64).cumsum(0).tolist()]).int()
    ck = torch.tensor([0, *torch.tensor(lk, dtype=torch.int64).cumsum(0).tolist()]).int()
    kw = dict(causal=data.draw(st.booleans(), label="causal"), window_size=_window(data))
    mods, sinks = _mods(data, B, H, dtype)
    kw.update(mods)
    # a max_seqlen above the longest is allowed (FlashAttention's contract is an upper bound)
    pad = data.draw(st.integers(0, 3), label="max_seqlen slack")
    mq, mk = max(lq, default=0) + pad, max(lk, default=0) + pad

    def ours(q, k, v, sinks=None):
        return attn_ext.attention_varlen(q, k, v, cq, ck, mq, mk, sinks=sinks, **kw)

    def ref(q, k, v, sinks=None):
        return attention_varlen_reference(q, k, v, cq, ck, sinks=sinks, **kw)

    inputs = [q, k, v] + ([sinks] if sinks is not None else [])
    out = ours(*inputs)
    assert out.shape == (sum(lq), H, Dv)
    truth = ground_truth(ref, *inputs)
    assert_error_rule(out, ref(*inputs), truth, name="out", slack_ulps=_fwd_ulps(dtype))
    if data.draw(st.booleans(), label="paged"):  # the same keys in pages
        page = data.draw(st.integers(1, 20), label="page size")
        layout = data.draw(st.sampled_from(["flash_attn", "heads_first"]), label="page layout")
        k_pages, v_pages, table = paged_varlen_kv(k, v, lk, page, layout)
        paged = attn_ext.attention_varlen(
            q, k_pages, v_pages, cq, ck, mq, mk, sinks=sinks, block_table=table, **kw
        )
        assert_paged_like_packed(paged, out, mq, mk)
    if data.draw(st.booleans(), label="backward") and out.numel() > 0:
        _check_grads(ours, ref, inputs, torch.randn(out.shape).to(dtype))
    _count("attention_varlen")


# --------------------------------------------------------------------------- decoding
@given(data=st.data())
def test_fuzz_decode_attention(data):
    _seeded(data)
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    B = data.draw(st.integers(1, 3), label="B")
    Hkv = data.draw(st.integers(1, 3), label="Hkv")
    H = Hkv * data.draw(st.integers(1, 4), label="group")
    # a decode step (1-4), or a chunk that runs on the flash forward (16 queries and more)
    sq = data.draw(st.one_of(st.integers(1, 4), st.integers(16, 24)), label="Sq")
    L = data.draw(st.integers(1, 60), label="capacity")
    D, Dv = data.draw(st.integers(1, 64), label="D"), data.draw(st.integers(1, 64), label="Dv")
    lens = data.draw(st.lists(st.integers(0, L), min_size=B, max_size=B), label="lengths")
    rows = B
    kw = {}
    page_size = None  # paged: the cache moved into shuffled pages behind a block table
    if data.draw(st.booleans(), label="cache_batch_idx"):
        rows = B + data.draw(st.integers(0, 3), label="extra cache rows")
        kw["cache_batch_idx"] = torch.randperm(rows)[:B].int()
    elif data.draw(st.booleans(), label="paged"):
        # a divisor of L, so the table's capacity is the reference's (L)
        page_size = data.draw(st.sampled_from(_divisors(L)), label="page size")
    if data.draw(st.booleans(), label="cache_leftpad"):
        kw["cache_leftpad"] = torch.tensor([data.draw(st.integers(0, n)) for n in lens]).int()
    causal = data.draw(st.booleans(), label="causal")
    left, right = _window(data)
    kw.update(causal=causal, window_left=left, window_right=-1 if causal else right)
    mods, sinks = _mods(data, B, H, dtype)
    kw.update(mods)
    layout = data.draw(st.sampled_from(["contiguous", "bshd"]), label="cache layout")
    k_cache = rand((rows, Hkv, L, D), dtype, "cpu", layout)
    v_cache = rand((rows, Hkv, L, Dv), dtype, "cpu", layout)
    q = rand((B, H, sq, D), dtype, "cpu", "bshd")
    cache_seqlens = torch.tensor(lens, dtype=torch.int32)
    splits = data.draw(st.sampled_from([0, 1, 2, 5]), label="num_splits")
    k_in, v_in, paged_kw = k_cache, v_cache, {}
    # A float8 cache: the kernel reads the bytes, the reference the dequantized values (exact in
    # every q dtype: float8 values times powers of two).
    fp8 = data.draw(st.sampled_from([None, torch.float8_e4m3fn, torch.float8_e5m2]), label="fp8")
    if fp8 is not None:
        scales = [2.0 ** -data.draw(st.integers(0, 6), label=f"{n} scale exp") for n in "kv"]
        big = torch.finfo(fp8).max
        k_in, v_in = (
            (t.double() * 4 / s).clamp(-big, big).to(fp8)
            for t, s in zip((k_cache, v_cache), scales)
        )
        k_cache, v_cache = ((t.double() * s).to(dtype) for t, s in zip((k_in, v_in), scales))
        kw_fp8 = dict(k_scale=scales[0], v_scale=scales[1])
    if page_size is not None:
        bytes_k, bytes_v = (t.view(torch.uint8) if fp8 else t for t in (k_in, v_in))
        k_in, v_in, table = page_out(
            bytes_k, bytes_v, page_size, seed=data.draw(st.integers(0, 99))
        )
        if fp8 is not None:
            k_in, v_in = k_in.view(fp8), v_in.view(fp8)
        if layout == "bshd":  # FlashAttention's (num_pages, page_size, Hkv, D), transposed
            k_in, v_in = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k_in, v_in))
        paged_kw["block_table"] = table
    if fp8 is not None:
        paged_kw.update(kw_fp8)
    out, lse = attn_ext.decode_attention(
        q,
        k_in,
        v_in,
        cache_seqlens,
        sinks=sinks,
        num_splits=splits,
        return_lse=True,
        **kw,
        **paged_kw,
    )
    ref, ref_lse = decode_reference(q, k_cache, v_cache, cache_seqlens, sinks=sinks, **kw)
    tru, tru_lse = ground_truth(
        decode_reference, q, k_cache, v_cache, cache_seqlens, sinks=sinks, **kw
    )
    assert_error_rule(out, ref, tru, name="decode out", slack_ulps=_fwd_ulps(dtype))
    assert_lse_close(lse, ref_lse, tru_lse, name="decode lse")
    _count("decode_attention")


@given(data=st.data())
def test_fuzz_rope(data):
    _seeded(data)
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    B, H = data.draw(st.integers(0, 3), label="B"), data.draw(st.integers(1, 3), label="H")
    S = data.draw(st.integers(0, 30), label="S")
    D = 2 * data.draw(st.integers(1, 40), label="D / 2")
    rotary_dim = 2 * data.draw(st.integers(1, D // 2), label="rotary_dim / 2")
    layout = data.draw(st.sampled_from(["contiguous", "bshd", "noncontig"]), label="layout")
    x = rand((B, H, S, D), dtype, "cpu", layout)
    kind = data.draw(st.sampled_from(["offset", "shared", "per_batch"]), label="positions")
    kw = dict(
        interleaved=data.draw(st.booleans(), label="interleaved"),
        rotary_dim=rotary_dim,
        base=data.draw(st.sampled_from([10000.0, 500.0, 1e6]), label="base"),
    )
    if kind == "offset":
        kw["offset"] = data.draw(st.integers(0, 100_000), label="offset")
    elif kind == "shared":
        kw["positions"] = torch.randint(0, 100_000, (S,))
    else:
        kw["positions"] = torch.randint(0, 100_000, (B, S))
    variants = ["plain", "linear", "yarn", "llama3"]  # longrope's factors fix rotary_dim 64
    variant = data.draw(st.sampled_from(variants), label="variant")
    if variant != "plain":  # a scaled variant's table and cos / sin factor
        kw["inv_freq"], kw["attention_scaling"] = attn_ext.rope_parameters(
            rotary_dim, kw["base"], ROPE_SCALING_EXAMPLES[variant]
        )
    out = attn_ext.rope(x, **kw)
    ref = rope_reference(x, **kw)
    tru = rope_reference(x, compute_dtype=torch.float64, **kw)  # attn_ext's frequencies, fp64
    assert out.stride() == torch.empty_like(x).stride()  # x's strides where x is dense
    assert_error_rule(out, ref, tru, name="rope")
    _count("rope")


def _check_paged_append(op, pages, table, page_size, lens, dense, dense_lens, overflow):
    """Runs the paged append ``op`` after the same append on the contiguous caches ``dense``
    (checked by _check_append): the table then reads back the contiguous caches, every row
    (the capacity is L), the lengths match, and the pages outside the table keep their bits; if
    the contiguous append overflowed, the paged one must raise and write nothing."""
    before = [p.clone() for p in pages]
    lens_before = lens.clone()
    if overflow:
        with pytest.raises(RuntimeError, match="overflow"):
            op()
        assert torch.equal(lens, lens_before)
        for a, b in zip(before, pages):
            assert torch.equal(a, b), "an overflowing paged append wrote"
        return
    op()
    assert torch.equal(lens, dense_lens)
    outside = torch.ones(pages[0].size(0), dtype=torch.bool)
    outside[table.flatten().long()] = False
    for p, b, d in zip(pages, before, dense):
        assert torch.equal(gather_pages(p, table, page_size), d), "paged rows differ"
        assert torch.equal(p[outside], b[outside]), "a page outside the table changed"


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


# --------------------------------------------------------------------------- attention_weights
def _probabilities_case(data, with_v=False):
    """dtype, q, k, v (None unless with_v) and the masking keywords of a probabilities case."""
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    B = data.draw(st.integers(0, 3), label="B")
    Hkv = data.draw(st.integers(1, 3), label="Hkv")
    H = Hkv * data.draw(st.integers(1, 3), label="group")
    Sq, Sk = data.draw(st.integers(0, 40), label="Sq"), data.draw(st.integers(0, 40), label="Sk")
    D = data.draw(st.integers(1, 72), label="D")
    Dv = data.draw(st.integers(1, 40), label="Dv") if with_v else None
    layout = data.draw(st.sampled_from(["contiguous", "bshd", "noncontig"]), label="layout")
    q = rand((B, H, Sq, D), dtype, "cpu", layout)
    k = rand((B, Hkv, Sk, D), dtype, "cpu", layout)
    v = rand((B, Hkv, Sk, Dv), dtype, "cpu", layout) if with_v else None
    kw = dict(causal=data.draw(st.booleans(), label="causal"), window_size=_window(data))
    mask = _mask(data, B, H, Sq, Sk, dtype)
    if mask is not None:
        kw["attn_mask"] = mask
    if data.draw(st.booleans(), label="explicit scale"):
        kw["scale"] = data.draw(st.sampled_from([0.05, 0.3, 1.0, 2.5]), label="scale")
    mods, sinks = _mods(data, B, H, dtype)  # attention's score modifiers, constants here
    kw.update(mods)
    if sinks is not None:
        kw["sinks"] = sinks
    return dtype, q, k, v, kw


@_ci_examples(100)
@given(data=st.data())
def test_fuzz_attention_weights(data):
    _seeded(data)
    dtype, q, k, _, kw = _probabilities_case(data)
    mask, H = kw.get("attn_mask"), q.shape[1]
    if H == 1 and data.draw(st.booleans(), label="3-D"):  # (B, S, D): one head
        q, k = q.squeeze(1), k.squeeze(1)
        if mask is not None and mask.dim() == 4:
            kw["attn_mask"] = mask.squeeze(1)

    def ours(q, k):
        return attn_ext.attention_weights(q, k, **kw)

    def ref(q, k):
        return attention_weights_reference(q, k, **kw)

    w = ours(q, k)
    assert w.dtype == dtype and w.shape == (*q.shape[:-1], k.shape[-2])
    assert_error_rule(
        w,
        ref(q, k),
        ground_truth(ref, q, k),
        name="weights",
        slack_ulps=_fwd_ulps(dtype),
        floor=max(perturbation_floor(ref, [q, k], dtype), logit_rounding_floor(q, k, dtype, **kw)),
    )
    assert (w >= 0).all()
    if data.draw(st.booleans(), label="backward") and w.numel() > 0:
        _check_grads(ours, ref, [q, k], torch.randn(w.shape).to(dtype))
    _count("attention_weights")


# --------------------------------------------------------------- attention_with_weights
@_ci_examples(100)
@given(data=st.data())
def test_fuzz_attention_with_weights(data):
    """The output is attention's own (same call, same dropout state), the weights its
    probabilities (dropped with the same mask; per head or their mean), both differentiated."""
    _seeded(data)
    dtype, q, k, v, kw = _probabilities_case(data, with_v=True)
    B, H, Sq, Sk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    mean_heads = data.draw(st.booleans(), label="mean over heads")
    p = data.draw(st.sampled_from([0.0, 0.0, 0.3]), label="dropout")
    seed = data.draw(st.integers(0, 2**31 - 1), label="dropout seed") if p > 0 else None
    keep = None
    if p > 0:
        keep = attn_ext.dropout_keep_mask(B, H, Sq, Sk, p, torch.Generator().manual_seed(seed))

    def generator():
        return torch.Generator().manual_seed(seed) if seed is not None else None

    def ours(q, k, v):
        out, w = attn_ext.attention_with_weights(
            q, k, v, dropout_p=p, generator=generator(), mean_heads=mean_heads, **kw
        )
        return torch.cat([out.flatten(), w.flatten()])

    def ref_weights(q, k):
        w = attention_weights_reference(q, k, **kw)
        w = w if keep is None else w * keep.to(w.dtype) / (1 - p)
        return w.mean(1) if mean_heads else w

    def ref(q, k, v):
        out = attention_reference(q, k, v, dropout_p=p, dropout_keep=keep, **kw)
        return torch.cat([out.flatten(), ref_weights(q, k).flatten()])

    out, w = attn_ext.attention_with_weights(
        q, k, v, dropout_p=p, generator=generator(), mean_heads=mean_heads, **kw
    )
    want_out = attn_ext.attention(q, k, v, dropout_p=p, generator=generator(), **kw)
    assert torch.equal(out, want_out)
    assert w.dtype == dtype and w.shape == ((B, Sq, Sk) if mean_heads else (B, H, Sq, Sk))
    assert_error_rule(
        w,
        ref_weights(q, k),
        ground_truth(ref_weights, q, k),
        name="weights",
        slack_ulps=_fwd_ulps(dtype),
        floor=max(
            perturbation_floor(ref_weights, [q, k], dtype),
            logit_rounding_floor(q, k, dtype, **kw) / (1 - p),
        ),
    )
    assert (w >= 0).all()
    if data.draw(st.booleans(), label="backward") and out.numel() + w.numel() > 0:
        g = torch.randn(out.numel() + w.numel()).to(dtype)
        # dq and dk carry the stored output's rounding through delta (test_fuzz_attention)
        truth = ground_truth(
            lambda *a: attention_reference(*a, dropout_p=p, dropout_keep=keep, **kw), q, k, v
        )
        fq, fk = stored_output_grad_floors(q, k, out, truth, g[: out.numel()].view(out.shape), **kw)
        _check_grads(ours, ref, [q, k, v], g, [2 * _amax(fq), 2 * _amax(fk), 0.0])
    _count("attention_with_weights")


# --------------------------------------------------------------------------- cache appends
def _rope_kw(data, D):
    """kv_cache_append's rope arguments: layout, base and rotary_dim (even, <= D)."""
    kw = dict(
        rope_interleaved=data.draw(st.booleans(), label="interleaved"),
        rope_base=data.draw(st.sampled_from([10000.0, 500.0, 1e6]), label="base"),
    )
    if D % 2 == 1 or data.draw(st.booleans(), label="partial rotary"):
        kw["rotary_dim"] = 2 * data.draw(st.integers(1, D // 2), label="rotary_dim / 2")
    return kw


def _check_append(op, views, lengths, parts, rope_kw, new_lengths):
    """Runs the append ``op`` and checks it: each sequence's last n_b new rows of parts[i] land
    at rows [len_b, len_b + n_b) of views[i] (parts[0], the keys, rotated at those positions
    against rope_reference when rope_kw is given; the others copied bit for bit), lengths
    advance by n_b, and every other element of the memory under the views (the whole buffers
    they are views of) keeps its bits. An overflowing append must raise and write nothing."""
    buffers = []
    for view in views:  # the distinct buffers (a view's base, or the view itself)
        buf = view if view._base is None else view._base
        if not any(buf is b for b in buffers):
            buffers.append(buf)
    before = [b.clone() for b in buffers]
    old_lengths = lengths.clone()
    S = parts[0].size(2)
    lens = lengths.tolist()
    n = [S] * len(lens) if new_lengths is None else new_lengths.tolist()
    if any(a + b > views[0].size(2) for a, b in zip(lens, n)):
        with pytest.raises(RuntimeError, match="overflow"):
            op()
        assert torch.equal(lengths, old_lengths)
        for a, b in zip(before, buffers):
            assert torch.equal(a, b), "an overflowing append wrote"
        return
    op()
    assert lengths.tolist() == [a + b for a, b in zip(lens, n)]
    for view, part in zip(views, parts):
        j = next(i for i, buf in enumerate(buffers) if buf is view or buf is view._base)
        # the same view of the old buffer: the expected memory is the old one with the
        # appended rows taken from the new buffer (those rows are checked below)
        expect = before[j].as_strided(
            view.size(), view.stride(), view.storage_offset() - buffers[j].storage_offset()
        )
        for b, (start, nb) in enumerate(zip(lens, n)):
            got = view[b : b + 1, :, start : start + nb]
            expect[b : b + 1, :, start : start + nb] = got
            new = part[b : b + 1, :, S - nb :]
            if view is views[0] and rope_kw is not None:
                kw = dict(
                    offset=start,
                    base=rope_kw["rope_base"],
                    interleaved=rope_kw["rope_interleaved"],
                    rotary_dim=rope_kw.get("rotary_dim"),
                )
                tru = rope_reference(new, compute_dtype=torch.float64, **kw)
                assert_error_rule(got, rope_reference(new, **kw), tru, name="rotated rows")
            else:
                assert torch.equal(got, new), "copied rows differ"
    for a, b in zip(before, buffers):
        assert torch.equal(a, b), "memory outside the appended rows changed"


@given(data=st.data())
def test_fuzz_kv_cache_append(data):
    _seeded(data)
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    B = data.draw(st.integers(0, 3), label="B")
    Hkv = data.draw(st.integers(1, 3), label="Hkv")
    L = data.draw(st.integers(0, 40), label="capacity")
    D, Dv = data.draw(st.integers(1, 48), label="D"), data.draw(st.integers(1, 48), label="Dv")
    S = data.draw(st.integers(0, 9), label="S_new")
    cache_layout = data.draw(st.sampled_from(["contiguous", "bshd", "v_view"]), label="cache")
    k_cache = rand((B, Hkv, L, D), dtype, "cpu", "bshd" if cache_layout == "bshd" else "contiguous")
    if cache_layout == "v_view":  # values: a column view of a wider cache
        v_cache = rand((B, Hkv, L, Dv + 5), dtype, "cpu")[..., 2 : Dv + 2]
    else:
        v_cache = rand((B, Hkv, L, Dv), dtype, "cpu", cache_layout)
    len_dtype = data.draw(st.sampled_from([torch.int32, torch.int64]), label="lengths dtype")
    lengths = torch.tensor(
        data.draw(st.lists(st.integers(0, L), min_size=B, max_size=B), label="lengths"),
        dtype=len_dtype,
    )
    layout = data.draw(st.sampled_from(["contiguous", "bshd", "noncontig"]), label="layout")
    k, v = rand((B, Hkv, S, D), dtype, "cpu", layout), rand((B, Hkv, S, Dv), dtype, "cpu", layout)
    new_lengths = None
    if data.draw(st.booleans(), label="new_lengths"):
        new_lengths = torch.tensor(
            data.draw(st.lists(st.integers(0, S), min_size=B, max_size=B), label="n"),
            dtype=torch.int64,
        )
    rope_kw = _rope_kw(data, D) if D >= 2 and data.draw(st.booleans(), label="rope") else None
    paged = None  # the same append through a block table, on pages holding the same rows
    if B > 0 and L > 0 and cache_layout != "v_view" and data.draw(st.booleans(), label="paged"):
        page_size = data.draw(st.sampled_from(_divisors(L)), label="page size")
        pages = page_out(k_cache.clone(), v_cache.clone(), page_size)
        n = [S] * B if new_lengths is None else new_lengths.tolist()
        overflow = any(a + b > L for a, b in zip(lengths.tolist(), n))
        paged = (page_size, *pages, lengths.clone(), overflow)

    def op(caches=(k_cache, v_cache), lens=lengths, **table):
        torch.ops.attn_ext.kv_cache_append(
            *caches,
            lens,
            k,
            v,
            new_lengths,
            rope=rope_kw is not None,
            **(rope_kw or {}),
            **table,
        )

    _check_append(op, [k_cache, v_cache], lengths, [k, v], rope_kw, new_lengths)
    if paged is not None:
        page_size, k_pages, v_pages, table, lens, overflow = paged
        _check_paged_append(
            lambda: op((k_pages, v_pages), lens, block_table=table),
            [k_pages, v_pages],
            table,
            page_size,
            lens,
            [k_cache, v_cache],
            lengths,
            overflow,
        )
    _count("kv_cache_append")


@given(data=st.data())
def test_fuzz_latent_cache_append(data):
    # MLA's cache: one buffer (B, Hkv, L, Dc + Dr) of rows [c_kv, RoPE(k_rope)]
    _seeded(data)
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    B = data.draw(st.integers(0, 3), label="B")
    Hkv = data.draw(st.integers(1, 2), label="Hkv")
    L = data.draw(st.integers(0, 40), label="capacity")
    Dc = data.draw(st.integers(1, 40), label="Dc")
    Dr = 2 * data.draw(st.integers(1, 16), label="Dr / 2")
    S = data.draw(st.integers(0, 9), label="S_new")
    cache_layout = data.draw(st.sampled_from(["contiguous", "bshd"]), label="cache")
    cache = rand((B, Hkv, L, Dc + Dr), dtype, "cpu", cache_layout)
    lengths = torch.tensor(
        data.draw(st.lists(st.integers(0, L), min_size=B, max_size=B), label="lengths"),
        dtype=data.draw(st.sampled_from([torch.int32, torch.int64]), label="lengths dtype"),
    )
    layout = data.draw(st.sampled_from(["contiguous", "bshd", "noncontig"]), label="layout")
    c_kv = rand((B, Hkv, S, Dc), dtype, "cpu", layout)
    k_rope = rand((B, Hkv, S, Dr), dtype, "cpu", layout)
    new_lengths = None
    if data.draw(st.booleans(), label="new_lengths"):
        new_lengths = torch.tensor(
            data.draw(st.lists(st.integers(0, S), min_size=B, max_size=B), label="n"),
            dtype=torch.int32,
        )
    rope_kw = dict(
        rope_interleaved=data.draw(st.booleans(), label="interleaved"),
        rope_base=data.draw(st.sampled_from([10000.0, 500.0, 1e6]), label="base"),
    )

    def op():
        torch.ops.attn_ext.latent_cache_append(cache, lengths, c_kv, k_rope, new_lengths, **rope_kw)

    views = [cache[..., Dc:], cache[..., :Dc]]
    _check_append(op, views, lengths, [k_rope, c_kv], rope_kw, new_lengths)
    _count("latent_cache_append")


# --------------------------------------------------------------------------- linear attention
@_ci_examples(100)
@given(data=st.data())
def test_fuzz_linear_attention(data):
    _seeded(data)
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    B, H = data.draw(st.integers(0, 3), label="B"), data.draw(st.integers(1, 3), label="H")
    causal = data.draw(st.booleans(), label="causal")
    # lengths across the causal kernel's 64-position chunks
    Sq = data.draw(st.one_of(st.integers(0, 20), st.integers(50, 140)), label="Sq")
    Sk = Sq if causal else data.draw(st.integers(0, 80), label="Sk")
    D, Dv = data.draw(st.integers(1, 40), label="D"), data.draw(st.integers(1, 40), label="Dv")
    feature_map = data.draw(st.sampled_from(["elu+1", "relu", "identity"]), label="feature_map")
    eps = data.draw(st.sampled_from([1e-6, 1e-3, 0.5]), label="eps")
    layout = data.draw(st.sampled_from(["contiguous", "bshd", "noncontig"]), label="layout")
    q = rand((B, H, Sq, D), dtype, "cpu", layout)
    k = rand((B, H, Sk, D), dtype, "cpu", layout)
    v = rand((B, H, Sk, Dv), dtype, "cpu", layout)
    if feature_map == "identity":
        # identity takes features the caller made: nonnegative ones, as linear attention's
        # normalizer needs (with random signs its denominator crosses 0 and both the kernel's
        # and the reference's errors there are conditioning, up to 1e6 ulps at D = 1)
        q, k = q.abs(), k.abs()
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    inputs = [q, k, v]
    if data.draw(st.booleans(), label="initial_state"):  # the state of some earlier keys
        n0 = data.draw(st.integers(1, 30), label="earlier keys")
        k0, v0 = torch.randn(B, H, n0, D), torch.randn(B, H, n0, Dv)
        if feature_map == "identity":
            # nonnegative earlier keys too: the state's key sum is part of the normalizer
            # (--fuzz found it crossing 0 with Sk = 0: gradients ~1e4, inf in float16)
            k0 = k0.abs()
        inputs += [t.to(state_dtype) for t in final_state(k0, v0, feature_map=feature_map)]
    three_d = H == 1 and data.draw(st.booleans(), label="3-D")
    return_state = data.draw(st.booleans(), label="return_state")
    kw = dict(causal=causal, eps=eps, feature_map=feature_map)

    def ours_full(q, k, v, *state):
        if three_d:
            q, k, v = q.squeeze(1), k.squeeze(1), v.squeeze(1)
            state = [t.squeeze(1) for t in state]
        init = tuple(state) if state else None
        out, st_ = attn_ext.linear_attention(q, k, v, initial_state=init, return_state=True, **kw)
        if three_d:
            out, st_ = out.unsqueeze(1), tuple(t.unsqueeze(1) for t in st_)
        return out, st_

    def ref_full(q, k, v, *state, normalizer_grad=True):
        init = tuple(state) if state else None
        out = linear_attention_quadratic(
            q, k, v, initial_state=init, normalizer_grad=normalizer_grad, **kw
        )
        return out, final_state(k, v, feature_map=feature_map, initial_state=init)

    got, want, tru = ours_full(*inputs), ref_full(*inputs), ground_truth(ref_full, *inputs)
    slack = _fwd_ulps(dtype)
    floor = perturbation_floor(lambda *x: ref_full(*x)[0], inputs, dtype)
    assert_error_rule(got[0], want[0], tru[0], name="out", slack_ulps=slack, floor=floor)
    if return_state:
        assert got[1][0].dtype == got[1][1].dtype == state_dtype
        for i, (name, a, r, t) in enumerate(zip(("kv state", "k state"), got[1], want[1], tru[1])):
            fl = perturbation_floor(lambda *x, i=i: ref_full(*x)[1][i], inputs, dtype)
            assert_error_rule(a, r, t, name=name, slack_ulps=slack, floor=fl)
    if data.draw(st.booleans(), label="backward") and got[0].numel() > 0:
        # through out, or through out and the returned state (one flat output)
        def pick(fn):
            return (lambda *x: _flat(fn(*x))) if return_state else (lambda *x: fn(*x)[0])

        ours, ref = pick(ours_full), pick(ref_full)
        n = ours(*inputs)
        g = torch.randn(n.shape).to(n.dtype)
        if return_state:
            # the flat output is float32 for float16 / bfloat16 inputs, but its out part
            # reaches both kernels through out.to(float32)'s backward, rounded to out's dtype:
            # the float64 truth must see that same gradient (unrounded, the truth differed
            # from both by half an ulp of the dtype: --fuzz, kv-state gradient at D = 1)
            m = got[0].numel()
            g[:m] = g[:m].to(got[0].dtype).to(g.dtype)
        floors = gradient_term_floors(
            pick(lambda *x: ref_full(*x, normalizer_grad=False)), inputs, g
        )
        _check_grads(ours, ref, inputs, g, floors)
    _count("linear_attention")


def _flat(res):
    """(out, (kv_state, k_state)) as one flat tensor at the wider of out's dtype and float32
    (the states are float32, float64 for float64), so that one error rule and one output
    gradient cover all three."""
    out, (kv, ks) = res
    dt = torch.promote_types(out.dtype, kv.dtype)
    return torch.cat([out.reshape(-1).to(dt), kv.reshape(-1).to(dt), ks.reshape(-1).to(dt)])


# --------------------------------------------------------------------------- MLA and TPA
@given(data=st.data())
def test_fuzz_tpa_expand(data):
    _seeded(data)
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    B, S = data.draw(st.integers(0, 3), label="B"), data.draw(st.integers(0, 12), label="S")
    R, H = data.draw(st.integers(1, 6), label="R"), data.draw(st.integers(1, 6), label="H")
    D = data.draw(st.integers(1, 40), label="D")
    # "bshd" makes the factors rank-major views (B, R, S, n).transpose(1, 2)
    layout = data.draw(st.sampled_from(["contiguous", "bshd", "noncontig"]), label="layout")
    a, b = rand((B, S, R, H), dtype, "cpu", layout), rand((B, S, R, D), dtype, "cpu", layout)
    kw = {}
    if data.draw(st.booleans(), label="explicit scale"):
        kw["scale"] = data.draw(st.sampled_from([0.25, 1.0, 3.0]), label="scale")
    if D >= 2 and data.draw(st.booleans(), label="rope"):
        kw.update(
            rope=True,
            rope_interleaved=data.draw(st.booleans(), label="interleaved"),
            rope_base=data.draw(st.sampled_from([10000.0, 500.0]), label="base"),
        )
        if D % 2 == 1 or data.draw(st.booleans(), label="partial rotary"):
            kw["rotary_dim"] = 2 * data.draw(st.integers(1, D // 2), label="rotary_dim / 2")
        pos = data.draw(st.sampled_from([None, "shared", "per_batch"]), label="positions")
        idx = data.draw(st.sampled_from([torch.int32, torch.int64]), label="positions dtype")
        if pos == "shared":
            kw["positions"] = torch.randint(0, 30000, (S,), dtype=idx)
        elif pos == "per_batch":
            kw["positions"] = torch.randint(0, 30000, (B, S), dtype=idx)

    def ours(a, b):
        return attn_ext.tpa_expand(a, b, **kw)

    def ref(a, b):
        return tpa_expand_reference(a, b, **kw)

    out = ours(a, b)
    assert out.shape == (B, S, H, D) and out.dtype == dtype and out.is_contiguous()
    assert_error_rule(
        out, ref(a, b), ground_truth(ref, a, b), name="tpa_expand", slack_ulps=_fwd_ulps(dtype)
    )
    if data.draw(st.booleans(), label="backward") and out.numel() > 0:
        _check_grads(ours, ref, [a, b], torch.randn(out.shape).to(dtype))
    _count("tpa_expand")


@given(data=st.data())
def test_fuzz_tpa_decode_attention(data):
    _seeded(data)
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    B, H = data.draw(st.integers(1, 3), label="B"), data.draw(st.integers(1, 4), label="H")
    S, N = data.draw(st.integers(1, 4), label="S"), data.draw(st.integers(0, 40), label="N")
    rk, rv = data.draw(st.integers(1, 4), label="R_K"), data.draw(st.integers(1, 4), label="R_V")
    D = data.draw(st.integers(1, 48), label="D")
    layout = data.draw(st.sampled_from(["contiguous", "bshd", "noncontig"]), label="layout")
    q = rand((B, H, S, D), dtype, "cpu", "bshd" if layout == "bshd" else "contiguous")
    factors = [
        rand((B, N, r, n), dtype, "cpu", layout) for r, n in ((rk, H), (rk, D), (rv, H), (rv, D))
    ]
    lengths = torch.tensor(
        data.draw(st.lists(st.integers(0, N), min_size=B, max_size=B), label="lengths"),
        dtype=data.draw(st.sampled_from([torch.int32, torch.int64]), label="lengths dtype"),
    )
    kw = {}
    for name in ("scale", "k_scale", "v_scale"):
        if data.draw(st.booleans(), label=name):
            kw[name] = data.draw(st.sampled_from([0.1, 0.5, 1.0, 2.0]), label=f"{name} value")
    out, lse = attn_ext.tpa_decode_attention(q, *factors, lengths, return_lse=True, **kw)
    assert out.dtype == dtype and lse.dtype == torch.float32
    # the plain reference forms K and V in float32 (float64) and rounds like ours (test_tpa.py)
    ref, ref_lse = tpa_decode_reference(q, *factors, lengths, **kw)
    tru, tru_lse = tpa_decode_reference(q, *factors, lengths, compute_dtype=torch.float64, **kw)
    floor = perturbation_floor(
        lambda q, *f: tpa_decode_reference(q, *f, lengths, **kw)[0], [q, *factors], dtype
    )
    assert_error_rule(out, ref.to(dtype), tru, name="out", slack_ulps=_fwd_ulps(dtype), floor=floor)
    assert_lse_close(lse, ref_lse, tru_lse)
    if data.draw(st.booleans(), label="backward"):

        def ours(*x):
            return attn_ext.tpa_decode_attention(*x, lengths, **kw)

        def ref_fn(q, *f):  # the plain reference at the inputs' own dtype
            return tpa_decode_reference(q, *f, lengths, compute_dtype=q.dtype, **kw)[0]

        _check_grads(ours, ref_fn, [q, *factors], torch.randn(out.shape).to(dtype))
    _count("tpa_decode_attention")


@_ci_examples(100)
@given(data=st.data())
def test_fuzz_mla(data):
    # attn_ext.nn.MultiHeadLatentAttention with random dims against mla_reference (DeepSeek-V2's
    # equations): the prefill (and its input gradient), or the weight-absorbed (or decompressed)
    # decode over latent_cache_append + decode_attention, step by step from a prompt.
    _seeded(data)
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    d_model, heads = (
        data.draw(st.integers(1, 40), label="d_model"),
        data.draw(st.integers(1, 4), label="heads"),
    )
    dims = dict(
        q_lora_rank=data.draw(st.one_of(st.none(), st.integers(1, 24)), label="q_lora_rank"),
        kv_lora_rank=data.draw(st.integers(1, 32), label="kv_lora_rank"),
        qk_nope_head_dim=data.draw(st.integers(1, 16), label="nope"),
        qk_rope_head_dim=2 * data.draw(st.integers(1, 8), label="rope / 2"),
        v_head_dim=data.draw(st.integers(1, 16), label="v_head_dim"),
        rope_interleaved=data.draw(st.booleans(), label="interleaved"),
    )
    m = attn_ext.nn.MultiHeadLatentAttention(d_model, heads, **dims)
    with torch.no_grad():  # RMSNorm weights away from 1, so that a missing weight shows
        for norm in (m.kv_a_layernorm, getattr(m, "q_a_layernorm", None)):
            if norm is not None:
                norm.weight.uniform_(0.5, 1.5)
    m = m.to(dtype)
    B, T = data.draw(st.integers(1, 3), label="B"), data.draw(st.integers(1, 14), label="T")
    x = torch.randn(B, T, d_model).to(dtype)
    w = {k: (t.detach() if isinstance(t, torch.Tensor) else t) for k, t in paper_weights(m).items()}

    def ref(x, w=w):
        return mla_reference(x, w, rope_base=m.rope_base, interleaved=m.rope_interleaved)

    mode = data.draw(st.sampled_from(["prefill", "absorbed", "decompressed"]), label="mode")
    if mode == "prefill":
        out = m(x)
        assert_error_rule(
            out,
            ref(x),
            ground_truth(ref, x),
            name="mla prefill",
            slack_ulps=_fwd_ulps(dtype),
            floor=perturbation_floor(ref, [x, w], dtype),
        )
        if data.draw(st.booleans(), label="backward"):
            _check_grads(m, ref, [x], torch.randn(out.shape).to(dtype))
    else:
        prompt = data.draw(st.integers(1, T), label="prompt")
        chunk = data.draw(st.integers(1, 3), label="chunk")
        cache = m.new_cache(B, T + data.draw(st.integers(0, 3), label="spare rows"))
        with torch.no_grad():
            outs = [m(x[:, :prompt], cache, absorb=mode == "absorbed")]
            for t in range(prompt, T, chunk):
                outs.append(m(x[:, t : t + chunk], cache, absorb=mode == "absorbed"))
        out = torch.cat(outs, dim=1)
        assert cache.lengths.tolist() == [T] * B
        # factor 4, as tests/test_mla.py: the absorbed form sums in another order (the latent,
        # then W^UV) and in low precision rounds the latent query and the attended latent once
        # more than the reference does.
        assert_error_rule(
            out,
            ref(x),
            ground_truth(ref, x),
            name=f"mla {mode} decode",
            factor=4.0,
            slack_ulps=_fwd_ulps(dtype),
            floor=perturbation_floor(ref, [x, w], dtype),
        )
    _count("mla")


# --------------------------------------------------------------------------- spatial (CBAM)
def _feature_map(data, dtype):
    N, C = data.draw(st.integers(0, 3), label="N"), data.draw(st.integers(1, 40), label="C")
    H, W = data.draw(st.integers(0, 13), label="H"), data.draw(st.integers(0, 13), label="W")
    layout = data.draw(st.sampled_from(["nchw", "channels_last", "strided"]), label="layout")
    x = torch.randn(N, C, H, 2 * W if layout == "strided" else W).to(dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "strided":  # neither layout: the ops copy it
        x = x[..., ::2]
    return x, layout


@given(data=st.data())
def test_fuzz_channel_pool(data):
    _seeded(data)
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    x, _ = _feature_map(data, dtype)
    if data.draw(st.booleans(), label="ties"):  # few distinct values: ties for the max
        x = torch.randint(-2, 3, x.shape).to(dtype).contiguous(memory_format=_format(x))
    pooled, argmax = attn_ext.channel_pool(x, return_argmax=True)
    assert pooled.dtype == dtype and argmax.dtype == torch.int32
    assert pooled.shape == (x.size(0), 2, *x.shape[2:])
    assert torch.equal(argmax.long(), torch.max(x, dim=1, keepdim=True).indices)
    ref = spatial_ref.channel_pool
    assert_error_rule(pooled, ref(x), ground_truth(ref, x), name="pooled", slack_ulps=SPATIAL_ULPS)
    if data.draw(st.booleans(), label="backward") and pooled.numel() > 0:
        _check_grads(attn_ext.channel_pool, ref, [x], torch.randn(pooled.shape).to(dtype))
    _count("channel_pool")


@given(data=st.data())
def test_fuzz_spatial_gate(data):
    _seeded(data)
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    x, layout = _feature_map(data, dtype)
    low = dtype in (torch.bfloat16, torch.float16)
    gate_dtype = torch.float32 if low and data.draw(st.booleans(), label="fp32 gate") else dtype
    gate = (3 * torch.randn(x.size(0), 1, *x.shape[2:])).to(gate_dtype)
    if data.draw(st.booleans(), label="channels_last gate"):
        gate = gate.contiguous(memory_format=torch.channels_last)

    def ref(x, gate):  # rounded to x's dtype like ours (the reference promotes to the gate's)
        return spatial_ref.spatial_gate(x, gate).to(x.dtype)

    out = attn_ext.spatial_gate(x, gate)
    assert out.dtype == dtype and out.shape == x.shape
    if layout != "strided":
        assert (
            out.stride() == x.stride()
            or out.numel() == 0
            or min(x.shape[1], x.shape[2] * x.shape[3]) <= 1
        )
    assert_error_rule(
        out, ref(x, gate), ground_truth(ref, x, gate), name="gated", slack_ulps=SPATIAL_ULPS
    )
    if data.draw(st.booleans(), label="backward") and out.numel() > 0:
        _check_grads(attn_ext.spatial_gate, ref, [x, gate], torch.randn(out.shape).to(dtype))
    _count("spatial_gate")


def _format(x):
    return (
        torch.channels_last
        if x.dim() == 4
        and x.is_contiguous(memory_format=torch.channels_last)
        and not x.is_contiguous()
        else torch.contiguous_format
    )


# --------------------------------------------------------------------------- drop-in modules
def _compat_case(data):
    """One attn_ext.compat class or function against its document's code, with drawn
    constructor arguments and input shapes (the fixed-shape cases are compat_cases())."""
    tc, lfs, tb, zoo = torchcode, llms_from_scratch, textbook, attention_zoo
    ints = st.integers
    B, Sq, Sk = (
        data.draw(ints(1, 3), label="B"),
        data.draw(ints(1, 20), label="Sq"),
        data.draw(ints(1, 20), label="Sk"),
    )
    heads = data.draw(ints(1, 4), label="heads")
    hd = data.draw(ints(1, 12), label="head dim")
    E = heads * hd
    D, Dv = data.draw(ints(1, 24), label="D"), data.draw(ints(1, 24), label="Dv")
    bias = data.draw(st.booleans(), label="qkv_bias")
    name = data.draw(st.sampled_from(COMPAT_NAMES), label="case")
    x, kv = (B, Sq, E), (B, Sk, E)
    C = CompatCase
    if name == "torchcode.scaled_dot_product_attention":
        lead = data.draw(st.sampled_from([(), (B,), (B, heads), (B, 2, heads)]), label="lead dims")
        return C(
            name,
            doc000.scaled_dot_product_attention,
            tc.scaled_dot_product_attention,
            ((*lead, Sq, D), (*lead, Sk, D), (*lead, Sk, Dv)),
        )
    if name == "torchcode.MultiHeadAttention":
        return C(
            name, doc000.MultiHeadAttention, tc.MultiHeadAttention, (x, kv, kv), args=(E, heads)
        )
    if name == "torchcode.causal_attention":
        return C(
            name,
            doc000.causal_attention,
            tc.causal_attention,
            ((B, Sq, D), (B, Sk, D), (B, Sk, Dv)),
        )
    if name == "torchcode.MultiHeadCrossAttention":
        return C(
            name,
            doc000.MultiHeadCrossAttention,
            tc.MultiHeadCrossAttention,
            (x, kv),
            args=(E, heads),
        )
    if name == "torchcode.GroupQueryAttention":
        kv_heads = data.draw(
            st.sampled_from([h for h in range(1, heads + 1) if heads % h == 0]), label="kv heads"
        )
        return C(
            name,
            doc000.GroupQueryAttention,
            tc.GroupQueryAttention,
            (x,),
            args=(E, heads, kv_heads),
        )
    if name == "torchcode.sliding_window_attention":
        w = data.draw(ints(0, Sq + 2), label="window")
        return C(
            name,
            doc000.sliding_window_attention,
            tc.sliding_window_attention,
            ((B, Sq, D), (B, Sq, D), (B, Sq, Dv)),
            kwargs=lambda device: {"window_size": w},
        )
    if name == "torchcode.flash_attention":
        bs = data.draw(ints(1, 40), label="block_size")
        return C(
            name,
            doc000.flash_attention,
            tc.flash_attention,
            ((B, Sq, D),) * 3,
            kwargs=lambda device: {"block_size": bs},
        )
    if name == "torchcode.apply_rope":
        # the document's cos/sin tables are float32 for any input (compat_cases' note)
        d2 = 2 * data.draw(ints(1, 12), label="D / 2")
        return C(
            name,
            _concat(doc000.apply_rope),
            _concat(tc.apply_rope),
            ((B, Sq, d2),) * 2,
            f64_rtol=max(Sq, 1) * 2.0**-22,
        )
    if name == "torchcode.linear_attention":
        return C(
            name,
            doc000.linear_attention,
            tc.linear_attention,
            ((B, Sq, D), (B, Sk, D), (B, Sk, Dv)),
        )
    if name == "llms_from_scratch.simplified_self_attention":
        return C(name, doc001.simplified_self_attention, lfs.simplified_self_attention, ((Sq, D),))
    if name in ("llms_from_scratch.SelfAttention_v1", "llms_from_scratch.SelfAttention_v2"):
        cls = name.split(".")[1]
        return C(name, getattr(doc001, cls), getattr(lfs, cls), ((Sq, E),), args=(E, D))
    if name == "llms_from_scratch.CausalAttention":
        ctx = Sq + data.draw(ints(0, 5), label="context extra")
        return C(
            name, doc001.CausalAttention, lfs.CausalAttention, (x,), args=(E, D, ctx, 0.0, bias)
        )
    if name == "llms_from_scratch.MultiHeadAttentionWrapper":
        ctx = Sq + data.draw(ints(0, 5), label="context extra")
        return C(
            name,
            doc001.MultiHeadAttentionWrapper,
            lfs.MultiHeadAttentionWrapper,
            (x,),
            args=(E, D, ctx, 0.0, heads, bias),
        )
    if name == "llms_from_scratch.MultiHeadAttention":
        ctx = Sq + data.draw(ints(0, 5), label="context extra")
        return C(
            name,
            doc001.MultiHeadAttention,
            lfs.MultiHeadAttention,
            (x,),
            args=(E, E, ctx, 0.0, heads, bias),
        )
    if name == "textbook.attention":
        keep = torch.rand(Sq, Sk) < 0.6
        keep[:, 0] = True  # a row with no key: the document averages, ours is 0 (documented)
        return C(
            name,
            doc003.attention,
            tb.attention,
            ((B, heads, Sq, D), (B, heads, Sk, D), (B, heads, Sk, Dv)),
            kwargs=lambda device: {"mask": keep.to(device)},
        )
    if name == "textbook.repeat_kv":
        n_rep = data.draw(ints(1, 4), label="n_rep")
        return C(
            name,
            doc003.repeat_kv,
            tb.repeat_kv,
            ((B, heads, Sq, D),),
            kwargs=lambda device: {"n_rep": n_rep},
        )
    if name == "attention_zoo.SelfAttention":
        lead = data.draw(st.sampled_from([(), (B,), (B, 2)]), label="lead dims")
        return C(name, doc004.SelfAttention, zoo.SelfAttention, ((*lead, Sq, E),), args=(E, D))
    if name == "attention_zoo.MultiHeadAttention":
        return C(
            name,
            doc004.MultiHeadAttention,
            zoo.MultiHeadAttention,
            ((B, Sq, D),),
            args=(D, heads, E),
        )
    if name == "attention_zoo.CrossAttention":
        b2 = data.draw(st.sampled_from([B, 1]), label="x2 batch")
        return C(name, doc004.CrossAttention, zoo.CrossAttention, (x, (b2, Sk, E)), args=(E, D))
    if name == "attention_zoo.GroupedAttention":
        groups = data.draw(
            st.sampled_from([g for g in range(1, heads + 1) if heads % g == 0]), label="groups"
        )
        return C(
            name,
            doc004.GroupedAttention,
            zoo.GroupedAttention,
            ((B, Sq, D),),
            args=(D, E, heads, groups),
        )
    if name == "attention_zoo.SpatialAttention":
        k = data.draw(st.sampled_from([3, 7]), label="kernel_size")
        shape = (
            B,
            data.draw(ints(1, 9), label="C"),
            data.draw(ints(1, 12), label="H"),
            data.draw(ints(1, 12), label="W"),
        )
        return C(name, doc004.SpatialAttention, zoo.SpatialAttention, (shape,), args=(k,))
    assert name == "attention_zoo.TemporalAttention"
    t = data.draw(ints(1, 10), label="time_emb_dim")
    return C(
        name,
        doc004.TemporalAttention,
        zoo.TemporalAttention,
        ((B, Sq, D), (B, 1, t)),
        args=(D, E, t),
    )


COMPAT_NAMES = [
    "torchcode.scaled_dot_product_attention",
    "torchcode.MultiHeadAttention",
    "torchcode.causal_attention",
    "torchcode.MultiHeadCrossAttention",
    "torchcode.GroupQueryAttention",
    "torchcode.sliding_window_attention",
    "torchcode.flash_attention",
    "torchcode.apply_rope",
    "torchcode.linear_attention",
    "llms_from_scratch.simplified_self_attention",
    "llms_from_scratch.SelfAttention_v1",
    "llms_from_scratch.SelfAttention_v2",
    "llms_from_scratch.CausalAttention",
    "llms_from_scratch.MultiHeadAttentionWrapper",
    "llms_from_scratch.MultiHeadAttention",
    "textbook.attention",
    "textbook.repeat_kv",
    "attention_zoo.SelfAttention",
    "attention_zoo.MultiHeadAttention",
    "attention_zoo.CrossAttention",
    "attention_zoo.GroupedAttention",
    "attention_zoo.SpatialAttention",
    "attention_zoo.TemporalAttention",
]


@_ci_examples(100)
@given(data=st.data())
def test_fuzz_compat_modules(data):
    # python -m attn_ext's compat check (selfcheck_compat.run_compat_case: ours loaded strictly
    # from the document's state dict; output and every input and parameter gradient, float64
    # to 1e-10 of the magnitude, float32 within 2x the document's own error + 4 float32 ulps,
    # GRAD_ULPS_F32 for gradients as in the other families)
    case = _compat_case(data)
    dtype = data.draw(st.sampled_from([torch.float64, torch.float32]), label="dtype")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    res = run_compat_case(
        case, torch.device("cpu"), dtype, seed=seed, grad_floor_ulps=GRAD_ULPS_F32
    )
    assert res.ok, format_result(res)
    _count("compat_modules")
