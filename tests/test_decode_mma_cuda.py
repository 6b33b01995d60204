"""GPU-only cases of decode_attention's tensor-core kernel (csrc/decoding/cuda/decode_mma.cu):
bf16 / fp16 decode with many query rows per KV head (G x Sq >= 8, D = Dv in {64, 128, 256})
and MLA's absorbed decode over the latent cache (576-wide keys whose first 512 columns are the
values, v_cache a view of k_cache), contiguous and paged. The kernel is compiled but has not yet
run on a GPU, so it serves calls only with ATTN_EXT_UNVERIFIED_CUDA=1 (the ``mma`` fixture).
Every case asserts through the profiler that the kernel ran, so that a routing change cannot
leave these tests checking another kernel. Skipped without a visible GPU.

Numerics: test_decoding.py's error rule against the float64 truth (the kernel rounds P to the
input dtype before P V, as FlashAttention does; the plain reference computes in the input dtype,
so its error bounds the kernel's at 2x plus one rounding unit of the output). Paged and
contiguous caches run the same arithmetic in the same order, so they must agree bit for bit.
"""

import pytest
import torch

import attn_ext
from attn_ext.testing.decoding import decode_reference, page_out
from attn_ext.testing.harness import cuda_kernel_names
from attn_ext.testing.numerics import assert_error_rule, assert_lse_close, ground_truth, rand

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible")

DEV = "cuda"
DTYPES = [
    pytest.param(torch.bfloat16, id="bfloat16"),
    pytest.param(torch.float16, id="float16"),
]
KERNEL = "decode_mma_kernel"  # its name as the profiler reports it (a template: a substring)
LATENT_D, LATENT_DV = 576, 512  # kDecodeMmaLatentDim / kDecodeMmaLatentDimV


@pytest.fixture
def mma(monkeypatch):
    monkeypatch.setenv("ATTN_EXT_UNVERIFIED_CUDA", "1")


def _run(fn):
    """fn()'s result and whether the tensor-core kernel served it."""
    result = []
    names = cuda_kernel_names(lambda: result.append(fn()))
    return result[0], any(KERNEL in n for n in names)


def _ints(values):
    return torch.tensor(values, dtype=torch.int32, device=DEV)


# B, H, Hkv, Sq, L, D, lengths, extra. A KV head's rows (G x Sq) run in one 16-row block when
# there are at most 16, else in blocks of 64 (D <= 128) or 32 (D 256): both kinds at every head
# dim, exactly one block, a partial last block, several blocks; lengths of 0 and 1; the band
# over several new tokens; the with_kvcache arguments the kernel serves (leftpad, batch_idx,
# sinks).
GROUP_CASES = [
    (2, 32, 4, 1, 1000, 128, [1000, 517], {}),  # G 8: kDecodeMmaMinRows, a 16-row block
    (3, 16, 1, 1, 700, 64, [700, 1, 0], {}),  # MQA, a one-key and an empty sequence
    (1, 64, 1, 1, 2100, 128, [2050], {}),  # one full 64-row block
    (2, 40, 2, 5, 300, 128, [300, 40], {}),  # 100 rows a KV head: two blocks, causal Sq 5
    (2, 16, 2, 4, 333, 256, [333, 70], dict(window_left=20)),  # D 256: 32-row blocks, window
    (2, 16, 2, 1, 333, 256, [333, 70], {}),  # D 256, a 16-row block
    (2, 24, 1, 2, 257, 64, [257, 256], dict(causal=False)),  # D 64, 48 rows of a 64-row block
    (3, 16, 2, 3, 200, 128, [200, 60, 9], dict(cache_leftpad=[5, 58, 0])),  # queries before start
    (3, 16, 2, 1, 150, 64, [150, 33, 100], dict(cache_batch_idx=[2, 0, 2])),
    (2, 32, 4, 2, 400, 128, [400, 0], dict(sinks=True, causal=False, window_right=3)),
]


