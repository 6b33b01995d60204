"""Threads and re-entrancy: the ops called concurrently from 8 Python threads (different shapes,
dtypes, with and without grad) return, bit for bit, what they return called one at a time; the
intra-op thread count changes no bit (work splits depend on shapes only, never on threads);
inference_mode / no_grad calls equal the grad-enabled ones."""

import threading

import pytest
import torch

import attn_ext

THREADS = 8


def _calls():
    """(name, zero-argument call returning tensors) covering the families' CPU kernels."""
    g = torch.Generator().manual_seed(0)

    def r(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype)

    cases = []
    for i, dtype in enumerate([torch.float32, torch.bfloat16, torch.float64, torch.float16]):
        q, k, v = r(2, 4, 33 + i, 32, dtype=dtype), r(2, 2, 50, 32, dtype=dtype), None
        v = r(2, 2, 50, 24, dtype=dtype)
        sinks = r(4, dtype=dtype)

        def fwd_bwd(q=q, k=k, v=v, sinks=sinks):
            leaves = [x.clone().requires_grad_(True) for x in (q, k, v, sinks)]
            out = attn_ext.attention(*leaves[:3], causal=True, softcap=5.0, sinks=leaves[3])
            out.float().square().sum().backward()
            return [out.detach()] + [x.grad for x in leaves]

        cases.append((f"attention fwd+bwd {dtype}", fwd_bwd))
    lens = [7, 0, 130, 1, 41]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    qv, kv, vv = r(sum(lens), 4, 32), r(sum(lens), 2, 32), r(sum(lens), 2, 32)

    def varlen():
        leaves = [x.clone().requires_grad_(True) for x in (qv, kv, vv)]
        out = attn_ext.attention_varlen(*leaves, cu, cu, 130, 130, causal=True)
        out.square().sum().backward()
        return [out.detach()] + [x.grad for x in leaves]

    cases.append(("attention_varlen fwd+bwd", varlen))
    qd, kc, vc = r(3, 8, 2, 64), r(3, 2, 300, 64), r(3, 2, 300, 64)
    lengths = torch.tensor([300, 17, 0], dtype=torch.int32)
    cases.append(("decode_attention", lambda: [attn_ext.decode_attention(qd, kc, vc, lengths)]))
    x = r(2, 4, 40, 64)
    cases.append(("rope", lambda: [attn_ext.rope(x, offset=7)]))
    w = r(2, 3, 20, 16)
    cases.append(("linear_attention", lambda: [attn_ext.linear_attention(w, w, w, causal=True)]))
    return cases


def _same(a, b, name):
    assert len(a) == len(b), name
    for x, y in zip(a, b):
        assert torch.equal(x, y), f"{name}: results differ"


def test_concurrent_python_threads_give_the_sequential_results():
    cases = _calls()
    expected = {name: fn() for name, fn in cases}
    results, errors = {}, []

    def worker(t):
        try:
            for j in range(3):  # every thread runs every case, in its own order
                for name, fn in cases[t % len(cases) :] + cases[: t % len(cases)]:
                    results[(t, j, name)] = fn()
        except Exception as e:  # reported below, with the thread
            errors.append((t, repr(e)))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert len(results) == THREADS * 3 * len(cases)
    for (t, j, name), got in results.items():
        _same(got, expected[name], f"{name} (thread {t}, round {j})")


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_intra_op_thread_count_changes_no_bit(threads):
    cases = _calls()
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        expected = {name: fn() for name, fn in cases}
        torch.set_num_threads(threads)
        for name, fn in cases:
            _same(fn(), expected[name], f"{name} at {threads} threads")
    finally:
        torch.set_num_threads(old)


def test_inference_mode_and_no_grad_equal_grad_mode():
    q, k, v = (torch.randn(2, 4, 37, 32) for _ in range(3))
    want = attn_ext.attention(q, k, v, causal=True)
    with torch.no_grad():
        assert torch.equal(attn_ext.attention(q, k, v, causal=True), want)
    with torch.inference_mode():
        got = attn_ext.attention(q, k, v, causal=True)
        assert got.is_inference() and torch.equal(got, want)


def test_autocast_behaves_like_sdpa(device):
    """Inside torch.autocast the attention ops run at the autocast dtype as SDPA does (q, k, v
    cast, differentiably: the fp32 leaves get fp32 gradients)."""
    dtype = torch.bfloat16 if device == "cpu" else torch.float16
    q, k, v = (torch.randn(2, 4, 37, 32, device=device, requires_grad=True) for _ in range(3))
    with torch.autocast(device, dtype=dtype):
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        got = attn_ext.attention(q, k, v, causal=True)
        # the same call on inputs cast by hand: the cast is all autocast adds
        manual = attn_ext.attention(*(x.detach().to(dtype) for x in (q, k, v)), causal=True)
    assert got.dtype == want.dtype == dtype
    assert torch.equal(got, manual)
    # SDPA's top-left and our bottom-right causal agree at Sq == Sk; both round to dtype
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    got.float().square().sum().backward()
    assert all(x.grad is not None and x.grad.dtype == torch.float32 for x in (q, k, v))
    with torch.autocast(device, dtype=dtype):
        tokens = q.detach()[0].transpose(0, 1)
        cu = torch.tensor([0, 37], dtype=torch.int32, device=device)
        varlen = attn_ext.attention_varlen(tokens, tokens, tokens, cu, cu, 37, 37)
        weights = attn_ext.attention_weights(q.detach(), k.detach())
        out_w, with_weights = attn_ext.attention_with_weights(q, k, v, causal=True)
    assert varlen.dtype == weights.dtype == out_w.dtype == with_weights.dtype == dtype
    manual_w = attn_ext.attention_with_weights(
        *(x.detach().to(dtype) for x in (q, k, v)), causal=True
    )[1]
    assert torch.equal(with_weights, manual_w)
