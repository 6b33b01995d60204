"""HuggingFace transformers integration: ``attn_implementation="attn_ext"``.

Usage::

    import attn_ext.integrations.transformers as attn_ext_hf
    attn_ext_hf.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="attn_ext")

:func:`register` adds two entries under the same name, as transformers requires for an
attention backend:

- an attention function (``AttentionInterface``), the counterpart of
  ``transformers.integrations.sdpa_attention.sdpa_attention_forward``, computed by
  :func:`attn_ext.attention`. Grouped-query attention is read in place (no ``repeat_kv``); the
  ``(B, H, S, D)`` views transformers hands over are not copied.
- a mask function (``AttentionMaskInterface``), the counterpart of
  ``transformers.masking_utils.sdpa_mask``.

How the mask reaches the kernel. When the mask transformers asks for is a plain causal or
sliding-window causal pattern, possibly with padding, and the query block is aligned with the
end of the key block (``q_offset + q_length == kv_offset + kv_length``: the case of no cache, of
``DynamicCache`` prefill/decoding and of its sliding-window layers), the mask function returns
no 4-D mask: ``None`` when nothing is padded, else the ``(B, Sk)`` bool keep-mask of the keys
(the convention of transformers' flash-attention backends). The attention function then passes
the structure as ``causal=True`` (taken from the ``is_causal`` argument or ``module.is_causal``)
and ``window_size=(sliding_window - 1, 0)`` (from the ``sliding_window`` argument that models
give their attention function, as for flash attention), bottom-right aligned, and the padding:

- a padded batch whose queries are its keys (training, prefill; outside ``torch.compile``) runs
  as a varlen batch (:func:`attn_ext.attention_varlen`): the real tokens of each row (one run,
  left or right padding) are gathered, attended with no work for the padding, and scattered back;
- decoding steps, compiled models and rows whose real tokens are not one run pass the padding
  as a ``(B, 1, 1, Sk)`` bool mask to the dense kernel, read through stride-0 views.

Packed sequences (several documents in one row, no padding, as ``DataCollatorWithFlattening``
produces) run as one varlen batch (causal, and the sliding window, within each document), so
packed training computes what unpacked training does. The attention function takes the
document boundaries from, in FlashAttention 2's order:

- FlashAttention's padding-free kwargs ``cu_seq_lens_q/k`` and ``max_length_q/k``
  (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``), as they are: no device read,
  and the one form that also runs on the varlen kernel inside ``torch.compile``;
- the ``(B, S)`` int64 sequence ids that the mask function returns instead of the block-diagonal
  4-D mask when it recognizes transformers' packed-sequence mask. transformers builds that mask
  only for a forward without a cache (``use_cache=False``, as the ``Trainer`` sets);
- else ``position_ids`` that restart (transformers' ``find_packed_sequence_indices``), handed to
  the attention function by the model: a training forward that leaves ``use_cache`` on gets no
  packed mask from transformers, and ``"sdpa"``/``"eager"`` then attend across documents, while
  this backend, like FlashAttention 2's, keeps them apart. This is checked only when no mask is
  given and the queries are the keys (not while decoding), at one device read per layer.

Everything else (static caches other than an aligned prefill, chunked attention, custom
``or``/``and`` mask functions, bidirectional masks, and, inside ``torch.compile`` where the mask
function cannot be recognized, sliding windows and packing without FlashAttention's kwargs) gets
the 4-D bool mask that ``sdpa_mask`` builds (or ``None`` where ``sdpa_mask`` itself skips a
bidirectional mask); a 4-D mask handed to the attention function (bool: True = keep, floating:
additive) is used as it is, with no causal flag.

Score modifiers: ``softcap`` (Gemma 2) and attention sinks (``s_aux``, gpt-oss; their gradient
flows to the sinks parameter) go to the kernels. No model of transformers 5.23 routes ALiBi
through the attention interface (BLOOM, MPT and Falcon compute it in their own eager code), so
``alibi_slopes`` has no entry here (``tests/test_transformers.py`` scans the installed
transformers for a model that would need one); :func:`attn_ext.attention` and
:func:`attn_ext.attention_varlen` take it directly, and the tests check the latter against BLOOM's
and MPT's own ALiBi attention.

Tested with transformers 4.57.1 and 5.23.0 (the mask function accepts both the
``q_length``/``q_offset`` arguments of recent versions and the older ``cache_position``), in
eager mode and under ``torch.compile(fullgraph=True)``.

Attention weights: ``model(..., output_attentions=True)`` returns each layer's ``(B, H, Sq, Sk)``
probabilities, as eager attention does (``"sdpa"`` and the FlashAttention backends return
none): the output from the flash kernel and the weights from its lse
(:func:`attn_ext.attention_with_weights`), with the same masks, softcap and sinks (rows sum to
one less the sink's share), dropped as the output's in training, and differentiable (q, k and
the sinks, as eager's). Such a call runs the dense kernel: packed documents become their
block-diagonal mask and a padded batch its padding mask (the weights matrix is that size
anyway). transformers refuses ``config.output_attentions`` for backends other than eager; the
forward argument is the way.

Differences from ``"sdpa"``: a query row that sees no key (e.g. a left-padding position) gets
zeros instead of whatever the torch backend returns there (eager's weights there are uniform).
"""

