"""attn_implementation="attn_ext" in HuggingFace transformers against "sdpa" and "eager".

Small Llama (GQA) and Mistral (GQA + sliding window shorter than the sequences) models with
random weights (no download), on the CPU: same logits as "sdpa" on the non-padded positions with
left or right padding, same greedy `generate` output (dynamic and static caches), same
gradients, and checks that the model really runs attn_ext's kernels with the causal /
sliding-window structure passed as flags rather than as a 4-D mask (padded batches as varlen
batches of their real tokens). Packed documents (DataCollatorWithFlattening) give the loss and
gradients of the same documents padded and run one by one. Gemma 2 (softcap, alternating
windows) and gpt-oss (sinks) against "eager"; ALiBi on the varlen op against BLOOM's and MPT's
own attention. Logits of padded positions are not compared: a query row that sees no key gives
zeros in attn_ext and something else in torch's SDPA.
"""

import copy
import inspect
import pathlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.masking_utils import (  # noqa: E402
    ALL_MASK_ATTENTION_FUNCTIONS,
    and_masks,
    causal_mask_function,
    chunked_causal_mask_function,
    sdpa_mask,
    sliding_window_causal_mask_function,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

import attn_ext.functional  # noqa: E402
from attn_ext.integrations import transformers as attn_ext_hf  # noqa: E402

VOCAB, WINDOW, LAYERS = 128, 8, 2
PACKED_LENGTHS = [7, 12, 5]  # documents of a packed batch; 12 > WINDOW: windows act inside one
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float64: dict(atol=1e-11, rtol=1e-10)}


def _config(kind):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    return transformers.MistralConfig(sliding_window=WINDOW, **common)


_MODELS = {}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The models are tiny: one intra-op thread is faster, and fair to a busy machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _models(kind, dtype):
    """(sdpa model, attn_ext model) with the same random weights, in eval mode."""
    key = (kind, dtype)
    if key not in _MODELS:
        attn_ext_hf.register()
        cls = transformers.LlamaForCausalLM if kind == "llama" else transformers.MistralForCausalLM
        cfg = _config(kind)
        models = []
        for impl in ("sdpa", "attn_ext"):
            torch.manual_seed(1234)
            # Each model gets its own config: the attention implementation is stored in it.
            models.append(
                cls._from_config(copy.deepcopy(cfg), attn_implementation=impl).to(dtype).eval()
            )
        models[1].load_state_dict(models[0].state_dict())
        assert models[0].config._attn_implementation == "sdpa"
        assert models[1].config._attn_implementation == "attn_ext"
        _MODELS[key] = tuple(models)
    return _MODELS[key]


