"""Multi-head Latent Attention (attn_ext.nn.MultiHeadLatentAttention, attn_ext.LatentKVCache)
against the plain reference of DeepSeek-V2's equations (attn_ext/testing/mla.py): prefill,
gradients, and the weight-absorbed decode step by step against the decompressed attention."""

import math

import pytest
import torch

import attn_ext
from attn_ext.nn import MultiHeadLatentAttention
from attn_ext.testing.mla import mla_reference, paper_weights
from attn_ext.testing.numerics import assert_error_rule, grad_slack_ulps

# Small dims with every width distinct (so a swapped axis cannot pass), and the paper's.
SMALL = dict(kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10)
PAPER = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


def _layer(device, dtype, d_model=40, heads=3, q_lora_rank=None, dims=SMALL, **kw):
    m = MultiHeadLatentAttention(d_model, heads, q_lora_rank=q_lora_rank, **dims, **kw)
    with torch.no_grad():  # RMSNorm weights away from 1 so a missing norm weight shows
        for norm in (m.kv_a_layernorm, getattr(m, "q_a_layernorm", None)):
            if norm is not None:
                norm.weight.uniform_(0.5, 1.5)
    return m.to(device=device, dtype=dtype)


def _truth(m, x, **kw):
    return mla_reference(
        x.detach(),
        paper_weights(m),
        compute_dtype=torch.float64,
        rope_base=m.rope_base,
        interleaved=m.rope_interleaved,
        **kw,
    )


def _plain(m, x, **kw):
    return mla_reference(
        x.detach(), paper_weights(m), rope_base=m.rope_base, interleaved=m.rope_interleaved, **kw
    )


# ------------------------------------------------------------------------------------ prefill


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("q_lora_rank", [None, 20])
@pytest.mark.parametrize("interleaved", [True, False])
def test_prefill_matches_reference(device, dtype, q_lora_rank, interleaved):
    m = _layer(device, dtype, q_lora_rank=q_lora_rank, rope_interleaved=interleaved)
    x = torch.randn(2, 37, 40, device=device, dtype=dtype)
    with torch.no_grad():
        out = m(x)
    assert out.shape == x.shape
    assert_error_rule(out, _plain(m, x), _truth(m, x), name="mla prefill")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_prefill_paper_dims(device, dtype):
    # D = 192, Dv = 128 on attn_ext.attention; the scale is 1/sqrt(192), not 1/sqrt(576).
    m = _layer(device, dtype, d_model=64, heads=2, q_lora_rank=48, dims=PAPER)
    assert m.softmax_scale == pytest.approx(1 / math.sqrt(192))
    x = torch.randn(1, 33, 64, device=device, dtype=dtype)
    with torch.no_grad():
        out = m(x)
    assert_error_rule(out, _plain(m, x), _truth(m, x), name="mla prefill (paper dims)")


def test_prefill_positions(device):
    m = _layer(device, torch.float64)
    x = torch.randn(2, 9, 40, device=device, dtype=torch.float64)
    pos = torch.randint(0, 5000, (2, 9), device=device)
    with torch.no_grad():
        out = m(x, positions=pos)
    assert_error_rule(out, None, _truth(m, x, positions=pos), name="mla prefill at positions")