from typing import Callable, Optional

import torch

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import (
        AttentionMaskInterface,
        causal_mask_function,
        sdpa_mask,
    )
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "attn_ext.integrations.transformers needs HuggingFace transformers with AttentionInterface "
        "and AttentionMaskInterface (transformers >= 4.57): pip install transformers"
    ) from e

try:  # transformers >= 4.54
    from transformers.masking_utils import (
        find_packed_sequence_indices as _find_packed_sequence_indices,
    )
except ImportError:  # pragma: no cover - older transformers: packing only through the mask
    _find_packed_sequence_indices = None

from .. import functional as _F

_FLASH_VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")

NAME = "attn_ext"

__all__ = ["NAME", "register", "attn_ext_attention_forward", "attn_ext_mask"]


def _compiling() -> bool:
    return torch.compiler.is_compiling()


# ----------------------------------------------------------------------------------------------
# mask function
# ----------------------------------------------------------------------------------------------


def _closure(fn: Callable, name: str):
    code = getattr(fn, "__code__", None)
    if code is None or fn.__closure__ is None or name not in code.co_freevars:
        return None
    return fn.__closure__[code.co_freevars.index(name)].cell_contents


def _sliding_window_of(mask_function: Callable, local_size: Optional[int]) -> Optional[int]:
    """The window if ``mask_function`` is transformers'
    ``sliding_window_causal_mask_function(local_size)``, i.e. ``and_masks(sliding_window_overlay(w),
    causal_mask_function)`` (``kv_idx > q_idx - w`` and ``kv_idx <= q_idx``); None otherwise."""
    if not isinstance(local_size, int) or local_size < 1 or _compiling():
        # torch.compile cannot trace the closure introspection below: a compiled model gets
        # the full mask for its sliding-window layers (correct, just not structured).
        return None
    parts = _closure(mask_function, "mask_functions")
    if not isinstance(parts, tuple) or len(parts) != 2 or parts[1] is not causal_mask_function:
        return None
    overlay = parts[0]
    if not getattr(overlay, "__qualname__", "").startswith("sliding_window_overlay."):
        return None
    if _closure(overlay, "sliding_window") != local_size:
        return None
    # Belt and braces: the recognized function must give the expected band on a small probe.
    w = local_size
    q = torch.tensor([0, w - 1, w, 2 * w + 1]).view(1, 1, -1, 1)
    kv = torch.arange(2 * w + 2).view(1, 1, 1, -1)
    zero = torch.zeros(1, dtype=torch.long).view(1, 1, 1, 1)
    got = mask_function(zero, zero, q, kv)
    if not torch.equal(got.expand(1, 1, q.numel(), kv.numel()), (kv <= q) & (kv > q - w)):
        return None
    return local_size