def _batch(seq=20, pads=(0, 6), seed=0, side="left"):
    """Token ids and the 2-D attention mask of a batch whose row b has pads[b] padding tokens
    on the given side (generation pads on the left, training usually on the right)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (len(pads), seq), generator=g)
    mask = torch.ones(len(pads), seq, dtype=torch.long)
    for b, p in enumerate(pads):
        pad = slice(0, p) if side == "left" else slice(seq - p, seq)
        mask[b, pad] = 0
        ids[b, pad] = 0
    return ids, mask


def _loss_and_grads(model, run):
    model.zero_grad(set_to_none=True)
    loss = run()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _assert_same_padded_step(ref, ours, ids, mask, atol, rtol):
    """The two models give the same logits on the real tokens of a padded batch and the same
    parameter gradients of transformers' loss (labels: the tokens, padding ignored). With left
    padding the loss also reads the last padding position (it predicts the first real token),
    whose output is zeros in attn_ext: that needs a reference that gives zeros there too."""
    labels = ids.masked_fill(mask == 0, -100)
    steps = []
    for model in (ref, ours):
        logits = []

        def run(model=model, logits=logits):
            out = model(ids, attention_mask=mask, labels=labels)
            logits.append(out.logits.detach()[mask.bool()])
            return out.loss

        _, grads = _loss_and_grads(model, run)
        steps.append(dict(grads, logits=logits[0]))
    assert steps[0].keys() == steps[1].keys() and len(steps[0]) > 1
    for n in steps[0]:
        torch.testing.assert_close(steps[1][n], steps[0][n], atol=atol, rtol=rtol, msg=n)
    return steps[1]


class _Spy:
    """Records the calls of attn_ext.functional.attention / attention_varlen made by the
    integration."""

    def __init__(self, monkeypatch):
        self.calls = []
        real, real_varlen = attn_ext.functional.attention, attn_ext.functional.attention_varlen

        def spy(q, k, v, **kw):
            m = kw.get("attn_mask")
            self.calls.append(
                dict(
                    sq=q.size(-2),
                    sk=k.size(-2),
                    heads=(q.size(1), k.size(1)),
                    causal=kw.get("causal"),
                    window=tuple(kw.get("window_size")),
                    mask=None if m is None else (tuple(m.shape), m.dtype),
                )
            )
            return real(q, k, v, **kw)

        def spy_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
            self.calls.append(
                dict(
                    varlen=cu_q.diff().tolist(),
                    heads=(q.size(1), k.size(1)),
                    causal=kw.get("causal"),
                    window=tuple(kw.get("window_size")),
                )
            )
            return real_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kw)

        monkeypatch.setattr(attn_ext.functional, "attention", spy)
        monkeypatch.setattr(attn_ext.functional, "attention_varlen", spy_varlen)


def test_register_is_idempotent():
    assert attn_ext_hf.register() == "attn_ext"
    n_attn, n_mask = len(ALL_ATTENTION_FUNCTIONS), len(ALL_MASK_ATTENTION_FUNCTIONS)
    assert attn_ext_hf.register() == "attn_ext"
    assert (len(ALL_ATTENTION_FUNCTIONS), len(ALL_MASK_ATTENTION_FUNCTIONS)) == (n_attn, n_mask)
    assert ALL_ATTENTION_FUNCTIONS["attn_ext"] is attn_ext_hf.attn_ext_attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS["attn_ext"] is attn_ext_hf.attn_ext_mask
    assert "attn_ext" in ALL_ATTENTION_FUNCTIONS.valid_keys()


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_logits_match_sdpa_with_padding(kind, dtype, side):
    ref, ours = _models(kind, dtype)
    # 20 > WINDOW, and a row shorter than WINDOW
    ids, mask = _batch(seq=20, pads=(0, 6, 13), side=side)
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
    keep = mask.bool()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[keep], want[keep], **TOL[dtype])
    # No padding at all: the mask function returns None, the kernel gets only the flags.
    with torch.no_grad():
        torch.testing.assert_close(ours(ids[:1]).logits, ref(ids[:1]).logits, **TOL[dtype])


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_model_calls_attn_ext_with_structure_not_a_4d_mask(kind, monkeypatch):
    """A padded batch runs as a varlen batch of its real tokens, an unpadded one with the causal
    / window flags only; never a 4-D mask."""
    ref, ours = _models(kind, torch.float32)
    spy = _Spy(monkeypatch)
    ids, mask = _batch(seq=20, pads=(0, 6))
    with torch.no_grad():
        ours(ids, attention_mask=mask)
    window = (WINDOW - 1, 0) if kind == "mistral" else (-1, -1)
    varlen = dict(varlen=[20, 14], heads=(4, 2), causal=True, window=window)
    assert spy.calls == [varlen] * LAYERS
    spy.calls.clear()
    with torch.no_grad():
        ref(ids, attention_mask=mask)  # the sdpa model does not go through attn_ext
        ours(ids)
    assert (
        spy.calls
        == [dict(sq=20, sk=20, heads=(4, 2), causal=True, window=window, mask=None)] * LAYERS
    )


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_greedy_generate_matches_sdpa(kind, monkeypatch):
    ref, ours = _models(kind, torch.float32)
    ids, mask = _batch(seq=12, pads=(0, 7), seed=1)
    args = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = ref.generate(ids, **args)
        spy = _Spy(monkeypatch)
        got = ours.generate(ids, **args)
    assert got.shape == (2, 20)
    assert torch.equal(got, want)
    # Prefill (a varlen batch of the real tokens), then one-token decoding steps on the KV
    # cache, each with at most the padding mask.
    assert len(spy.calls) == 8 * LAYERS
    assert spy.calls[0]["varlen"] == [12, 5]
    decode = spy.calls[LAYERS:]
    assert all(c["sq"] == 1 and c["causal"] for c in decode)
    if kind == "mistral":
        # The sliding-window cache layers hold the last WINDOW - 1 keys: padding is among them
        # for the first steps only, after which no mask is passed at all.
        assert all(c["sk"] == WINDOW and c["window"] == (WINDOW - 1, 0) for c in decode)
        masks = [c["mask"] for c in decode]
        assert masks[0] == ((2, 1, 1, WINDOW), torch.bool) and masks[-1] is None
    else:
        assert [c["sk"] for c in decode[::LAYERS]] == list(range(13, 20))
        assert all(c["mask"] == ((2, 1, 1, c["sk"]), torch.bool) for c in decode)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_chunked_prefill_on_a_cache_matches_sdpa(kind):
    # Several new tokens on top of a cache: causal / window bottom-right aligned, Sk > Sq.
    ref, ours = _models(kind, torch.float64)
    ids, mask = _batch(seq=20, pads=(0, 3), seed=6)
    logits = []
    for model in (ref, ours):
        with torch.no_grad():
            first = model(ids[:, :11], attention_mask=mask[:, :11], use_cache=True)
            rest = model(
                ids[:, 11:],
                attention_mask=mask,
                past_key_values=first.past_key_values,
                use_cache=True,
            )
        logits.append(torch.cat([first.logits, rest.logits], 1))
    keep = mask.bool()
    torch.testing.assert_close(logits[1][keep], logits[0][keep], **TOL[torch.float64])


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_generate_with_static_cache_matches_sdpa(kind, monkeypatch):
    # A static cache's keys are not aligned with the queries (unfilled tail; its decoding steps
    # are compileable): there the mask function falls back to the 4-D mask.
    ref, ours = _models(kind, torch.float32)
    ids, mask = _batch(seq=12, pads=(0, 5), seed=2)
    args = dict(
        attention_mask=mask,
        max_new_tokens=6,
        do_sample=False,
        pad_token_id=0,
        cache_implementation="static",
    )
    with torch.no_grad():
        want = ref.generate(ids, **args)
        spy = _Spy(monkeypatch)
        got = ours.generate(ids, **args)
    assert torch.equal(got, want)
    assert len(spy.calls) == 6 * LAYERS
    full = spy.calls if kind == "llama" else spy.calls[LAYERS:]  # Mistral's prefill is aligned
    assert all(
        not c["causal"] and c["mask"] == ((2, 1, c["sq"], c["sk"]), torch.bool) for c in full
    )


def test_user_4d_mask_is_used_as_is():
    ref, ours = _models("llama", torch.float64)
    ids, _ = _batch(seq=10, pads=(0, 0))
    keep = torch.rand(2, 1, 10, 10, generator=torch.Generator().manual_seed(3)) > 0.3
    keep |= torch.eye(10, dtype=torch.bool)  # no empty row
    for m in (keep, torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, float("-inf"))):
        with torch.no_grad():
            torch.testing.assert_close(
                ours(ids, attention_mask=m).logits,
                ref(ids, attention_mask=m).logits,
                **TOL[torch.float64],
            )


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_gradients_match_sdpa(kind, side):
    ref, ours = _models(kind, torch.float64)
    ids, mask = _batch(seq=16, pads=(0, 4), seed=4, side=side)
    _assert_same_padded_step(ref, ours, ids, mask, **TOL[torch.float64])


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("batch", ["padded", "packed_flash_kwargs"])
def test_compiled_model_matches_sdpa(batch):
    """torch.compile(fullgraph=True): a padded batch (the (B, Sk) padding mask on the dense
    kernel) gives sdpa's logits; packed documents with FlashAttention's kwargs (the varlen
    kernel; use_cache left on, so no mask separates the documents) give the logits of the
    documents run one by one."""
    ref, ours = _models("llama", torch.float32)
    if batch == "padded":
        ids, mask = _batch(seq=20, pads=(0, 6), seed=5)
        inputs, keep = dict(input_ids=ids, attention_mask=mask), mask.bool()
        with torch.no_grad():
            want = ref(**inputs).logits[keep]
    else:
        g = torch.Generator().manual_seed(5)
        docs = [torch.randint(1, VOCAB, (n,), generator=g) for n in PACKED_LENGTHS]
        collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
        inputs = collate([{"input_ids": d.tolist()} for d in docs])
        keep = torch.ones(inputs["input_ids"].shape, dtype=torch.bool)
        with torch.no_grad():
            want = torch.cat([ours(d[None]).logits[0] for d in docs])
    torch._dynamo.reset()
    compiled = torch.compile(ours, fullgraph=True)
    with torch.no_grad():
        got = compiled(**inputs).logits[keep]
    torch._dynamo.reset()
    torch.testing.assert_close(got, want, **TOL[torch.float32])


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("batch", ["padded", "packed_flash_kwargs"])
def test_compiled_output_attentions(batch):
    """torch.compile(fullgraph=True) with output_attentions=True: the weights of the uncompiled
    call (the padding mask; packed documents as their block mask from FlashAttention's
    kwargs)."""
    _, ours = _models("llama", torch.float32)
    if batch == "padded":
        ids, mask = _batch(seq=20, pads=(0, 6), seed=5)
        inputs = dict(input_ids=ids, attention_mask=mask)
    else:
        g = torch.Generator().manual_seed(5)
        docs = [torch.randint(1, VOCAB, (n,), generator=g) for n in PACKED_LENGTHS]
        collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
        inputs = collate([{"input_ids": d.tolist()} for d in docs])
        inputs.pop("labels")
    with torch.no_grad():
        want = ours(**inputs, output_attentions=True).attentions
    torch._dynamo.reset()
    compiled = torch.compile(ours, fullgraph=True)
    with torch.no_grad():
        got = compiled(**inputs, output_attentions=True).attentions
    torch._dynamo.reset()
    assert len(got) == len(want) == LAYERS
    for g_, w_ in zip(got, want):
        torch.testing.assert_close(g_, w_, **TOL[torch.float32])


# ---- the mask function alone ---------------------------------------------------------------

new_mask_api = pytest.mark.skipif(
    "q_length" not in inspect.signature(sdpa_mask).parameters,
    reason="sdpa_mask of this transformers takes cache_position "
    "(the unit tests use q_length / q_offset)",
)


def _sdpa_full(**kw):
    return sdpa_mask(allow_is_causal_skip=False, **kw)


@new_mask_api
def test_mask_function_returns_structure_or_padding():
    pad = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 1, 1]], dtype=torch.bool)
    m = attn_ext_hf.attn_ext_mask
    assert m(batch_size=2, q_length=5, kv_length=5) is None
    assert (
        m(batch_size=2, q_length=5, kv_length=5, attention_mask=torch.ones(2, 5, dtype=torch.bool))
        is None
    )
    assert torch.equal(m(batch_size=2, q_length=5, kv_length=5, attention_mask=pad), pad)
    # decoding on a dynamic cache: the 2-D mask grows with the cache
    got = m(batch_size=2, q_length=1, kv_length=5, q_offset=4, attention_mask=pad)
    assert torch.equal(got, pad)
    # sliding-window cache layer: keys start at kv_offset; the padding mask is sliced to them
    sw = sliding_window_causal_mask_function(3)
    got = m(
        batch_size=2,
        q_length=1,
        kv_length=3,
        q_offset=4,
        kv_offset=2,
        mask_function=sw,
        local_size=3,
        attention_mask=pad,
    )
    assert torch.equal(got, pad[:, 2:5])


@new_mask_api
@pytest.mark.parametrize("case", ["static", "chunked", "custom", "no_skip", "sliding_other_size"])
def test_mask_function_falls_back_to_the_full_mask(case):
    pad = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    kw = dict(batch_size=2, q_length=6, kv_length=6, attention_mask=pad)
    if case == "static":  # prefill into a longer static cache
        kw.update(q_length=4, kv_length=8, attention_mask=pad[:, :4])
    elif case == "chunked":
        kw.update(
            mask_function=chunked_causal_mask_function(2, torch.zeros(2, dtype=torch.long)),
            local_size=2,
        )
    elif case == "custom":
        kw.update(mask_function=and_masks(causal_mask_function, lambda b, h, q, k: k != 1))
    elif case == "no_skip":
        kw.update(allow_is_causal_skip=False)
    else:  # a window that does not match local_size is not trusted
        kw.update(mask_function=sliding_window_causal_mask_function(3), local_size=4)
    got = attn_ext_hf.attn_ext_mask(**kw)
    want = _sdpa_full(**{k: v for k, v in kw.items() if k != "allow_is_causal_skip"})
    assert got.dim() == 4 and torch.equal(got, want)


# ---- packed sequences, softcap (Gemma 2) and sinks (gpt-oss) -------------------------------


@pytest.mark.parametrize("signal", ["packed_mask", "position_ids", "flash_kwargs"])
@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_packed_training_equals_unpacked(kind, signal, monkeypatch):
    """Documents packed into one row by DataCollatorWithFlattening run as one varlen batch and
    give the loss (transformers' own, from the collator's labels) and the gradients of the same
    documents as a right-padded batch and run one by one. The packing reaches the backend three
    ways: transformers' packed-sequence mask (use_cache=False, as the Trainer sets), restarting
    position_ids alone (use_cache left on: transformers then builds no packed mask, and "sdpa"
    mixes the documents), or FlashAttention's cu_seq_lens kwargs."""
    _, ours = _models(kind, torch.float32)
    g = torch.Generator().manual_seed(8)
    docs = [torch.randint(1, VOCAB, (n,), generator=g) for n in PACKED_LENGTHS]
    collate = transformers.DataCollatorWithFlattening(
        return_flash_attn_kwargs=signal == "flash_kwargs"
    )
    packed = collate([{"input_ids": d.tolist()} for d in docs])
    if signal == "packed_mask":
        packed["use_cache"] = False
    if signal == "flash_kwargs":
        # the kwargs alone must be enough: the ids / position_ids route is switched off
        monkeypatch.setattr(attn_ext_hf, "_packed", None)

    spy = _Spy(monkeypatch)
    got, got_grads = _loss_and_grads(ours, lambda: ours(**packed).loss)
    window = (WINDOW - 1, 0) if kind == "mistral" else (-1, -1)
    call = dict(varlen=PACKED_LENGTHS, heads=(4, 2), causal=True, window=window)
    assert spy.calls == [call] * LAYERS

    ids, mask = _batch(
        seq=max(PACKED_LENGTHS),
        pads=[max(PACKED_LENGTHS) - n for n in PACKED_LENGTHS],
        side="right",
    )
    for b, d in enumerate(docs):
        ids[b, : len(d)] = d
    labels = ids.masked_fill(mask == 0, -100)
    padded = _loss_and_grads(ours, lambda: ours(ids, attention_mask=mask, labels=labels).loss)
    # transformers' loss is a mean over the predicted tokens (n - 1 per document)
    weights = [n - 1 for n in PACKED_LENGTHS]
    one_by_one = _loss_and_grads(
        ours,
        lambda: (
            sum(w * ours(d[None], labels=d[None]).loss for w, d in zip(weights, docs))
            / sum(weights)
        ),
    )
    for want, want_grads in (padded, one_by_one):
        # fp32: the three runs multiply matrices of different shapes, so the sums round in a
        # different order (measured: one ulp of the loss)
        torch.testing.assert_close(got, want, atol=0, rtol=1e-5)
        assert want_grads.keys() == got_grads.keys()
        for n in want_grads:
            torch.testing.assert_close(got_grads[n], want_grads[n], atol=1e-5, rtol=1e-4, msg=n)


