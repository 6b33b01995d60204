#!/usr/bin/env python
"""Small calls of every attn_ext op that has a CUDA kernel, sized for compute-sanitizer.

attention (forward and backward): tensor-core forward at head dims 64 / 128 / 256 and a padded
one, the generic forward and backward in every dtype, masks (bool, additive, broadcast), causal
and window bands, fully masked rows, GQA, Dv != D, dropout, strided and misaligned inputs.
attention with softcap / ALiBi / sinks, attention_varlen (empty and one-token sequences, a
sequence longer than the max_seqlen passed (16, 0), GQA, causal window, dropout, tokens past
the last offset), forward and
backward, and decode_attention with window_right / softcap / ALiBi / sinks / cache_batch_idx /
cache_leftpad (also out of range: the GPU op clamps them).
The decoding and compression ops: rope / rope_ / rope backward, kv_cache_append (left padding,
rope on the way in), latent_cache_append, decode_attention (split and unsplit, window, empty
sequences, several queries), tpa_expand (+ backward, rope), tpa_decode_attention, channel_pool
and spatial_gate (+ backward, both layouts).
The paged cache on CUDA (issue 21; clean under memcheck and racecheck on an H100, 2026-11-27):
PagedKVCache appends across page ends, a fork, decode through the block table with the split-KV
kernel (every dtype and head dim it serves, one and several splits, several queries, a window),
a table entry out of range (clamped by decode, refused by append). ``--paged`` runs these cases
only.
The vectorized spatial kernels (issue 28, unverified: csrc/spatial/cuda/spatial_vec.cu) through
the CBAM spatial gate's forward and backward and the pooling's own backward: every dtype, both
layouts, sizes on the 16-byte path and off it, a misaligned storage offset, grids that stride:
``--spatial`` runs these cases (only there: its large maps would slow the full run).
The fused linear-attention kernels (issue 28, unverified): the forward causal and non-causal
and the causal backward, every dtype, head dim and feature map they serve, lengths off the
64-row chunk, Sq != Sk, an initial state and the final state's gradient, strided (B, S, H, D)
views, an empty sequence. ``--linear`` runs these cases only.
The tensor-core decode kernel (issue 21, unverified: csrc/decoding/cuda/decode_mma.cu): bf16 and
fp16, D = Dv 64 / 128 / 256 with 8-100 query rows per KV head (16-row and larger blocks,
partial ones, causal Sq 3 and 5, a window, leftpad, sinks), MLA's 576-wide latent head with 16
and 128 heads, contiguous and
paged (one and several splits, a one-key and an empty sequence, a table entry out of range).
``--decode-mma`` runs these cases only.
RoPE with a frequency table and attention_scaling (unverified on CUDA): rope forward and
backward, rope_, kv_cache_append and latent_cache_append.

    compute-sanitizer --tool memcheck  python tools/sanitize_cuda.py
    compute-sanitizer --tool racecheck python tools/sanitize_cuda.py
    compute-sanitizer --tool synccheck python tools/sanitize_cuda.py
    compute-sanitizer --tool memcheck  python tools/sanitize_cuda.py --spatial
    compute-sanitizer --tool racecheck python tools/sanitize_cuda.py --decode-mma

Exits 0 after every case ran (printing one line per case), 0 with a note without a GPU.
"""

from __future__ import annotations

import os
import sys

import torch

import attn_ext

# (name, dtype, B, H, Hkv, Sq, Sk, D, Dv, options)
CASES = [
    ("mma d64", torch.bfloat16, 1, 2, 2, 70, 90, 64, 64, {}),
    ("mma d128 causal", torch.float16, 1, 2, 1, 90, 70, 128, 128, dict(causal=True)),
    ("mma d256 window", torch.bfloat16, 1, 2, 2, 65, 65, 256, 256, dict(window_size=(9, 3))),
    ("mma padded d40/dv72", torch.bfloat16, 2, 2, 2, 33, 17, 40, 72, {}),
    (
        "mma bool mask + dropout",
        torch.bfloat16,
        2,
        4,
        2,
        67,
        75,
        64,
        64,
        dict(mask="bool", dropout_p=0.3),
    ),
    ("mma additive broadcast", torch.float16, 2, 2, 2, 64, 64, 128, 128, dict(mask="float_b")),
    ("generic f32", torch.float32, 1, 2, 2, 40, 50, 64, 48, dict(causal=True)),
    (
        "generic f64 dropout",
        torch.float64,
        1,
        2,
        1,
        21,
        33,
        32,
        32,
        dict(dropout_p=0.2, mask="bool"),
    ),
    ("generic bf16 d320", torch.bfloat16, 1, 1, 1, 20, 24, 320, 320, {}),
    ("empty rows", torch.bfloat16, 1, 2, 2, 40, 20, 64, 64, dict(causal=True)),
    ("misaligned rows", torch.float16, 1, 2, 2, 50, 50, 64, 64, dict(misaligned=True)),
    ("sq=1", torch.float32, 2, 4, 2, 1, 17, 64, 64, {}),
]