def _qualname_starts(fn, prefix: str) -> bool:
    return getattr(fn, "__qualname__", "").startswith(prefix)


def _packed_sequence_ids(mask_function: Callable, local_size: Optional[int]):
    """The (B, S) sequence ids if ``mask_function`` is transformers' packed-sequence form of the
    causal or sliding-window causal mask; None otherwise. Two forms: transformers 5
    (``packed_sequence_compatibility_function``: ``and_masks(packed_sequence_mask_function(ids),
    remap_positions_for_packed_sequence(base, position_ids))``) and 4.x
    (``and_masks(base, packed_sequence_mask_function(ids))``, positions not remapped: the same
    mask, as causality and the window only compare positions within one sequence)."""
    if _compiling():
        return None
    parts = _closure(mask_function, "mask_functions")
    if not isinstance(parts, tuple) or len(parts) != 2:
        return None
    packed = "packed_sequence_mask_function."
    if _qualname_starts(parts[0], packed):
        same_sequence, base = parts
    elif _qualname_starts(parts[1], packed):
        base, same_sequence = parts
    else:
        return None
    if _qualname_starts(base, "remap_positions_for_packed_sequence."):
        base = _closure(base, "mask_function")
    if base is not causal_mask_function and _sliding_window_of(base, local_size) is None:
        return None
    ids = _closure(same_sequence, "packed_sequence_mask")
    return ids if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None


def _padding_keep(
    attention_mask: torch.Tensor, kv_length: int, kv_offset: int, device
) -> torch.Tensor:
    """The (B, kv_length) keep-mask of the keys at positions [kv_offset, kv_offset + kv_length)
    from the 2-D padding mask (positions past its end, e.g. an unfilled cache, are not kept)."""
    keep = attention_mask.to(device=device, dtype=torch.bool)
    if (missing := kv_offset + kv_length - keep.size(-1)) > 0:
        keep = torch.nn.functional.pad(keep, (0, missing))
    return keep[:, kv_offset : kv_offset + kv_length]


def attn_ext_mask(
    batch_size: int,
    q_length: Optional[int] = None,
    kv_length: Optional[int] = None,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable = causal_mask_function,
    attention_mask: Optional[torch.Tensor] = None,
    local_size: Optional[int] = None,
    allow_is_causal_skip: bool = True,
    cache_position: Optional[torch.Tensor] = None,
    device="cpu",
    **kwargs,
) -> Optional[torch.Tensor]:
    """The mask function registered under ``"attn_ext"`` (same arguments as ``sdpa_mask``; the
    ``cache_position`` form of transformers < 5.2 is accepted too).

    Returns ``None`` (plain causal / sliding-window causal, nothing padded), a ``(B, kv_length)``
    bool keep-mask (the same with padding), the ``(B, S)`` int64 sequence ids of packed
    sequences (causal within each), or the 4-D ``(B, 1, q_length, kv_length)`` bool mask of
    ``sdpa_mask`` for every other pattern. The first two only when transformers allows the
    structure to replace the mask (``allow_is_causal_skip``) and the queries are aligned with the
    end of the keys, which is what attn_ext's bottom-right ``causal``/``window_size`` express.
    """
    if cache_position is not None:  # older API: the queries' absolute positions
        q_length = cache_position.shape[0]
        # Reading the first position would break a compiled graph: then treat it as unaligned.
        q_offset = None if _compiling() or q_length == 0 else int(cache_position[0])
    structured = False
    if allow_is_causal_skip and not kwargs.get("use_vmap", False):
        if mask_function is causal_mask_function:
            structured = True
        elif local_size is not None:
            structured = _sliding_window_of(mask_function, local_size) is not None
    # Tensor offsets (static caches) are not read: that would break a compiled graph.
    aligned = (
        isinstance(q_offset, int)
        and isinstance(kv_offset, int)
        and isinstance(kv_length, int)
        and q_offset + q_length == kv_offset + kv_length
    )
    if (
        allow_is_causal_skip is False
        and attention_mask is None
        and aligned
        and q_offset == 0
        and (ids := _packed_sequence_ids(mask_function, local_size)) is not None
        and ids.shape == (batch_size, q_length)
    ):
        # Packed sequences (position_ids restarts, DataCollatorWithFlattening): the int64
        # sequence ids stand for the block-diagonal mask; the attention function runs them as
        # a varlen batch.
        return ids
    if structured and aligned:
        if attention_mask is None:
            return None
        padding = _padding_keep(attention_mask, kv_length, kv_offset, device)
        if not _compiling() and bool(padding.all()):
            return None
        return padding
    positions = (
        dict(cache_position=cache_position)
        if cache_position is not None
        else dict(q_length=q_length, q_offset=q_offset)
    )
    return sdpa_mask(
        batch_size=batch_size,
        kv_length=kv_length,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        local_size=local_size,
        allow_is_causal_skip=False,
        device=device,
        **positions,
        **kwargs,
    )


