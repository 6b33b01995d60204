"""Reference for Tensor Product Attention, plain PyTorch written from the equations of
"Tensor Product Attention Is All You Need" (Zhang et al., 2025), §3:

    a^Q_r(x_t) = W^{a_Q}_r x_t ∈ R^h,   b^Q_r(x_t) = W^{b_Q}_r x_t ∈ R^{d_h}
    Q_t = (1/R_Q) Σ_r a^Q_r(x_t) ⊗ b^Q_r(x_t)        (h × d_h), likewise K_t, V_t
    RoPE: b^Q_r, b^K_r rotated at position t before the product (so Q_t, K_t are rotated);
    head i: softmax(Q[i] K[i]^T / sqrt(d_h)) V[i]  over positions, causal when asked;
    output = W^O concat_i(head_i).

The factors are read from a module's nn.Linear layers with document 004's layout: W_a_*(x)
holds (R, H) row-major and W_b_*(x) holds (R, d_h).
"""

from __future__ import annotations

import math

import torch

from attn_ext.testing.decoding import rope_reference


def factors(m, x: torch.Tensor, dtype=None):
    """{name: (B, S, R, n)} for the six factor projections of module ``m`` at ``dtype``."""
    dt = dtype or x.dtype
    out = {}
    for kind, R in (("q", m.r_q), ("k", m.r_k), ("v", m.r_v)):
        for side, n in (("a", m.num_heads), ("b", m.head_dim)):
            lin = getattr(m, f"W_{side}_{kind}")
            w = lin.weight.detach().to(dt)
            bias = None if lin.bias is None else lin.bias.detach().to(dt)
            y = x.to(dt) @ w.T
            if bias is not None:
                y = y + bias
            out[f"{side}_{kind}"] = y.unflatten(-1, (R, n))
    return out


def tensor_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(1/R) Σ_r a_r ⊗ b_r: a (B, S, R, H), b (B, S, R, D) -> (B, S, H, D), rank by rank."""
    out = torch.zeros(*a.shape[:2], a.size(3), b.size(3), dtype=a.dtype, device=a.device)
    for r in range(a.size(2)):
        out = out + a[:, :, r, :, None] * b[:, :, r, None, :]
    return out / a.size(2)


def rope_factor(b: torch.Tensor, positions, **rope_kw) -> torch.Tensor:
    """RoPE of the feature-side factors b (B, S, R, D) at the tokens' positions."""
    return rope_reference(b.transpose(1, 2), positions=positions, **rope_kw).transpose(1, 2)


def tpa_reference(
    m,
    x: torch.Tensor,
    *,
    positions=None,
    rope: bool = True,
    causal: bool = True,
    scale=None,
    compute_dtype=None,
):
    """TPA forward of x (B, S, d_model) with module ``m``'s weights, at ``compute_dtype``
    (float64 takes the float64 RoPE: the ground truth)."""
    dt = compute_dtype or x.dtype
    f = factors(m, x, dt)
    b_q, b_k = f["b_q"], f["b_k"]
    if rope:
        kw = dict(
            base=m.rope_base,
            interleaved=m.rope_interleaved,
            compute_dtype=torch.float64 if dt == torch.float64 else None,
        )
        b_q, b_k = rope_factor(b_q, positions, **kw), rope_factor(b_k, positions, **kw)
    Q = tensor_product(f["a_q"], b_q).transpose(1, 2)  # (B, H, S, D)
    K = tensor_product(f["a_k"], b_k).transpose(1, 2)
    V = tensor_product(f["a_v"], f["b_v"]).transpose(1, 2)
    scale = 1.0 / math.sqrt(Q.size(-1)) if scale is None else scale
    scores = Q @ K.transpose(-1, -2) * scale
    if causal:
        S = x.size(1)
        scores = scores.masked_fill(
            torch.ones(S, S, dtype=torch.bool, device=x.device).triu(1), float("-inf")
        )
    out = torch.softmax(scores, dim=-1) @ V
    B, H, S, D = out.shape
    W_o = m.out_proj.weight.detach().to(dt)
    bo = m.out_proj.bias
    y = out.transpose(1, 2).reshape(B, S, H * D) @ W_o.T
    return y if bo is None else y + bo.detach().to(dt)


def tpa_expand_reference(
    a,
    b,
    *,
    positions=None,
    scale=None,
    rope=False,
    rope_base=10000.0,
    rope_interleaved=False,
    rotary_dim=None,
    compute_dtype=None,
):
    """What attn_ext.tpa_expand computes: scale * Σ_r a_r ⊗ RoPE(b_r), (B, S, H, D)."""
    dt = compute_dtype or a.dtype
    a, b = a.to(dt), b.to(dt)
    if rope:
        b = rope_factor(
            b,
            positions,
            base=rope_base,
            interleaved=rope_interleaved,
            rotary_dim=rotary_dim,
            compute_dtype=torch.float64 if dt == torch.float64 else None,
        )
    R = a.size(2)
    scale = 1.0 / R if scale is None else scale
    return tensor_product(a, b) * (R * scale)


def tpa_decode_reference(
    q, a_k, b_k, a_v, b_v, lengths, *, scale=None, k_scale=None, v_scale=None, compute_dtype=None
):
    """Attention of q (B, H, S, D) against a factor cache the plain way: the keys and values
    formed from their factors (``K_t[h] = k_scale sum_r a_k[t, r, h] b_k[t, r]``, likewise V),
    then a masked softmax; query i of sequence b sees tokens t <= lengths[b] - S + i. Rows
    that see no token give 0 and lse -inf. Returns (out, lse) in q's dtype (or
    compute_dtype) and float32 (float64 for a float64 compute)."""
    dt = compute_dtype or (torch.float64 if q.dtype == torch.float64 else torch.float32)
    q, a_k, b_k, a_v, b_v = (t.to(dt) for t in (q, a_k, b_k, a_v, b_v))
    B, H, S, D = q.shape
    N = a_k.size(1)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    k_scale = 1.0 / a_k.size(2) if k_scale is None else k_scale
    v_scale = 1.0 / a_v.size(2) if v_scale is None else v_scale
    keys = torch.einsum("bnrh,bnrd->bhnd", a_k, b_k) * k_scale
    values = torch.einsum("bnrh,bnrd->bhnd", a_v, b_v) * v_scale
    scores = (q @ keys.transpose(-1, -2)) * scale  # (B, H, S, N)
    last = lengths.to(torch.int64).to(q.device)[:, None] - S + torch.arange(S, device=q.device)
    visible = torch.arange(N, device=q.device)[None, None, :] <= last[:, :, None]  # (B, S, N)
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.where(
        torch.isfinite(lse)[..., None],
        (scores - lse[..., None]).exp(),
        torch.zeros((), dtype=dt, device=q.device),
    )
    return p @ values, lse
