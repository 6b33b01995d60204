"""torch.compile(fullgraph=True, dynamic=True): no graph break (fullgraph
raises on one), results equal eager, and no recompilation when only the
sequence lengths change."""

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

import attn_ext
from attn_ext.testing.numerics import make_qkv, random_bool_mask

# Lengths avoid 0 and 1 (dynamo specializes on them by design) and, on the
# first call, any size equal to another dim of the inputs (duck sizing would
# then tie the two symbols together, a guard of the test's making).
LENGTHS = [(23, 37), (40, 29), (57, 57)]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compile(fn, backend="inductor"):
    counter = CompileCounterWithBackend(backend)
    return torch.compile(fn, backend=counter, fullgraph=True, dynamic=True), counter


class NoRecompile:
    """Records the compile count after the first call; later calls (other
    sequence lengths) must not compile again. (The first call may compile
    more than once: dynamo can restart its analysis, e.g. when it decides to
    specialize a float argument; that is not a recompilation.)"""

    def __init__(self, counter):
        self.counter = counter
        self.after_first = None

    def step(self):
        assert self.counter.frame_count >= 1
        if self.after_first is None:
            self.after_first = self.counter.frame_count
        assert self.counter.frame_count == self.after_first, (
            f"recompiled: {self.counter.frame_count} compilations, {self.after_first} after the "
            "first call"
        )


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_compile_attention_causal_mask_lse(device):
    def fn(q, k, v, mask):
        out, lse = attn_ext.attention(q, k, v, causal=True, attn_mask=mask, return_lse=True)
        return out * 2.0, lse

    cfn, counter = _compile(fn)
    watch = NoRecompile(counter)
    for sq, sk in LENGTHS:
        q, k, v = make_qkv(2, 4, 2, sq, sk, 32, device=device)
        mask = random_bool_mask((2, 1, sq, sk), device)
        out, lse = cfn(q, k, v, mask)
        ref_out, ref_lse = fn(q, k, v, mask)
        _close(out, ref_out)
        _close(lse, ref_lse)
        watch.step()


def test_compile_attention_backward(device):
    def fn(q, k, v):
        return attn_ext.attention(q, k, v, causal=True, window_size=(8, -1)).square().sum()

    cfn, counter = _compile(fn)
    watch = NoRecompile(counter)
    for sq, sk in LENGTHS:
        q, k, v = make_qkv(1, 2, 2, sq, sk, 16, device=device)
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        cfn(*leaves).backward()
        ref_leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        fn(*ref_leaves).backward()
        for a, b in zip(leaves, ref_leaves):
            _close(a.grad, b.grad)
        watch.step()


def test_compile_attention_3d_float_mask(device):
    def fn(q, k, v, mask):
        return attn_ext.attention(q, k, v, attn_mask=mask, scale=0.25)

    cfn, counter = _compile(fn, backend="aot_eager")
    watch = NoRecompile(counter)
    for sq, sk in LENGTHS:
        q, k, v = (torch.randn(3, s, 16, device=device) for s in (sq, sk, sk))
        mask = torch.randn(sq, sk, device=device)
        _close(cfn(q, k, v, mask), fn(q, k, v, mask))
        watch.step()


def test_compile_attention_dropout_fixed_state(device):
    """Dropout through the op with an explicit rng_state is deterministic, so
    compiled and eager agree exactly in which entries they drop."""

    def fn(q, k, v, state):
        out, _ = torch.ops.attn_ext.attention(q, k, v, causal=True, dropout_p=0.3, rng_state=state)
        return out

    cfn, counter = _compile(fn, backend="aot_eager")
    watch = NoRecompile(counter)
    state = torch.tensor([1234, 0])
    for sq, sk in LENGTHS:
        q, k, v = make_qkv(1, 2, 2, sq, sk, 16, device=device)
        _close(cfn(q, k, v, state), fn(q, k, v, state))
        watch.step()


