"""A drop-in for ``torch.nn.MultiheadAttention`` whose attention runs on attn_ext's kernels."""

import warnings
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..functional import attention, attention_with_weights, scaled_dot_product_attention

__all__ = ["MultiheadAttention"]


def _check_mask_type(mask: Optional[Tensor], name: str) -> None:
    if mask is not None and mask.dtype != torch.bool and not torch.is_floating_point(mask):
        raise AssertionError(f"only bool and floating types of {name} are supported")


def _to_additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """torch's canonical form: bool True (= masked) becomes -inf, a float mask is kept."""
    if mask.dtype == torch.bool:
        return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))
    return mask


def _shape_check(query, key, value, key_padding_mask, attn_mask, num_heads) -> bool:
    """torch.nn.functional._mha_shape_check, same errors: returns whether the input is batched."""
    if query.dim() == 3:
        if key.dim() != 3 or value.dim() != 3:
            raise AssertionError(
                "For batched (3-D) `query`, expected `key` and `value` to be 3-D"
                f" but found {key.dim()}-D and {value.dim()}-D tensors respectively"
            )
        if key_padding_mask is not None and key_padding_mask.dim() != 2:
            raise AssertionError(
                "For batched (3-D) `query`, expected `key_padding_mask` to be `None` or 2-D"
                f" but found {key_padding_mask.dim()}-D tensor instead"
            )
        if attn_mask is not None and attn_mask.dim() not in (2, 3):
            raise AssertionError(
                "For batched (3-D) `query`, expected `attn_mask` to be `None`, 2-D or 3-D"
                f" but found {attn_mask.dim()}-D tensor instead"
            )
        return True
    if query.dim() == 2:
        if key.dim() != 2 or value.dim() != 2:
            raise AssertionError(
                "For unbatched (2-D) `query`, expected `key` and `value` to be 2-D"
                f" but found {key.dim()}-D and {value.dim()}-D tensors respectively"
            )
        if key_padding_mask is not None and key_padding_mask.dim() != 1:
            raise AssertionError(
                "For unbatched (2-D) `query`, expected `key_padding_mask` to be `None` or 1-D"
                f" but found {key_padding_mask.dim()}-D tensor instead"
            )
        if attn_mask is not None:
            if attn_mask.dim() not in (2, 3):
                raise AssertionError(
                    "For unbatched (2-D) `query`, expected `attn_mask` to be `None`, 2-D or 3-D"
                    f" but found {attn_mask.dim()}-D tensor instead"
                )
            if attn_mask.dim() == 3:
                expected = (num_heads, query.shape[0], key.shape[0])
                if attn_mask.shape != expected:
                    raise AssertionError(
                        f"Expected `attn_mask` shape to be {expected} but got {attn_mask.shape}"
                    )
        return False
    raise AssertionError(
        "query should be unbatched 2D or batched 3D tensor but received "
        f"{query.dim()}-D query tensor"
    )


