"""The source documents' attention code, reproduced in our own code: the ground truth that
:mod:`attn_ext.compat` is checked against, by ``python -m attn_ext`` and by the test suite.

Each class/function computes what its document (``../shared/seeds/``) computes, written as in
the document (same names, parameters, operations), under one namespace per document:

- :class:`doc000` -- document 000, TorchCode chapter 3 (:mod:`attn_ext.compat.torchcode`)
- :class:`doc001` -- document 001, LLMs from scratch chapter 3
  (:mod:`attn_ext.compat.llms_from_scratch`)
- :class:`doc003` -- document 003, textbook section 4.2 (:mod:`attn_ext.compat.textbook`)
- :class:`doc004` -- document 004, the attention zoo (:mod:`attn_ext.compat.attention_zoo`)

Where the document's code is wrong (design.md, "Where a document's code is wrong"), the
reproduction computes what the document means and says so in a comment tagged CORRECTED; the
document's literal code is kept beside it where a test uses it.

Document 000 (TorchCode) has two plain classes (MultiHeadAttention, GroupQueryAttention, not
nn.Modules); they are kept plain here: :func:`plain_state_dict` builds the state dict a user
would load from one and :func:`plain_to` moves one to a device/dtype.

This module is plain PyTorch (it does not use attn_ext) and is slow by design: it materializes
every score matrix, as the documents do.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


# =============================================================================================
# Document 000: TorchCode, chapter 3
# =============================================================================================
class doc000:
    @staticmethod
    def scaled_dot_product_attention(Q, K, V):
        d_k = Q.shape[-1]
        scores = torch.matmul(Q, K.transpose(-1, -2)) / math.sqrt(d_k)
        weights = torch.softmax(scores, dim=-1)
        return weights @ V

    class MultiHeadAttention:
        def __init__(self, d_model: int, num_heads: int):
            self.num_heads = num_heads
            self.dk = d_model // num_heads
            self.W_q = nn.Linear(d_model, d_model)
            self.W_k = nn.Linear(d_model, d_model)
            self.W_v = nn.Linear(d_model, d_model)
            self.W_o = nn.Linear(d_model, d_model)

        def forward(self, Q, K, V):
            B, S_q, _ = Q.shape
            S_k = K.shape[1]
            q = self.W_q(Q)
            k = self.W_k(K)
            v = self.W_v(V)
            q = q.view(B, S_q, self.num_heads, self.dk).transpose(1, 2)
            k = k.view(B, S_k, self.num_heads, self.dk).transpose(1, 2)
            v = v.view(B, S_k, self.num_heads, self.dk).transpose(1, 2)
            scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.dk)
            weights = torch.softmax(scores, dim=-1)
            attn = weights @ v
            out = attn.transpose(1, 2).contiguous().view(B, S_q, -1)
            return self.W_o(out)

    @staticmethod
    def causal_attention(Q, K, V):
        d_k = Q.shape[-1]
        scores = Q @ K.transpose(-1, -2) / math.sqrt(d_k)
        mask = torch.triu(torch.full_like(scores, float("-inf")), diagonal=1)
        scores = scores + mask
        weights = torch.softmax(scores, dim=-1)
        return weights @ V

    class MultiHeadCrossAttention(nn.Module):
        def __init__(self, d_model: int, num_heads: int):
            super().__init__()
            self.num_heads = num_heads
            self.dk = d_model // num_heads
            self.W_q = nn.Linear(d_model, d_model)
            self.W_k = nn.Linear(d_model, d_model)
            self.W_v = nn.Linear(d_model, d_model)
            self.W_o = nn.Linear(d_model, d_model)

        def forward(self, x_q, x_kv):
            B, S_q, _ = x_q.shape
            S_kv = x_kv.shape[1]
            q = self.W_q(x_q).view(B, S_q, self.num_heads, self.dk).transpose(1, 2)
            k = self.W_k(x_kv).view(B, S_kv, self.num_heads, self.dk).transpose(1, 2)
            v = self.W_v(x_kv).view(B, S_kv, self.num_heads, self.dk).transpose(1, 2)
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.dk)
            weights = torch.softmax(scores, dim=-1)
            attn = (weights @ v).transpose(1, 2).contiguous().view(B, S_q, -1)
            return self.W_o(attn)

    class GroupQueryAttention:
        def __init__(self, d_model, num_heads, num_kv_heads):
            self.num_heads = num_heads
            self.num_kv_heads = num_kv_heads
            self.dk = d_model // num_heads
            self.groups = num_heads // num_kv_heads
            self.W_q = nn.Linear(d_model, d_model)
            self.W_k = nn.Linear(d_model, num_kv_heads * self.dk)
            self.W_v = nn.Linear(d_model, num_kv_heads * self.dk)
            self.W_o = nn.Linear(d_model, d_model)

        def forward(self, x):
            B, S, _ = x.shape
            q = self.W_q(x).view(B, S, self.num_heads, self.dk).transpose(1, 2)
            k = self.W_k(x).view(B, S, self.num_kv_heads, self.dk).transpose(1, 2)
            v = self.W_v(x).view(B, S, self.num_kv_heads, self.dk).transpose(1, 2)
            k = k.repeat_interleave(self.groups, dim=1)
            v = v.repeat_interleave(self.groups, dim=1)
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.dk)
            weights = torch.softmax(scores, dim=-1)
            attn = (weights @ v).transpose(1, 2).contiguous().view(B, S, -1)
            return self.W_o(attn)

    @staticmethod
    def sliding_window_attention(Q, K, V, window_size):
        d_k = Q.shape[-1]
        S = Q.shape[1]
        scores = Q @ K.transpose(-1, -2) / math.sqrt(d_k)
        # CORRECTED: the document's torch.arange(S) is on the CPU (fails for CUDA inputs).
        positions = torch.arange(S, device=Q.device)
        mask = (positions.unsqueeze(0) - positions.unsqueeze(1)).abs() > window_size
        scores = scores.masked_fill(mask.unsqueeze(0), float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        return weights @ V

    @staticmethod
    def flash_attention(Q, K, V, block_size=32):
        B, S, D = Q.shape
        scale = 1.0 / math.sqrt(D)
        output = torch.zeros_like(Q)
        row_max = torch.full((B, S, 1), float("-inf"), device=Q.device)
        row_sum = torch.zeros((B, S, 1), device=Q.device)
        for j_start in range(0, S, block_size):
            j_end = min(j_start + block_size, S)
            K_block = K[:, j_start:j_end]
            V_block = V[:, j_start:j_end]
            scores = torch.bmm(Q, K_block.transpose(1, 2)) * scale
            block_max = scores.max(dim=-1, keepdim=True).values
            new_max = torch.maximum(row_max, block_max)
            correction = torch.exp(row_max - new_max)
            output = output * correction
            row_sum = row_sum * correction
            exp_scores = torch.exp(scores - new_max)
            output = output + torch.bmm(exp_scores, V_block)
            row_sum = row_sum + exp_scores.sum(dim=-1, keepdim=True)
            row_max = new_max
        return output / row_sum

    class KVCacheAttention(nn.Module):
        """Self-attention with a (k, v) tuple cache grown by concatenation; a call of
        S_new > 1 tokens masks with triu(-inf, diagonal=S_total - S_new + 1)."""

        def __init__(self, d_model, num_heads):
            super().__init__()
            self.num_heads = num_heads
            self.dk = d_model // num_heads
            self.W_q = nn.Linear(d_model, d_model)
            self.W_k = nn.Linear(d_model, d_model)
            self.W_v = nn.Linear(d_model, d_model)
            self.W_o = nn.Linear(d_model, d_model)

        def forward(self, x, cache=None):
            B, S_new, _ = x.shape
            heads = [
                proj(x).view(B, S_new, self.num_heads, self.dk).transpose(1, 2)
                for proj in (self.W_q, self.W_k, self.W_v)
            ]
            q, k, v = heads
            if cache is not None:
                k = torch.cat([cache[0], k], dim=2)
                v = torch.cat([cache[1], v], dim=2)
            S_total = k.shape[2]
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.dk)
            if S_new > 1:
                future = torch.full((S_new, S_total), float("-inf"), device=x.device)
                scores = scores + torch.triu(future, diagonal=S_total - S_new + 1)
            attn = torch.softmax(scores, dim=-1) @ v
            return self.W_o(attn.transpose(1, 2).contiguous().view(B, S_new, -1)), (k, v)

    @staticmethod
    def apply_rope(q, k):
        """Interleaved RoPE on (B, S, D) at positions 0..S-1, tables in float32."""
        _, S, D = q.shape
        freqs = 1.0 / (10000.0 ** (torch.arange(0, D, 2, device=q.device).float() / D))
        angles = torch.arange(S, device=q.device).float()[:, None] * freqs[None]
        cos, sin = torch.cos(angles)[None], torch.sin(angles)[None]

        def rotate(x):
            even, odd = x[..., 0::2], x[..., 1::2]
            return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)

        return rotate(q), rotate(k)

    @staticmethod
    def linear_attention(Q, K, V):
        """phi = elu + 1; phi(Q) (phi(K)^T V) normalized by phi(Q) . sum phi(K) + 1e-6 on
        (B, S, D) tensors."""
        Qf, Kf = F.elu(Q) + 1, F.elu(K) + 1
        numerator = torch.bmm(Qf, torch.bmm(Kf.transpose(1, 2), V))
        denominator = torch.bmm(Qf, Kf.sum(dim=1, keepdim=True).transpose(1, 2))
        return numerator / (denominator + 1e-6)


PLAIN_LAYERS = ("W_q", "W_k", "W_v", "W_o")


def plain_state_dict(obj, names=PLAIN_LAYERS):
    """The state dict of one of document 000's plain classes (its nn.Linear attributes)."""
    return {f"{n}.{p}": t for n in names for p, t in getattr(obj, n).named_parameters()}