def _group_case(case, dtype):
    B, H, Hkv, Sq, L, D, lengths, extra = GROUP_CASES[case]
    extra = dict(extra)
    g = torch.Generator().manual_seed(case)
    rows = B
    if "cache_leftpad" in extra:
        extra["cache_leftpad"] = _ints(extra["cache_leftpad"])
    if "cache_batch_idx" in extra:
        extra["cache_batch_idx"] = _ints(extra["cache_batch_idx"])
        rows = int(extra["cache_batch_idx"].max()) + 1
    if extra.pop("sinks", False):
        extra["sinks"] = torch.randn(H, generator=g).to(DEV)
    k = rand((rows, Hkv, L, D), dtype, DEV)
    v = rand((rows, Hkv, L, D), dtype, DEV)
    q = rand((B, H, Sq, D), dtype, DEV, layout="bshd")
    return q, k, v, _ints(lengths), extra


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [0, 1, 3])
@pytest.mark.parametrize("case", range(len(GROUP_CASES)))
def test_grouped_decode(mma, dtype, num_splits, case):
    q, k, v, lens, extra = _group_case(case, dtype)
    (out, lse), ran = _run(
        lambda: attn_ext.decode_attention(
            q, k, v, lens, num_splits=num_splits, return_lse=True, **extra
        )
    )
    assert ran, "the tensor-core kernel did not serve the call"
    ref_out, ref_lse = decode_reference(q, k, v, lens, **extra)
    t_out, t_lse = ground_truth(decode_reference, q, k, v, lens, **extra)
    assert_error_rule(out, ref_out, t_out, name="decode out")
    assert_lse_close(lse, ref_lse, t_lse, name="decode lse")


def _latent(B, L, dtype, seed=0):
    torch.manual_seed(seed)
    kv = rand((B, 1, L, LATENT_D), dtype, DEV)
    return kv, kv[..., :LATENT_DV]  # the values: a view of the keys' first columns


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,Sq", [(16, 1), (128, 1), (16, 2)])
@pytest.mark.parametrize("num_splits", [0, 1, 4])
def test_latent_decode(mma, dtype, H, Sq, num_splits):
    """MLA's absorbed decode (DeepSeek-V2-Lite: 16 heads; V2 / V3: 128) over one latent head."""
    B, L = 2, 700
    kv, v = _latent(B, L, dtype)
    lens = _ints([700, 301])
    q = rand((B, H, Sq, LATENT_D), dtype, DEV, layout="bshd")
    scale = 0.1147  # the model's softmax scale, not 576 ** -0.5
    (out, lse), ran = _run(
        lambda: attn_ext.decode_attention(
            q, kv, v, lens, scale=scale, num_splits=num_splits, return_lse=True
        )
    )
    assert ran, "the tensor-core kernel did not serve the latent call"
    assert out.shape == (B, H, Sq, LATENT_DV)
    ref_out, ref_lse = decode_reference(q, kv, v, lens, scale=scale)
    t_out, t_lse = ground_truth(decode_reference, q, kv, v, lens, scale=scale)
    assert_error_rule(out, ref_out, t_out, name="latent decode out")
    assert_lse_close(lse, ref_lse, t_lse, name="latent decode lse")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [16, 64, 256])
@pytest.mark.parametrize("shape", ["grouped", "latent"])
def test_paged_equals_contiguous_bitwise(mma, dtype, page_size, shape):
    """Through a block table (shuffled pages, a shared prefix, garbage in the spare pages and
    past each length) the kernel gives the contiguous cache's bits."""
    B, L = 3, 700
    lens = _ints([700, 517, 33])
    if shape == "grouped":
        H, Hkv, D = 32, 4, 128
        k, v = rand((B, Hkv, L, D), dtype, DEV), rand((B, Hkv, L, D), dtype, DEV)
    else:
        H, Hkv, D = 16, 1, LATENT_D
        k, v = _latent(B, L, dtype)
    q = rand((B, H, 1, D), dtype, DEV)
    # page_out makes sequence 1's first page sequence 0's rows, in k and v in place (so the
    # contiguous call below sees them too); its pages are host tensors
    if shape == "grouped":
        k_pages, v_pages, table = page_out(k, v, page_size, shared_prefix_pages=1)
        k_pages, v_pages = k_pages.to(DEV), v_pages.to(DEV)
    else:
        k_pages, _, table = page_out(k, k.clone(), page_size, shared_prefix_pages=1)
        k_pages = k_pages.to(DEV)
        v_pages = k_pages[..., :LATENT_DV]  # a view again, on the device
    table = table.to(DEV)
    (out, lse), ran = _run(lambda: attn_ext.decode_attention(q, k, v, lens, return_lse=True))
    (p_out, p_lse), p_ran = _run(
        lambda: attn_ext.decode_attention(
            q, k_pages, v_pages, lens, block_table=table, return_lse=True
        )
    )
    assert ran and p_ran, "the tensor-core kernel did not serve both calls"
    assert torch.equal(out, p_out) and torch.equal(lse, p_lse)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_past_lengths_never_read(mma, dtype):
    """NaN in every cache row past a sequence's length (uninitialized memory) changes nothing:
    those rows are zeros in shared memory, never loaded."""
    B, H, Hkv, L, D = 2, 32, 4, 500, 128
    k, v = rand((B, Hkv, L, D), dtype, DEV), rand((B, Hkv, L, D), dtype, DEV)
    lens = _ints([130, 257])
    q = rand((B, H, 1, D), dtype, DEV)
    (clean, _), _ = _run(lambda: attn_ext.decode_attention(q, k, v, lens, return_lse=True))
    for b, n in enumerate([130, 257]):
        k[b, :, n:] = float("nan")
        v[b, :, n:] = float("nan")
    (dirty, _), ran = _run(lambda: attn_ext.decode_attention(q, k, v, lens, return_lse=True))
    assert ran
    assert torch.equal(clean, dirty)