def test_compile_sdpa(device):
    def fn(q, k, v):
        return attn_ext.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    cfn, counter = _compile(fn)
    watch = NoRecompile(counter)
    for sq, sk in LENGTHS:
        q, k, v = make_qkv(2, 4, 2, sq, sk, 32, device=device)
        _close(cfn(q, k, v), fn(q, k, v))
        _close(
            cfn(q, k, v),
            torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True
            ),
        )
        watch.step()


@pytest.mark.parametrize("mods", ["plain", "softcap_alibi_sinks"])
def test_compile_attention_weights(device, mods):
    extra = {}
    if mods != "plain":
        slopes, sinks = (
            torch.tensor([0.25, 0.5], device=device),
            torch.tensor([1.0, -0.5], device=device),
        )
        extra = dict(softcap=1.5, alibi_slopes=slopes, sinks=sinks)

    def fn(q, k):
        return attn_ext.attention_weights(q, k, causal=True, **extra).sum(-2)

    cfn, counter = _compile(fn)
    watch = NoRecompile(counter)
    for sq, sk in LENGTHS:
        q, k, _ = make_qkv(2, 2, 2, sq, sk, 16, device=device)
        ql, kl = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
        out = cfn(ql, kl)
        _close(out, fn(q, k))
        (out * torch.arange(sk, device=device)).sum().backward()
        qr, kr = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
        (fn(qr, kr) * torch.arange(sk, device=device)).sum().backward()
        _close(ql.grad, qr.grad)
        _close(kl.grad, kr.grad)
        watch.step()


@pytest.mark.parametrize("mean_heads", [False, True], ids=["heads", "mean"])
def test_compile_attention_with_weights(device, mean_heads):
    def fn(q, k, v):
        out, w = attn_ext.attention_with_weights(q, k, v, causal=True, mean_heads=mean_heads)
        return out, w.sum(-2)

    cfn, counter = _compile(fn)
    watch = NoRecompile(counter)
    for sq, sk in LENGTHS:
        q, k, v = make_qkv(2, 4, 2, sq, sk, 16, device=device)
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        refs = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out, w = cfn(*leaves)
        want_out, want_w = fn(*refs)
        _close(out, want_out)
        _close(w, want_w)
        key_weight = torch.arange(sk, device=device)
        (out.sum() + (w * key_weight).sum()).backward()
        (want_out.sum() + (want_w * key_weight).sum()).backward()
        for a, b in zip(leaves, refs):
            _close(a.grad, b.grad)
        watch.step()


def test_compile_in_a_module(device):
    """A small attention block (projection, head split via view + transpose,
    attn_ext, merge, projection) compiles as one graph and trains."""

    class Block(torch.nn.Module):
        def __init__(self, d=32, h=4):
            super().__init__()
            self.h = h
            self.qkv = torch.nn.Linear(d, 3 * d)
            self.o = torch.nn.Linear(d, d)

        def forward(self, x):
            B, S, d = x.shape
            q, k, v = self.qkv(x).view(B, S, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
            y = attn_ext.attention(q, k, v, causal=True)
            return self.o(y.transpose(1, 2).reshape(B, S, d))

    torch.manual_seed(0)
    m = Block().to(device)
    cm, counter = _compile(m)
    watch = NoRecompile(counter)
    for S in (13, 21, 37):
        x = torch.randn(2, S, 32, device=device)
        y = cm(x)
        _close(y, m(x))
        y.sum().backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())
        watch.step()


def test_compile_rope_offsets_and_backward(device):
    def fn(x, pos, offset):
        return attn_ext.rope(x, positions=pos, interleaved=True) + attn_ext.rope(x, offset=offset)

    cfn, counter = _compile(fn)
    watch = NoRecompile(counter)
    for s, offset in ((23, 5), (40, 6), (57, 700)):
        x = torch.randn(2, 3, s, 16, device=device, requires_grad=True)
        pos = torch.randint(0, 1000, (2, s), device=device)
        out = cfn(x, pos, offset)
        ref = fn(x, pos, offset)
        _close(out, ref)
        (g,) = torch.autograd.grad(out.sum(), x)
        (g_ref,) = torch.autograd.grad(ref.sum(), x)
        _close(g, g_ref)
        watch.step()