def _pair(cls, cfg, dtype, ref_impl="eager"):
    attn_ext_hf.register()
    models = []
    for impl in (ref_impl, "attn_ext"):
        torch.manual_seed(1234)
        models.append(cls._from_config(copy.deepcopy(cfg), attn_implementation=impl).to(dtype))
    models[1].load_state_dict(models[0].state_dict())
    return [m.eval() for m in models]


def _gemma2():
    cfg = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        sliding_window=WINDOW, attn_logit_softcapping=5.0, query_pre_attn_scalar=16,
        pad_token_id=0, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    assert "sliding_attention" in cfg.layer_types and "full_attention" in cfg.layer_types
    return _pair(transformers.Gemma2ForCausalLM, cfg, torch.float32)


def test_gemma2_softcap_and_alternating_windows_match_eager(monkeypatch):
    """Gemma 2 (logit soft-capping; sliding-window and global layers alternating): same logits
    as transformers' eager attention on a left-padded batch, the same greedy generation, and the
    same gradients (softcap's backward) on a right-padded training batch."""
    ref, ours = _gemma2()
    ids, mask = _batch(seq=20, pads=(0, 6, 13), seed=9)
    with torch.no_grad():
        want, got = ref(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(got[keep], want[keep], **TOL[torch.float32])
    # eager gives a left-padding row (it sees no key) uniform weights, not zeros: right padding
    right = _batch(seq=20, pads=(0, 6, 13), seed=9, side="right")
    _assert_same_padded_step(ref, ours, *right, **TOL[torch.float32])
    args = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    spy = _Spy(monkeypatch)
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, **args), ref.generate(ids, **args))
    assert {c["window"] for c in spy.calls} == {(WINDOW - 1, 0), (-1, -1)}


