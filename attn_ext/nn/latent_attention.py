"""Multi-head Latent Attention (MLA, DeepSeek-V2 §2.1): causal self-attention whose KV cache
holds one compressed latent per token instead of per-head keys and values.

Per token ``t`` (paper notation, ``d_h`` = ``qk_nope_head_dim``, ``d_h^R`` = ``qk_rope_head_dim``):

* ``c_t^KV = RMSNorm(W^DKV h_t)`` (``kv_lora_rank`` values), ``k_t^C = W^UK c_t^KV`` and
  ``v_t^C = W^UV c_t^KV`` per head;
* ``k_t^R = RoPE(W^KR h_t)``: one decoupled RoPE key shared by every head;
* ``c_t^Q = RMSNorm(W^DQ h_t)`` (or ``h_t`` itself without ``q_lora_rank``),
  ``q_t^C = W^UQ c_t^Q``, ``q_t^R = RoPE(W^QR c_t^Q)`` per head;
* ``q = [q^C, q^R]``, ``k = [k^C, k^R]``, causal softmax attention with the scale
  ``1 / sqrt(d_h + d_h^R)``, ``u_t = W^O [o_t,1; ...; o_t,H]``.

Two ways to run:

* without a cache, or a prompt into an empty cache: the keys and values are decompressed and
  :func:`attn_ext.attention` runs with ``D = d_h + d_h^R``, ``Dv = v_head_dim``;
* decoding against a :class:`attn_ext.LatentKVCache` (only ``c^KV`` and the rotated ``k^R``
  are cached: ``kv_lora_rank + d_h^R`` values per token): the weight-absorbed form. ``W^UK``
  is folded into the query (``q^C W^UK`` lives in the latent space), so every head attends to
  the one shared cache row ``[c^KV, k^R]`` as key and to its first ``kv_lora_rank`` columns as
  value, through :func:`attn_ext.decode_attention` (all query heads of the one KV head form one
  row block, so each cache row is read once per step); ``W^UV`` is applied to the attended
  latent afterwards. Nothing per head is ever materialized for the cached tokens. A
  :class:`attn_ext.PagedLatentKVCache` (``new_cache(..., page_size=...)``) is read the same
  way through its block table.
"""

import math
from typing import Any, Dict, Optional, Union

import torch
from torch import nn

from ..caches import LatentKVCache, PagedLatentKVCache
from ..decoding import _register_rope_variant, decode_attention, rope
from ..functional import attention

# The caches the layer decodes against: contiguous, or paged through a block table.
LatentCache = Union[LatentKVCache, PagedLatentKVCache]

__all__ = ["MultiHeadLatentAttention"]


