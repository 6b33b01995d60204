"""The paged KV cache (issue 21, item 4): ``kv_cache_append``, ``latent_cache_append`` and
``decode_attention`` through a ``block_table``, against the contiguous cache holding the same
rows, :class:`attn_ext.PagedKVCache`'s page allocation, and MLA's
:class:`attn_ext.PagedLatentKVCache` under :class:`attn_ext.nn.MultiHeadLatentAttention`, on the
CPU and on CUDA (skipped without a GPU)."""

import pytest
import torch
import torch._dynamo.testing

import attn_ext
from attn_ext.testing.decoding import decode_reference, gather_pages, page_out
from attn_ext.testing.harness import cuda_kernel_names
from attn_ext.testing.numerics import assert_error_rule, assert_lse_close, ground_truth, rand

ops = torch.ops.attn_ext

PAGE_SIZES = [1, 16, 64, 256]
DTYPES = [torch.float32, torch.bfloat16, torch.float64]
# The rows a key tile of the CPU decode kernel spans (FlashTraits::kDecodeBlockN). Row blocks
# of more than DECODE_ROWS_IN_PLACE rows multiply with BLAS: there, smaller pages are gathered
# into whole tiles and pages a multiple of it are read a tile at a time, so the tiles are the
# contiguous kernel's (other sizes cut tiles at page ends). Smaller row blocks (decode_rows.h)
# read every page size in place, in the contiguous kernel's tiles.
DECODE_TILE = 256
DECODE_ROWS_IN_PLACE = 8


def _lengths(page_size):
    """Empty, one row, and each side of a page boundary, and a few pages in."""
    return [0, 1, max(page_size - 1, 0), page_size, page_size + 1, 3 * page_size + 5]


