"""Scaled RoPE variants: ``inv_freq`` / ``attention_scaling`` of rope, rope_, rope_backward,
kv_cache_append and latent_cache_append (``rope_inv_freq`` / ``rope_attention_scaling``), the
frequencies of attn_ext.rope_parameters against Hugging Face transformers' (bit for bit), the
layers' ``rope_scaling``, errors, opcheck and torch.compile.

Numerics: the error rule against the float64 truth (attn_ext/testing/decoding.py's
rope_reference with the same frequency table and factor), as tests/test_decoding.py's RoPE
cases. On CUDA a scaled variant serves only with ATTN_EXT_UNVERIFIED_CUDA=1 until a GPU session
has run these cases there (the ``cuda_opt_in`` fixture sets it for the device parametrization).
"""

import pytest
import torch

import attn_ext
from attn_ext.testing.decoding import ROPE_SCALING_EXAMPLES, rope_reference
from attn_ext.testing.numerics import ALL_DTYPES, assert_error_rule, rand

ops = torch.ops.attn_ext

MAX_POS, THETA, ROT = 131072, 500000.0, 64


@pytest.fixture
def cuda_opt_in(device, monkeypatch):
    if device == "cuda":
        monkeypatch.setenv("ATTN_EXT_UNVERIFIED_CUDA", "1")


def _variant(name, seq_len=None, device="cpu"):
    return attn_ext.rope_parameters(
        ROT,
        THETA,
        ROPE_SCALING_EXAMPLES[name],
        max_position_embeddings=MAX_POS,
        seq_len=seq_len,
        device=device,
    )