def make(shape, dtype, misaligned):
    if misaligned:
        return torch.randn(*shape[:-1], shape[-1] + 1, device="cuda").to(dtype)[..., 1:]
    return torch.randn(shape, device="cuda").to(dtype)


def _report(name, tensors):
    """Prints and returns whether every tensor is finite (after the device finished)."""
    torch.cuda.synchronize()
    finite = all(torch.isfinite(t).all().item() for t in tensors)
    print(f"{'ok ' if finite else 'NON-FINITE'} {name}")
    return finite


def run_case(name, dtype, B, H, Hkv, Sq, Sk, D, Dv, opts):
    opts = dict(opts)
    mis = opts.pop("misaligned", False)
    mask = opts.pop("mask", None)
    if mask == "bool":
        opts["attn_mask"] = torch.rand(B, H, Sq, Sk, device="cuda") < 0.7
    elif mask == "float_b":
        opts["attn_mask"] = torch.randn(1, 1, Sq, Sk, device="cuda").to(dtype)
    q = make((B, H, Sq, D), dtype, mis).requires_grad_(True)
    k = make((B, Hkv, Sk, D), dtype, mis).requires_grad_(True)
    v = make((B, Hkv, Sk, Dv), dtype, mis).requires_grad_(True)
    out = attn_ext.attention(q, k, v, **opts)
    out.float().square().sum().backward()
    return _report(name, [out, q.grad, k.grad, v.grad])


def modifier_and_varlen_cases():
    """The varlen kernel and the score modifiers (the generic kernels' second instantiation)."""
    dev, ok = "cuda", []
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        q, k, v = (
            torch.randn(2, h, 37, 64, device=dev).to(dtype).requires_grad_(True) for h in (4, 2, 2)
        )
        sinks = torch.randn(4, device=dev).to(dtype).requires_grad_(True)
        out = attn_ext.attention(
            q, k, v, causal=True, softcap=5.0, alibi_slopes=torch.rand(2, 4, device=dev),
            sinks=sinks,
        )  # fmt: skip
        out.float().square().sum().backward()
        ok.append(
            _report(f"softcap+alibi+sinks {dtype}", [out, q.grad, k.grad, v.grad, sinks.grad])
        )
        lens = [0, 1, 45, 7]
        cu = torch.tensor([0, 0, 1, 46, 53], dtype=torch.int32, device=dev)
        q, k, v = (
            torch.randn(sum(lens), h, 64, device=dev).to(dtype).requires_grad_(True)
            for h in (4, 2, 2)
        )
        for max_len, opts in ((45, dict(causal=True, window_size=(9, 0))), (16, {}), (0, {})):
            # max_len 16 or 0 < 45: the kernels must still compute the long sequence whole
            out = attn_ext.attention_varlen(
                q, k, v, cu, cu, max_len, max_len, dropout_p=0.1, softcap=3.0, sinks=sinks,
                **opts,
            )  # fmt: skip
            out.float().square().sum().backward()
            ok.append(_report(f"varlen max_seqlen={max_len} {dtype}", [out, q.grad, k.grad]))
            q.grad = k.grad = v.grad = None
        # offsets ending 5 tokens short of q (unchecked on the GPU): those rows belong to no
        # sequence; the preprocess must not read past the offsets for them
        short = torch.tensor([0, 0, 1, 46, 48], dtype=torch.int32, device=dev)
        out = attn_ext.attention_varlen(q, k, v, short, cu, 45, 45, causal=True, sinks=sinks)
        out.float().square().sum().backward()
        ok.append(_report(f"varlen stray tokens {dtype}", [out, q.grad, k.grad, sinks.grad]))
        q.grad = k.grad = v.grad = None
        # decode with every FlashAttention argument (cache rows out of order, left padding)
        kc, vc = (torch.randn(5, 2, 80, 64, device=dev).to(dtype) for _ in range(2))
        qd = torch.randn(3, 4, 2, 64, device=dev).to(dtype)
        for splits in (1, 3):
            out = attn_ext.decode_attention(
                qd, kc, vc, torch.tensor([80, 9, 0], dtype=torch.int32, device=dev),
                causal=False, window_left=20, window_right=3, num_splits=splits, softcap=4.0,
                alibi_slopes=torch.rand(4, device=dev), sinks=sinks.detach(),
                cache_batch_idx=torch.tensor([4, 0, 2], dtype=torch.int32, device=dev),
                cache_leftpad=torch.tensor([3, 9, 0], dtype=torch.int32, device=dev),
            )  # fmt: skip
            ok.append(_report(f"decode FlashAttention arguments splits={splits} {dtype}", [out]))
            # out-of-range values (the CPU op rejects them; the GPU op clamps, never reads
            # outside the cache): only memcheck's verdict counts, not the values
            out = attn_ext.decode_attention(
                qd, kc, vc, torch.tensor([95, -4, 50], dtype=torch.int32, device=dev),
                num_splits=splits,
                cache_batch_idx=torch.tensor([7, -1, 2], dtype=torch.int32, device=dev),
                cache_leftpad=torch.tensor([-3, 0, 200], dtype=torch.int32, device=dev),
            )  # fmt: skip
            ok.append(_report(f"decode clamped indices splits={splits} {dtype}", [out]))
    return ok