# ----------------------------------------------------------------------------- decode attention


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("sq", [1, 4])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode_matches_contiguous(dtype, page_size, sq, num_splits):
    """Shuffled pages, pages shared by two sequences, GQA 8/2, lengths around page bounds."""
    lengths = _lengths(page_size)
    B, H, Hkv, D, Dv = len(lengths), 8, 2, 32, 24
    L = -(-max(lengths) // page_size) * page_size
    k, v = rand((B, Hkv, L, D), dtype, "cpu"), rand((B, Hkv, L, Dv), dtype, "cpu")
    # sequences 0 and 1 share their first page(s) (sequence 1 is the shorter: one row)
    k_pages, v_pages, table = page_out(k, v, page_size, shared_prefix_pages=1)
    lens = torch.tensor(lengths, dtype=torch.int32)
    q = rand((B, H, sq, D), dtype, "cpu", layout="bshd")
    out, lse = attn_ext.decode_attention(
        q, k_pages, v_pages, lens, num_splits=num_splits, return_lse=True, block_table=table
    )
    ref_out, ref_lse = decode_reference(q, k, v, lens)
    t_out, t_lse = ground_truth(decode_reference, q, k, v, lens)
    assert_error_rule(out, ref_out, t_out, name="paged decode out")
    assert_lse_close(lse, ref_lse, t_lse, name="paged decode lse")


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize(
    "extra",
    [
        dict(window_left=37),
        dict(causal=False, window_left=20, window_right=5, softcap=2.0),
        dict(sinks=torch.randn(8), alibi_slopes=torch.rand(8)),
        dict(cache_leftpad=torch.tensor([0, 0, 5, 9, 3, 40], dtype=torch.int32)),
    ],
    ids=["window", "noncausal_window_softcap", "sinks_alibi", "leftpad"],
)
def test_paged_decode_with_band_and_modifiers(page_size, extra):
    """The band and the score modifiers are unchanged by paging (tiles cut at page ends)."""
    lengths = _lengths(page_size)
    B, H, Hkv, D = len(lengths), 8, 2, 16
    L = -(-max(lengths) // page_size) * page_size
    k, v = rand((B, Hkv, L, D), torch.float32, "cpu"), rand((B, Hkv, L, D), torch.float32, "cpu")
    k_pages, v_pages, table = page_out(k, v, page_size)
    lens = torch.tensor(lengths, dtype=torch.int32)
    if "cache_leftpad" in extra:  # a sequence's keys start within its rows
        extra = dict(cache_leftpad=torch.minimum(extra["cache_leftpad"], lens))
    q = rand((B, H, 3, D), torch.float32, "cpu")
    out, lse = attn_ext.decode_attention(
        q, k_pages, v_pages, lens, num_splits=2, return_lse=True, block_table=table, **extra
    )
    ref_out, ref_lse = decode_reference(q, k, v, lens, **extra)
    t_out, t_lse = ground_truth(decode_reference, q, k, v, lens, **extra)
    assert_error_rule(out, ref_out, t_out, name="paged decode out")
    assert_lse_close(lse, ref_lse, t_lse, name="paged decode lse")


# (page size, window_left): a window starts the tiles off the page boundaries, which cuts the
# tiles of pages a multiple of the tile (but not the gathered small pages').
BITWISE_CASES = [(ps, -1) for ps in (1, 16, 64, DECODE_TILE, 2 * DECODE_TILE)] + [
    (ps, 300) for ps in (1, 16, 64)
]


@pytest.mark.parametrize("page_size,window_left", BITWISE_CASES)
@pytest.mark.parametrize("num_splits", [1, 2, 0])
def test_paged_decode_bitwise_where_tiles_coincide(page_size, window_left, num_splits):
    """Row blocks on BLAS (GQA 4 x 3 queries = 12 rows), pages smaller than the kernel's key
    tile or a multiple of it: the same tiles, the same sums, bit for bit."""
    lengths = [0, 1, page_size - 1, page_size + 1, 3 * page_size + 7]
    B, H, Hkv, D, Sq = len(lengths), 8, 2, 64, 3
    assert H // Hkv * Sq > DECODE_ROWS_IN_PLACE
    L = -(-max(lengths) // page_size) * page_size
    k, v = rand((B, Hkv, L, D), torch.float32, "cpu"), rand((B, Hkv, L, D), torch.float32, "cpu")
    k_pages, v_pages, table = page_out(k, v, page_size)
    lens = torch.tensor(lengths, dtype=torch.int32)
    q = rand((B, H, Sq, D), torch.float32, "cpu")
    kw = dict(num_splits=num_splits, return_lse=True, window_left=window_left)
    out, lse = attn_ext.decode_attention(q, k_pages, v_pages, lens, block_table=table, **kw)
    ref_out, ref_lse = attn_ext.decode_attention(q, k, v, lens, **kw)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


# (group, new tokens): every row count the in-place products are instantiated for, and 9 rows
# (BLAS) beside them.
FEW_ROWS = [(1, 1), (2, 1), (3, 1), (4, 1), (5, 1), (3, 2), (7, 1), (8, 1), (4, 2), (9, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group,sq", FEW_ROWS, ids=lambda x: str(x))
@pytest.mark.parametrize("page_size,window_left", [(1, -1), (16, -1), (48, 300), (384, -1)])
def test_paged_decode_few_rows_any_page_size(dtype, group, sq, page_size, window_left):
    """Row blocks of at most 8 rows read the cache rows in place: any page size (48 and 384 cut
    BLAS's tiles at page ends) gives the contiguous cache's bits, and both meet the error rule.
    D 44 and Dv 41 leave features past the 8-lane chunks (and past the 16-wide chunks of
    blocks of up to 4 rows); lengths span splits, tiles and pages."""
    lengths = [700, 1, 0, 2 * page_size + 3]
    B, Hkv, D, Dv = len(lengths), 2, 44, 41
    H = group * Hkv
    L = -(-max(lengths) // page_size) * page_size
    k, v = rand((B, Hkv, L, D), dtype, "cpu"), rand((B, Hkv, L, Dv), dtype, "cpu")
    k_pages, v_pages, table = page_out(k, v, page_size)
    lens = torch.tensor(lengths, dtype=torch.int32)
    q = rand((B, H, sq, D), dtype, "cpu", layout="bshd")
    for num_splits in (1, 3):
        kw = dict(num_splits=num_splits, return_lse=True, window_left=window_left)
        out, lse = attn_ext.decode_attention(q, k_pages, v_pages, lens, block_table=table, **kw)
        c_out, c_lse = attn_ext.decode_attention(q, k, v, lens, **kw)
        if group * sq <= DECODE_ROWS_IN_PLACE or page_size in (1, 16):
            assert torch.equal(out, c_out) and torch.equal(lse, c_lse)
        ref_out, ref_lse = decode_reference(q, k, v, lens, window_left=window_left)
        t_out, t_lse = ground_truth(decode_reference, q, k, v, lens, window_left=window_left)
        assert_error_rule(out, ref_out, t_out, name="paged decode out")
        assert_error_rule(c_out, ref_out, t_out, name="decode out")
        assert_lse_close(lse, ref_lse, t_lse, name="paged decode lse")


# Threads against the KV heads a task of the CPU decode kernel covers in a paged cache with
# pages below the key tile (decode_attention.cpp, heads_per_task), Hkv 4, two sequences, one
# split: 1 or 2 threads give tasks of all 4 heads, 3 threads tasks of 2, 5 threads of 1.
# 16-bit rows in (page, Hkv, rows, D) pages always take one head per task.
TASK_THREADS = [1, 2, 3, 5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("flash_pages", [False, True], ids=["pages_hkv_rows", "pages_rows_hkv"])
@pytest.mark.parametrize("threads", TASK_THREADS)
@pytest.mark.parametrize(
    "group,sq,mods",
    [
        (4, 1, {}),
        (3, 2, dict(window_left=300, softcap=2.0)),
        (2, 1, dict(sinks="randn", alibi_slopes="rand")),
    ],
    ids=["gqa4", "gqa3_sq2_window_softcap", "gqa2_sinks_alibi"],
)
def test_paged_decode_tasks_over_heads_same_bits(dtype, flash_pages, threads, group, sq, mods):
    """A task may read several KV heads of a paged cache page by page (every head's rows of a
    page before the next page, in the order they lie in either page layout) instead of one
    head's rows: the scores, softmax and P V of each head are the same sums in the same order,
    so every thread count, page layout and split count gives the contiguous cache's result
    bit for bit, with per-head modifiers (ALiBi, sinks) on the right heads. D 44 / Dv 41 leave
    feature tails; the lengths cross pages, tiles and splits."""
    torch.manual_seed(0)
    page_size, lengths = 16, [700, 1100]
    B, Hkv, D, Dv = len(lengths), 4, 44, 41
    H = group * Hkv
    L = -(-max(lengths) // page_size) * page_size
    k, v = rand((B, Hkv, L, D), dtype, "cpu"), rand((B, Hkv, L, Dv), dtype, "cpu")
    k_pages, v_pages, table = page_out(k, v, page_size)
    if flash_pages:  # FlashAttention's (num_pages, page_size, Hkv, D) pages, read in place
        k_pages = k_pages.transpose(1, 2).contiguous().transpose(1, 2)
        v_pages = v_pages.transpose(1, 2).contiguous().transpose(1, 2)
    lens = torch.tensor(lengths, dtype=torch.int32)
    q = rand((B, H, sq, D), dtype, "cpu")
    kw = {
        name: getattr(torch, value)(H) if isinstance(value, str) else value
        for name, value in mods.items()
    }
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for num_splits in (1, 2, 0):
            call = dict(kw, num_splits=num_splits, return_lse=True)
            out, lse = attn_ext.decode_attention(
                q, k_pages, v_pages, lens, block_table=table, **call
            )
            c_out, c_lse = attn_ext.decode_attention(q, k, v, lens, **call)
            assert torch.equal(out, c_out) and torch.equal(lse, c_lse), num_splits
    finally:
        torch.set_num_threads(before)
    ref_out, ref_lse = decode_reference(q, k, v, lens, **kw)
    t_out, t_lse = ground_truth(decode_reference, q, k, v, lens, **kw)
    assert_error_rule(out, ref_out, t_out, name="paged decode out")
    assert_lse_close(lse, ref_lse, t_lse, name="paged decode lse")


def test_paged_decode_reads_flash_attn_pages_in_place():
    """FlashAttention's (num_pages, page_size, Hkv, D) pages, transposed, are not copied: a
    write to the pages after the call is seen by the next call."""
    page_size, lengths = 16, [20, 33]
    B, H, Hkv, D = 2, 4, 2, 16
    L = 48
    k, v = rand((B, Hkv, L, D), torch.float32, "cpu"), rand((B, Hkv, L, D), torch.float32, "cpu")
    k_pages, v_pages, table = page_out(k, v, page_size)
    k_fa = k_pages.transpose(1, 2).contiguous()  # (num_pages, page_size, Hkv, D)
    v_fa = v_pages.transpose(1, 2).contiguous()
    lens = torch.tensor(lengths, dtype=torch.int32)
    q = rand((B, H, 1, D), torch.float32, "cpu")
    out = attn_ext.decode_attention(
        q, k_fa.transpose(1, 2), v_fa.transpose(1, 2), lens, block_table=table
    )
    ref = attn_ext.decode_attention(q, k_pages, v_pages, lens, block_table=table)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    # the append writes through the same views: row 20 of sequence 0 lands in the pages
    ops.kv_cache_append(
        k_fa.transpose(1, 2),
        v_fa.transpose(1, 2),
        lens.clone(),
        torch.ones(B, Hkv, 1, D),
        torch.ones(B, Hkv, 1, D),
        block_table=table,
    )
    assert torch.equal(k_fa[table[0, 1], 20 % page_size], torch.ones(Hkv, D))


# ------------------------------------------------------------------------------------- append


def _append_case(dtype, page_size):
    """A contiguous cache, the same rows in shuffled pages, lengths around page bounds, and a
    left-padded append (new rows crossing page boundaries): (k0, v0, k_pages, v_pages, table,
    lengths, k_new, v_new, new_lengths)."""
    lengths = _lengths(page_size)
    B, Hkv, D, Dv, S = len(lengths), 2, 16, 8, 5
    L = -(-(max(lengths) + S) // page_size) * page_size
    k0, v0 = rand((B, Hkv, L, D), dtype, "cpu"), rand((B, Hkv, L, Dv), dtype, "cpu")
    k_pages, v_pages, table = page_out(k0, v0, page_size)
    k_new = rand((B, Hkv, S, D), dtype, "cpu", layout="bshd")
    v_new = rand((B, Hkv, S, Dv), dtype, "cpu")
    new_lengths = torch.tensor([5, 0, 3, 5, 1, 2])
    lens = torch.tensor(lengths, dtype=torch.int32)
    return k0, v0, k_pages, v_pages, table, lens, k_new, v_new, new_lengths


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("rope", [False, True])
def test_paged_append_matches_contiguous(dtype, page_size, rope):
    """The same appends into a contiguous and a paged cache leave the same rows, bit for bit
    (left-padded inputs; new rows crossing page boundaries)."""
    k0, v0, k_pages, v_pages, table, lens, k_new, v_new, new_lengths = _append_case(
        dtype, page_size
    )
    kw = dict(rope=rope, rope_interleaved=True)
    lens_dense, lens_paged = lens.clone(), lens.clone()
    ops.kv_cache_append(k0, v0, lens_dense, k_new, v_new, new_lengths, **kw)
    ops.kv_cache_append(
        k_pages, v_pages, lens_paged, k_new, v_new, new_lengths, block_table=table, **kw
    )
    assert torch.equal(lens_paged, lens_dense)
    k_dense, v_dense = (
        gather_pages(k_pages, table, page_size),
        gather_pages(v_pages, table, page_size),
    )
    for b, n in enumerate(lens_dense.tolist()):
        assert torch.equal(k_dense[b, :, :n], k0[b, :, :n]), b
        assert torch.equal(v_dense[b, :, :n], v0[b, :, :n]), b


def test_paged_append_writes_only_its_rows():
    """Rows outside [len, len + new) of the pages written, and the other pages, keep their
    values."""
    page_size = 4
    k_pages, v_pages = torch.randn(6, 1, page_size, 8), torch.randn(6, 1, page_size, 8)
    before_k, before_v = k_pages.clone(), v_pages.clone()
    table = torch.tensor([[5, 2, -1], [0, -1, -1]], dtype=torch.int32)  # -1: never touched
    lens = torch.tensor([3, 1], dtype=torch.int32)
    ops.kv_cache_append(
        k_pages,
        v_pages,
        lens,
        torch.zeros(2, 1, 2, 8),
        torch.zeros(2, 1, 2, 8),
        block_table=table,
    )
    assert lens.tolist() == [5, 3]
    written = {(5, 3), (2, 0), (0, 1), (0, 2)}
    for page in range(6):
        for row in range(page_size):
            want = torch.zeros(8) if (page, row) in written else before_k[page, 0, row]
            assert torch.equal(k_pages[page, 0, row], want), (page, row)
            want = torch.zeros(8) if (page, row) in written else before_v[page, 0, row]
            assert torch.equal(v_pages[page, 0, row], want), (page, row)


# ------------------------------------------------------------------------------ bad block tables


def _bad_table_setup():
    page_size, num_pages = 4, 5
    k = torch.randn(num_pages, 2, page_size, 8)
    v = torch.randn(num_pages, 2, page_size, 8)
    table = torch.tensor([[0, 1, -1], [2, 3, 4]], dtype=torch.int32)
    lens = torch.tensor([5, 9], dtype=torch.int32)  # entry [0, 2] covers no row: left -1
    return k, v, table, lens


# (how the table is spoiled, what the message must say). The append adds 3 rows to each
# sequence, rows [5, 8) and [9, 12): entries [0, 1] and [1, 2]; the decode reads entries
# [0, 0:2] and [1, 0:3].
BAD_TABLES = [
    (lambda t: t.long(), "block_table must be int32, got Long"),
    (lambda t: t[:1], r"block_table must have shape \(B, max_pages\) with B = 2"),
    (lambda t: t[0], r"block_table must have shape \(B, max_pages\) with B = 2"),
    (
        lambda t: torch.stack([t[:, 0], t[:, 0] * 0 - 7, t[:, 1]]).t(),
        "block_table must have contiguous rows",
    ),
    (
        lambda t: torch.tensor([[0, 1, -1], [2, 3, 5]], dtype=torch.int32),
        r"block_table\[1, 2\] must be a page of the cache, in \[0, num_pages = 5\), got 5",
    ),
    (
        lambda t: torch.tensor([[0, -2, 2], [2, 3, 4]], dtype=torch.int32),
        r"block_table\[0, 1\] must be a page of the cache, in \[0, num_pages = 5\), got -2",
    ),
    (lambda t: t[:, :2], "would overflow the cache|must be in \\[0, 8\\]"),
]


@pytest.mark.parametrize("case", range(len(BAD_TABLES)))
@pytest.mark.parametrize("op", ["append", "decode"])
def test_bad_block_table_errors_and_writes_nothing(case, op):
    spoil, msg = BAD_TABLES[case]
    k, v, table, lens = _bad_table_setup()
    bad = spoil(table)
    before = [t.clone() for t in (k, v, lens)]
    with pytest.raises(RuntimeError, match=msg):
        if op == "append":
            ops.kv_cache_append(
                k, v, lens, torch.zeros(2, 2, 3, 8), torch.zeros(2, 2, 3, 8), block_table=bad
            )
        else:
            attn_ext.decode_attention(torch.randn(2, 4, 1, 8), k, v, lens, block_table=bad)
    for a, b in zip(before, (k, v, lens)):
        assert torch.equal(a, b)


def test_block_table_other_errors():
    k, v, table, lens = _bad_table_setup()
    q = torch.randn(2, 4, 1, 8)
    with pytest.raises(RuntimeError, match="either block_table or cache_batch_idx"):
        attn_ext.decode_attention(
            q, k, v, lens, block_table=table, cache_batch_idx=torch.tensor([0, 1])
        )
    with pytest.raises(RuntimeError, match=r"page size \(k_cache dim 2\) must be >= 1"):
        attn_ext.decode_attention(q, k[:, :, :0], v[:, :, :0], lens * 0, block_table=table)
    with pytest.raises(RuntimeError, match="at least one page"):
        attn_ext.decode_attention(q, k[:0], v[:0], lens * 0, block_table=table)
    with pytest.raises(RuntimeError, match="v_cache pages"):
        attn_ext.decode_attention(q, k, v[:4], lens, block_table=table)
    with pytest.raises(RuntimeError, match="cache_seqlens\\[1\\] must be in \\[0, 12\\]"):
        attn_ext.decode_attention(q, k, v, torch.tensor([5, 13]), block_table=table)
    # the entries past a sequence's length are not read: -1 there is fine
    attn_ext.decode_attention(q, k, v, torch.tensor([8, 9]), block_table=table)


# ------------------------------------------------------------------------- opcheck and compile


def _opcheck_inputs():
    k, v, table, lens = _bad_table_setup()
    table = torch.tensor([[4, 1, 0], [2, 3, 4]], dtype=torch.int32)  # page 4 shared
    return k, v[..., :6], table, lens


def test_opcheck_paged_ops():
    k, v, table, lens = _opcheck_inputs()
    torch.library.opcheck(
        ops.kv_cache_append.default,
        (
            k,
            v,
            torch.tensor([1, 0], dtype=torch.int32),
            torch.randn(2, 2, 2, 8),
            torch.randn(2, 2, 2, 6),
        ),
        dict(block_table=table, rope=True),
    )
    q = torch.randn(2, 4, 2, 8).transpose(1, 2).contiguous().transpose(1, 2)
    torch.library.opcheck(
        ops.decode_attention.default, (q, k, v, lens), dict(block_table=table, num_splits=2)
    )


def test_compile_paged_decode_step():
    """A decode step (append + attend through the table) compiles with no graph break and is
    not recompiled as the lengths grow across pages."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()

    def step(q, k_new, v_new, k_pages, v_pages, lengths, table):
        ops.kv_cache_append(k_pages, v_pages, lengths, k_new, v_new, block_table=table)
        return ops.decode_attention(q, k_pages, v_pages, lengths, block_table=table)[0]

    cstep = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    page_size, B, Hkv, D = 4, 2, 2, 8
    table = torch.tensor([[3, 0, 5, 1], [2, 4, 6, 7]], dtype=torch.int32)
    pages = [torch.zeros(8, Hkv, page_size, D) for _ in range(4)]
    lens = [torch.zeros(B, dtype=torch.int32) for _ in range(2)]
    for _ in range(10):
        q, k_new, v_new = (
            torch.randn(B, 4, 1, D),
            torch.randn(B, Hkv, 1, D),
            torch.randn(B, Hkv, 1, D),
        )
        out = cstep(q, k_new, v_new, pages[0], pages[1], lens[0], table)
        ref = step(q, k_new, v_new, pages[2], pages[3], lens[1], table)
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert counter.frame_count == 1
    assert torch.equal(pages[0], pages[2]) and lens[0].tolist() == [10, 10]


# --------------------------------------------------------------------------------- PagedKVCache


def test_paged_cache_grows_frees_and_reuses_pages():
    c = attn_ext.PagedKVCache(6, 4, 2, 8, max_batch=2, max_pages_per_seq=3, dtype=torch.float32)
    assert c.num_free_pages == 6 and c.max_len == 12
    c.append(torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8))
    assert c.pages(0) == [0] and c.pages(1) == [1] and c.num_free_pages == 4
    c.append(torch.randn(2, 2, 2, 8), torch.randn(2, 2, 2, 8), new_lengths=torch.tensor([2, 0]))
    assert c.pages(0) == [0, 2] and c.pages(1) == [1] and c.lengths.tolist() == [5, 3]
    assert c.block_table.tolist() == [[0, 2, -1], [1, -1, -1]]
    c.release(0)
    assert c.num_free_pages == 5 and c.lengths.tolist() == [0, 3] and c.pages(0) == []
    assert c.block_table[0].tolist() == [-1, -1, -1]
    c.append(torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8))  # freed pages are reused
    assert sorted(c.pages(0) + c.pages(1)) == [0, 1, 2, 3] and c.lengths.tolist() == [5, 8]
    c.reset()
    assert c.num_free_pages == 6 and c.lengths.tolist() == [0, 0]


def test_paged_cache_matches_kv_cache():
    """Prefill (left padded) and decode steps through PagedKVCache and KVCache agree; RoPE on
    the way in. Page size 256 with float32: the kernel's tiles coincide, bit for bit."""
    torch.manual_seed(0)
    B, H, Hkv, D, page_size = 3, 8, 2, 32, 256
    dense = attn_ext.KVCache(B, Hkv, 3 * page_size, D)
    paged = attn_ext.PagedKVCache(
        8, page_size, Hkv, D, max_batch=B, max_pages_per_seq=3, dtype=torch.float32
    )
    prompt = 300
    new_lengths = torch.tensor([300, 17, 255])
    k, v = torch.randn(B, Hkv, prompt, D), torch.randn(B, Hkv, prompt, D)
    for c in (dense, paged):
        c.append(k, v, new_lengths=new_lengths, rope=True)
    for _ in range(3):
        k, v, q = torch.randn(B, Hkv, 1, D), torch.randn(B, Hkv, 1, D), torch.randn(B, H, 1, D)
        outs = []
        for c in (dense, paged):
            c.append(k, v, rope=True)
            outs.append(c.attend(q, return_lse=True))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert paged.lengths.tolist() == [303, 20, 258] and paged.num_free_pages == 8 - 5


def test_paged_cache_out_of_pages_writes_nothing():
    c = attn_ext.PagedKVCache(3, 4, 1, 8, max_batch=2, max_pages_per_seq=4)
    c.append(torch.randn(2, 1, 4, 8), torch.randn(2, 1, 4, 8))
    state = [c.k.clone(), c.v.clone(), c.lengths.clone(), c.block_table.clone()]
    msg = "out of pages: the append needs 2 new pages of 4 rows, 1 are free \\(nothing was written"
    with pytest.raises(RuntimeError, match=msg):
        c.append(torch.randn(2, 1, 1, 8), torch.randn(2, 1, 1, 8))
    with pytest.raises(RuntimeError, match="sequence 0 would overflow the cache"):
        c.append(torch.randn(2, 1, 13, 8), torch.randn(2, 1, 13, 8))
    with pytest.raises(RuntimeError, match="k must have k_cache's dtype"):  # pages given back
        k = torch.randn(2, 1, 1, 8, dtype=torch.float64)
        c.append(k, k, new_lengths=torch.tensor([1, 0]))
    for a, b in zip(state, (c.k, c.v, c.lengths, c.block_table)):
        assert torch.equal(a, b)
    assert c.num_free_pages == 1 and c.pages(0) == [0]
    # one sequence still fits
    c.append(torch.randn(2, 1, 1, 8), torch.randn(2, 1, 1, 8), new_lengths=torch.tensor([1, 0]))
    assert c.lengths.tolist() == [5, 4] and c.num_free_pages == 0


def test_paged_cache_fork_shares_full_pages():
    """Two sequences on shared pages (a shared prompt): the full pages are shared, the partly
    filled one copied; each may append; a page is free once neither holds it."""
    torch.manual_seed(1)
    c = attn_ext.PagedKVCache(8, 4, 1, 8, max_batch=2, max_pages_per_seq=4)
    c.append(torch.randn(2, 1, 6, 8), torch.randn(2, 1, 6, 8), new_lengths=torch.tensor([6, 0]))
    c.fork(0, 1)
    assert c.pages(1)[0] == c.pages(0)[0] and c.pages(1)[1] != c.pages(0)[1]
    assert c.lengths.tolist() == [6, 6] and c.num_free_pages == 5
    k, v = torch.randn(2, 1, 3, 8), torch.randn(2, 1, 3, 8)
    c.append(k, v)  # different continuations of the shared prompt
    q = torch.randn(2, 2, 1, 8)
    out = c.attend(q)
    dense = gather_pages(c.k, c.block_table, 4)
    assert torch.equal(dense[0, :, :6], dense[1, :, :6])
    assert torch.equal(dense[0, :, 6:9], k[0]) and torch.equal(dense[1, :, 6:9], k[1])
    ref = decode_reference(q, dense, gather_pages(c.v, c.block_table, 4), c.lengths)[0]
    torch.testing.assert_close(out, ref)
    shared = c.pages(0)[0]
    c.release(0)
    assert c.num_free_pages == 5  # the shared page is still held by sequence 1
    assert shared in c.pages(1)
    c.release(1)
    assert c.num_free_pages == 8


def test_paged_cache_arguments():
    with pytest.raises(ValueError, match="page_size must be >= 1, got 0"):
        attn_ext.PagedKVCache(4, 0, 1, 8, max_batch=1, max_pages_per_seq=1)
    c = attn_ext.PagedKVCache(
        4, 16, 2, 8, 6, max_batch=3, max_pages_per_seq=2, dtype=torch.bfloat16
    )
    assert c.k.shape == (4, 2, 16, 8) and c.v.shape == (4, 2, 16, 6)
    assert c.block_table.shape == (3, 2) and c.block_table.dtype == torch.int32
    assert "PagedKVCache(num_pages=4, page_size=16" in repr(c)


# ------------------------------------------------------------------------- paged latent cache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_paged_latent_append_matches_contiguous(dtype, page_size):
    """latent_cache_append through a table leaves the rows the contiguous latent cache gets,
    bit for bit: c_kv as given, k_rope rotated at the rows' positions (left-padded inputs,
    new rows crossing page boundaries)."""
    lengths = _lengths(page_size)
    B, dc, dr, S = len(lengths), 12, 8, 5
    L = -(-(max(lengths) + S) // page_size) * page_size
    kv0 = rand((B, 1, L, dc + dr), dtype, "cpu")
    pages, _, table = page_out(kv0, kv0[..., :1], page_size)
    lens = torch.tensor(lengths, dtype=torch.int32)
    c_kv, k_rope = rand((B, 1, S, dc), dtype, "cpu"), rand((B, 1, S, dr), dtype, "cpu", "bshd")
    new_lengths = torch.tensor([5, 0, 3, 5, 1, 2])
    lens_dense, lens_paged = lens.clone(), lens.clone()
    kw = dict(rope_interleaved=True)
    ops.latent_cache_append(kv0, lens_dense, c_kv, k_rope, new_lengths, **kw)
    ops.latent_cache_append(pages, lens_paged, c_kv, k_rope, new_lengths, block_table=table, **kw)
    assert torch.equal(lens_paged, lens_dense)
    dense = gather_pages(pages, table, page_size)
    for b, n in enumerate(lens_dense.tolist()):
        assert torch.equal(dense[b, :, :n], kv0[b, :, :n]), b


@pytest.mark.parametrize("case", range(len(BAD_TABLES)))
def test_bad_block_table_latent_append_writes_nothing(case):
    spoil, msg = BAD_TABLES[case]
    k, _, table, lens = _bad_table_setup()
    before = [k.clone(), lens.clone()]
    with pytest.raises(RuntimeError, match=msg):
        ops.latent_cache_append(
            k, lens, torch.zeros(2, 2, 3, 4), torch.zeros(2, 2, 3, 4), block_table=spoil(table)
        )
    assert torch.equal(before[0], k) and torch.equal(before[1], lens)


def test_opcheck_paged_latent_append():
    k, _, table, _ = _opcheck_inputs()
    torch.library.opcheck(
        ops.latent_cache_append.default,
        (
            k,
            torch.tensor([1, 0], dtype=torch.int32),
            torch.randn(2, 2, 2, 4),
            torch.randn(2, 2, 2, 4),
        ),
        dict(block_table=table),
    )


def test_compile_paged_latent_decode_step():
    """MLA's paged step (latent append + absorbed decode through the table, the values a column
    view of the pages) compiles with no graph break, once, and matches eager bit for bit."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    dc, dr = 6, 4

    def step(q, c_kv, k_rope, pages, lengths, table):
        ops.latent_cache_append(pages, lengths, c_kv, k_rope, block_table=table)
        return ops.decode_attention(q, pages, pages[..., :dc], lengths, block_table=table)[0]

    cstep = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    table = torch.tensor([[3, 0, 5, 1], [2, 4, 6, 7]], dtype=torch.int32)
    pages = [torch.zeros(8, 1, 4, dc + dr) for _ in range(2)]
    lens = [torch.zeros(2, dtype=torch.int32) for _ in range(2)]
    for _ in range(10):
        q, c_kv, k_rope = (
            torch.randn(2, 3, 1, dc + dr),
            torch.randn(2, 1, 1, dc),
            torch.randn(2, 1, 1, dr),
        )
        out = cstep(q, c_kv, k_rope, pages[0], lens[0], table)
        ref = step(q, c_kv, k_rope, pages[1], lens[1], table)
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert counter.frame_count == 1
    assert torch.equal(pages[0], pages[1]) and lens[0].tolist() == [10, 10]


def _mla(dtype, **dims):
    from attn_ext.nn import MultiHeadLatentAttention

    torch.manual_seed(0)
    dims = dims or dict(kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
    return MultiHeadLatentAttention(40, 4, **dims).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("absorb", [True, False])
@pytest.mark.parametrize("page_size", [1, 4, 256])
def test_mla_paged_latent_cache_matches_contiguous(dtype, absorb, page_size):
    """MLA decoding against PagedLatentKVCache (prompt into an empty cache, a left-padded
    multi-token step, single-token steps) gives the contiguous LatentKVCache's outputs bit for
    bit: the decode kernel gathers small pages into its whole tiles, and the prompt and
    decompressed paths read the same rows gathered."""
    m = _mla(dtype)
    x = torch.randn(3, 12, 40, dtype=dtype)
    outs = []
    with torch.no_grad():
        for paged in (None, page_size):
            cache = m.new_cache(3, 16, page_size=paged)
            steps = [m(x[:, :5], cache, absorb=absorb)]
            steps.append(m(x[:, 5:8], cache, new_lengths=torch.tensor([3, 1, 2]), absorb=absorb))
            steps += [m(x[:, t : t + 1], cache, absorb=absorb) for t in range(8, 12)]
            outs.append((torch.cat(steps, dim=1), cache.lengths.tolist()))
    assert outs[0][1] == outs[1][1] == [12, 10, 11]
    assert torch.equal(outs[1][0], outs[0][0])


def test_paged_latent_cache_pages_fork_and_rows():
    torch.manual_seed(2)
    c = attn_ext.PagedLatentKVCache(6, 4, 8, 4, max_batch=2, max_pages_per_seq=3)
    assert c.kv.shape == (6, 1, 4, 12) and c.k.data_ptr() == c.kv.data_ptr()
    assert c.v.shape == (6, 1, 4, 8) and c.v.data_ptr() == c.kv.data_ptr()
    assert c.empty and c.max_len == 12 and "PagedLatentKVCache(num_pages=6" in repr(c)
    c_kv, k_rope = torch.randn(2, 1, 6, 8), torch.randn(2, 1, 6, 4)
    c.append(c_kv, k_rope, new_lengths=torch.tensor([6, 0]))
    assert not c.empty and c.pages(0) == [0, 1] and c.num_free_pages == 4
    c.fork(0, 1)  # page 0 shared, the partly filled page 1 copied
    assert c.pages(1)[0] == 0 and c.pages(1)[1] not in (0, 1)
    rows = c.rows(6)
    assert rows.shape == (2, 1, 6, 12) and torch.equal(rows[0], rows[1])
    assert torch.equal(rows[0, 0, :, :8], c_kv[0, 0])
    c.release(0)
    assert c.num_free_pages == 4  # page 0 is still sequence 1's
    with pytest.raises(ValueError, match="page_size must be >= 1, got 0"):
        attn_ext.PagedLatentKVCache(4, 0, 8, 4, max_batch=1, max_pages_per_seq=1)
    m = _mla(torch.float32)
    with pytest.raises(TypeError, match="LatentKVCache or PagedLatentKVCache"):
        m(
            torch.randn(2, 1, 40),
            attn_ext.PagedKVCache(4, 4, 1, 8, max_batch=2, max_pages_per_seq=2),
        )
    with pytest.raises(ValueError, match="num_pages needs page_size"):
        m.new_cache(2, 8, num_pages=4)


# ----------------------------------------------------------------------------------------- CUDA
# The split-KV decode kernel and the paged append (csrc/decoding/cuda/decode_split_kv.cu,
# rope.cu): the split-KV kernel serves the paged and the contiguous decode where it can (bf16 /
# fp16 / fp32, D = Dv in {64, 128, 256}). Checked against the float64 truth and the same-dtype
# reference, as on the CPU.

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (H, Hkv, Sq): G * Sq rows per KV head of 1 (MHA), 4 (one small block), 8, and 64 (eight
# blocks of eight rows).
CUDA_GROUPS = [(4, 4, 1), (8, 2, 1), (8, 1, 1), (16, 1, 4)]


def _cuda_case(dtype, page_size, head_dim, groups, extra=None, seed=0):
    """A shuffled paged cache on the GPU and the contiguous cache holding its rows; lengths
    around page bounds and one long enough to split (several key tiles)."""
    torch.manual_seed(seed)
    H, Hkv, sq = groups
    lengths = _lengths(page_size) + [1000]
    B, D = len(lengths), head_dim
    L = -(-max(lengths) // page_size) * page_size
    k, v = rand((B, Hkv, L, D), dtype, "cpu"), rand((B, Hkv, L, D), dtype, "cpu")
    k_pages, v_pages, table = page_out(k, v, page_size, shared_prefix_pages=1)
    lens = torch.tensor(lengths, dtype=torch.int32)
    q = rand((B, H, sq, D), dtype, "cpu", layout="bshd")
    return [t.cuda() for t in (q, k, v, k_pages, v_pages, table, lens)]


def _check_cuda_decode(out, lse, q, k, v, lens, **kw):
    ref_out, ref_lse = decode_reference(q, k, v, lens, **kw)
    t_out, t_lse = ground_truth(decode_reference, q, k, v, lens, **kw)
    assert_error_rule(out, ref_out, t_out, name="cuda decode out")
    assert_lse_close(lse, ref_lse, t_lse, name="cuda decode lse")


@cuda
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("page_size", [16, 48, 256])
@pytest.mark.parametrize("groups", CUDA_GROUPS, ids=lambda g: "H{}_Hkv{}_Sq{}".format(*g))
@pytest.mark.parametrize("num_splits", [1, 3, 0])
def test_cuda_split_kv_decode(dtype, head_dim, page_size, groups, num_splits):
    """Paged and contiguous caches through the one kernel, against the float64 truth; the
    paged result equals the contiguous one bit for bit (the same keys in the same order)."""
    q, k, v, k_pages, v_pages, table, lens = _cuda_case(dtype, page_size, head_dim, groups)
    kw = dict(num_splits=num_splits, return_lse=True)
    out, lse = attn_ext.decode_attention(q, k_pages, v_pages, lens, block_table=table, **kw)
    _check_cuda_decode(out, lse, q, k, v, lens)
    dense_out, dense_lse = attn_ext.decode_attention(q, k, v, lens, **kw)
    assert torch.equal(out, dense_out) and torch.equal(lse, dense_lse)


@cuda
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize(
    "extra",
    [
        dict(window_left=37),
        dict(causal=False, window_left=20, window_right=5, softcap=2.0),
        dict(sinks="randn", alibi_slopes="rand"),
        dict(cache_leftpad=[0, 0, 5, 9, 3, 40, 700]),
    ],
    ids=["window", "noncausal_window_softcap", "sinks_alibi", "leftpad"],
)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_cuda_split_kv_decode_band_and_modifiers(dtype, paged, extra, num_splits):
    q, k, v, k_pages, v_pages, table, lens = _cuda_case(dtype, 16, 64, (8, 2, 3))
    kw = {}
    for name, val in extra.items():
        if val in ("randn", "rand"):
            val = getattr(torch, val)(q.size(1), device="cuda")
        elif name == "cache_leftpad":
            val = torch.minimum(torch.tensor(val, dtype=torch.int32, device="cuda"), lens)
        kw[name] = val
    cache = dict(block_table=table) if paged else {}
    kc, vc = (k_pages, v_pages) if paged else (k, v)
    out, lse = attn_ext.decode_attention(
        q, kc, vc, lens, num_splits=num_splits, return_lse=True, **cache, **kw
    )
    _check_cuda_decode(out, lse, q, k, v, lens, **kw)


@cuda
def test_cuda_split_kv_decode_cache_batch_idx():
    q, k, v, *_, lens = _cuda_case(torch.bfloat16, 16, 128, (8, 2, 1))
    idx = torch.randperm(k.size(0), device="cuda").to(torch.int32)
    lens_b = lens[idx.long()]
    out, lse = attn_ext.decode_attention(q, k, v, lens_b, cache_batch_idx=idx, return_lse=True)
    _check_cuda_decode(out, lse, q, k, v, lens_b, cache_batch_idx=idx)


@cuda
def test_cuda_split_kv_decode_ignores_strides_of_size_one_dims():
    """One KV head given an odd head stride (torch leaves a size-1 dim's stride arbitrary): the
    rows are still 16-byte aligned, so the split-KV kernel serves the call, bit for bit the
    contiguous cache's result."""
    q, k, v, *_, lens = _cuda_case(torch.bfloat16, 16, 128, (8, 1, 1))
    odd_k, odd_v = (t.as_strided(t.shape, (t.stride(0), 7, t.stride(2), 1)) for t in (k, v))
    names = cuda_kernel_names(
        lambda: attn_ext.decode_attention(q, odd_k, odd_v, lens, return_lse=True)
    )
    assert any("split_kv_kernel" in n for n in names), names
    out, lse = attn_ext.decode_attention(q, odd_k, odd_v, lens, return_lse=True)
    dense_out, dense_lse = attn_ext.decode_attention(q, k, v, lens, return_lse=True)
    assert torch.equal(out, dense_out) and torch.equal(lse, dense_lse)


@cuda
def test_cuda_split_kv_never_reads_past_lengths():
    """NaN in every row at or past a sequence's length, and in unused pages: never read."""
    q, k, v, k_pages, v_pages, table, lens = _cuda_case(torch.float16, 16, 128, (8, 2, 1))
    poisoned_k, poisoned_v = k.clone(), v.clone()
    for b, n in enumerate(lens.tolist()):
        poisoned_k[b, :, n:] = float("nan")
        poisoned_v[b, :, n:] = float("nan")
    out, lse = attn_ext.decode_attention(q, poisoned_k, poisoned_v, lens, return_lse=True)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    used = torch.zeros(k_pages.size(0), dtype=torch.bool)
    for b, n in enumerate(lens.tolist()):
        used[table[b, : -(-n // 16)].long().cpu()] = True
    k_pages[~used.cuda()] = float("nan")
    out, lse = attn_ext.decode_attention(
        q, k_pages, v_pages, lens, block_table=table, return_lse=True
    )
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()


@cuda
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("rope", [False, True])
def test_cuda_paged_append_matches_cpu(dtype, page_size, rope):
    k0, v0, k_pages, v_pages, table, lens, k_new, v_new, new_lengths = _append_case(
        dtype, page_size
    )
    kw = dict(rope=rope, rope_interleaved=True)
    gpu = [t.cuda() for t in (k_pages, v_pages, lens, k_new, v_new, new_lengths, table)]
    ops.kv_cache_append(k_pages, v_pages, lens, k_new, v_new, new_lengths, block_table=table, **kw)
    ops.kv_cache_append(*gpu[:6], block_table=gpu[6], **kw)
    assert torch.equal(gpu[2].cpu(), lens)
    if rope:  # cos / sin on the GPU round differently: the rows agree to an ulp or two
        torch.testing.assert_close(gpu[0].cpu(), k_pages)
    else:
        assert torch.equal(gpu[0].cpu(), k_pages)
    assert torch.equal(gpu[1].cpu(), v_pages)


@cuda
@pytest.mark.parametrize("case", ["overflow", "bad_entry"])
def test_cuda_paged_append_that_does_not_fit_writes_nothing(case):
    """The GPU op cannot raise without a sync: an append that would overflow, or whose rows
    land in a table entry outside the cache, writes nothing and leaves the lengths."""
    k, v, table, lens = (t.cuda() for t in _bad_table_setup())
    if case == "overflow":
        table = table[:, :2].contiguous()  # capacity 8 < 9 + 3
    else:
        table = torch.tensor([[0, 1, -1], [2, 3, 5]], dtype=torch.int32, device="cuda")
    before = [t.clone() for t in (k, v, lens)]
    new = torch.ones(2, 2, 3, 8, device="cuda")
    ops.kv_cache_append(k, v, lens, new, new, block_table=table)
    torch.cuda.synchronize()
    for a, b in zip(before, (k, v, lens)):
        assert torch.equal(a, b)


@cuda
def test_cuda_paged_cache_matches_cpu():
    """PagedKVCache on the GPU: appends, a fork and decode steps give the CPU cache's results."""
    caches = [
        attn_ext.PagedKVCache(
            12, 16, 2, 64, max_batch=3, max_pages_per_seq=4, dtype=torch.float32, device=dev
        )
        for dev in ("cpu", "cuda")
    ]
    torch.manual_seed(0)
    prompt_k, prompt_v = torch.randn(3, 2, 21, 64), torch.randn(3, 2, 21, 64)
    for c in caches:
        c.append(prompt_k.to(c.k.device), prompt_v.to(c.k.device))
        c.fork(0, 2)
    for _ in range(3):
        q, k_new, v_new = (
            torch.randn(3, 8, 1, 64),
            torch.randn(3, 2, 1, 64),
            torch.randn(3, 2, 1, 64),
        )
        outs = []
        for c in caches:
            dev = c.k.device
            c.append(k_new.to(dev), v_new.to(dev))
            outs.append(c.attend(q.to(dev), num_splits=2).cpu())
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


@cuda
def test_cuda_paged_append_validates_the_table():
    """A table of the wrong dtype gets the validation's message on CUDA too (the entries the GPU
    op cannot check without a sync: test_cuda_paged_append_that_does_not_fit_writes_nothing)."""
    k, v, table, lens = (t.cuda() for t in _bad_table_setup())
    new = torch.zeros(2, 2, 1, 8, device="cuda")
    with pytest.raises(RuntimeError, match="block_table must be int32"):
        ops.kv_cache_append(k, v, lens, new, new, block_table=table.long())


@cuda
@pytest.mark.parametrize(
    "dtype,head_dim", [(torch.float64, 64), (torch.float32, 48), (torch.bfloat16, 512)]
)
def test_cuda_paged_decode_unsupported_shapes(dtype, head_dim):
    """What the split-KV kernel does not serve (fp64, head dims outside {64, 128, 256}, D != Dv)
    runs the SIMT kernel on the gathered pages: the same bits as the contiguous call on the
    same rows (pages out of table order, an unused entry of -1 past a short sequence)."""
    dv = head_dim // 2 if dtype == torch.float32 else head_dim  # fp32: MLA's D != Dv too
    k = torch.randn(5, 2, 16, head_dim, device="cuda", dtype=dtype)
    v = torch.randn(5, 2, 16, dv, device="cuda", dtype=dtype)
    table = torch.tensor([[3, -1], [0, 4]], dtype=torch.int32, device="cuda")
    lens = torch.tensor([5, 32], dtype=torch.int32, device="cuda")
    q = torch.randn(2, 4, 1, head_dim, device="cuda", dtype=dtype)
    out, lse = attn_ext.decode_attention(q, k, v, lens, block_table=table, return_lse=True)
    k_rows, v_rows = gather_pages(k, table, 16), gather_pages(v, table, 16)
    want, want_lse = attn_ext.decode_attention(q, k_rows, v_rows, lens, return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    ref = decode_reference(q, k_rows, v_rows, lens)[0]
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


@cuda
def test_cuda_paged_latent_cache_matches_cpu():
    """MLA decoding through PagedLatentKVCache on the GPU gives the CPU's (the latent append
    through the table, then the absorbed decode: D != Dv, the SIMT kernel on gathered pages)."""
    m = _mla(
        torch.float32, kv_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16
    )
    x = torch.randn(2, 9, 40)
    outs = []
    with torch.no_grad():
        for dev in ("cpu", "cuda"):
            m = m.to(dev)
            cache = m.new_cache(2, 12, page_size=4)
            steps = [m(x[:, :5].to(dev), cache)]
            steps += [m(x[:, t : t + 1].to(dev), cache) for t in range(5, 9)]
            outs.append(torch.cat(steps, dim=1).cpu())
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
