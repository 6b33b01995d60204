"""attn_ext: attention operators for PyTorch with CPU (and CUDA) kernels.

Importing the package loads the compiled operators (torch.ops.attn_ext.*) and registers
their fake kernels and autograd formulas.
"""

import torch  # noqa: F401  (loads libtorch, which _C links against)

from . import (  # noqa: F401  (drop-in and canonical modules)
    _C,  # noqa: F401  (registers the operators)
    _registration,  # noqa: F401
    compat,
    flash_attn,
    nn,
)
from .cache_size import kv_cache_bytes
from .caches import (
    KVCache,
    LatentKVCache,
    LinearAttentionState,
    PagedKVCache,
    PagedLatentKVCache,
    TPAFactorCache,
)
from .decoding import decode_attention, rope, rope_, rope_parameters
from .functional import (
    attention,
    attention_probabilities,
    attention_varlen,
    attention_weights,
    attention_with_weights,
    dropout_keep_mask,
    merge_attention_states,
    merge_attention_states_,
    scaled_dot_product_attention,
)
from .linear import linear_attention
from .spatial import channel_pool, spatial_gate
from .tpa import tpa_decode_attention, tpa_expand

__version__ = "0.1.0"
__all__ = [
    "attention",
    "attention_varlen",
    "attention_weights",
    "attention_probabilities",
    "attention_with_weights",
    "dropout_keep_mask",
    "merge_attention_states",
    "merge_attention_states_",
    "scaled_dot_product_attention",
    "rope",
    "rope_",
    "rope_parameters",
    "decode_attention",
    "KVCache",
    "PagedKVCache",
    "PagedLatentKVCache",
    "LatentKVCache",
    "TPAFactorCache",
    "LinearAttentionState",
    "linear_attention",
    "channel_pool",
    "spatial_gate",
    "kv_cache_bytes",
    "tpa_expand",
    "tpa_decode_attention",
]