class MultiHeadLatentAttention(nn.Module):
    r"""Multi-head Latent Attention (DeepSeek-V2), with prefill and absorbed decode.

    Args:
        d_model: model width.
        num_heads: attention heads ``H``.
        q_lora_rank: rank of the low-rank query projection (``None``: a full projection, as in
            DeepSeek-V2-Lite).
        kv_lora_rank: width of the cached latent ``c^KV``.
        qk_nope_head_dim / qk_rope_head_dim: per-head query/key widths without and with RoPE.
        v_head_dim: per-head value width.
        rope_base: RoPE base.
        rope_interleaved: ``True`` rotates the pairs ``(2i, 2i + 1)`` (DeepSeek-V2's checkpoint
            layout), ``False`` the halves ``(i, i + d/2)``.
        rope_scaling: a scaled RoPE variant as the config's ``rope_scaling`` dict (DeepSeek-V2 /
            V3: ``{"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}``;
            :func:`attn_ext.rope_parameters`); ``None``: plain RoPE. DeepSeek's YaRN also
            scales the softmax (``softmax_scale``), which stays the caller's.
        max_position_embeddings: the model's context length, for the variants that read it.
        softmax_scale: default ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)``.
        rms_norm_eps: epsilon of the two RMSNorms.

    Parameters (HuggingFace DeepSeek-V2 names): ``q_proj`` (d_model -> H*(nope+rope)) or
    ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj``; ``kv_a_proj_with_mqa``
    (d_model -> kv_lora_rank + rope, the latent then the shared RoPE key), ``kv_a_layernorm``,
    ``kv_b_proj`` (kv_lora_rank -> H*(nope + v), per head ``[W^UK; W^UV]``), ``o_proj``.
    No biases.

    ``forward(x, cache=None, *, positions=None, new_lengths=None, absorb=True)``:
    x (B, S, d_model) -> (B, S, d_model). Without ``cache`` the tokens sit at ``positions``
    (int (B, S) or (S,), default ``0..S-1``) under a causal mask. With ``cache`` (from
    :meth:`new_cache`) they continue each sequence where it stands; ``new_lengths`` marks a
    left-padded batch as in :class:`attn_ext.nn.DecoderAttention`. ``absorb=False`` decodes
    by decompressing every cached latent into per-head keys and values (the naive form; for
    comparison).
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        q_lora_rank: Optional[int] = None,
        kv_lora_rank: int = 512,
        qk_nope_head_dim: int = 128,
        qk_rope_head_dim: int = 64,
        v_head_dim: int = 128,
        rope_base: float = 10000.0,
        rope_interleaved: bool = True,
        rope_scaling: Optional[Dict[str, Any]] = None,
        max_position_embeddings: Optional[int] = None,
        softmax_scale: Optional[float] = None,
        rms_norm_eps: float = 1e-6,
        device=None,
        dtype=None,
    ):
        super().__init__()
        name = type(self).__name__
        for arg, value in (
            ("d_model", d_model),
            ("num_heads", num_heads),
            ("kv_lora_rank", kv_lora_rank),
            ("v_head_dim", v_head_dim),
        ):
            if value <= 0:
                raise ValueError(f"{name}: {arg} must be positive, got {value}")
        if q_lora_rank is not None and q_lora_rank <= 0:
            raise ValueError(f"{name}: q_lora_rank must be positive or None, got {q_lora_rank}")
        if qk_nope_head_dim < 0:
            raise ValueError(f"{name}: qk_nope_head_dim must be >= 0, got {qk_nope_head_dim}")
        if qk_rope_head_dim <= 0 or qk_rope_head_dim % 2:
            raise ValueError(
                f"{name}: qk_rope_head_dim must be positive and even (RoPE rotates "
                f"pairs), got {qk_rope_head_dim}"
            )
        self.d_model, self.num_heads = d_model, num_heads
        self.q_lora_rank, self.kv_lora_rank = q_lora_rank, kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.rope_base, self.rope_interleaved = float(rope_base), rope_interleaved
        _register_rope_variant(
            self, qk_rope_head_dim, rope_base, rope_scaling, max_position_embeddings, device
        )
        self.softmax_scale = (
            1.0 / math.sqrt(self.qk_head_dim) if softmax_scale is None else float(softmax_scale)
        )
        kw = dict(device=device, dtype=dtype)
        if q_lora_rank is None:
            self.q_proj = nn.Linear(d_model, num_heads * self.qk_head_dim, bias=False, **kw)
        else:
            self.q_a_proj = nn.Linear(d_model, q_lora_rank, bias=False, **kw)
            self.q_a_layernorm = nn.RMSNorm(q_lora_rank, eps=rms_norm_eps, **kw)
            self.q_b_proj = nn.Linear(q_lora_rank, num_heads * self.qk_head_dim, bias=False, **kw)
        self.kv_a_proj_with_mqa = nn.Linear(
            d_model, kv_lora_rank + qk_rope_head_dim, bias=False, **kw
        )
        self.kv_a_layernorm = nn.RMSNorm(kv_lora_rank, eps=rms_norm_eps, **kw)
        self.kv_b_proj = nn.Linear(
            kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False, **kw
        )
        self.o_proj = nn.Linear(num_heads * v_head_dim, d_model, bias=False, **kw)

    # ------------------------------------------------------------------ projections

    def new_cache(
        self,
        batch_size: int,
        max_len: int,
        *,
        page_size: Optional[int] = None,
        num_pages: Optional[int] = None,
        dtype=None,
        device=None,
        kv_scale: float = 1.0,
    ) -> LatentCache:
        """An empty :class:`attn_ext.LatentKVCache` for this layer (default: its weights'
        dtype and device): ``kv_lora_rank + qk_rope_head_dim`` values per token
        (``dtype=torch.float8_e4m3fn`` with ``kv_scale``: one byte each, on the CPU). With
        ``page_size``, a :class:`attn_ext.PagedLatentKVCache` of ``num_pages`` pages (default:
        enough for every sequence at ``max_len``)."""
        w = self.kv_b_proj.weight
        kw = dict(dtype=dtype or w.dtype, device=device or w.device, kv_scale=kv_scale)
        if page_size is None:
            if num_pages is not None:
                raise ValueError(f"{type(self).__name__}.new_cache: num_pages needs page_size")
            return LatentKVCache(
                batch_size, max_len, self.kv_lora_rank, self.qk_rope_head_dim, **kw
            )
        pages_per_seq = -(-max_len // page_size) if page_size > 0 else 0
        return PagedLatentKVCache(
            batch_size * pages_per_seq if num_pages is None else num_pages,
            page_size,
            self.kv_lora_rank,
            self.qk_rope_head_dim,
            max_batch=batch_size,
            max_pages_per_seq=pages_per_seq,
            **kw,
        )

    def _rope_kw(self):
        return dict(
            base=self.rope_base,
            interleaved=self.rope_interleaved,
            inv_freq=self.rope_inv_freq,
            attention_scaling=self.rope_attention_scaling,
        )

    def _query(self, x: torch.Tensor):
        """(q_nope (B, H, S, nope), q_rope (B, H, S, rope)) as views, q_rope not yet rotated."""
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.unflatten(-1, (self.num_heads, self.qk_head_dim)).transpose(1, 2)
        return q[..., : self.qk_nope_head_dim], q[..., self.qk_nope_head_dim :]

    def _latent(self, x: torch.Tensor):
        """(c_kv (B, 1, S, kv_lora_rank) normalized, k_rope (B, 1, S, rope) not yet rotated)."""
        kv = self.kv_a_proj_with_mqa(x).unsqueeze(1)
        return self.kv_a_layernorm(kv[..., : self.kv_lora_rank]), kv[..., self.kv_lora_rank :]

    def _up_weights(self):
        """W^UK (H, nope, kv_lora_rank) and W^UV (H, v, kv_lora_rank), views of kv_b_proj."""
        w = self.kv_b_proj.weight.unflatten(
            0, (self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
        )
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]

    def _split_rows(self, rows: torch.Tensor):
        """Cache rows [c_kv, k_rope] as the two parts (views)."""
        return rows[..., : self.kv_lora_rank], rows[..., self.kv_lora_rank :]

    def _decompress(self, c_kv: torch.Tensor, k_rope: torch.Tensor):
        """Per-head keys (B, H, S, nope + rope) and values (B, H, S, v) from the latent
        (B, 1, S, kv_lora_rank) and the rotated shared key (B, 1, S, rope)."""
        kv = self.kv_b_proj(c_kv.squeeze(1))
        kv = kv.unflatten(-1, (self.num_heads, self.qk_nope_head_dim + self.v_head_dim)).transpose(
            1, 2
        )
        k_nope, v = kv[..., : self.qk_nope_head_dim], kv[..., self.qk_nope_head_dim :]
        k = torch.cat([k_nope, k_rope.expand(-1, self.num_heads, -1, -1)], dim=-1)
        return k, v

    def _merge_heads(self, out: torch.Tensor) -> torch.Tensor:
        B, _, S, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(B, S, self.num_heads * self.v_head_dim))

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        x: torch.Tensor,
        cache: Optional[LatentCache] = None,
        *,
        positions: Optional[torch.Tensor] = None,
        new_lengths: Optional[torch.Tensor] = None,
        absorb: bool = True,
    ) -> torch.Tensor:
        name = type(self).__name__
        if x.dim() != 3 or x.size(-1) != self.d_model:
            raise ValueError(
                f"{name}: x must be (B, S, d_model = {self.d_model}), got {tuple(x.shape)}"
            )
        if cache is None:
            if new_lengths is not None:
                raise ValueError(f"{name}: new_lengths needs a cache")
            return self._prefill(x, positions)
        if positions is not None:
            raise ValueError(
                f"{name}: with a cache the positions follow the cache's lengths; "
                "do not pass positions"
            )
        if not isinstance(cache, (LatentKVCache, PagedLatentKVCache)):
            raise TypeError(
                f"{name}: cache must be an attn_ext.LatentKVCache or PagedLatentKVCache "
                "(from new_cache), "
                f"got {type(cache).__name__}"
            )
        if cache.kv_lora_rank != self.kv_lora_rank or cache.rope_dim != self.qk_rope_head_dim:
            raise ValueError(
                f"{name}: cache holds kv_lora_rank={cache.kv_lora_rank}, "
                f"rope_dim={cache.rope_dim}; this layer needs {self.kv_lora_rank}, "
                f"{self.qk_rope_head_dim}"
            )
        return self._decode(x, cache, new_lengths, absorb)

    def _prefill(self, x: torch.Tensor, positions: Optional[torch.Tensor]) -> torch.Tensor:
        q_nope, q_rope = self._query(x)
        c_kv, k_rope = self._latent(x)
        k, v = self._decompress(c_kv, rope(k_rope, positions=positions, **self._rope_kw()))
        return self._attend(q_nope, rope(q_rope, positions=positions, **self._rope_kw()), k, v)

    def _attend(self, q_nope, q_rope, k, v) -> torch.Tensor:
        # Causal attention over decompressed keys: D = nope + rope, Dv = v_head_dim.
        q = torch.cat([q_nope, q_rope], dim=-1)
        return self._merge_heads(attention(q, k, v, causal=True, scale=self.softmax_scale))

    def _decode(self, x: torch.Tensor, cache: LatentCache, new_lengths, absorb: bool):
        S = x.size(1)
        q_nope, q_rope = self._query(x)
        c_kv, k_rope = self._latent(x)
        prompt = S > 1 and new_lengths is None and cache.empty
        q_rope = rope(q_rope, positions=cache.positions(S, new_lengths), **self._rope_kw())
        cache.append(
            c_kv,
            k_rope,
            new_lengths=new_lengths,
            rope_base=self.rope_base,
            rope_interleaved=self.rope_interleaved,
            rope_inv_freq=self.rope_inv_freq,
            rope_attention_scaling=self.rope_attention_scaling,
        )
        if prompt:
            # A prompt into an empty cache: causal attention over its decompressed keys
            # (D = nope + rope) costs less than the absorbed form's kv_lora_rank-wide scores.
            k, v = self._decompress(*self._split_rows(cache.rows(S, dtype=q_nope.dtype)))
            return self._attend(q_nope, q_rope, k, v)
        if not absorb:
            return self._decode_decompressed(torch.cat([q_nope, q_rope], dim=-1), cache)
        w_uk, w_uv = self._up_weights()
        # q^C W^UK: (B, H, S, nope) @ (H, nope, kv_lora_rank) -> the query in latent space.
        q = torch.cat([torch.matmul(q_nope, w_uk), q_rope], dim=-1)
        out = cache.attend(q, scale=self.softmax_scale)
        # Attended latent (B, H, S, kv_lora_rank) through W^UV (H, v, kv_lora_rank).
        return self._merge_heads(torch.matmul(out, w_uv.transpose(1, 2)))

    def _decode_decompressed(self, q: torch.Tensor, cache: LatentCache) -> torch.Tensor:
        rows = cache.rows(_max_length(cache), dtype=q.dtype)
        k, v = self._decompress(*self._split_rows(rows))
        return self._merge_heads(decode_attention(q, k, v, cache.lengths, scale=self.softmax_scale))

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, num_heads={self.num_heads}, q_lora_rank={self.q_lora_rank}, "
            f"kv_lora_rank={self.kv_lora_rank}, qk_nope_head_dim={self.qk_nope_head_dim}, "
            f"qk_rope_head_dim={self.qk_rope_head_dim}, v_head_dim={self.v_head_dim}, "
            f"rope_base={self.rope_base}, rope_interleaved={self.rope_interleaved}"
        )


def _host_lengths(cache: LatentCache):
    # A GPU cache keeps a host copy of its lengths (reading the tensor would synchronize).
    return cache.lengths.tolist() if cache.kv.device.type == "cpu" else cache._host_lengths


def _max_length(cache: LatentCache) -> int:
    return max(_host_lengths(cache), default=0)