# ----------------------------------------------------------------------------------------------
# attention function
# ----------------------------------------------------------------------------------------------


def attn_ext_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    position_bias: Optional[torch.Tensor] = None,
    s_aux: Optional[torch.Tensor] = None,
    cache=None,
    **kwargs,
):
    """The attention function registered under ``"attn_ext"`` (same contract as
    ``sdpa_attention_forward``): query ``(B, H, Sq, D)``, key/value ``(B, Hkv, Sk, D|Dv)``;
    returns ``(out (B, Sq, H, Dv) contiguous, None)``, or with ``output_attentions=True``
    ``(out, weights (B, H, Sq, Sk))`` as eager attention returns them."""
    weights = bool(kwargs.get("output_attentions", False))
    if _paged(cache):
        key, value = cache.update(
            key_states=key, value_states=value, layer_idx=module.layer_idx, kwargs=kwargs
        )

    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    mods = dict(softcap=float(softcap) if softcap else 0.0, sinks=s_aux)
    window = (int(sliding_window) - 1, 0) if is_causal and sliding_window is not None else (-1, -1)
    mask = attention_mask
    varlen = dict(is_causal=is_causal, window=window, scaling=scaling, dropout=dropout, mods=mods)
    packed_ids = mask is not None and mask.dim() == 2 and _is_sequence_ids(mask)
    flash_varlen = all(kwargs.get(k) is not None for k in _FLASH_VARLEN_KWARGS)
    aligned_prefill = position_bias is None and query.size(-2) == key.size(-2)
    mask_allows_kwargs = mask is None or packed_ids or mask.dim() == 4
    documents = None
    if weights:
        # The weights are (B, H, Sq, Sk) whatever the batch's form: packed documents become
        # the block-diagonal mask they stand for, and the dense kernel runs (as eager does).
        if flash_varlen and aligned_prefill and not _paged(cache) and mask_allows_kwargs:
            documents = _sequence_ids_from_cu_seqlens(kwargs["cu_seq_lens_q"], query)
        elif packed_ids and aligned_prefill:
            documents = mask
        elif mask is None and aligned_prefill:
            documents = _sequence_ids_from_positions(kwargs.get("position_ids"), query)
    elif flash_varlen and aligned_prefill and not _paged(cache) and mask_allows_kwargs:
        # FlashAttention 2's varlen kwargs: every token is real and the kwargs say where each
        # document starts. A 4-D mask beside them is the causal mask transformers < 5.2 builds
        # under torch.compile (the queries' offset unread, attn_ext_mask cannot call it
        # aligned): it would mix the documents, so the kwargs win, as in FlashAttention 2's
        # own path, which never gets a 4-D mask.
        return _flash_kwargs_varlen(query, key, value, kwargs, **varlen)
    if (mask is None or packed_ids) and aligned_prefill and not weights:
        # Padding-free batches without those kwargs: the sequence ids of attn_ext_mask, then
        # restarting position_ids.
        if mask is None:
            mask = _sequence_ids_from_positions(kwargs.get("position_ids"), query)
        if mask is not None:
            return _packed(query, key, value, mask, **varlen)
    if mask is not None and mask.dim() == 2 and position_bias is None and not weights:
        if query.size(-2) == key.size(-2) and not _compiling():
            out = _unpadded(query, key, value, mask, **varlen)
            if out is not None:
                return out
    causal = False
    if documents is not None:
        # The documents' block-diagonal mask, with the module's causal / sliding window.
        causal = bool(is_causal)
        ids = documents.to(query.device)
        mask = (ids[:, None, :, None] == ids[:, None, None, :]) & (ids >= 0)[:, None, None, :]
    elif mask is None or mask.dim() == 2:
        # Structure from the module (see attn_ext_mask): causal / sliding window, bottom-right
        # aligned, and at most a (B, Sk) padding keep-mask.
        causal = bool(is_causal)
        if mask is not None:
            if mask.size(-1) != key.size(-2):
                raise ValueError(
                    f"attn_ext attention: the 2-D padding mask covers {mask.size(-1)} keys, but "
                    "there are "
                    f"{key.size(-2)} keys"
                )
            if mask.dtype != torch.bool:
                mask = mask.bool()
            mask = mask[:, None, None, :]
    if position_bias is not None:
        bias = position_bias
        if mask is None:
            mask = bias
        elif mask.dtype == torch.bool:
            mask = torch.where(
                mask, bias, torch.tensor(float("-inf"), dtype=bias.dtype, device=bias.device)
            )
        else:
            mask = bias + mask
    if mask is not None and mask.requires_grad:
        mask = mask.detach()

    dense = dict(
        scale=scaling,
        causal=causal,
        window_size=window if causal else (-1, -1),
        attn_mask=mask,
        dropout_p=float(dropout),
        **mods,
    )
    if weights:
        out, w = _F.attention_with_weights(query, key, value, **dense)
        return out.transpose(1, 2).contiguous(), w
    out = _F.attention(query, key, value, **dense)
    return out.transpose(1, 2).contiguous(), None


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """(B, H, S, D) -> (B * S, H, D) tokens (a view when x is a transposed (B, S, H, D))."""
    return x.transpose(1, 2).reshape(-1, x.size(1), x.size(3))


