"""Drop-ins for document 003 (textbook section 4.2, "Attention Mechanism").

``attention(q, k, v, mask=None, dropout_p=0.0, training=False)`` is the document's "minimal
PyTorch implementation" computed by :func:`attn_ext.attention`; ``repeat_kv(x, n_rep)`` is the
document's helper (a view: ``expand`` + ``reshape``, as written there).

Differences from the document's code:

- The document takes the softmax as ``softmax(scores.float()).to(q.dtype)``: meant to *raise*
  low-precision scores to float32, it *lowers* float64 scores to float32. The drop-in takes the
  softmax in float32 for float16/bfloat16/float32 inputs and in float64 for float64 inputs.
- ``mask`` must be bool (True = visible), as the document says; the document's ``~mask`` would
  silently bit-flip an integer mask and fail on a float one, the drop-in raises ``ValueError``.
- A query row whose keys are all masked: the document fills the masked scores with
  ``finfo.min`` (not ``-inf``), so such a row gets *uniform* weights over all keys; the drop-in
  returns that same uniform average of ``v`` for such rows (without dropout on them).
- Dropout draws its mask from attn_ext's Philox generator (seeded from torch's default
  generator) rather than ``F.dropout``'s: same distribution and ``1/(1-p)`` scaling.
"""

import torch

from . import _attend

__all__ = ["attention", "repeat_kv"]


def attention(q, k, v, mask=None, dropout_p=0.0, training=False):
    """``dropout(softmax(q k^T / sqrt(Dh) masked)) v``.

    q: (..., Tq, Dh) (``[B, H, T, Dh]`` in the document), k: (..., Tk, Dh), v: (..., Tk, Dv),
    leading dimensions broadcasting; ``mask``: bool, broadcastable to (..., Tq, Tk), True =
    visible. Dropout with probability ``dropout_p`` only when ``training``. Returns
    (..., Tq, Dv) in q's dtype."""
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise ValueError(
                "attention: mask must be a bool tensor (True = visible), got "
                f"{mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__}"
            )
        if mask.device != q.device:
            mask = mask.to(q.device)
    p = float(dropout_p) if training else 0.0
    if p < 0.0 or p > 1.0:
        raise ValueError(f"attention: dropout probability has to be between 0 and 1, but got {p}")
    out = _attend(q, k, v, attn_mask=mask, dropout_p=p, name="attention")
    if mask is not None:
        # Rows with no visible key: the document's finfo.min fill gives uniform weights there.
        empty = ~mask.any(dim=-1, keepdim=True)
        out = torch.where(empty, v.mean(dim=-2, keepdim=True).to(out.dtype), out)
    return out


def repeat_kv(x, n_rep):
    """(B, H_kv, T, D) -> (B, H_kv * n_rep, T, D), each kv head repeated ``n_rep`` times
    consecutively (head ``h`` of the result is head ``h // n_rep`` of ``x``).

    Note that :func:`attn_ext.attention` reads grouped K/V heads directly (query head ``h`` reads
    kv head ``h // (H // H_kv)``, the same mapping), so with attn_ext there is no need to repeat."""
    if x.dim() != 4:
        raise ValueError(
            f"repeat_kv: x must be 4-D [B, H_kv, T, D], got {x.dim()}-D {tuple(x.shape)}"
        )
    if n_rep == 1:
        return x
    b, h, t, d = x.shape
    x = x[:, :, None, :, :].expand(b, h, n_rep, t, d)
    return x.reshape(b, h * n_rep, t, d)
