"""attn_ext.kv_cache_bytes against what each decoding cache actually allocates per token."""

import pytest
import torch

import attn_ext


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bytes_match_the_caches(dtype):
    L = 7
    mha = attn_ext.KVCache(1, 16, L, 128, dtype=dtype)
    gqa = attn_ext.KVCache(1, 4, L, 128, dtype=dtype)
    mqa = attn_ext.KVCache(1, 1, L, 128, 96, dtype=dtype)
    mla = attn_ext.LatentKVCache(1, L, 512, 64, dtype=dtype)
    tpa = attn_ext.TPAFactorCache(1, L, 16, 128, 2, 3, dtype=dtype)

    def per_token(*tensors):
        return sum(t.nbytes for t in tensors) // L

    kw = dict(dtype=dtype)
    assert attn_ext.kv_cache_bytes("mha", num_heads=16, head_dim=128, **kw) == per_token(
        mha.k, mha.v
    )
    assert attn_ext.kv_cache_bytes(
        "gqa", num_heads=16, num_kv_heads=4, head_dim=128, **kw
    ) == per_token(gqa.k, gqa.v)
    assert attn_ext.kv_cache_bytes("mqa", head_dim=128, head_dim_v=96, **kw) == per_token(
        mqa.k, mqa.v
    )
    assert attn_ext.kv_cache_bytes("mla", kv_lora_rank=512, qk_rope_head_dim=64, **kw) == per_token(
        mla.kv
    )
    assert attn_ext.kv_cache_bytes(
        "tpa", num_heads=16, head_dim=128, r_k=2, r_v=3, **kw
    ) == per_token(tpa.a_k, tpa.b_k, tpa.a_v, tpa.b_v)


def test_paper_numbers():
    # DeepSeek-V2: (d_c + d_h^R) = 576 values per token per layer; MHA at 16 x 128: 4096.
    assert attn_ext.kv_cache_bytes("mla", kv_lora_rank=512, qk_rope_head_dim=64) == 576 * 2
    assert attn_ext.kv_cache_bytes("mha", num_heads=16, head_dim=128) == 4096 * 2
    # TPA, ranks 2/2 at 16 heads of 128: 2 * 2 * (16 + 128) = 576 values.
    assert attn_ext.kv_cache_bytes("tpa", num_heads=16, head_dim=128, r_k=2, r_v=2) == 576 * 2


def test_errors():
    with pytest.raises(ValueError, match="kind must be one of"):
        attn_ext.kv_cache_bytes("mqa2", head_dim=64)
    with pytest.raises(ValueError, match="kind='gqa' needs num_kv_heads"):
        attn_ext.kv_cache_bytes("gqa", head_dim=64)
    with pytest.raises(ValueError, match="r_k must be positive, got 0"):
        attn_ext.kv_cache_bytes("tpa", num_heads=4, head_dim=64, r_k=0, r_v=2)
    with pytest.raises(ValueError, match="must be a multiple of num_kv_heads"):
        attn_ext.kv_cache_bytes("gqa", num_heads=6, num_kv_heads=4, head_dim=64)