def _cu_seqlens(lengths: torch.Tensor):
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    return cu, int(lengths.max()) if lengths.numel() else 0


def _is_sequence_ids(mask: torch.Tensor) -> bool:
    """The (B, S) int64 sequence ids of packed sequences that attn_ext_mask returns, as opposed
    to a bool (or 0/1 floating) padding keep-mask."""
    return not mask.dtype.is_floating_point and mask.dtype != torch.bool


def _paged(cache) -> bool:
    return cache is not None and type(cache).__name__ == "PagedAttentionCache"


def _sequence_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """The (B, S) sequence ids of FlashAttention's padding-free kwargs: token t of the B * S
    belongs to document b where cu[b] <= t < cu[b + 1] (tokens past the last: -1, masked)."""
    B, _, S, _ = query.shape
    cu = cu_seqlens.to(device=query.device, dtype=torch.long)
    tokens = torch.arange(B * S, device=query.device)
    ids = torch.searchsorted(cu[1:], tokens, right=True)
    return ids.masked_fill(tokens >= cu[-1], -1).view(B, S)


def _sequence_ids_from_positions(position_ids, query: torch.Tensor):
    """The (B, S) sequence ids where ``position_ids`` restart (transformers'
    ``find_packed_sequence_indices``), or None when no row holds several sequences. This is how
    FlashAttention 2's backend recognizes packing when no mask says so, e.g. a training forward
    that keeps ``use_cache=True``: transformers then builds no packed-sequence mask at all."""
    B, _, S, _ = query.shape
    if (
        _find_packed_sequence_indices is None
        or _compiling()  # the check is data-dependent control flow
        or not isinstance(position_ids, torch.Tensor)
        or position_ids.dim() != 2  # e.g. Qwen2-VL's (3, B, S) multimodal positions
        or position_ids.size(0) not in (1, B)
        or position_ids.size(1) != S
        or position_ids.dtype.is_floating_point
    ):
        return None
    ids = _find_packed_sequence_indices(position_ids.expand(B, S))
    # some transformers versions return the ids even when every row is one sequence
    return None if ids is None or bool((ids[:, -1] == 0).all()) else ids