def decoding_cases():
    dev, ok = "cuda", []
    for dtype, d in ((torch.bfloat16, 128), (torch.float32, 64), (torch.float16, 96)):
        x = torch.randn(2, 3, 7, d, device=dev, dtype=dtype, requires_grad=True)
        y = attn_ext.rope(x, offset=5) + attn_ext.rope(x, interleaved=True, rotary_dim=d // 2)
        y.float().sum().backward()
        z = x.detach().clone()
        attn_ext.rope_(z, positions=torch.randint(0, 100, (2, 7), device=dev))
        ok.append(_report(f"rope {dtype} d{d}", [y, x.grad, z]))

        cache = attn_ext.KVCache(3, 2, 300, d, dtype=dtype, device=dev)
        cache.append(
            torch.randn(3, 2, 150, d, device=dev, dtype=dtype),
            torch.randn(3, 2, 150, d, device=dev, dtype=dtype),
            new_lengths=torch.tensor([0, 150, 97], device=dev),
            rope=True,
        )
        cache.append(
            torch.randn(3, 2, 3, d, device=dev, dtype=dtype),
            torch.randn(3, 2, 3, d, device=dev, dtype=dtype),
            new_lengths=torch.tensor([3, 3, 1], device=dev),
        )
        outs = []
        for sq in (1, 3):
            q = torch.randn(3, 8, sq, d, device=dev, dtype=dtype)
            for splits in (1, 4, 0):
                outs += cache.attend(q, num_splits=splits, return_lse=True)
            outs += cache.attend(q, window_left=40, return_lse=True)
            outs.append(cache.attend(q, causal=False))
        # an empty sequence's rows are zeros and its lse -inf: check the others only
        ok.append(
            _report(f"kv_cache_append + decode_attention {dtype} d{d}", [o[1:] for o in outs])
        )

    latent = attn_ext.LatentKVCache(2, 40, 512, 64, dtype=torch.bfloat16, device=dev)
    latent.append(
        torch.randn(2, 1, 9, 512, device=dev, dtype=torch.bfloat16),
        torch.randn(2, 1, 9, 64, device=dev, dtype=torch.bfloat16),
        new_lengths=torch.tensor([9, 4], device=dev),
    )
    q = torch.randn(2, 16, 1, 576, device=dev, dtype=torch.bfloat16)
    out = attn_ext.decode_attention(q, latent.k, latent.v, latent.lengths)
    ok.append(_report("latent_cache_append + absorbed decode", [latent.kv, out]))
    return ok


def paged_cases():
    """The split-KV decode kernel and the paged append (decoding/cuda/decode_split_kv.cu)."""
    dev, ok = "cuda", []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for d in (64, 128, 256):
            c = attn_ext.PagedKVCache(
                20, 16, 2, d, max_batch=3, max_pages_per_seq=6, dtype=dtype, device=dev
            )
            c.append(
                torch.randn(3, 2, 40, d, device=dev, dtype=dtype),
                torch.randn(3, 2, 40, d, device=dev, dtype=dtype),
                new_lengths=torch.tensor([0, 40, 17], device=dev),
                rope=True,
            )
            c.fork(2, 0)
            outs = []
            for h, sq in ((2, 1), (8, 1), (16, 2), (8, 3)):
                q = torch.randn(3, h, sq, d, device=dev, dtype=dtype)
                for splits in (1, 3, 0):
                    outs += c.attend(q, num_splits=splits, return_lse=True)
                outs += c.attend(q, window_left=9, return_lse=True)
            ok.append(_report(f"paged append + split-KV decode {dtype} d{d}", outs))
    # a bad entry: decode clamps it into the cache, append writes nothing
    k = torch.randn(4, 2, 16, 64, device=dev, dtype=torch.bfloat16)
    table = torch.tensor([[0, 9], [-5, 3]], dtype=torch.int32, device=dev)
    lens = torch.tensor([20, 30], dtype=torch.int32, device=dev)
    out = attn_ext.decode_attention(
        torch.randn(2, 4, 1, 64, device=dev, dtype=torch.bfloat16), k, k, lens, block_table=table
    )
    new = torch.randn(2, 2, 1, 64, device=dev, dtype=torch.bfloat16)
    torch.ops.attn_ext.kv_cache_append(k, k, lens, new, new, block_table=table)
    ok.append(_report("paged entries out of range", [out]))
    return ok


def decode_mma_cases():
    """The tensor-core decode kernel (decoding/cuda/decode_mma.cu), which serves only with the
    opt-in; every call here must reach it (bf16 / fp16, >= 8 rows a KV head, or the latent
    head)."""
    os.environ["ATTN_EXT_UNVERIFIED_CUDA"] = "1"
    dev, ok = "cuda", []
    for dtype in (torch.bfloat16, torch.float16):
        # 16-row blocks (G x Sq <= 16) and the larger ones, at each head dim
        shapes = ((64, 16, 2, 1), (64, 32, 1, 2), (128, 8, 1, 1), (128, 40, 2, 5))
        for d, h, hkv, sq in shapes + ((256, 16, 2, 1), (256, 16, 2, 3)):
            k = torch.randn(3, hkv, 150, d, device=dev, dtype=dtype)
            v = torch.randn(3, hkv, 150, d, device=dev, dtype=dtype)
            lens = torch.tensor([150, 1, 0], dtype=torch.int32, device=dev)
            q = torch.randn(3, h, sq, d, device=dev, dtype=dtype)
            outs = []
            for splits in (1, 3, 0):
                outs += attn_ext.decode_attention(q, k, v, lens, num_splits=splits, return_lse=True)
            outs += attn_ext.decode_attention(
                q,
                k,
                v,
                lens,
                window_left=9,
                cache_leftpad=torch.tensor([4, 0, 0], dtype=torch.int32, device=dev),
                sinks=torch.randn(h, device=dev),
                return_lse=True,
            )
            pages, table = _paged_copy(k, 16)
            v_pages, _ = _paged_copy(v, 16)
            outs += attn_ext.decode_attention(
                q, pages, v_pages, lens, block_table=table, num_splits=2, return_lse=True
            )
            ok.append(_report(f"tensor-core decode {dtype} d{d} H{h} Hkv{hkv} Sq{sq}", outs))
        for h in (16, 128):
            kv = torch.randn(2, 1, 200, 576, device=dev, dtype=dtype)
            lens = torch.tensor([200, 37], dtype=torch.int32, device=dev)
            q = torch.randn(2, h, 1, 576, device=dev, dtype=dtype)
            outs = []
            for splits in (1, 0):
                outs += attn_ext.decode_attention(
                    q, kv, kv[..., :512], lens, num_splits=splits, return_lse=True
                )
            pages, table = _paged_copy(kv, 16)
            table[1, 0] = 99  # out of range: clamped into the cache
            outs += attn_ext.decode_attention(
                q, pages, pages[..., :512], lens, block_table=table, return_lse=True
            )
            ok.append(_report(f"tensor-core latent decode {dtype} H{h}", outs))
    return ok


def scaled_rope_cases():
    """RoPE with a frequency table and attention_scaling (unverified on CUDA: the opt-in) in
    rope, its backward, rope_, kv_cache_append and latent_cache_append."""
    os.environ["ATTN_EXT_UNVERIFIED_CUDA"] = "1"
    dev, outs = "cuda", []
    inv, scaling = attn_ext.rope_parameters(
        32, 10000.0, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    )
    kw = dict(inv_freq=inv.to(dev), attention_scaling=scaling)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        x = torch.randn(2, 3, 9, 48, device=dev, dtype=dtype, requires_grad=dtype != torch.bfloat16)
        y = attn_ext.rope(x, rotary_dim=32, offset=5, **kw)
        if x.requires_grad:
            y.sum().backward()
            outs.append(x.grad)
        outs.append(y.detach())
        z = x.detach().clone()
        attn_ext.rope_(z, rotary_dim=32, interleaved=True, **kw)
        outs.append(z)
        c = attn_ext.KVCache(2, 3, 20, 48, dtype=dtype, device=dev)
        c.append(
            z,
            z,
            rope=True,
            rotary_dim=32,
            rope_inv_freq=kw["inv_freq"],
            rope_attention_scaling=scaling,
        )
        outs.append(c.k)
    lat = attn_ext.LatentKVCache(2, 16, kv_lora_rank=16, rope_dim=32, device=dev)
    lat.append(
        torch.randn(2, 1, 5, 16, device=dev),
        torch.randn(2, 1, 5, 32, device=dev),
        rope_inv_freq=kw["inv_freq"],
        rope_attention_scaling=scaling,
    )
    outs.append(lat.kv)
    return [_report("scaled RoPE: rope, backward, rope_, kv / latent append", outs)]


def _paged_copy(cache, page_size):
    """cache (B, Hkv, L, D) as pages (B * L / page_size, Hkv, page_size, D), in reverse order,
    and its block table."""
    B, Hkv, L, D = cache.shape
    n = L // page_size + (L % page_size > 0)
    padded = torch.zeros(B, Hkv, n * page_size, D, device=cache.device, dtype=cache.dtype)
    padded[:, :, :L] = cache
    pages = (
        padded.view(B, Hkv, n, page_size, D).permute(0, 2, 1, 3, 4).reshape(-1, Hkv, page_size, D)
    )
    order = torch.arange(B * n - 1, -1, -1, device=cache.device)
    table = order.view(B, n).to(torch.int32)
    return pages.flip(0).contiguous(), table


def linear_cases():
    """The fused linear-attention kernels (linear/cuda/linear_attention_fwd.cu, _bwd.cu)."""
    os.environ["ATTN_EXT_UNVERIFIED_CUDA"] = "1"
    dev, ok = "cuda", []
    maps = ("elu+1", "relu", "identity")
    for i, (dtype, d, dv) in enumerate(
        (t, d, dv)
        for t in (torch.bfloat16, torch.float16, torch.float32)
        for d in (64, 128)
        for dv in (64, 128)
    ):
        outs = []
        for causal, sq, sk in ((True, 70, 70), (True, 1, 1), (False, 70, 130), (False, 300, 0)):
            q = torch.randn(1, sq, 2, d, device=dev, dtype=dtype).transpose(1, 2)
            k = torch.randn(1, sk, 2, d, device=dev, dtype=dtype).transpose(1, 2)
            v = torch.randn(1, 2, sk, dv, device=dev, dtype=dtype)
            init = (
                torch.randn(1, 2, d, dv, device=dev),
                torch.rand(1, 2, d, device=dev) + 1,
            )
            kw = dict(causal=causal, feature_map=maps[i % len(maps)], eps=0.5)
            state = init if sk % 2 == 0 else None
            out, final = attn_ext.linear_attention(
                q.abs(), k.abs(), v, initial_state=state, return_state=True, **kw
            )
            outs += [out, *final]
            if causal:  # the backward kernels (non-causal: the composite's)
                grad_final = [torch.randn_like(t) for t in final] if state else [None, None]
                outs += torch.ops.attn_ext.linear_attention_backward(
                    torch.randn_like(out),
                    q.abs(),
                    k.abs(),
                    v,
                    *(state or [None, None]),
                    *grad_final,
                    **kw,
                )
        ok.append(_report(f"linear_attention {dtype} d{d} dv{dv} {maps[i % len(maps)]}", outs))
    return ok


def compression_cases():
    dev, ok = "cuda", []
    for dtype in (torch.bfloat16, torch.float32):
        a = torch.randn(2, 9, 3, 8, device=dev, dtype=dtype, requires_grad=True)
        b = torch.randn(2, 9, 3, 64, device=dev, dtype=dtype, requires_grad=True)
        e = attn_ext.tpa_expand(a, b, scale=1 / 3) + attn_ext.tpa_expand(
            a, b, rope=True, rotary_dim=32
        )
        e.float().sum().backward()
        ok.append(_report(f"tpa_expand {dtype}", [e, a.grad, b.grad]))

        B, S, H, D, rk, rv, L = 2, 2, 8, 64, 2, 2, 45
        q = torch.randn(B, H, S, D, device=dev, dtype=dtype, requires_grad=True)
        a_k = torch.randn(B, L, rk, H, device=dev, dtype=dtype, requires_grad=True)
        b_k = torch.randn(B, L, rk, D, device=dev, dtype=dtype, requires_grad=True)
        a_v = torch.randn(B, L, rv, H, device=dev, dtype=dtype, requires_grad=True)
        b_v = torch.randn(B, L, rv, D, device=dev, dtype=dtype, requires_grad=True)
        out = attn_ext.tpa_decode_attention(
            q, a_k, b_k, a_v, b_v, torch.tensor([30, 45], device=dev)
        )
        out.float().square().sum().backward()
        ok.append(
            _report(
                f"tpa_decode_attention {dtype}", [out] + [t.grad for t in (q, a_k, b_k, a_v, b_v)]
            )
        )
    return ok


def spatial_cases():
    dev, ok = "cuda", []
    for dtype in (torch.float32, torch.bfloat16):
        for fmt in (torch.contiguous_format, torch.channels_last):
            x = (
                torch.randn(2, 37, 13, 11, device=dev, dtype=dtype)
                .to(memory_format=fmt)
                .requires_grad_(True)
            )
            pooled = attn_ext.channel_pool(x)
            gate = torch.randn(2, 1, 13, 11, device=dev, dtype=dtype, requires_grad=True)
            y = attn_ext.spatial_gate(x, gate)
            (pooled.float().sum() + y.float().square().sum()).backward()
            ok.append(
                _report(
                    f"channel_pool + spatial_gate {dtype} {str(fmt).split('.')[-1]}",
                    [pooled, y, x.grad, gate.grad],
                )
            )
    return ok


def spatial_vec_cases():
    """The vectorized spatial kernels (spatial/cuda/spatial_vec.cu), opted in."""
    os.environ["ATTN_EXT_UNVERIFIED_CUDA"] = "1"
    dev, ok = "cuda", []
    sa = attn_ext.nn.SpatialAttention(3).to(dev)
    # (N, C, H, W): vectors in both layouts; NCHW scalar (P = 35) / channels-last vectors
    # (C = 24); channels-last scalar (C = 13); fewer channels than an NCHW block's warps; a map
    # whose NCHW and channels-last grids stride (more tiles / rows than the grid's cap)
    shapes = [(2, 16, 8, 8), (2, 24, 5, 7), (1, 13, 6, 4), (2, 3, 4, 4), (32, 8, 128, 128)]
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        sa = sa.to(dtype)
        for shape in shapes:
            for fmt in ("nchw", "channels_last"):
                for offset in (0, 1):  # 1: every 16-byte vector misaligned, the scalar path
                    n, c, h, w = shape
                    dims = (n, h, w, c) if fmt == "channels_last" else shape
                    flat = torch.randn(n * c * h * w + offset, device=dev, dtype=dtype)
                    x = flat[offset:].view(dims)
                    x = x.permute(0, 3, 1, 2) if fmt == "channels_last" else x
                    x.requires_grad_(True)
                    y = sa(x)  # channel_pool, spatial_gate and, below, their fused backward
                    y.float().square().sum().backward()
                    pooled = attn_ext.channel_pool(x)  # its backward: channel_pool_backward
                    (gx,) = torch.autograd.grad(pooled.float().sum(), x)
                    ok.append(
                        _report(
                            f"vectorized spatial {dtype} {'x'.join(map(str, shape))} {fmt} "
                            f"offset {offset}",
                            [y, x.grad, gx, pooled],
                        )
                    )
    return ok


def main() -> int:
    if not torch.cuda.is_available():
        print("sanitize_cuda: no CUDA device visible; nothing to check")
        return 0
    torch.manual_seed(0)
    if "--paged" in sys.argv[1:]:
        return 0 if all(paged_cases()) else 1
    if "--spatial" in sys.argv[1:]:
        return 0 if all(spatial_vec_cases()) else 1
    if "--linear" in sys.argv[1:]:
        return 0 if all(linear_cases()) else 1
    if "--decode-mma" in sys.argv[1:]:
        return 0 if all(decode_mma_cases()) else 1
    results = (
        [run_case(*c) for c in CASES]
        + modifier_and_varlen_cases()
        + decoding_cases()
        + paged_cases()
        + linear_cases()
        + decode_mma_cases()
        + scaled_rope_cases()
        + compression_cases()
        + spatial_cases()
    )
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