def plain_to(obj, device=None, dtype=None, names=PLAIN_LAYERS):
    """``.to(device, dtype)`` for one of document 000's plain classes (moves its nn.Linear
    attributes in place); returns ``obj``."""
    for n in names:
        getattr(obj, n).to(device=device, dtype=dtype)
    return obj


# =============================================================================================
# Document 001: LLMs from scratch, chapter 3
# =============================================================================================
class doc001:
    @staticmethod
    def simplified_self_attention(inputs):
        attn_scores = inputs @ inputs.T
        attn_weights = torch.softmax(attn_scores, dim=-1)
        return attn_weights @ inputs

    class SelfAttention_v1(nn.Module):
        def __init__(self, d_in, d_out):
            super().__init__()
            self.W_query = nn.Parameter(torch.rand(d_in, d_out))
            self.W_key = nn.Parameter(torch.rand(d_in, d_out))
            self.W_value = nn.Parameter(torch.rand(d_in, d_out))

        def forward(self, x):
            keys = x @ self.W_key
            queries = x @ self.W_query
            values = x @ self.W_value
            attention_scores = queries @ keys.T
            # CORRECTED: the document writes torch.soft (AttributeError); it means torch.softmax.
            attention_weights = torch.softmax(attention_scores / keys.shape[-1] ** 0.5, dim=-1)
            context_vec = attention_weights @ values
            return context_vec

    class SelfAttention_v2(nn.Module):
        def __init__(self, d_in, d_out):
            super().__init__()
            self.W_query = nn.Linear(d_in, d_out)
            self.W_key = nn.Linear(d_in, d_out)
            self.W_value = nn.Linear(d_in, d_out)

        def forward(self, x):
            keys = self.W_key(x)
            queries = self.W_query(x)
            values = self.W_value(x)
            attention_scores = queries @ keys.T
            attention_weights = torch.softmax(attention_scores / keys.shape[-1] ** 0.5, dim=-1)
            context_vec = attention_weights @ values
            return context_vec

    class CausalAttention(nn.Module):
        def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
            super().__init__()
            self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
            self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
            self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
            self.dropout = nn.Dropout(dropout)
            self.register_buffer(
                "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1)
            )

        def forward(self, x):
            b, num_tokens, d_in = x.shape
            keys = self.W_key(x)
            queries = self.W_query(x)
            values = self.W_value(x)
            attention_scores = queries @ keys.transpose(1, 2)
            attention_scores.masked_fill_(self.mask.bool()[:num_tokens, :num_tokens], -torch.inf)
            attention_weights = torch.softmax(attention_scores / keys.shape[-1] ** 0.5, dim=-1)
            attention_weights = self.dropout(attention_weights)
            context_vec = attention_weights @ values
            return context_vec

    class MultiHeadAttentionWrapper(nn.Module):
        def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
            super().__init__()
            self.heads = nn.ModuleList(
                [
                    doc001.CausalAttention(d_in, d_out, context_length, dropout, qkv_bias)
                    for _ in range(num_heads)
                ]
            )

        def forward(self, x):
            return torch.cat([head(x) for head in self.heads], dim=-1)

    class MultiHeadAttention(nn.Module):
        def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
            super().__init__()
            assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
            self.d_out = d_out
            self.num_heads = num_heads
            self.head_dim = d_out // num_heads
            self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
            self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
            self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
            self.out_proj = nn.Linear(d_out, d_out)
            self.dropout = nn.Dropout(dropout)
            self.register_buffer(
                "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1)
            )

        def forward(self, x):
            b, num_tokens, d_in = x.shape
            keys = self.W_key(x)
            queries = self.W_query(x)
            values = self.W_value(x)
            keys = keys.view(b, num_tokens, self.num_heads, self.head_dim)
            queries = queries.view(b, num_tokens, self.num_heads, self.head_dim)
            values = values.view(b, num_tokens, self.num_heads, self.head_dim)
            keys = keys.transpose(1, 2)
            queries = queries.transpose(1, 2)
            values = values.transpose(1, 2)
            attention_scores = queries @ keys.transpose(2, 3)
            attention_scores.masked_fill_(self.mask.bool()[:num_tokens, :num_tokens], -torch.inf)
            attention_weights = torch.softmax(attention_scores / keys.shape[-1] ** 0.5, dim=-1)
            attention_weights = self.dropout(attention_weights)
            context_vec = attention_weights @ values
            context_vec = context_vec.transpose(1, 2)
            context_vec = context_vec.contiguous().view(b, num_tokens, self.d_out)
            context_vec = self.out_proj(context_vec)
            return context_vec


