"""Drop-in replacements for the attention code of the source documents.

One submodule per document, each class and function with the document's name, constructor
signature, parameter/buffer names and shapes (``load_state_dict(strict=True)`` of the document's
weights works), forward signature, return value, accepted input ranks and train/eval dropout
behaviour. The projections stay ``nn.Linear``/``nn.Parameter`` under the document's names and the
attention itself is computed by :func:`attn_ext.attention` (or
:func:`attn_ext.scaled_dot_product_attention` / :func:`attn_ext.attention_weights`): no class
here materializes the score matrix or takes a softmax itself.

- :mod:`attn_ext.compat.torchcode`          document 000 (TorchCode, chapter 3)
- :mod:`attn_ext.compat.llms_from_scratch`  document 001 (LLMs from scratch, chapter 3)
- :mod:`attn_ext.compat.textbook`           document 003 (textbook section 4.2)
- :mod:`attn_ext.compat.attention_zoo`      document 004 (Transformer attention zoo)

Where a document's code is wrong (a typo, a broadcasting bug), the drop-in does what the document
means; each such difference is listed in the docstring of the class concerned.
"""

from typing import Optional

import torch

from .. import functional as _F

# --------------------------------------------------------------------------------------------- #
# Shared helpers. They are defined before the submodules are imported (the submodules import
# them from this package while it is still initializing). They only adapt shapes (views) and
# arguments; the attention math is the operator's.
# --------------------------------------------------------------------------------------------- #


def _dropout_p(dropout: torch.nn.Module, training: bool) -> float:
    """The probability an ``nn.Dropout`` module would apply now (0 in eval mode)."""
    if not training:
        return 0.0
    p = float(dropout.p)
    if p < 0.0 or p > 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    return p


def _check_rank(name: str, x: torch.Tensor, ranks, what: str) -> None:
    if x.dim() not in ranks:
        want = " or ".join(f"{r}-D" for r in ranks)
        raise ValueError(
            f"{name}: expected a {want} input {what}, got {x.dim()}-D {tuple(x.shape)}"
        )


def _check_last(name: str, x: torch.Tensor, size: int, what: str) -> None:
    if x.dim() == 0 or x.size(-1) != size:
        raise ValueError(
            f"{name}: {what} must have last dimension {size}, got shape {tuple(x.shape)}"
        )


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: Optional[float] = None,
    causal: bool = False,
    window_size=(-1, -1),
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    gqa: bool = False,
    name: str = "attention",
) -> torch.Tensor:
    """``softmax(scale * q k^T + mask) v`` over the last two dimensions, for inputs of any rank
    >= 2 whose leading dimensions broadcast (as ``q @ k.transpose(-2, -1)`` would).

    3-D (B, S, D) and 4-D (B, H, S, D) inputs with equal leading dimensions go to
    :func:`attn_ext.attention` as they are; 2-D inputs get a batch axis; other ranks or broadcast
    leading dimensions are flattened into one batch axis. ``gqa=True`` lets 4-D k/v have fewer
    heads than q (attn_ext's grouped mapping, head h reads kv head h // (H // Hkv)).
    ``dropout_p == 1`` (``nn.Dropout(1.0)`` in training) drops every probability, as torch's
    dropout does.
    """
    for n, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() < 2:
            raise ValueError(
                f"{name}: {n} must be at least 2-D (..., S, D), got {t.dim()}-D {tuple(t.shape)}"
            )
    if q.size(-1) != k.size(-1):
        raise ValueError(
            f"{name}: query and key feature sizes differ: {tuple(q.shape)} vs {tuple(k.shape)}"
        )
    if k.size(-2) != v.size(-2):
        raise ValueError(
            f"{name}: key and value lengths differ: {tuple(k.shape)} vs {tuple(v.shape)}"
        )
    p = float(dropout_p)
    drop_all = p >= 1.0
    if drop_all:
        p = 0.0
    lead_q, lead_k, lead_v = q.shape[:-2], k.shape[:-2], v.shape[:-2]
    grouped = (
        gqa
        and q.dim() == 4
        and k.dim() == 4
        and lead_k == lead_v
        and lead_q[0] == lead_k[0]
        and k.size(1) > 0
        and q.size(1) % k.size(1) == 0
    )
    if (q.dim() in (3, 4) and lead_q == lead_k == lead_v) or grouped:
        out = _F.attention(
            q,
            k,
            v,
            scale=scale,
            causal=causal,
            window_size=window_size,
            attn_mask=attn_mask,
            dropout_p=p,
        )
    else:
        try:
            lead = torch.broadcast_shapes(lead_q, lead_k, lead_v)
        except RuntimeError:
            raise ValueError(
                f"{name}: leading (batch) dimensions do not broadcast: q {tuple(q.shape)}, "
                f"k {tuple(k.shape)}, v {tuple(v.shape)}"
            ) from None
        q3 = q.expand(*lead, *q.shape[-2:]).reshape(-1, *q.shape[-2:])
        k3 = k.expand(*lead, *k.shape[-2:]).reshape(-1, *k.shape[-2:])
        v3 = v.expand(*lead, *v.shape[-2:]).reshape(-1, *v.shape[-2:])
        m3 = None
        if attn_mask is not None:
            m = attn_mask.expand(*lead, q.size(-2), k.size(-2)) if len(lead) else attn_mask
            m3 = m.reshape(-1, q.size(-2), k.size(-2))
        out = _F.attention(
            q3,
            k3,
            v3,
            scale=scale,
            causal=causal,
            window_size=window_size,
            attn_mask=m3,
            dropout_p=p,
        )
        out = out.view(*lead, q.size(-2), v.size(-1))
    return out * 0.0 if drop_all else out


@torch.compiler.assume_constant_result
def _float32_sqrt(n: int) -> float:
    """``torch.sqrt(torch.tensor(n).float())`` as a Python float: document 004 scales by the
    float32 square root of the head size, which differs from the float64 one in the 8th digit
    (e.g. for 8); the drop-in uses the same number so float64 results agree to ~1e-15.

    The number is computed the document's way, with torch, not as the correctly rounded
    ``float32(math.sqrt(n))``: torch's CPU float32 ``sqrt`` goes through MKL's vector math,
    whose result is within one ulp but not always correctly rounded, and depends on the code
    path MKL picks for the CPU. Its AVX-512 path is one ulp off for 330 of the integers below
    65,536 (the first is 267); its SSE/AVX path (``MKL_CBWR=COMPATIBLE``, and the CPU of the
    CI run that failed) for 12,562, 10 of them below 100, 19 the first: there the document
    divides by 4.35889864 where the correctly rounded sqrt is 4.35889912. One float32 ulp in the
    scale moves a float64 result by ~1e-7 relative. Computed once per n (MKL picks its path
    once per process)."""
    n = int(n)
    if n not in _FLOAT32_SQRT:
        _FLOAT32_SQRT[n] = torch.sqrt(torch.tensor(n).float()).item()
    return _FLOAT32_SQRT[n]


_FLOAT32_SQRT: dict = {}


from . import attention_zoo, llms_from_scratch, textbook, torchcode  # noqa: E402

__all__ = ["attention_zoo", "llms_from_scratch", "textbook", "torchcode"]
