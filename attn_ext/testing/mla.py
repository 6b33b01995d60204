"""Reference for Multi-head Latent Attention, plain PyTorch written from the equations of
DeepSeek-V2 §2.1 (eqs. 9-19), with no absorption and no cache:

    c^Q = RMSNorm(W^DQ h)          (or h itself without a query compression)
    q^C_i = W^UQ_i c^Q,  q^R_i = RoPE(W^QR_i c^Q)      per head i
    c^KV = RMSNorm(W^DKV h)
    k^C_i = W^UK_i c^KV, v^C_i = W^UV_i c^KV,  k^R = RoPE(W^KR h)   (k^R shared by the heads)
    q_i = [q^C_i; q^R_i], k_i = [k^C_i; k^R]
    o_t,i = sum_{j <= t} softmax_j(q_t,i . k_j,i / sqrt(d_h + d_h^R)) v^C_j,i
    u_t = W^O [o_t,1; ...; o_t,H]

:func:`paper_weights` reads those matrices out of an ``attn_ext.nn.MultiHeadLatentAttention``
(its HuggingFace DeepSeek-V2 parameter layout), so the reference and the module share weights
but nothing else.
"""

from __future__ import annotations

import math

import torch

from attn_ext.testing.decoding import rope_reference


def paper_weights(m) -> dict:
    """The paper's matrices of module ``m`` (detached views; per-head ones as (H, out, in))."""
    H, nope, rot, dv = m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    w = {}
    if m.q_lora_rank is None:
        wq = m.q_proj.weight
        w["W_DQ"], w["q_norm"] = None, None
    else:
        wq = m.q_b_proj.weight
        w["W_DQ"], w["q_norm"] = m.q_a_proj.weight, m.q_a_layernorm.weight
    wq = wq.unflatten(0, (H, nope + rot))
    w["W_UQ"], w["W_QR"] = wq[:, :nope], wq[:, nope:]
    wa = m.kv_a_proj_with_mqa.weight
    w["W_DKV"], w["W_KR"] = wa[: m.kv_lora_rank], wa[m.kv_lora_rank :]
    w["kv_norm"] = m.kv_a_layernorm.weight
    wb = m.kv_b_proj.weight.unflatten(0, (H, nope + dv))
    w["W_UK"], w["W_UV"] = wb[:, :nope], wb[:, nope:]
    w["W_O"] = m.o_proj.weight
    w["eps"] = m.kv_a_layernorm.eps
    return w


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _per_head(W: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """W (H, out, in), c (B, S, in) -> (B, H, S, out)."""
    return torch.einsum("hoi,bsi->bhso", W, c)


def mla_reference(
    h: torch.Tensor,
    w: dict,
    *,
    positions=None,
    rope_base: float = 10000.0,
    interleaved: bool = True,
    compute_dtype=None,
    return_parts: bool = False,
):
    """MLA forward of h (B, S, d_model) with causal attention, all at ``compute_dtype``
    (default h's dtype; float64 with the float64 RoPE gives the ground truth)."""
    dt = compute_dtype or h.dtype
    w = {k: (v.to(dt) if isinstance(v, torch.Tensor) else v) for k, v in w.items()}
    h = h.to(dt)
    eps = w["eps"]
    c_q = h if w["W_DQ"] is None else rms_norm(h @ w["W_DQ"].T, w["q_norm"], eps)
    q_c = _per_head(w["W_UQ"], c_q)
    rkw = dict(
        positions=positions,
        base=rope_base,
        interleaved=interleaved,
        compute_dtype=torch.float64 if dt == torch.float64 else None,
    )
    q_r = rope_reference(_per_head(w["W_QR"], c_q), **rkw)
    c_kv = rms_norm(h @ w["W_DKV"].T, w["kv_norm"], eps)
    k_c = _per_head(w["W_UK"], c_kv)
    v_c = _per_head(w["W_UV"], c_kv)
    k_r = rope_reference((h @ w["W_KR"].T).unsqueeze(1), **rkw)  # (B, 1, S, rope)
    q = torch.cat([q_c, q_r], dim=-1)
    k = torch.cat([k_c, k_r.expand(-1, q.size(1), -1, -1)], dim=-1)
    S = h.size(1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
    future = torch.ones(S, S, dtype=torch.bool, device=h.device).triu(1)
    p = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    o = p @ v_c  # (B, H, S, dv)
    u = o.transpose(1, 2).flatten(2) @ w["W_O"].T
    if return_parts:
        return u, dict(c_kv=c_kv, k_r=k_r)
    return u