# =============================================================================================
# Document 003: textbook section 4.2
# =============================================================================================
class doc003:
    @staticmethod
    def attention(q, k, v, mask=None, dropout_p=0.0, training=False):
        scores = q @ k.transpose(-2, -1)
        scores = scores / math.sqrt(q.shape[-1])
        if mask is not None:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        # CORRECTED: the document's scores.float() upcasts low precision but *downcasts* float64;
        # it means "at least float32".
        softmax_dtype = torch.float64 if scores.dtype == torch.float64 else torch.float32
        probs = torch.softmax(scores.to(softmax_dtype), dim=-1).to(q.dtype)
        probs = F.dropout(probs, p=dropout_p, training=training)
        out = probs @ v
        return out

    @staticmethod
    def repeat_kv(x, n_rep):
        if n_rep == 1:
            return x
        b, h, t, d = x.shape
        x = x[:, :, None, :, :].expand(b, h, n_rep, t, d)
        return x.reshape(b, h * n_rep, t, d)


# =============================================================================================
# Document 004: attention zoo
# =============================================================================================
class doc004:
    class SelfAttention(nn.Module):
        def __init__(self, input_dim, d_k):
            super().__init__()
            self.W_q = nn.Linear(input_dim, d_k)
            self.W_k = nn.Linear(input_dim, d_k)
            self.W_v = nn.Linear(input_dim, d_k)

        def forward(self, x):
            Q = self.W_q(x)
            K = self.W_k(x)
            V = self.W_v(x)
            scores = torch.matmul(Q, K.transpose(-2, -1)) / torch.sqrt(
                torch.tensor(Q.size(-1)).float()
            )
            attn_weights = F.softmax(scores, dim=-1)
            output = torch.matmul(attn_weights, V)
            return output

    class MultiHeadAttention(nn.Module):
        def __init__(self, input_dim, num_heads, d_k):
            super().__init__()
            self.input_dim = input_dim
            self.num_heads = num_heads
            self.d_k = d_k
            self.head_dim = d_k // num_heads
            self.W_q = nn.Linear(input_dim, d_k)
            self.W_k = nn.Linear(input_dim, d_k)
            self.W_v = nn.Linear(input_dim, d_k)
            self.W_o = nn.Linear(d_k, input_dim)

        def forward(self, x):
            batch_size, seq_len, _ = x.size()
            Q = self.W_q(x).view(batch_size, seq_len, self.num_heads, self.head_dim).transpose(1, 2)
            K = self.W_k(x).view(batch_size, seq_len, self.num_heads, self.head_dim).transpose(1, 2)
            V = self.W_v(x).view(batch_size, seq_len, self.num_heads, self.head_dim).transpose(1, 2)
            scores = torch.matmul(Q, K.transpose(-2, -1)) / torch.sqrt(
                torch.tensor(self.head_dim).float()
            )
            attn_weights = F.softmax(scores, dim=-1)
            output = torch.matmul(attn_weights, V)
            output = output.transpose(1, 2).contiguous().view(batch_size, seq_len, -1)
            output = self.W_o(output)
            return output

    class CrossAttention(nn.Module):
        def __init__(self, input_dim, d_k):
            super().__init__()
            self.W_q = nn.Linear(input_dim, d_k)
            self.W_k = nn.Linear(input_dim, d_k)
            self.W_v = nn.Linear(input_dim, d_k)

        def forward(self, x1, x2):
            Q = self.W_q(x1)
            K = self.W_k(x2)
            V = self.W_v(x2)
            scores = torch.matmul(Q, K.transpose(-2, -1)) / torch.sqrt(
                torch.tensor(Q.size(-1)).float()
            )
            attn_weights = F.softmax(scores, dim=-1)
            output = torch.matmul(attn_weights, V)
            return output

    class GroupedAttentionLiteral(nn.Module):
        """The document's GroupedAttention exactly as written (batch bug included: query group g
        reads the keys of batch element g; runs only for batch_size 1 or num_groups)."""

        def __init__(self, input_dim, d_k, num_heads, num_groups):
            super().__init__()
            assert num_heads % num_groups == 0
            self.num_heads = num_heads
            self.num_groups = num_groups
            self.head_dim = d_k // num_heads
            self.W_q = nn.Linear(input_dim, d_k)
            self.W_k = nn.Linear(input_dim, d_k // num_groups)
            self.W_v = nn.Linear(input_dim, d_k // num_groups)
            self.W_o = nn.Linear(d_k, input_dim)

        def forward(self, x):
            batch_size, seq_len, _ = x.size()
            Q = self.W_q(x).view(batch_size, seq_len, self.num_heads, self.head_dim).transpose(1, 2)
            K = (
                self.W_k(x)
                .view(batch_size, seq_len, self.num_heads // self.num_groups, self.head_dim)
                .transpose(1, 2)
            )
            V = (
                self.W_v(x)
                .view(batch_size, seq_len, self.num_heads // self.num_groups, self.head_dim)
                .transpose(1, 2)
            )
            Q = Q.view(
                batch_size,
                self.num_groups,
                self.num_heads // self.num_groups,
                seq_len,
                self.head_dim,
            )
            scores = torch.matmul(Q, K.transpose(-2, -1)) / torch.sqrt(
                torch.tensor(self.head_dim).float()
            )
            attn_weights = F.softmax(scores, dim=-1)
            output = torch.matmul(attn_weights, V)
            output = (
                output.view(batch_size, self.num_heads, seq_len, self.head_dim)
                .transpose(1, 2)
                .contiguous()
                .view(batch_size, seq_len, -1)
            )
            output = self.W_o(output)
            return output

    class GroupedAttention(GroupedAttentionLiteral):
        """CORRECTED: as the document, but K/V get an explicit group axis (B, 1, Hkv, S, hd) so
        every batch element reads its own keys; query head h = g * Hkv + r reads kv head r."""

        def forward(self, x):
            batch_size, seq_len, _ = x.size()
            Q = self.W_q(x).view(batch_size, seq_len, self.num_heads, self.head_dim).transpose(1, 2)
            K = (
                self.W_k(x)
                .view(batch_size, seq_len, self.num_heads // self.num_groups, self.head_dim)
                .transpose(1, 2)
            )
            V = (
                self.W_v(x)
                .view(batch_size, seq_len, self.num_heads // self.num_groups, self.head_dim)
                .transpose(1, 2)
            )
            Q = Q.view(
                batch_size,
                self.num_groups,
                self.num_heads // self.num_groups,
                seq_len,
                self.head_dim,
            )
            K, V = K.unsqueeze(1), V.unsqueeze(1)  # the correction
            scores = torch.matmul(Q, K.transpose(-2, -1)) / torch.sqrt(
                torch.tensor(self.head_dim).float()
            )
            attn_weights = F.softmax(scores, dim=-1)
            output = torch.matmul(attn_weights, V)
            output = (
                output.view(batch_size, self.num_heads, seq_len, self.head_dim)
                .transpose(1, 2)
                .contiguous()
                .view(batch_size, seq_len, -1)
            )
            output = self.W_o(output)
            return output

    class SpatialAttention(nn.Module):
        """CBAM's spatial attention map as the document writes it: returns the gate
        sigmoid(conv([mean_c x; max_c x])) (N, 1, H, W); the caller multiplies x by it."""

        def __init__(self, kernel_size=7):
            super().__init__()
            assert kernel_size in (3, 7), "kernel size must be 3 or 7"
            padding = 3 if kernel_size == 7 else 1
            self.conv1 = nn.Conv2d(2, 1, kernel_size, padding=padding, bias=False)
            self.sigmoid = nn.Sigmoid()

        def forward(self, x):
            avg_out = torch.mean(x, dim=1, keepdim=True)
            max_out, _ = torch.max(x, dim=1, keepdim=True)
            x = torch.cat([avg_out, max_out], dim=1)
            x = self.conv1(x)
            return self.sigmoid(x)

    class TemporalAttention(nn.Module):
        """Scores Q (T^T T / (||T||_F + 1e-8)) K^T / sqrt(d_k), T the time embedding repeated
        over the sequence; returns (output, attn_weights)."""

        def __init__(self, input_dim, d_k, time_emb_dim):
            super().__init__()
            self.input_dim = input_dim
            self.d_k = d_k
            self.time_emb_dim = time_emb_dim
            self.W_q = nn.Linear(input_dim, d_k)
            self.W_k = nn.Linear(input_dim, d_k)
            self.W_v = nn.Linear(input_dim, d_k)
            self.W_t = nn.Linear(time_emb_dim, d_k)

        def forward(self, x, time_points):
            batch_size, seq_len, _ = x.size()
            Q = self.W_q(x)
            K = self.W_k(x)
            V = self.W_v(x)
            time_emb = self.W_t(time_points)
            T = time_emb.repeat(1, seq_len, 1)
            T_norm = torch.norm(T, p="fro", dim=(1, 2), keepdim=True)
            T_scaled = (T.transpose(1, 2) @ T) / (T_norm + 1e-8)
            scores = torch.matmul(Q, T_scaled)
            scores = torch.matmul(scores, K.transpose(1, 2))
            scores = scores / torch.sqrt(torch.tensor(self.d_k, dtype=torch.float32))
            attn_weights = F.softmax(scores, dim=-1)
            output = torch.matmul(attn_weights, V)
            return output, attn_weights

    class TensorProductAttentionLiteral(nn.Module):
        """The document's TensorProductAttention as written: its parameters (what the drop-in
        must load) and its forward, which attends across heads at each position, sums the rank
        terms without 1/R and multiplies B_Q, B_K elementwise by ``rope_pos`` (S, d_k). The
        paper's definition (the drop-in's) is in attn_ext/testing/tpa.py."""

        def __init__(self, d_model, num_heads, d_k, r_q=6, r_k=2, r_v=2):
            super().__init__()
            self.num_heads = num_heads
            self.d_k = d_k
            self.r_q, self.r_k, self.r_v = r_q, r_k, r_v
            self.W_a_q = nn.Linear(d_model, num_heads * r_q)
            self.W_b_q = nn.Linear(d_model, d_k * r_q)
            self.W_a_k = nn.Linear(d_model, num_heads * r_k)
            self.W_b_k = nn.Linear(d_model, d_k * r_k)
            self.W_a_v = nn.Linear(d_model, num_heads * r_v)
            self.W_b_v = nn.Linear(d_model, d_k * r_v)
            self.out_proj = nn.Linear(num_heads * d_k, d_model)

        def _factor(self, W, x, r, n):
            B, S, _ = x.shape
            return W(x).view(B, S, r, n).transpose(1, 2)  # (B, r, S, n)

        def forward(self, x, rope_pos=None):
            B, S, _ = x.shape
            A_Q = self._factor(self.W_a_q, x, self.r_q, self.num_heads)
            B_Q = self._factor(self.W_b_q, x, self.r_q, self.d_k)
            A_K = self._factor(self.W_a_k, x, self.r_k, self.num_heads)
            B_K = self._factor(self.W_b_k, x, self.r_k, self.d_k)
            A_V = self._factor(self.W_a_v, x, self.r_v, self.num_heads)
            B_V = self._factor(self.W_b_v, x, self.r_v, self.d_k)
            if rope_pos is not None:
                m = rope_pos.unsqueeze(0).unsqueeze(1)
                B_Q, B_K = B_Q * m, B_K * m
            Q = (A_Q.unsqueeze(-1) * B_Q.unsqueeze(-2)).sum(dim=1)  # (B, S, H, d_k)
            K = (A_K.unsqueeze(-1) * B_K.unsqueeze(-2)).sum(dim=1)
            V = (A_V.unsqueeze(-1) * B_V.unsqueeze(-2)).sum(dim=1)
            scores = (Q @ K.transpose(2, 3)) / torch.sqrt(
                torch.tensor(self.d_k, dtype=torch.float32)
            )
            out = (F.softmax(scores, dim=-1) @ V).transpose(1, 2).contiguous()
            return self.out_proj(out.view(B, S, -1))