@pytest.mark.parametrize("name", list(ROPE_SCALING_EXAMPLES))
@pytest.mark.parametrize("seq_len", [None, 200_000])
def test_parameters_match_transformers(name, seq_len):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = dict(ROPE_SCALING_EXAMPLES[name])
    kind = scaling.get("rope_type", scaling.get("type"))
    config = transformers.LlamaConfig(
        hidden_size=1024,
        num_attention_heads=16,
        head_dim=ROT,
        max_position_embeddings=MAX_POS,
        rope_theta=THETA,
        rope_scaling=scaling,
    )
    want, want_scaling = ROPE_INIT_FUNCTIONS[kind](config, None, seq_len=seq_len)
    got, got_scaling = _variant(name, seq_len)
    assert got.dtype == torch.float32 and got.shape == (ROT // 2,)
    assert torch.equal(got, want) and got_scaling == want_scaling


def test_parameters_default_and_errors():
    inv, scaling = attn_ext.rope_parameters(16, 10000.0)
    assert scaling == 1.0 and inv.shape == (8,)
    with pytest.raises(ValueError, match="rope_type must be one of"):
        attn_ext.rope_parameters(16, rope_scaling={"rope_type": "ntk-by-parts"})
    with pytest.raises(ValueError, match="needs 'factor'"):
        attn_ext.rope_parameters(16, rope_scaling={"rope_type": "linear"})
    with pytest.raises(ValueError, match="needs max_position_embeddings"):
        attn_ext.rope_parameters(16, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="positive and even"):
        attn_ext.rope_parameters(15)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("name", ["llama3", "yarn_deepseek", "longrope"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_against_reference(device, cuda_opt_in, dtype, name, interleaved):
    inv, scaling = _variant(name, device=device)
    x = rand((2, 3, 37, 80), dtype, device, layout="bshd")
    kw = dict(
        positions=torch.randint(0, 100_000, (2, 37), device=device),
        interleaved=interleaved,
        rotary_dim=ROT,
        inv_freq=inv,
        attention_scaling=scaling,
    )
    out = attn_ext.rope(x, **kw)
    truth = rope_reference(x.double(), compute_dtype=torch.float64, **kw)
    assert_error_rule(out, rope_reference(x, **kw), truth, name="scaled rope")
    y = x.clone()
    attn_ext.rope_(y, **kw)
    assert torch.equal(y, out)


def test_plain_table_gives_the_default_bits():
    """The default frequencies passed as a table, with attention_scaling 1, change no bit."""
    from attn_ext.testing.decoding import rope_inv_freq

    x = torch.randn(2, 4, 33, 64)
    pos = torch.randint(0, 40_000, (33,))
    want = attn_ext.rope(x, positions=pos, base=5000.0)
    got = attn_ext.rope(x, positions=pos, inv_freq=rope_inv_freq(64, 5000.0))
    assert torch.equal(got, want)


def test_rope_gradcheck():
    inv, scaling = _variant("yarn")
    x = torch.randn(1, 2, 5, ROT, dtype=torch.float64, requires_grad=True)
    pos = torch.tensor([3, 900, 17, 40_000, 5])

    def fn(t):
        return attn_ext.rope(t, positions=pos, inv_freq=inv, attention_scaling=scaling)

    assert torch.autograd.gradcheck(fn, (x,))
    # the backward is the scaled inverse rotation: the gradient of sum(y * g) is s R^T g
    g = torch.randn(1, 2, 5, ROT, dtype=torch.float64)
    (dx,) = torch.autograd.grad(fn(x), x, g)
    want = ops.rope_backward(g, pos, inv_freq=inv, attention_scaling=scaling)
    assert torch.equal(dx, want)


def _append_case(device, dtype):
    B, Hkv, L, D = 2, 2, 40, 80
    k_cache = torch.zeros(B, Hkv, L, D, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    k = rand((B, Hkv, 7, D), dtype, device)
    v = rand((B, Hkv, 7, D), dtype, device)
    lens = torch.tensor([3, 30], dtype=torch.int32, device=device)
    return k_cache, v_cache, k, v, lens


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_kv_cache_append_rotates_with_the_variant(device, cuda_opt_in, dtype):
    inv, scaling = _variant("llama3", device=device)
    k_cache, v_cache, k, v, lens = _append_case(device, dtype)
    start = lens.clone()
    ops.kv_cache_append(
        k_cache,
        v_cache,
        lens,
        k,
        v,
        rope=True,
        rotary_dim=ROT,
        rope_inv_freq=inv,
        rope_attention_scaling=1.25,
    )
    for b in range(2):
        n = int(start[b])
        want = attn_ext.rope(
            k[b : b + 1], offset=n, rotary_dim=ROT, inv_freq=inv, attention_scaling=1.25
        )
        assert torch.equal(k_cache[b : b + 1, :, n : n + 7], want)
        assert torch.equal(v_cache[b : b + 1, :, n : n + 7], v[b : b + 1])
    assert scaling == 1.0  # llama3 has no factor of its own: 1.25 is this test's


def test_latent_cache_append_rotates_with_the_variant():
    inv, scaling = _variant("yarn_deepseek")
    cache = attn_ext.LatentKVCache(2, 20, kv_lora_rank=32, rope_dim=ROT)
    c_kv, k_rope = torch.randn(2, 1, 5, 32), torch.randn(2, 1, 5, ROT)
    cache.append(c_kv, k_rope, rope_interleaved=True, rope_inv_freq=inv, rope_attention_scaling=1.5)
    want = attn_ext.rope(k_rope, interleaved=True, inv_freq=inv, attention_scaling=1.5)
    assert torch.equal(cache.rope_key[:, :, :5], want)
    assert torch.equal(cache.latent[:, :, :5], c_kv)


def test_errors():
    x = torch.randn(1, 2, 3, 16)
    with pytest.raises(
        RuntimeError, match=r"inv_freq must have shape \(rotary_dim / 2,\) = \(8,\)"
    ):
        attn_ext.rope(x, inv_freq=torch.ones(16))
    with pytest.raises(
        RuntimeError, match=r"inv_freq must have shape \(rotary_dim / 2,\) = \(4,\)"
    ):
        attn_ext.rope(x, rotary_dim=8, inv_freq=torch.ones(8))
    with pytest.raises(RuntimeError, match="inv_freq must be floating point"):
        attn_ext.rope(x, inv_freq=torch.ones(8, dtype=torch.int64))
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(RuntimeError, match="attention_scaling must be positive and finite"):
            attn_ext.rope(x, attention_scaling=bad)
    k_cache, v_cache, k, v, lens = _append_case("cpu", torch.float32)
    with pytest.raises(RuntimeError, match="need rope=True"):
        ops.kv_cache_append(k_cache, v_cache, lens, k, v, rope_attention_scaling=2.0)
    with pytest.raises(RuntimeError, match="rope_inv_freq must have shape"):
        ops.kv_cache_append(k_cache, v_cache, lens, k, v, rope=True, rope_inv_freq=torch.ones(3))
    assert int(lens.sum()) == 33 and not k_cache.any()  # refused before anything was written


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible")
def test_cuda_gate(monkeypatch):
    monkeypatch.delenv("ATTN_EXT_UNVERIFIED_CUDA", raising=False)
    x = torch.randn(1, 2, 3, 16, device="cuda")
    with pytest.raises(RuntimeError, match="ATTN_EXT_UNVERIFIED_CUDA=1"):
        attn_ext.rope(x, attention_scaling=2.0)
    attn_ext.rope(x)  # the plain rotation needs no opt-in


def test_opcheck_and_compile():
    inv, scaling = _variant("yarn")
    x = torch.randn(2, 3, 9, ROT)
    pos = torch.arange(9) * 1000
    kw = dict(inv_freq=inv, attention_scaling=scaling)
    torch.library.opcheck(ops.rope.default, (x, pos), kw)
    torch.library.opcheck(ops.rope_backward.default, (x, pos), kw)
    torch.library.opcheck(ops.rope_.default, (x.clone(), pos), kw)

    def step(t):
        return attn_ext.rope(t, positions=pos, **kw) * 2

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), step(x))


@pytest.mark.parametrize("name", ["llama3", "yarn"])
def test_decoder_layer_rope_scaling(name):
    """DecoderAttention(rope_scaling=...): a generation through its cache equals the full
    forward at every position (the cache's keys rotated with the same variant as the queries),
    and differs from the unscaled layer."""
    torch.manual_seed(0)
    kw = dict(rope_base=THETA, max_position_embeddings=MAX_POS)
    layer = attn_ext.nn.DecoderAttention(128, 4, 2, rope_scaling=ROPE_SCALING_EXAMPLES[name], **kw)
    plain = attn_ext.nn.DecoderAttention(128, 4, 2, **kw)
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(2, 12, 128)
    pos = torch.arange(12) + 50_000
    with torch.no_grad():
        full = layer(x, positions=pos)
        cache = layer.new_cache(2, 64)
        cache.lengths.fill_(0)
        steps = [layer(x[:, :5], cache)] + [layer(x[:, t : t + 1], cache) for t in range(5, 12)]
        assert not torch.allclose(full, plain(x, positions=pos))
    torch.testing.assert_close(torch.cat(steps, 1), layer(x), rtol=1e-5, atol=1e-5)
    assert layer.rope_inv_freq is not None and "rope_inv_freq" not in layer.state_dict()


def test_latent_layer_rope_scaling():
    """MultiHeadLatentAttention with DeepSeek-V2's YaRN: absorbed decode through the latent
    cache equals the prefill's decompressed attention at every position."""
    torch.manual_seed(0)
    mla = attn_ext.nn.MultiHeadLatentAttention(
        256,
        4,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=ROT,
        v_head_dim=32,
        rope_scaling=ROPE_SCALING_EXAMPLES["yarn_deepseek"],
        max_position_embeddings=MAX_POS,
    )
    x = torch.randn(2, 10, 256)
    with torch.no_grad():
        full = mla(x)
        cache = mla.new_cache(2, 32)
        steps = [mla(x[:, :4], cache)] + [mla(x[:, t : t + 1], cache) for t in range(4, 10)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-5)


def test_append_ops_opcheck_and_compile():
    """The two appends' new arguments through opcheck (fakes, schema, autograd registration),
    and a cache step that appends with a variant compiled whole."""
    inv, scaling = _variant("yarn")
    k_cache, v_cache, k, v, lens = _append_case("cpu", torch.float32)
    kw = dict(rope=True, rotary_dim=ROT, rope_inv_freq=inv, rope_attention_scaling=scaling)
    torch.library.opcheck(ops.kv_cache_append.default, (k_cache, v_cache, lens, k, v), kw)
    latent = torch.zeros(2, 1, 20, 16 + ROT)
    c_kv, k_rope = torch.randn(2, 1, 3, 16), torch.randn(2, 1, 3, ROT)
    torch.library.opcheck(
        ops.latent_cache_append.default,
        (latent, torch.tensor([4, 0], dtype=torch.int32), c_kv, k_rope),
        dict(rope_inv_freq=inv, rope_attention_scaling=scaling),
    )

    def step(cache, k, v, q):
        cache.append(k, v, rope=True, rope_inv_freq=inv, rope_attention_scaling=scaling)
        return cache.attend(q)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    caches = [attn_ext.KVCache(2, 2, 16, ROT) for _ in range(2)]
    for _ in range(3):
        k, v, q = torch.randn(2, 2, 1, ROT), torch.randn(2, 2, 1, ROT), torch.randn(2, 4, 1, ROT)
        assert torch.equal(compiled(caches[0], k, v, q), step(caches[1], k, v, q))
    assert torch.equal(caches[0].k, caches[1].k)
