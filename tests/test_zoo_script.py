"""Document 004's own test script (its ``if __name__ == "__main__"`` block), with the imports
changed to attn_ext.compat.attention_zoo: every class it builds exists, runs with the script's
arguments and inputs, and returns the shapes the script prints (the same shapes as the
document's classes, reproduced in attn_ext.testing.documents).

The script's GroupedAttention call (batch 2, 2 groups) is one the document's broadcasting bug
lets through, so its shape is compared with the document's literal class.
"""

import pytest
import torch

import attn_ext.compat.attention_zoo as zoo
from attn_ext.testing.documents import doc004

# What the document prints ("执行结果").
PRINTED = {
    "Self-Attention": (2, 10, 32),
    "Multi-Head Attention": (2, 10, 64),
    "Spatial-Attention": (2, 3, 16, 16),
    "Temporal-Attention": (2, 10, 64),
    "Cross-Attention": (2, 10, 64),
    "Grouped-Attention": (2, 10, 768),
    "Tensor Product Attention": (2, 1024, 768),
}


def run_script(ns, *, with_tpa):
    """The script's steps for the classes of namespace ``ns``; returns {label: output shape}."""
    shapes = {}
    input_dim, d_k, seq_len, batch_size = 64, 32, 10, 2
    x = torch.randn(batch_size, seq_len, input_dim)
    shapes["Self-Attention"] = ns.SelfAttention(input_dim, d_k)(x).shape
    num_heads = 4
    shapes["Multi-Head Attention"] = ns.MultiHeadAttention(input_dim, num_heads, d_k)(x).shape
    x_spatial = torch.randn(batch_size, 3, 16, 16)
    attn_map = ns.SpatialAttention()(x_spatial)
    shapes["Spatial-Attention"] = (x_spatial * attn_map).shape
    input_dim, d_k, time_emb_dim = 768, 64, 32
    x = torch.randn(batch_size, seq_len, input_dim)
    time_points = torch.randn(batch_size, 1, time_emb_dim)
    output_temporal, attn_weights = ns.TemporalAttention(input_dim, d_k, time_emb_dim)(
        x, time_points
    )
    assert attn_weights.shape == (batch_size, seq_len, seq_len)
    shapes["Temporal-Attention"] = output_temporal.shape
    x1, x2 = (
        torch.randn(batch_size, seq_len, input_dim),
        torch.randn(batch_size, seq_len, input_dim),
    )
    shapes["Cross-Attention"] = ns.CrossAttention(input_dim, d_k)(x1, x2).shape
    grouped = getattr(ns, "GroupedAttentionLiteral", ns.GroupedAttention)
    shapes["Grouped-Attention"] = grouped(input_dim, d_k, 4, 2)(x).shape
    if with_tpa:
        d_model, num_heads, d_k = 768, 12, 64
        batch_size, seq_len = 2, 1024
        x = torch.randn(batch_size, seq_len, d_model)
        rope_pos = torch.randn(seq_len, d_k)
        tpa_class = getattr(ns, "TensorProductAttentionLiteral", None) or ns.TensorProductAttention
        tpa = tpa_class(d_model, num_heads, d_k, 6, 2, 2)
        shapes["Tensor Product Attention"] = tpa(x, rope_pos).shape
    return {k: tuple(v) for k, v in shapes.items()}


def test_document_004_script_runs_on_attention_zoo():
    ours = run_script(zoo, with_tpa=False)
    docs = run_script(doc004, with_tpa=False)
    assert ours == docs
    assert ours == {k: v for k, v in PRINTED.items() if k != "Tensor Product Attention"}


def test_document_004_script_tensor_product_attention():
    # The script's float rope_pos is the document's multiplier: the drop-in reads it as RoPE
    # at positions 0..S-1 and says so.
    with pytest.warns(UserWarning, match="positions 0..S-1"):
        ours = run_script(zoo, with_tpa=True)
    assert ours == PRINTED
    assert ours == run_script(doc004, with_tpa=True)
