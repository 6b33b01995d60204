"""attn_ext.nn: attention layers computed by attn_ext's kernels.

* :class:`MultiHeadAttention` -- the canonical layer for new code: self or cross attention,
  GQA/MQA (``num_kv_heads``), bottom-right causal and sliding-window masks, optional bias,
  attention dropout. The general layer that document-compatible classes are shells over.
* :class:`MultiheadAttention` -- an exact drop-in for ``torch.nn.MultiheadAttention`` (same
  constructor, parameters, ``state_dict`` keys, initialization, forward and returns).
* :class:`DecoderAttention` -- causal self-attention of a decoder-only model: GQA/MQA, RoPE,
  sliding window, and prefill + decode against a preallocated :class:`attn_ext.KVCache`.
* :class:`LinearAttention` -- multi-head linear attention (``elu+1`` feature map by default),
  non-causal or causal, with recurrent decoding through an
  :class:`attn_ext.LinearAttentionState`.
* :class:`ChannelAttention`, :class:`SpatialAttention`, :class:`CBAM` -- CBAM (Woo et al. 2018)
  on attn_ext's fused channel pooling and sigmoid gate (NCHW or channels-last).
* :class:`TemporalAttention` -- multi-head temporal attention (document 004, Rosin & Radinsky
  2022): the time matrix folded into the queries, then :func:`attn_ext.attention`.
* :class:`MultiHeadLatentAttention` -- DeepSeek-V2's MLA: a compressed latent KV cache
  (:class:`attn_ext.LatentKVCache`) and weight-absorbed decoding.
* :class:`TensorProductAttention` -- Tensor Product Attention: Q, K, V as per-token sums of
  tensor products, RoPE on the feature-side factors, a :class:`attn_ext.TPAFactorCache` for
  decoding.

* :class:`ContextParallelAttention` -- the attention core of a layer whose sequence is sharded
  across a process group (ring or Ulysses context parallelism, :mod:`attn_ext.distributed`).

The decoding state classes live in :mod:`attn_ext.caches`; ``TPAFactorCache`` and
``LinearAttentionState`` stay importable from here, where they were first defined.
"""

from ..caches import LinearAttentionState, TPAFactorCache
from .context_parallel import ContextParallelAttention
from .decoder_attention import DecoderAttention
from .latent_attention import MultiHeadLatentAttention
from .linear_attention import LinearAttention
from .multi_head_attention import MultiHeadAttention
from .multihead_attention import MultiheadAttention
from .spatial_attention import CBAM, ChannelAttention, SpatialAttention
from .temporal_attention import TemporalAttention
from .tensor_product_attention import TensorProductAttention

__all__ = [
    "CBAM",
    "ChannelAttention",
    "ContextParallelAttention",
    "DecoderAttention",
    "LinearAttention",
    "LinearAttentionState",
    "MultiHeadAttention",
    "MultiheadAttention",
    "MultiHeadLatentAttention",
    "SpatialAttention",
    "TemporalAttention",
    "TPAFactorCache",
    "TensorProductAttention",
]
