"""Plain-PyTorch references for the spatial (CBAM) and temporal attention family.

Written from what document 004 and the papers compute, materializing everything:
* channel pooling / gate: ``cat([mean_c x, max_c x])`` and ``x * sigmoid(a)`` (torch.max's
  index-based gradient, so the max's gradient goes to the first maximal channel);
* CBAM (Woo et al. 2018): channel gate ``sigmoid(W1 relu(W0 avg) + W1 relu(W0 max))`` (biases
  optional), spatial gate ``sigmoid(conv([avg_c; max_c]))`` applied to the channel gate's output;
* temporal attention: the time matrix ``T`` built explicitly (the time embedding repeated per
  token) and the scores ``Q (T^T T / (||T||_F + eps)) K^T * scale`` formed as an S x S matrix.
"""

import torch
import torch.nn.functional as F


def channel_pool(x):
    return torch.cat([x.mean(dim=1, keepdim=True), torch.max(x, dim=1, keepdim=True).values], dim=1)


def spatial_gate(x, a):
    return x * torch.sigmoid(a)


def doc_spatial_map(x, conv_weight):
    """Document 004's SpatialAttention: the gate map (N, 1, H, W)."""
    k = conv_weight.size(-1)
    return torch.sigmoid(F.conv2d(channel_pool(x), conv_weight, padding=k // 2))


def cbam_channel(x, w0, w1, b0=None, b1=None):
    def mlp(v):
        return F.linear(F.relu(F.linear(v, w0, b0)), w1, b1)

    gate = torch.sigmoid(mlp(x.mean(dim=(2, 3))) + mlp(x.amax(dim=(2, 3))))
    return x * gate[:, :, None, None]


def cbam_spatial(x, conv_weight):
    return x * doc_spatial_map(x, conv_weight)


def cbam(x, w0, w1, conv_weight, b0=None, b1=None):
    return cbam_spatial(cbam_channel(x, w0, w1, b0, b1), conv_weight)


def temporal_scores_attention(q, k, v, t, scale, eps=1e-8, causal=False):
    """q, k, v (..., S, d); t (..., S, d): the explicit time matrix (one row per token).
    Returns (out, weights) with scores q (t^T t / (||t||_F + eps)) k^T * scale."""
    norm = torch.linalg.vector_norm(t, dim=(-2, -1), keepdim=True)
    m = t.transpose(-2, -1) @ t / (norm + eps)
    scores = (q @ m @ k.transpose(-2, -1)) * scale
    if causal:
        S = scores.size(-1)
        keep = torch.ones(S, S, dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    w = torch.softmax(scores, dim=-1)
    return w @ v, w


def temporal_multihead(layer, x, time_points, causal=False):
    """attn_ext.nn.TemporalAttention's math with explicit per-head time matrices."""
    B, S, E = x.shape
    H, d = layer.num_heads, layer.head_dim
    if time_points.dim() == 2:
        time_points = time_points.unsqueeze(1)
    t = layer.time_proj(time_points).expand(B, S, E)  # T: one row per token

    def heads(z):
        return z.reshape(B, S, H, d).transpose(1, 2)

    out, w = temporal_scores_attention(
        heads(layer.q_proj(x)),
        heads(layer.k_proj(x)),
        heads(layer.v_proj(x)),
        heads(t),
        d**-0.5,
        layer.eps,
        causal,
    )
    return layer.out_proj(out.transpose(1, 2).reshape(B, S, E)), w