def test_gpt_oss_sinks_match_eager():
    """gpt-oss (a learned sink logit per head, s_aux): same logits and gradients, the sinks'
    included, as transformers' eager attention."""
    ref, ours = _gpt_oss()
    ids, mask = _batch(seq=16, pads=(0, 4), seed=10)
    step = _assert_same_padded_step(ref, ours, ids, mask, **TOL[torch.float32])
    assert any(n.endswith("sinks") for n in step)


# ---- output_attentions: the weights eager attention returns --------------------------------


def _gpt_oss():
    """A two-layer gpt-oss pair (eager, attn_ext), float32: the experts' grouped matmul has no
    float64 kernel."""
    cfg = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=WINDOW, pad_token_id=0, bos_token_id=None,
        eos_token_id=None,
    )  # fmt: skip
    return _pair(transformers.GptOssForCausalLM, cfg, torch.float32)


def _eager_pair(kind):
    if kind == "gemma2":
        return _gemma2()
    if kind == "gpt_oss":
        return _gpt_oss()
    cls = transformers.LlamaForCausalLM if kind == "llama" else transformers.MistralForCausalLM
    return _pair(cls, _config(kind), torch.float32)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2", "gpt_oss"])
def test_output_attentions_match_eager(kind, side):
    """model(..., output_attentions=True) returns each layer's (B, H, S, S) weights, as eager
    attention does (sdpa and FlashAttention return none): the causal / sliding-window /
    padding masks, Gemma 2's softcap, gpt-oss's sinks (rows summing to one less the sink's
    share). A differentiated function of the weights gives eager's parameter gradients."""
    ref, ours = _eager_pair(kind)
    ids, mask = _batch(seq=14, pads=(0, 5), seed=11, side=side)
    # eager gives a row that sees no key (left padding) uniform weights, not zeros, and a
    # gradient through them: only the real query rows are compared and differentiated
    real = mask.bool()[:, None, :, None]
    probe = torch.randn(LAYERS, 2, 4, 14, 14, generator=torch.Generator().manual_seed(3)) * real
    results = []
    for model in (ref, ours):
        model.zero_grad(set_to_none=True)
        out = model(ids, attention_mask=mask, output_attentions=True)
        weights = out.attentions
        assert len(weights) == model.config.num_hidden_layers
        n = min(LAYERS, len(weights))
        (sum((w * probe[i]).sum() for i, w in enumerate(weights[:n]))).backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        results.append(([w.detach() * real for w in weights], out.logits.detach(), grads))
    (want_w, want_logits, want_g), (got_w, got_logits, got_g) = results
    for want, got in zip(want_w, got_w):
        assert got.shape == want.shape == (2, 4, 14, 14)
        torch.testing.assert_close(got, want, **TOL[torch.float32])
    if kind == "gpt_oss":  # the sinks took a share of the rows
        assert (got_w[0].sum(-1)[real[..., 0].expand(-1, 4, -1)] < 1 - 1e-4).any()
    keep = mask.bool()
    torch.testing.assert_close(got_logits[keep], want_logits[keep], **TOL[torch.float32])
    assert want_g.keys() == got_g.keys() and len(got_g) > 1, set(want_g) ^ set(got_g)
    for k in want_g:
        torch.testing.assert_close(got_g[k], want_g[k], atol=1e-5, rtol=1e-4, msg=k)


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_generate_output_attentions_match_eager(kind):
    """generate(..., output_attentions=True): the same tokens and, at every step (prefill, then
    one query against the cache and its padding mask; Gemma 2's sliding layers too), the same
    weights as eager on the real query rows."""
    ref, ours = _eager_pair(kind)
    ids, mask = _batch(seq=12, pads=(0, 4), seed=5)
    args = dict(
        attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
        output_attentions=True, return_dict_in_generate=True,
    )  # fmt: skip
    with torch.no_grad():
        want, got = ref.generate(ids, **args), ours.generate(ids, **args)
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.attentions) == len(want.attentions) == 5
    real = mask.bool()[:, None, :, None]  # the prefill's left-padding rows see no key
    for step, (want_step, got_step) in enumerate(zip(want.attentions, got.attentions)):
        for w, g in zip(want_step, got_step):
            assert g.shape == w.shape and g.shape[2] == (12 if step == 0 else 1)
            rows = real if step == 0 else torch.ones_like(real[..., :1, :])
            torch.testing.assert_close(g * rows, w * rows, **TOL[torch.float32])


