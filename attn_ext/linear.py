"""Linear attention (document 000's ``linear_attention``, "transformers are RNNs"): a thin
wrapper over ``torch.ops.attn_ext.linear_attention`` that adapts shapes (views only)."""

from typing import Optional, Tuple

import torch

from ._ops import ops as _ops

FEATURE_MAPS = ("elu+1", "relu", "identity")


def _as_4d(name: str, x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 4:
        return x
    if x.dim() == 3:
        return x.unsqueeze(1)
    raise ValueError(
        f"attn_ext.linear_attention: {name} must be 3-D (B, S, D) or 4-D (B, H, S, D), "
        f"got {x.dim()}-D {tuple(x.shape)}"
    )


def _state_4d(initial_state, three_d: bool):
    if initial_state is None:
        return None, None
    try:
        kv, k = initial_state
    except (TypeError, ValueError):
        raise ValueError(
            "attn_ext.linear_attention: initial_state must be a pair (kv_state, k_state), "
            f"got {type(initial_state).__name__}"
        ) from None
    if three_d:  # a 3-D call's state has no head axis
        kv, k = kv.unsqueeze(1), k.unsqueeze(1)
    return kv, k


def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    eps: float = 1e-6,
    feature_map: str = "elu+1",
    initial_state: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    return_state: bool = False,
):
    r"""Linear attention ``out_i = phi(q_i)^T S_i / (phi(q_i)^T z_i + eps)``.

    ``S_i = sum_j phi(k_j) v_j^T`` and ``z_i = sum_j phi(k_j)`` run over every key
    (``causal=False``) or over the keys ``j <= i`` (``causal=True``), plus the initial state.
    Cost O(S * D * Dv); no S x S matrix is formed (causal is computed in chunks of 64 positions,
    quadratic inside a chunk, with the state carried between chunks).

    q: (B, H, Sq, D) or (B, Sq, D); k: (B, H, Sk, D); v: (B, H, Sk, Dv). Causal needs
    ``Sq == Sk``. ``feature_map`` is ``"elu+1"`` (document 000, positive), ``"relu"`` or
    ``"identity"`` (not positive: its denominator may vanish).

    State: ``(kv_state, k_state)`` with kv_state (B, H, D, Dv) = ``sum phi(k) v^T`` and k_state
    (B, H, D) = ``sum phi(k)`` (no H axis for 3-D inputs), float32 for float32/bfloat16/float16
    inputs and float64 for float64. ``initial_state`` is added to the sums of the keys given;
    ``return_state=True`` also returns the final state (initial + every key), so a sequence can
    be processed in pieces, e.g. a prompt and then one token per call (recurrent decoding).
    Gradients flow through both.

    Returns ``out`` (B, H, Sq, Dv) in q's dtype, or ``(out, (kv_state, k_state))``.
    """
    three_d = q.dim() == 3
    q4, k4, v4 = _as_4d("q", q), _as_4d("k", k), _as_4d("v", v)
    init_kv, init_k = _state_4d(initial_state, three_d)
    out, state_kv, state_k = _ops.linear_attention(
        q4, k4, v4, init_kv, init_k, causal=causal, eps=eps, feature_map=feature_map
    )
    if three_d:
        out, state_kv, state_k = out.squeeze(1), state_kv.squeeze(1), state_k.squeeze(1)
    return (out, (state_kv, state_k)) if return_state else out