@pytest.mark.parametrize("q_lora_rank", [None, 20])
def test_prefill_gradients(device, q_lora_rank):
    # Gradients through attn_ext.attention (D = nope + rope, Dv = v) and the projections, for
    # the input and every parameter, against autograd through the reference.
    dtype = torch.float32
    m = _layer(device, dtype, q_lora_rank=q_lora_rank)
    x = torch.randn(2, 21, 40, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(2, 21, 40, device=device, dtype=dtype)
    params = dict(m.named_parameters())
    grads = torch.autograd.grad(m(x), [x, *params.values()], g)

    m64 = _layer(device, torch.float64, q_lora_rank=q_lora_rank)
    m64.load_state_dict({k: v.double() for k, v in m.state_dict().items()})
    for mod, dt in ((m64, torch.float64), (m, dtype)):
        xx = x.detach().to(dt).requires_grad_(True)
        ps = list(mod.parameters())
        out = mla_reference(
            xx,
            paper_weights(mod),
            rope_base=mod.rope_base,
            interleaved=mod.rope_interleaved,
            compute_dtype=torch.float64 if dt == torch.float64 else None,
        )
        ref = torch.autograd.grad(out, [xx, *ps], g.to(dt))
        if dt == torch.float64:
            truth = ref
        else:
            plain = ref
    for name, a, r, t in zip(["x", *params], grads, plain, truth):
        assert_error_rule(a, r, t, name=f"grad {name}", slack_ulps=grad_slack_ulps(dtype))


def test_prefill_gradcheck():
    m = _layer(
        "cpu",
        torch.float64,
        d_model=8,
        heads=2,
        dims=dict(kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=3),
    )
    x = torch.randn(1, 5, 8, dtype=torch.float64, requires_grad=True)
    w = m.kv_b_proj.weight
    torch.autograd.gradcheck(
        lambda x, w: torch.func.functional_call(m, {"kv_b_proj.weight": w}, (x,)), (x, w)
    )


# ------------------------------------------------------------------------------------- decode


def _step_by_step(m, x, prompt, chunk=1, absorb=True):
    cache = m.new_cache(x.size(0), x.size(1) + 3)
    outs = [m(x[:, :prompt], cache, absorb=absorb)]
    for t in range(prompt, x.size(1), chunk):
        outs.append(m(x[:, t : t + chunk], cache, absorb=absorb))
    return torch.cat(outs, dim=1), cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("q_lora_rank", [None, 20])
@pytest.mark.parametrize("interleaved", [True, False])
def test_absorbed_decode_step_by_step(device, dtype, q_lora_rank, interleaved):
    # Prompt of 6, then 13 single-token steps: every step's output equals the reference's
    # full causal forward at that position (RoPE positions continue across steps).
    m = _layer(device, dtype, q_lora_rank=q_lora_rank, rope_interleaved=interleaved)
    x = torch.randn(2, 19, 40, device=device, dtype=dtype)
    with torch.no_grad():
        out, cache = _step_by_step(m, x, prompt=6)
    assert cache.lengths.tolist() == [19, 19]
    # The absorbed form sums in another order (the latent, then W^UV) and, in bf16, rounds the
    # latent query and the attended latent once more: its error is a few ulps of the
    # reference's, hence factor 4.
    assert_error_rule(out, _plain(m, x), _truth(m, x), name="absorbed decode", factor=4.0)


@pytest.mark.parametrize("chunk", [2, 5])
def test_absorbed_decode_multi_token_steps(device, chunk):
    # Several new tokens per step: bottom-right causal inside the step.
    m = _layer(device, torch.float64, q_lora_rank=20)
    x = torch.randn(2, 17, 40, device=device, dtype=torch.float64)
    with torch.no_grad():
        out, _ = _step_by_step(m, x, prompt=7, chunk=chunk)
    assert_error_rule(out, None, _truth(m, x), name="absorbed decode (chunks)")


def test_absorbed_equals_decompressed(device):
    # The weight-absorbed decode and decompressing the whole cache every step, same weights.
    m = _layer(device, torch.float32, d_model=64, heads=4, q_lora_rank=32, dims=PAPER)
    x = torch.randn(2, 12, 64, device=device)
    with torch.no_grad():
        absorbed, c1 = _step_by_step(m, x, prompt=4)
        naive, c2 = _step_by_step(m, x, prompt=4, absorb=False)
    torch.testing.assert_close(c1.kv, c2.kv, rtol=0, atol=0)
    # Both are float32 sums of the same terms in different orders (tolerance: ~1e3 ulps of
    # outputs of size ~1, far below any indexing or scale error).
    torch.testing.assert_close(absorbed, naive, rtol=1e-4, atol=1e-4)
    assert_error_rule(
        absorbed, _plain(m, x), _truth(m, x), name="absorbed (paper dims)", factor=4.0
    )


def test_decode_left_padded_batch(device):
    # Sequence 1 owns only its last 3 prompt tokens: it must equal decoding that sequence alone.
    m = _layer(device, torch.float64)
    x = torch.randn(2, 8, 40, device=device, dtype=torch.float64)
    cache = m.new_cache(2, 16)
    with torch.no_grad():
        m(x[:, :5], cache, new_lengths=torch.tensor([5, 3], device=device))
        steps = torch.cat([m(x[:, t : t + 1], cache) for t in range(5, 8)], dim=1)
    assert cache.lengths.tolist() == [8, 6]
    assert_error_rule(steps[0], None, _truth(m, x[:1])[0, 5:], name="sequence 0")
    assert_error_rule(steps[1], None, _truth(m, x[1:, 2:])[0, 3:], name="sequence 1 (padded)")


def test_latent_cache_layout(device):
    m = _layer(device, torch.float32, d_model=64, heads=16, dims=PAPER)
    cache = m.new_cache(3, 50)
    # 576 values per token per layer; the values are the first 512 columns of the same memory.
    assert cache.kv.shape == (3, 1, 50, 576) and cache.k.data_ptr() == cache.kv.data_ptr()
    assert cache.v.shape == (3, 1, 50, 512) and cache.v.data_ptr() == cache.kv.data_ptr()
    assert cache.v.stride() == cache.kv.stride()
    x = torch.randn(3, 4, 64, device=device)
    with torch.no_grad():
        m(x, cache)
    # What was cached is the normalized latent and the key rotated at positions 0..3.
    _, parts = mla_reference(x, paper_weights(m), return_parts=True)
    torch.testing.assert_close(cache.latent[:, :, :4], parts["c_kv"].unsqueeze(1))
    torch.testing.assert_close(cache.rope_key[:, :, :4], parts["k_r"])
    assert float(cache.kv[:, :, 4:].abs().max()) == 0.0


def test_latent_cache_append_op(device):
    # The op behind LatentKVCache.append: c_kv copied, k_rope rotated at the rows' positions,
    # left padding honoured, the row width checked.
    cache = attn_ext.LatentKVCache(2, 9, 6, 4, device=device, dtype=torch.float64)
    c_kv = torch.randn(2, 1, 3, 6, device=device, dtype=torch.float64)
    k_rope = torch.randn(2, 1, 3, 4, device=device, dtype=torch.float64)
    cache.append(c_kv[:, :, :2], k_rope[:, :, :2])
    cache.append(c_kv, k_rope, new_lengths=torch.tensor([3, 1], device=device))
    assert cache.lengths.tolist() == [5, 3]
    torch.testing.assert_close(cache.latent[0, :, 2:5], c_kv[0])
    torch.testing.assert_close(cache.latent[1, :, 2:3], c_kv[1, :, 2:])
    rotated = attn_ext.rope(k_rope, positions=torch.tensor([[2, 3, 4], [0, 1, 2]], device=device))
    torch.testing.assert_close(cache.rope_key[0, :, 2:5], rotated[0])
    with pytest.raises(
        RuntimeError, match=r"row width \(dim 3\) must be c_kv's \+ k_rope's = 6 \+ 5"
    ):
        torch.ops.attn_ext.latent_cache_append(
            cache.kv, cache.lengths, c_kv, k_rope.new_zeros(2, 1, 3, 5)
        )
    # messages name the latent op's own arguments, not kv_cache_append's k / v
    with pytest.raises(RuntimeError, match=r"c_kv length \(dim 2\) must be 2"):
        torch.ops.attn_ext.latent_cache_append(cache.kv, cache.lengths, c_kv, k_rope[:, :, :2])
    with pytest.raises(RuntimeError, match=r"c_kv must have cache\[\.\.\., Dc:\]'s dtype"):
        torch.ops.attn_ext.latent_cache_append(cache.kv, cache.lengths, c_kv.float(), k_rope)
    with pytest.raises(RuntimeError, match="overflow"):
        cache.append(c_kv, k_rope)
        cache.append(c_kv, k_rope)


def test_errors():
    with pytest.raises(ValueError, match="qk_rope_head_dim must be positive and even"):
        MultiHeadLatentAttention(32, 2, qk_rope_head_dim=7)
    with pytest.raises(ValueError, match="kv_lora_rank must be positive"):
        MultiHeadLatentAttention(32, 2, kv_lora_rank=0)
    with pytest.raises(ValueError, match="q_lora_rank must be positive"):
        MultiHeadLatentAttention(32, 2, q_lora_rank=0)
    m = MultiHeadLatentAttention(40, 3, **SMALL)
    with pytest.raises(ValueError, match=r"x must be \(B, S, d_model = 40\)"):
        m(torch.randn(2, 5, 41))
    with pytest.raises(TypeError, match="LatentKVCache"):
        m(torch.randn(2, 1, 40), attn_ext.KVCache(2, 1, 8, 32))
    other = MultiHeadLatentAttention(
        40, 3, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10
    )
    with pytest.raises(ValueError, match="kv_lora_rank=16"):
        m(torch.randn(2, 1, 40), other.new_cache(2, 8))
    with pytest.raises(ValueError, match="do not pass positions"):
        m(torch.randn(2, 1, 40), m.new_cache(2, 8), positions=torch.zeros(1, dtype=torch.long))
    cache = m.new_cache(1, 4)
    with torch.no_grad(), pytest.raises(RuntimeError, match="overflow"):
        m(torch.randn(1, 5, 40), cache)
    assert cache.lengths.tolist() == [0]