@pytest.mark.parametrize("signal", ["packed_mask", "position_ids", "flash_kwargs"])
def test_output_attentions_of_packed_documents(signal):
    """Packed documents return (1, H, S, S) weights that are block diagonal: document d's block
    is its weights run alone, and no weight crosses documents, whichever way the packing
    reached the backend."""
    _, ours = _models("mistral", torch.float32)
    g = torch.Generator().manual_seed(8)
    docs = [torch.randint(1, VOCAB, (n,), generator=g) for n in PACKED_LENGTHS]
    collate = transformers.DataCollatorWithFlattening(
        return_flash_attn_kwargs=signal == "flash_kwargs"
    )
    packed = collate([{"input_ids": d.tolist()} for d in docs])
    packed.pop("labels")
    if signal == "packed_mask":
        packed["use_cache"] = False
    with torch.no_grad():
        weights = ours(**packed, output_attentions=True).attentions
        alone = [ours(d[None], output_attentions=True).attentions for d in docs]
    bounds = torch.tensor([0, *PACKED_LENGTHS]).cumsum(0).tolist()
    for layer, w in enumerate(weights):
        assert w.shape == (1, 4, sum(PACKED_LENGTHS), sum(PACKED_LENGTHS))
        inside = torch.zeros_like(w, dtype=torch.bool)
        for d, (b0, b1) in enumerate(zip(bounds, bounds[1:])):
            inside[..., b0:b1, b0:b1] = True
            torch.testing.assert_close(w[..., b0:b1, b0:b1], alone[d][layer], **TOL[torch.float32])
        assert (w[~inside] == 0).all()