def test_compile_decode_loop(device):
    """A prefill + decode loop of DecoderAttention over a KVCache compiles into graphs with
    the in-place cache ops (no graph break), and later steps reuse them."""
    torch.manual_seed(0)
    m = attn_ext.nn.DecoderAttention(64, 8, 2, device=device)
    x = torch.randn(2, 30, 64, device=device)

    def step(x_t, cache):
        return m(x_t, cache)

    cstep, counter = _compile(step)
    with torch.no_grad():
        ref_cache = m.new_cache(2, 40)
        ref = [m(x[:, :23], ref_cache)] + [m(x[:, t : t + 1], ref_cache) for t in range(23, 30)]
        c = m.new_cache(2, 40)
        outs = [cstep(x[:, :23], c)]
        first = None
        for t in range(23, 30):
            outs.append(cstep(x[:, t : t + 1], c))
            if t == 24:  # the prefill graph and the single-token graph exist now
                first = counter.frame_count
    assert counter.frame_count == first, f"recompiled: {counter.frame_count} vs {first}"
    assert c.lengths.tolist() == [30, 30]
    for a, b in zip(outs, ref):
        _close(a, b)
    _close(c.k, ref_cache.k)


# Map sizes for the spatial ops: no size equal to another (duck sizing) nor 0/1.
MAP_SIZES = [(9, 13), (12, 7), (20, 17)]


@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_compile_spatial_ops(device, layout):
    """channel_pool -> a gate computed from the pooled maps -> spatial_gate, forward and
    backward, across map sizes. (The gate is not a convolution here: torch's own conv2d backward
    specializes the map size under dynamic=True, which would be a recompile of torch's making;
    the CBAM test below covers the convolution.)"""

    def fn(x, w):
        pooled = attn_ext.channel_pool(x)
        logits = (pooled * w).sum(dim=1, keepdim=True)
        return attn_ext.spatial_gate(x, logits) * 2.0

    w = torch.randn(1, 2, 1, 1, device=device)
    cfn, counter = _compile(fn)
    watch = NoRecompile(counter)
    for h, wd in MAP_SIZES:
        x = torch.randn(2, 6, h, wd, device=device)
        if layout == "channels_last":
            x = x.contiguous(memory_format=torch.channels_last)
        leaves = [x.clone().requires_grad_(True), w.clone().requires_grad_(True)]
        out = cfn(*leaves)
        out.square().sum().backward()
        ref_leaves = [x.clone().requires_grad_(True), w.clone().requires_grad_(True)]
        ref = fn(*ref_leaves)
        ref.square().sum().backward()
        _close(out, ref)
        for a, b in zip(leaves, ref_leaves):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5)
        watch.step()


def test_compile_cbam_module(device):
    """CBAM compiles with fullgraph (the fused autograd.Function included) and matches eager;
    inference does not recompile across map sizes. (Training may: torch's conv2d backward
    specializes the map size under dynamic=True.)"""
    m = attn_ext.nn.CBAM(16, reduction_ratio=4).to(device)
    cfn, counter = _compile(m)
    watch = NoRecompile(counter)
    with torch.no_grad():
        for h, wd in MAP_SIZES:
            x = torch.randn(2, 16, h, wd, device=device)
            _close(cfn(x), m(x))
            watch.step()
    torch._dynamo.reset()
    cfn, _ = _compile(m)
    for h, wd in MAP_SIZES[:2]:
        x = torch.randn(2, 16, h, wd, device=device)
        xr = x.clone().requires_grad_(True)
        out = cfn(xr)
        out.sum().backward()
        xe = x.clone().requires_grad_(True)
        ref = m(xe)
        ref.sum().backward()
        _close(out, ref)
        torch.testing.assert_close(xr.grad, xe.grad, rtol=1e-5, atol=1e-5)