class MultiheadAttention(nn.MultiheadAttention):
    r"""Drop-in for :class:`torch.nn.MultiheadAttention`, computed by attn_ext's kernels.

    It *is* a ``torch.nn.MultiheadAttention`` (a subclass that only replaces ``forward``): the
    constructor ``(embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False,
    add_zero_attn=False, kdim=None, vdim=None, batch_first=False, device=None, dtype=None)``,
    the parameters (``in_proj_weight`` when ``kdim == vdim == embed_dim``, else
    ``q_proj_weight``/``k_proj_weight``/``v_proj_weight``; ``in_proj_bias``, ``bias_k``,
    ``bias_v``, ``out_proj``), the ``state_dict`` keys and the initialization (same random draws
    in the same order) are torch's, so ``ours.load_state_dict(theirs.state_dict(), strict=True)``
    works both ways and ``isinstance(ours, torch.nn.MultiheadAttention)`` holds.

    ``forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
    average_attn_weights=True, is_causal=False) -> (attn_output, attn_weights or None)`` follows
    ``torch.nn.functional.multi_head_attention_forward`` (torch's general path) step by step:
    unbatched ``(L, E)`` inputs, ``batch_first``, bool (True = *not* allowed) and float
    (additive) masks, ``attn_mask`` of shape ``(L, S)`` or ``(N * num_heads, L, S)``,
    ``key_padding_mask`` ``(N, S)`` merged into it as torch merges them (a deprecation warning
    when their types differ), ``add_bias_kv`` and ``add_zero_attn`` (masks padded with
    "allowed" for the extra keys), ``is_causal`` as torch's *hint*: it requires ``attn_mask``
    (RuntimeError otherwise); with no ``key_padding_mask`` and ``need_weights=False`` torch
    replaces the mask by a top-left causal mask (so do we), otherwise the mask is used and the
    hint ignored. Dropout (training mode only) applies to the attention probabilities.

    How it computes: the projections are torch's ``F.linear`` calls (one packed matmul for self
    attention); heads are split with views (no copy) and the attention runs on
    :func:`attn_ext.attention` (or :func:`attn_ext.scaled_dot_product_attention` for the causal
    hint) when ``need_weights=False``. With ``need_weights=True`` (torch's default) it runs
    :func:`attn_ext.attention_with_weights`: the same flash kernel, then the probabilities from
    its log-sum-exp in one more pass over the scores (with dropout, the returned weights are the
    dropped ones, as in torch); the backward is the flash kernel's unless the weights take a
    gradient. Pass ``need_weights=False`` to skip the (N, H, L, S) weights. Bool masks are
    given to the kernel as keep-masks (no float copy) and a lone ``key_padding_mask`` is read
    through a broadcast view.

    Differences from torch, all deliberate:

    * A query row that can attend to no key (fully masked): here its attention output is
      always zero (``attn_output`` is then ``out_proj.bias``), its weights are zero and its
      gradients are zero. torch 2.13 gives the same zeros on its ``need_weights=False`` CPU path
      (SDPA), but NaN on its ``need_weights=True`` path (and on SDPA backends that do not zero
      such rows).
    * torch's inference fast path (``torch._native_multi_head_attention``: eval mode, no grad,
      batched self attention with ``batch_first``...) is never taken: every call follows the
      general path above. Its results are the same, except where the fast path differs from
      torch's own general path (it ignores ``is_causal``, so it does not raise when
      ``attn_mask`` is missing, and it accepts NestedTensor inputs, which are rejected here).
    * The gradient with respect to a floating ``attn_mask`` or ``key_padding_mask`` is not
      supported (attn_ext's kernels raise NotImplementedError); pass detached masks.
    * Float masks are cast to the query's dtype.
    * A module that calls ``torch._transformer_encoder_layer_fwd`` on our parameters directly
      (``nn.TransformerEncoderLayer``'s inference fast path) bypasses this ``forward``.
    """

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Optional[Tensor] = None,
        need_weights: bool = True,
        attn_mask: Optional[Tensor] = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        if query.is_nested or key.is_nested or value.is_nested:
            raise AssertionError(
                "attn_ext.nn.MultiheadAttention does not support NestedTensor inputs"
            )
        _check_mask_type(key_padding_mask, "key_padding_mask")
        _check_mask_type(attn_mask, "attn_mask")
        if (
            key_padding_mask is not None
            and attn_mask is not None
            and key_padding_mask.dtype != attn_mask.dtype
        ):
            warnings.warn(
                "Support for mismatched key_padding_mask and attn_mask is deprecated. "
                "Use same type for both instead.",
                stacklevel=2,
            )
        is_batched = _shape_check(query, key, value, key_padding_mask, attn_mask, self.num_heads)
        if is_causal and attn_mask is None:
            raise RuntimeError(
                "Need attn_mask if specifying the is_causal hint. You may use the Transformer "
                "module method `generate_square_subsequent_mask` to create this mask."
            )
        # torch: with a key_padding_mask or need_weights the mask is used and the hint dropped;
        # otherwise the mask is dropped and a top-left causal mask applied.
        causal = is_causal and key_padding_mask is None and not need_weights
        if causal:
            attn_mask = None

        E, H, D = self.embed_dim, self.num_heads, self.head_dim
        # Work batch-first: (N, L, E) views of the inputs.
        seq_first = is_batched and not self.batch_first
        if not is_batched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        if query.size(-1) != E:
            raise AssertionError(
                f"was expecting embedding dimension of {E}, but got {query.size(-1)}"
            )
        if self._qkv_same_embed_dim:
            if key.shape != value.shape:
                raise AssertionError(
                    f"key shape {key.shape} does not match value shape {value.shape}"
                )
        elif key.shape[:2] != value.shape[:2]:
            raise AssertionError(
                f"key's sequence and batch dims {key.shape[:2]} do not match value's "
                f"{value.shape[:2]}"
            )
        q, k, v = self._in_projection(query, key, value)
        if seq_first:  # projections ran on (L, N, .); make them (N, L, .) views
            q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        N, L, S = q.size(0), q.size(1), k.size(1)
        if k.size(0) != N:
            raise AssertionError(f"query batch size {N} does not match key batch size {k.size(0)}")

        if attn_mask is not None:
            if attn_mask.dim() == 2:
                if attn_mask.shape != (L, S):
                    raise RuntimeError(
                        f"The shape of the 2D attn_mask is {attn_mask.shape}, but should be "
                        f"{(L, S)}."
                    )
                attn_mask = attn_mask.view(1, 1, L, S)
            else:
                if attn_mask.shape != (N * H, L, S):
                    raise RuntimeError(
                        f"The shape of the 3D attn_mask is {attn_mask.shape}, but should be "
                        f"{(N * H, L, S)}."
                    )
                attn_mask = attn_mask.view(N, H, L, S)

        extra = 0  # keys appended after the sequence, always allowed by the masks
        if self.bias_k is not None and self.bias_v is not None:
            k = torch.cat([k, self.bias_k.expand(N, 1, E)], dim=1)
            v = torch.cat([v, self.bias_v.expand(N, 1, E)], dim=1)
            extra += 1
        elif self.bias_k is not None or self.bias_v is not None:
            raise AssertionError("bias_k and bias_v must both be set or both be None")
        # (N, S, H*D) -> (N, H, S, D) views.
        q = q.unflatten(-1, (H, D)).transpose(1, 2)
        k = k.unflatten(-1, (H, D)).transpose(1, 2)
        v = v.unflatten(-1, (H, D)).transpose(1, 2)
        if self.add_zero_attn:
            zeros = k.new_zeros((N, H, 1, D))
            k = torch.cat([k, zeros], dim=2)
            v = torch.cat([v, zeros], dim=2)
            extra += 1
        src_len = S + extra

        if key_padding_mask is not None and key_padding_mask.shape != (N, S):
            if key_padding_mask.size(0) != N:
                raise AssertionError(
                    f"Expected key_padded_mask.shape[0] to be {N}, but got "
                    f"{key_padding_mask.size(0)}"
                )
            raise AssertionError(
                f"Expected key_padded_mask.shape[1] to be {src_len}, but got "
                f"{key_padding_mask.size(1) + extra}"
            )
        mask = self._merge_masks(attn_mask, key_padding_mask, extra, q.dtype)

        dropout_p = self.dropout if self.training else 0.0
        weights = None
        if need_weights:
            out, weights = attention_with_weights(
                q, k, v, attn_mask=mask, dropout_p=dropout_p, mean_heads=average_attn_weights
            )
        elif causal:
            out = scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        else:
            out = attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)

        # Merge heads (one copy) in the output layout, then the output projection.
        if seq_first:
            out = out.permute(2, 0, 1, 3).reshape(L, N, E)
        else:
            out = out.transpose(1, 2).reshape(N, L, E)
        out = F.linear(out, self.out_proj.weight, self.out_proj.bias)
        if not is_batched:
            out = out.squeeze(0)
        if weights is not None and not is_batched:
            weights = weights.squeeze(0)
        return out, weights

    def _in_projection(
        self, query: Tensor, key: Tensor, value: Tensor
    ) -> Tuple[Tensor, Tensor, Tensor]:
        """torch's in-projection: packed ``in_proj_weight`` (one matmul for self attention, one
        for a shared key/value input) or separate ``q/k/v_proj_weight``. Returns views."""
        E = self.embed_dim
        b = self.in_proj_bias
        if self._qkv_same_embed_dim:
            w = self.in_proj_weight
            if key is value:
                if query is key:
                    return F.linear(query, w, b).split(E, dim=-1)
                w_q, w_kv = w.split([E, 2 * E])
                b_q, b_kv = (None, None) if b is None else b.split([E, 2 * E])
                k, v = F.linear(key, w_kv, b_kv).split(E, dim=-1)
                return F.linear(query, w_q, b_q), k, v
            w_q, w_k, w_v = w.chunk(3)
        else:
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
            for name, x, w_x in (("key", key, w_k), ("value", value, w_v)):
                if x.size(-1) != w_x.size(1):
                    raise AssertionError(
                        f"expecting {name} weights shape of {(E, x.size(-1))}, but got {w_x.shape}"
                    )
        b_q, b_k, b_v = (None, None, None) if b is None else b.chunk(3)
        return F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)

    @staticmethod
    def _merge_masks(
        attn_mask: Optional[Tensor],
        key_padding_mask: Optional[Tensor],
        extra: int,
        dtype: torch.dtype,
    ) -> Optional[Tensor]:
        """One mask in attn_ext's convention (bool True = attend, float = additive),
        broadcastable to (N, H, L, S + extra): torch's padding and merging of the two masks.
        attn_mask is (1 or N, 1 or H, L, S), key_padding_mask (N, S) (torch convention)."""
        if attn_mask is None and key_padding_mask is None:
            return None
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask[:, None, None, :]  # (N, 1, 1, S) view
        masks = [m for m in (attn_mask, key_padding_mask) if m is not None]
        if all(m.dtype == torch.bool for m in masks):
            blocked = masks[0] if len(masks) == 1 else masks[0] | masks[1]
            keep = ~blocked
            return F.pad(keep, (0, extra), value=True) if extra else keep
        merged = _to_additive(masks[0], dtype)
        if len(masks) == 2:
            merged = merged + _to_additive(masks[1], dtype)
        merged = merged.to(dtype)
        return F.pad(merged, (0, extra), value=0.0) if extra else merged