# ---- ALiBi: no model hands it to the attention interface -----------------------------------


def test_no_alibi_model_uses_the_attention_interface():
    """The module docstring's claim that the backend needs no ALiBi entry: every model of this
    transformers that computes ALiBi (BLOOM, MPT, Falcon in 5.23) runs its own attention code,
    never an attention function. If this fails, a model now routes ALiBi through the interface
    and the backend should pass its slopes to the kernel."""
    models = pathlib.Path(transformers.__file__).parent / "models"
    alibi = [f for f in models.glob("*/modeling_*.py") if "alibi" in f.read_text().lower()]
    assert alibi, "no ALiBi model found: the scan looks in the wrong place"
    assert [f.name for f in alibi if "ALL_ATTENTION_FUNCTIONS" in f.read_text()] == []


def _alibi_attention(kind, heads, head_dim, seq):
    """(eager attention module, its q, k, v (B, H, S, D) from hidden states, its output
    projection, its eager call (hidden, keep (B, S) bool), its ALiBi slopes (H,) float32)."""
    if kind == "bloom":
        from transformers.models.bloom import modeling_bloom as mb

        cfg = transformers.BloomConfig(hidden_size=heads * head_dim, n_head=heads)
        attn = mb.BloomAttention(cfg, layer_idx=0).eval()

        def eager(hidden, keep):
            blocked = ~_causal_keep(keep)
            bias = torch.zeros(blocked.shape).masked_fill(blocked, torch.finfo(hidden.dtype).min)
            alibi = mb.build_alibi_tensor(keep.long(), heads, hidden.dtype)
            return attn(hidden, torch.zeros_like(hidden), alibi, bias)[0]

        def qkv(hidden):
            return attn._reshape(attn.query_key_value(hidden))

        # The slopes from BLOOM's own alibi tensor (B * H, 1, S) = slope_h * position, read at
        # position 1: build_alibi_tensor is public in every supported transformers version
        # (the private _get_alibi_slopes is not in 4.x).
        positions = mb.build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), heads, torch.float32)
        return qkv, attn.dense, eager, positions.view(heads, 2)[:, 1]
    from transformers.models.mpt import modeling_mpt as mm

    cfg = transformers.MptConfig(d_model=heads * head_dim, n_heads=heads, max_seq_len=seq)
    attn = mm.MptAttention(cfg, layer_idx=0).eval()
    bias = mm.build_mpt_alibi_tensor(heads, seq)  # (H, 1, S): slope_h * (j - S + 1)

    def eager(hidden, keep):
        return attn(hidden, bias, attention_mask=~_causal_keep(keep))[0]

    def qkv(hidden):
        B, S, _ = hidden.shape
        parts = attn.Wqkv(hidden).chunk(3, dim=2)
        return [x.reshape(B, S, heads, head_dim).transpose(1, 2) for x in parts]

    return qkv, attn.out_proj, eager, (bias[:, 0, 1] - bias[:, 0, 0]).float()