def test_compile_temporal_attention(device):
    m = attn_ext.nn.TemporalAttention(32, 4, 8).to(device)

    def fn(x, tp):
        return m(x, tp, causal=True)

    cfn, counter = _compile(fn)
    watch = NoRecompile(counter)
    for s in (23, 37, 50):
        x = torch.randn(2, s, 32, device=device, requires_grad=True)
        tp = torch.randn(2, 1, 8, device=device)
        out = cfn(x, tp)
        out.sum().backward()
        xe = x.detach().clone().requires_grad_(True)
        ref = fn(xe, tp)
        ref.sum().backward()
        _close(out, ref)
        torch.testing.assert_close(x.grad, xe.grad, rtol=1e-5, atol=1e-5)
        watch.step()


def test_compile_tpa_expand_and_backward(device):
    def fn(a, b, pos):
        q = attn_ext.tpa_expand(a, b, positions=pos, rope=True, rope_interleaved=True)
        return attn_ext.attention(
            q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2), causal=True
        )

    cfn, counter = _compile(fn)
    watch = NoRecompile(counter)
    for s in (23, 40, 57):
        a = torch.randn(2, s, 3, 4, device=device, requires_grad=True)
        b = torch.randn(2, s, 3, 16, device=device, requires_grad=True)
        pos = torch.randint(0, 1000, (2, s), device=device)
        out, ref = cfn(a, b, pos), fn(a, b, pos)
        _close(out, ref)
        for g, g_ref in zip(
            torch.autograd.grad(out.sum(), (a, b)), torch.autograd.grad(ref.sum(), (a, b))
        ):
            _close(g, g_ref)
        watch.step()


def test_compile_tpa_decode_attention(device):
    """Factor-cache attention with its backward: one graph, no recompile across cache lengths."""

    def fn(q, a_k, b_k, a_v, b_v, lengths):
        out, lse = attn_ext.tpa_decode_attention(q, a_k, b_k, a_v, b_v, lengths, return_lse=True)
        return out.sum() + lse.sum()

    cfn, counter = _compile(fn)
    watch = NoRecompile(counter)
    for n in (23, 40, 57):
        q = torch.randn(2, 4, 1, 16, device=device, requires_grad=True)
        factors = [
            torch.randn(2, n, r, x, device=device, requires_grad=True)
            for r, x in ((2, 4), (2, 16), (3, 4), (3, 16))
        ]
        lengths = torch.tensor([n, n - 5], device=device)
        out, ref = cfn(q, *factors, lengths), fn(q, *factors, lengths)
        _close(out, ref)
        for g, g_ref in zip(
            torch.autograd.grad(out, (q, *factors)), torch.autograd.grad(ref, (q, *factors))
        ):
            torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-5)
        watch.step()


def test_compile_mla_prefill_and_absorbed_decode(device):
    """MLA prefill into a LatentKVCache and absorbed single-token steps compile without a graph
    break, and later steps reuse the single-token graph."""
    torch.manual_seed(0)
    m = attn_ext.nn.MultiHeadLatentAttention(
        64,
        4,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        device=device,
    )
    x = torch.randn(2, 30, 64, device=device)
    cstep, counter = _compile(lambda x_t, cache: m(x_t, cache))
    with torch.no_grad():
        ref_cache = m.new_cache(2, 40)
        ref = [m(x[:, :23], ref_cache)] + [m(x[:, t : t + 1], ref_cache) for t in range(23, 30)]
        c = m.new_cache(2, 40)
        outs = [cstep(x[:, :23], c)]
        first = None
        for t in range(23, 30):
            outs.append(cstep(x[:, t : t + 1], c))
            if t == 24:
                first = counter.frame_count
    assert counter.frame_count == first, f"recompiled: {counter.frame_count} vs {first}"
    for a, b in zip(outs, ref):
        _close(a, b)
    _close(c.kv, ref_cache.kv)