def test_gate_and_routing(monkeypatch):
    """Without the opt-in the kernel never runs; with it, calls it does not serve (fp32,
    softcap / ALiBi, fewer than 8 rows a KV head, separate value rows of D != Dv) run the other
    kernels as before."""
    B, H, Hkv, L, D = 2, 32, 4, 300, 128
    k, v = rand((B, Hkv, L, D), torch.bfloat16, DEV), rand((B, Hkv, L, D), torch.bfloat16, DEV)
    lens = _ints([300, 77])
    q = rand((B, H, 1, D), torch.bfloat16, DEV)
    monkeypatch.delenv("ATTN_EXT_UNVERIFIED_CUDA", raising=False)
    assert not _run(lambda: attn_ext.decode_attention(q, k, v, lens))[1]
    monkeypatch.setenv("ATTN_EXT_UNVERIFIED_CUDA", "1")
    assert _run(lambda: attn_ext.decode_attention(q, k, v, lens))[1]
    assert not _run(lambda: attn_ext.decode_attention(q, k, v, lens, softcap=5.0))[1]
    q_g2 = rand((B, 2 * Hkv, 1, D), torch.bfloat16, DEV)  # G 2: the split-KV kernel's
    assert not _run(lambda: attn_ext.decode_attention(q_g2, k, v, lens))[1]
    assert not _run(lambda: attn_ext.decode_attention(q.float(), k.float(), v.float(), lens))[1]
    wide = rand((B, 1, L, LATENT_D), torch.bfloat16, DEV)
    separate = rand((B, 1, L, LATENT_DV), torch.bfloat16, DEV)  # not a view of the keys
    q_lat = rand((B, 16, 1, LATENT_D), torch.bfloat16, DEV)
    assert not _run(lambda: attn_ext.decode_attention(q_lat, wide, separate, lens))[1]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [None, 16])
def test_latent_cache_generation(mma, monkeypatch, dtype, page_size):
    """MultiHeadLatentAttention's generation through its latent cache (contiguous or paged): the
    tensor-core kernel's steps against the same steps on the default kernels (the SIMT kernel,
    on gathered pages for a paged cache)."""
    torch.manual_seed(0)
    mla = attn_ext.nn.MultiHeadLatentAttention(512, 16, device=DEV, dtype=dtype)  # 512 + 64
    x = torch.randn(2, 40, 512, device=DEV, dtype=dtype)

    def generate():
        cache = mla.new_cache(2, 64, page_size=page_size)
        outs = [mla(x[:, :32], cache)]
        outs += [mla(x[:, t : t + 1], cache) for t in range(32, 40)]
        return torch.cat(outs, dim=1)

    with torch.no_grad():
        got, ran = _run(generate)
        monkeypatch.delenv("ATTN_EXT_UNVERIFIED_CUDA", raising=False)
        want = generate()
    assert ran
    # two kernels' roundings of P (16 bits here, fp32 in the SIMT kernel) and of the output
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