def _causal_keep(keep):
    """(B, 1, S, S) keep-mask: causal, and only the real keys of each row."""
    S = keep.size(1)
    return torch.ones(S, S, dtype=torch.bool).tril() & keep[:, None, None, :]


@pytest.mark.parametrize("kind", ["bloom", "mpt"])
def test_alibi_on_the_varlen_op_matches_the_models_own_attention(kind):
    """attention_varlen with alibi_slopes, on the real tokens of a left-padded batch, computes
    what BLOOM's and MPT's eager attention computes with their own ALiBi tensors (BLOOM: slope
    times the key's position from the row's first real token; MPT: slope times the key's
    distance to the last key; softmax makes both equal to -slope * |i - j| under the causal
    mask): outputs, and gradients with respect to the hidden states."""
    H, D, S = 4, 16, 12
    qkv, project, eager, slopes = _alibi_attention(kind, H, D, S)
    keep = _batch(seq=S, pads=(0, 5), seed=11)[1].bool()
    B = keep.size(0)
    idx = keep.flatten().nonzero().squeeze(1)
    lengths = keep.sum(1)
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    longest = int(lengths.max())
    hidden = torch.randn(B, S, H * D, generator=torch.Generator().manual_seed(12))

    results = []
    for ours in (False, True):
        h = hidden.clone().requires_grad_()
        if ours:
            tokens = [x.transpose(1, 2).reshape(B * S, H, D).index_select(0, idx) for x in qkv(h)]
            out = attn_ext.functional.attention_varlen(
                *tokens, cu, cu, longest, longest, causal=True, alibi_slopes=slopes
            )
            out = project(out.reshape(-1, H * D))
        else:
            out = eager(h, keep).reshape(B * S, -1).index_select(0, idx)
        out.square().sum().backward()
        results.append((out.detach(), h.grad))
    # float32: both eager modules take their softmax in float32
    for want, got in zip(*results):
        torch.testing.assert_close(got, want, **TOL[torch.float32])