def _flash_kwargs_varlen(query, key, value, kw, *, is_causal, window, scaling, dropout, mods):
    """FlashAttention 2's padding-free kwargs (``cu_seq_lens_q/k``, ``max_length_q/k``, as
    ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` makes): the (B * S) tokens are
    the packed sequences, passed to the varlen kernel as they are."""
    B, H, S, _ = query.shape
    cu_q, cu_k = (kw[k].to(device=query.device) for k in ("cu_seq_lens_q", "cu_seq_lens_k"))
    out = _F.attention_varlen(
        _tokens(query), _tokens(key), _tokens(value), cu_q, cu_k,
        int(kw["max_length_q"]), int(kw["max_length_k"]),
        scale=scaling, causal=bool(is_causal), window_size=window, dropout_p=float(dropout),
        **mods,
    )  # fmt: skip
    return out.view(B, S, H, -1), None


def _packed(query, key, value, ids, *, is_causal, window, scaling, dropout, mods):
    """Packed sequences as one varlen batch: sequence boundaries where the (B, S) ids change
    (or a batch row ends); every token is real, so nothing is gathered or scattered."""
    B, H, S, _ = query.shape
    ids = ids.to(query.device)
    row = torch.arange(B, device=ids.device).view(B, 1) * (S + 1)
    _, lengths = torch.unique_consecutive((ids + row).flatten(), return_counts=True)
    cu, longest = _cu_seqlens(lengths)
    out = _F.attention_varlen(
        _tokens(query), _tokens(key), _tokens(value), cu, cu, longest, longest,
        scale=scaling, causal=bool(is_causal), window_size=window, dropout_p=float(dropout),
        **mods,
    )  # fmt: skip
    return out.view(B, S, H, -1), None


def _unpadded(query, key, value, keep, *, is_causal, window, scaling, dropout, mods):
    """A padded batch (the (B, S) keep-mask of attn_ext_mask, queries aligned with the keys) as
    a varlen batch of its real tokens: gathered, attended with no work for the padding, and
    scattered back (padding rows get zeros, as when they see no key). None when some row's
    real tokens are not one run (their positions would not be those of the padded call)."""
    B, H, S, _ = query.shape
    if keep.shape != (B, S):
        return None
    keep = keep.to(device=query.device, dtype=torch.bool)
    runs = keep[:, 0].long() + (keep[:, 1:] & ~keep[:, :-1]).sum(1)
    if bool((runs > 1).any()):
        return None
    idx = keep.flatten().nonzero().squeeze(1)
    cu, longest = _cu_seqlens(keep.sum(1))
    out = _F.attention_varlen(
        *(_tokens(x).index_select(0, idx) for x in (query, key, value)), cu, cu, longest, longest,
        scale=scaling, causal=bool(is_causal), window_size=window, dropout_p=float(dropout),
        **mods,
    )  # fmt: skip
    full = out.new_zeros(B * S, H, out.size(-1)).index_copy(0, idx, out)
    return full.view(B, S, H, -1), None


# ----------------------------------------------------------------------------------------------
# registration
# ----------------------------------------------------------------------------------------------


def register(name: str = NAME) -> str:
    """Register attn_ext's attention and mask functions with transformers under ``name`` (default
    ``"attn_ext"``), so that ``attn_implementation=name`` selects them. Idempotent: calling it again
    re-registers the same two functions. Returns ``name``."""
    AttentionInterface.register(name, attn_ext_attention_forward)
    AttentionMaskInterface.register(name, attn_ext_mask)
    return name
