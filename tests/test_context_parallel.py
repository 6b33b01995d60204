"""Context parallelism (attn_ext.distributed, attn_ext.nn.ContextParallelAttention) on the CPU.

The ring / Ulysses tests spawn one gloo group per world size (2 and 4 ranks, loopback only,
rendezvous through a file) and run every case inside it; each rank compares its shard of out,
lse and the gradients with the float64 reference over the whole sequence
(attn_ext.testing.attention.attention_reference), sharded the same way, and writes a verdict
per case that the parametrized tests below read. Every group runs under a wall-clock deadline
and every collective under gloo's timeout, so a hang fails a test instead of the CI job.

Tolerances (max abs error against the float64 truth; inputs are N(0, 1), outputs O(1)):
- ring, float64: 1e-6. The blocks' partial results merge by the operator's lse, which is
  float32 by design (about 6e-8 relative: 3e-7 absolute at lse ~ 5), so float64 agrees to the
  float32 rounding of lse, not to float64's; measured max 1e-7.
- Ulysses, float64: 1e-10 (the local attention sees the whole sequence: no merge); lse,
  float32 for every dtype, to 1e-6.
- float32: 2e-5 (merge weights and accumulators in fp32, S <= 64 keys per row).
- bfloat16: out / lse 3e-2, gradients 8e-2 (each of the <= 2W partial outputs and gradients is
  rounded to bfloat16 (8 bits: 4e-3 relative) before the fp32 merge, as the single-process
  kernel rounds its one result).
"""

from __future__ import annotations

import datetime
import json
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import attn_ext
from attn_ext import distributed as cp
from attn_ext.testing.attention import attention_reference, window_keep

ops = torch.ops.attn_ext

WORLD_SIZES = (2, 4)
# Wall-clock bound of one spawned group (start-up of every rank, all cases, teardown): ample
# for a loaded 2-core CI machine, short enough that a hang fails the test, not the job.
GROUP_DEADLINE_S = 150
# gloo's timeout of every collective and transfer inside the groups.
PG_TIMEOUT_S = 30
# The timeout of the group in which a rank dies or stays away (the error must come this fast).
FAILURE_TIMEOUT_S = 3

# The group that also runs the compiled-module case (dynamo costs every rank ~20 s of CPU).
COMPILE_WORLD_SIZE = 2
OUT_TOL = {"ring": {torch.float64: 1e-6}, "ulysses": {torch.float64: 1e-10}}
# lse is float32 for every dtype (by design): its rounding at |lse| ~ 5.
LSE_TOL = 1e-6
DTYPE_TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (3e-2, 8e-2)}  # (out/lse, grads)


@dataclass(frozen=True)
class Case:
    method: str
    layout: str
    causal: bool = False
    window: tuple = (-1, -1)
    dtype: torch.dtype = torch.float64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    v_head_dim: int = 16
    local_len: int = 8
    three_d: bool = False

    @property
    def id(self) -> str:
        w = "" if self.window == (-1, -1) else f"-w{self.window[0]}_{self.window[1]}"
        return (
            f"{self.method}-{self.layout}-{'causal' if self.causal else 'full'}{w}-"
            f"{str(self.dtype).split('.')[-1]}-h{self.heads}kv{self.kv_heads}"
            f"-d{self.head_dim}dv{self.v_head_dim}{'-3d' if self.three_d else ''}"
        )

    def tolerances(self):
        if self.dtype == torch.float64:
            t = OUT_TOL[self.method][self.dtype]
            return t, t
        return DTYPE_TOL[self.dtype]


def _cases(world_size: int):
    cases = []
    for layout in cp.LAYOUTS:
        for causal, window in (
            (False, (-1, -1)),
            (True, (-1, -1)),
            (True, (5, 0)),
            (False, (3, 2)),
        ):
            cases.append(Case("ring", layout, causal, window))
        cases.append(Case("ring", layout, True, dtype=torch.float32))
        cases.append(Case("ring", layout, True, dtype=torch.bfloat16))
        cases.append(Case("ulysses", layout, True))
        cases.append(Case("ulysses", layout, False, (3, 2)))
    cases += [
        # MQA, Dv != D
        Case("ring", "zigzag", True, kv_heads=1, v_head_dim=24),
        # a window shorter than a shard: the contiguous ring stops after two steps
        Case("ring", "contiguous", True, (3, 0), local_len=6),
        # a window wider than the sequence: every step, no key masked in the earlier blocks
        Case("ring", "contiguous", False, (100, 1)),
        Case("ring", "zigzag", False, (-1, 0), heads=2, kv_heads=2, three_d=False),
        Case("ring", "zigzag", True, heads=1, kv_heads=1, three_d=True),
        # K/V heads repeated to the group size (W % Hkv == 0) or split (Hkv % W == 0)
        Case("ulysses", "zigzag", True, heads=4 * world_size, kv_heads=1),
        Case("ulysses", "contiguous", True, heads=world_size, kv_heads=world_size),
        Case("ulysses", "contiguous", False, dtype=torch.bfloat16),
    ]
    return cases


CASE_IDS = {w: [c.id for c in _cases(w)] for w in WORLD_SIZES}
ERROR_CASES = (
    "uneven_shards",
    "odd_zigzag_length_on_one_rank",
    "ulysses_heads_not_divisible",
    "bad_layout",
)


def _seed(case_id: str) -> int:
    # The same seed on every rank (Python's str hash is salted per process).
    return sum(ord(ch) * (i + 1) for i, ch in enumerate(case_id)) % (2**31)


def _run_case(case: Case, rank: int, W: int):
    g = torch.Generator().manual_seed(_seed(case.id))
    S, B = case.local_len * W, 2

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    q = rnd(B, case.heads, S, case.head_dim)
    k = rnd(B, case.kv_heads, S, case.head_dim)
    v = rnd(B, case.kv_heads, S, case.v_head_dim)
    gout = rnd(B, case.heads, S, case.v_head_dim)
    glse = rnd(B, case.heads, S).float().double()  # lse and its gradient are float32
    if case.three_d:
        q, k, v, gout, glse = q[:, 0], k[:, 0], v[:, 0], gout[:, 0], glse[:, 0]
    seq = q.dim() - 2

    def shard(x, dim=seq):
        return cp.shard_sequence(x, W, rank, layout=case.layout, dim=dim)

    mine = [shard(x).to(case.dtype).requires_grad_() for x in (q, k, v)]
    fn = cp.ring_attention if case.method == "ring" else cp.ulysses_attention
    out, lse = fn(
        *mine, causal=case.causal, window_size=case.window, layout=case.layout, return_lse=True
    )
    loss = (out.double() * shard(gout)).sum() + (lse.double() * shard(glse, seq)).sum()
    loss.backward()

    full = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = attention_reference(
        *full, causal=case.causal, window_size=case.window, return_lse=True
    )
    ((ref_out * gout).sum() + (ref_lse * glse).sum()).backward()
    tol_out, tol_grad = case.tolerances()
    # lse is float32 whatever the dtype: at least its rounding
    tol_lse = max(tol_out, LSE_TOL)
    checks = [("out", out, shard(ref_out), tol_out), ("lse", lse, shard(ref_lse, seq), tol_lse)]
    checks += [(f"grad_{n}", t.grad, shard(f.grad), tol_grad) for n, t, f in zip("qkv", mine, full)]
    for name, got, want, tol in checks:
        assert got.dtype == (torch.float32 if name == "lse" else case.dtype), (name, got.dtype)
        err = (got.double() - want.detach()).abs().max().item()
        assert err <= tol, f"{name}: max abs error {err:.3g} > {tol:.3g}"


def _expect_error(exc_type, match, fn):
    try:
        fn()
    except exc_type as e:
        assert match in str(e), f"message {str(e)!r} lacks {match!r}"
        return
    raise AssertionError(f"no {exc_type.__name__} raised")


def _run_error_case(name: str, rank: int, W: int):
    x = torch.randn(1, 4, 8, 16, dtype=torch.float64)
    if name == "uneven_shards":
        y = torch.randn(1, 4, 8 + 2 * (rank == 1), 16, dtype=torch.float64)
        _expect_error(
            ValueError,
            "local sequence length (size(2)) by rank: [8, 10",
            lambda: cp.ring_attention(y, y, y),
        )
    elif name == "odd_zigzag_length_on_one_rank":
        y = torch.randn(1, 4, 7 if rank == 0 else 8, 16, dtype=torch.float64)
        match = "must be a multiple of 2; got q.size(2) = 7" if rank == 0 else "rank(s) [0]"
        _expect_error(ValueError, match, lambda: cp.ring_attention(y, y, y, layout="zigzag"))
    elif name == "ulysses_heads_not_divisible":
        y = torch.randn(1, W + 1, 8, 16, dtype=torch.float64)
        _expect_error(ValueError, "H % W == 0", lambda: cp.ulysses_attention(y, y, y))
    elif name == "bad_layout":
        _expect_error(
            ValueError, "layout must be one of", lambda: cp.ring_attention(x, x, x, layout="ring")
        )


def _module_compile_case(rank: int, W: int):
    """ContextParallelAttention inside a compiled layer equals the layer run single-process."""
    torch.manual_seed(7)  # the same weights and input on every rank
    E, H, S = 32, 4, 8 * W
    proj, out_proj = torch.nn.Linear(E, 3 * E).double(), torch.nn.Linear(E, E).double()
    x = torch.randn(2, S, E, dtype=torch.float64)
    attn = attn_ext.nn.ContextParallelAttention(causal=True)

    def layer(x, core):
        q, k, v = (t.unflatten(-1, (H, -1)).transpose(1, 2) for t in proj(x).chunk(3, -1))
        return out_proj(core(q, k, v).transpose(1, 2).flatten(2))

    # aot_eager: dynamo's graph breaks around the collectives and AOT autograd, without
    # inductor's code generation (tens of seconds per rank on a 2-core CI machine)
    got = torch.compile(layer, backend="aot_eager")(cp.shard_sequence(x, W, rank, dim=1), attn)
    want = layer(x, lambda q, k, v: attn_ext.attention(q, k, v, causal=True))
    err = (got - cp.shard_sequence(want, W, rank, dim=1)).abs().max().item()
    assert err <= 1e-6, f"compiled layer: max abs error {err:.3g}"
    gathered = cp.gather_sequence(got, dim=1)
    assert (gathered - want).abs().max().item() <= 1e-6


def _init(rank: int, W: int, store: str, timeout_s: float):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=W,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _worker(rank: int, W: int, tmp: str):
    _init(rank, W, os.path.join(tmp, "store"), PG_TIMEOUT_S)
    verdicts = {}
    jobs = [(c.id, lambda c=c: _run_case(c, rank, W)) for c in _cases(W)]
    jobs += [(n, lambda n=n: _run_error_case(n, rank, W)) for n in ERROR_CASES]
    if W == COMPILE_WORLD_SIZE:
        jobs.append(("module_compile", lambda: _module_compile_case(rank, W)))
    for name, job in jobs:
        try:
            t0 = time.perf_counter()
            job()
            verdicts[name] = "ok"
            if os.environ.get("ATTN_EXT_CP_TIMES"):
                print(f"rank {rank} {name}: {time.perf_counter() - t0:.2f} s", flush=True)
        except Exception:
            verdicts[name] = traceback.format_exc()
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(verdicts))
    dist.barrier()
    dist.destroy_process_group()


def _failure_worker(rank: int, W: int, tmp: str, scenario: str):
    """Rank 1 dies (scenario "dead_peer": at its first K/V transfer) or never calls
    (scenario "absent_peer"); rank 0 must raise within about the timeout."""
    _init(rank, W, os.path.join(tmp, "store"), FAILURE_TIMEOUT_S)
    x = torch.randn(1, 2, 8, 16, dtype=torch.float64)
    if rank == 1:
        if scenario == "dead_peer":
            cp._Ring.start = lambda *a, **kw: os._exit(0)
            cp.ring_attention(x, x, x, causal=True)
        else:
            time.sleep(FAILURE_TIMEOUT_S + 2)
        os._exit(0)
    t0 = time.monotonic()
    try:
        cp.ring_attention(x, x, x, causal=True)
        verdict = {"error": None}
    except RuntimeError as e:
        verdict = {"error": str(e)}
    verdict["seconds"] = time.monotonic() - t0
    Path(tmp, "rank0.json").write_text(json.dumps(verdict))
    os._exit(0)  # the group cannot be torn down with a peer gone


def _spawn(fn, W: int, tmp: Path, *args):
    ctx = mp.start_processes(fn, args=(W, str(tmp), *args), nprocs=W, join=False)
    deadline = time.monotonic() + GROUP_DEADLINE_S
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the {W}-rank gloo group did not finish within {GROUP_DEADLINE_S} s")


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"world{w}")
def group_verdicts(request, tmp_path_factory):
    W = request.param
    tmp = tmp_path_factory.mktemp(f"cp{W}")
    _spawn(_worker, W, tmp)
    return W, [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(W)]


def _verdict(group_verdicts, name):
    W, verdicts = group_verdicts
    failures = [f"rank {r}:\n{v[name]}" for r, v in enumerate(verdicts) if v[name] != "ok"]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("index", range(len(CASE_IDS[2])), ids=CASE_IDS[2])
def test_matches_single_process_attention(group_verdicts, index):
    W, _ = group_verdicts
    _verdict(group_verdicts, CASE_IDS[W][index])


@pytest.mark.parametrize("name", ERROR_CASES)
def test_bad_arguments_raise_on_every_rank(group_verdicts, name):
    _verdict(group_verdicts, name)


def test_module_under_torch_compile(group_verdicts):
    if group_verdicts[0] != COMPILE_WORLD_SIZE:
        pytest.skip(
            f"compiled once, in the {COMPILE_WORLD_SIZE}-rank group (tens of seconds per rank)"
        )
    _verdict(group_verdicts, "module_compile")


@pytest.mark.parametrize("scenario", ["dead_peer", "absent_peer"])
def test_failed_peer_raises_instead_of_hanging(tmp_path, scenario):
    _spawn(_failure_worker, 2, tmp_path, scenario)
    verdict = json.loads(Path(tmp_path, "rank0.json").read_text())
    assert verdict["error"] is not None, "ring_attention returned with its peer gone"
    assert "attn_ext.ring_attention" in verdict["error"], verdict["error"]
    assert "timeout" in verdict["error"], verdict["error"]
    assert verdict["seconds"] < FAILURE_TIMEOUT_S + 10, verdict


# ---------------------------------------------------------------- layouts and the block plan


@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_shard_unshard_roundtrip(layout, world_size):
    x = torch.arange(2 * 3 * 4 * world_size * 5).reshape(2, 3, 4 * world_size, 5)
    shards = [cp.shard_sequence(x, world_size, r, layout=layout) for r in range(world_size)]
    assert torch.equal(cp.unshard_sequence(shards, layout=layout), x)
    pos = torch.cat(
        [
            cp.sequence_positions(4 * world_size, world_size, r, layout=layout)
            for r in range(world_size)
        ]
    )
    assert torch.equal(torch.cat(shards, 2), x[:, :, pos])


def test_zigzag_shard_holds_chunks_r_and_2w_minus_1_minus_r():
    assert cp.sequence_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp.sequence_positions(8, 2, 1).tolist() == [2, 3, 4, 5]


def test_shard_rejects_indivisible_length():
    with pytest.raises(ValueError, match=r"must be a multiple of 4 \(zigzag layout over 2"):
        cp.shard_sequence(torch.zeros(1, 1, 6, 2), 2, 0)


PLAN_WINDOWS = [(-1, -1), (-1, 0), (3, 0), (0, 0), (5, 2), (2, 5), (-1, 3), (1, -1), (40, 0)]


@pytest.mark.parametrize("window", PLAN_WINDOWS, ids=str)
@pytest.mark.parametrize(
    "world_size,layout,local_len",
    [
        (1, "zigzag", 8),
        (2, "zigzag", 8),
        (4, "zigzag", 6),
        (3, "contiguous", 5),
        (4, "contiguous", 8),
    ],
)
def test_plan_covers_the_global_mask_once(world_size, layout, local_len, window):
    """The calls of every rank's plan, at global positions, see exactly the keys the global
    window sees, each (query, key) pair once."""
    W, S = world_size, world_size * local_len
    pos = [cp.sequence_positions(S, W, r, layout=layout) for r in range(W)]
    seen = torch.zeros(S, S, dtype=torch.int64)
    steps = {cp._plan(W, r, local_len, layout, window)[1] for r in range(W)}
    assert len(steps) == 1, "ranks disagree on the number of ring steps"
    for r in range(W):
        for t, calls in enumerate(cp._plan(W, r, local_len, layout, window)[0]):
            src = (r - t) % W
            for c in calls:
                qp, kp = pos[r][c.q0 : c.q1], pos[src][c.k0 : c.k1]
                if c.key_offset is None:
                    keep = torch.ones(len(qp), len(kp), dtype=torch.bool)
                else:
                    keep = window_keep(len(qp), len(kp), c.window, key_offset=c.key_offset)
                seen[
                    qp.unsqueeze(1).expand_as(keep)[keep], kp.unsqueeze(0).expand_as(keep)[keep]
                ] += 1
    truth = window_keep(S, S, window)
    assert torch.equal(seen, truth.long())


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_zigzag_causal_balances_work_and_skips_unseen_blocks(world_size):
    """Every rank computes the same number of (query, key) products: (2L)^2 / 2 for its own
    block (causal, one call) and L * 2L for each other block (one unmasked call)."""
    L = 8
    for r in range(world_size):
        plans, steps = cp._plan(world_size, r, 2 * L, "zigzag", (-1, 0))
        assert steps == world_size
        assert [len(p) for p in plans] == [1] * world_size
        assert plans[0][0].key_offset == 0 and plans[0][0].window == (-1, 0)
        for calls in plans[1:]:
            c = calls[0]
            assert c.key_offset is None and (c.q1 - c.q0) * (c.k1 - c.k0) == 2 * L * L


def test_contiguous_window_runs_only_the_steps_it_needs():
    plans, steps = cp._plan(8, 5, 16, "contiguous", (10, 0))
    assert steps == 2 and len(plans) == 2


# --------------------------------------------------------------------- merge_attention_states


def _merge_reference(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a.double(), lse_b.double())
    wa = torch.where(lse_a == -torch.inf, 0.0, torch.exp(lse_a.double() - lse))
    wb = torch.where(lse_b == -torch.inf, 0.0, torch.exp(lse_b.double() - lse))
    out = wa.unsqueeze(-1) * out_a.double() + wb.unsqueeze(-1) * out_b.double()
    return out, lse


def _states(shape, dtype, lse_dtype=torch.float32, empty_rows=True, layout="contiguous"):
    out_a, out_b = torch.randn(*shape, dtype=dtype), torch.randn(*shape, dtype=dtype)
    if layout == "strided":  # (B, S, H, D).transpose(1, 2), as a view
        out_a = torch.randn(shape[0], shape[2], shape[1], shape[3], dtype=dtype).transpose(1, 2)
    lse_a = torch.randn(*shape[:-1], dtype=lse_dtype) * 3
    lse_b = torch.randn(*shape[:-1], dtype=lse_dtype) * 3
    if empty_rows:
        flat_a, flat_b = lse_a.view(-1), lse_b.view(-1)
        flat_a[0] = -torch.inf  # a empty
        flat_b[1] = -torch.inf  # b empty
        flat_a[2] = flat_b[2] = -torch.inf  # both empty
    return out_a, lse_a, out_b, lse_b


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_merge_matches_reference(dtype, layout):
    out_a, lse_a, out_b, lse_b = _states((2, 3, 5, 8), dtype, layout=layout)
    out, lse = attn_ext.merge_attention_states(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = _merge_reference(out_a, lse_a, out_b, lse_b)
    assert out.dtype == dtype and lse.dtype == torch.float32
    # fp32 weights, one rounding to the output dtype
    tol = {torch.float64: 1e-6, torch.float32: 1e-6}.get(dtype, 2 * torch.finfo(dtype).eps)
    torch.testing.assert_close(out.double(), ref_out, atol=tol * 4, rtol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-6, rtol=1e-6)
    assert torch.equal(out[0, 0, 2], torch.zeros(8, dtype=dtype)) and lse[0, 0, 2] == -torch.inf


def test_merge_float64_lse_is_exact():
    out_a, lse_a, out_b, lse_b = _states((3, 4, 6), torch.float64, torch.float64)
    out, lse = attn_ext.merge_attention_states(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = _merge_reference(out_a, lse_a, out_b, lse_b)
    assert lse.dtype == torch.float64
    torch.testing.assert_close(out, ref_out, atol=1e-14, rtol=1e-14)
    torch.testing.assert_close(lse, ref_lse, atol=1e-14, rtol=1e-14)


def test_merge_ignores_the_out_of_an_empty_state():
    out_a, lse_a, out_b, lse_b = _states((4, 8), torch.float32, empty_rows=False)
    out_a[1] = torch.nan
    lse_a[1] = -torch.inf
    out, lse = attn_ext.merge_attention_states(out_a, lse_a, out_b, lse_b)
    assert torch.equal(out[1], out_b[1]) and lse[1] == lse_b[1]
    lse_a[2] = torch.nan  # a NaN lse is propagated, not hidden
    out, lse = attn_ext.merge_attention_states(out_a, lse_a, out_b, lse_b)
    assert out[2].isnan().all() and lse[2].isnan()


def test_merge_of_two_halves_is_attention_over_all_keys():
    q, k, v = (torch.randn(2, 4, 16, 8, dtype=torch.float64) for _ in range(3))
    o1, l1 = attn_ext.attention(q, k[:, :, :9], v[:, :, :9], return_lse=True)
    o2, l2 = attn_ext.attention(q, k[:, :, 9:], v[:, :, 9:], return_lse=True)
    out, lse = attn_ext.merge_attention_states(o1, l1, o2, l2)
    ref, ref_lse = attn_ext.attention(q, k, v, return_lse=True)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)  # float32 lse weights
    torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_merge_inplace_accumulates_in_float32(dtype):
    parts = [_states((2, 3, 4, 8), dtype, empty_rows=False) for _ in range(6)]
    acc = torch.empty(2, 3, 4, 8, dtype=torch.float32 if dtype != torch.float64 else dtype)
    acc_lse = torch.full((2, 3, 4), -torch.inf)
    ref_out, ref_lse = None, None
    for out_b, lse_b, _, _ in parts:
        attn_ext.merge_attention_states_(acc, acc_lse, out_b, lse_b)
        if ref_out is None:
            ref_out, ref_lse = out_b.double(), lse_b.double()
        else:
            ref_out, ref_lse = _merge_reference(ref_out, ref_lse, out_b, lse_b)
    # the accumulator holds fp32: no rounding to dtype between the merges
    torch.testing.assert_close(acc.double(), ref_out, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(acc_lse.double(), ref_lse, atol=2e-6, rtol=2e-6)


def test_merge_inplace_into_a_strided_view():
    acc = torch.zeros(2, 3, 10, 8)
    acc_lse = torch.full((2, 3, 10), -torch.inf)
    out_b, lse_b, _, _ = _states((2, 3, 4, 8), torch.float32, empty_rows=False)
    attn_ext.merge_attention_states_(acc[:, :, 3:7], acc_lse[:, :, 3:7], out_b, lse_b)
    assert torch.equal(acc[:, :, 3:7], out_b) and torch.equal(acc_lse[:, :, 3:7], lse_b)
    assert (acc[:, :, :3] == 0).all() and (acc_lse[:, :, 7:] == -torch.inf).all()


@pytest.mark.parametrize(
    "args,match",
    [
        (lambda a, la, b, lb: (a, la, b.float(), lb), "out_b must have dtype"),
        (lambda a, la, b, lb: (a, la, b, lb[..., :3]), "lse_b must have shape"),
        (lambda a, la, b, lb: (a, la.half(), b, lb), "lse_a must have dtype"),
        (lambda a, la, b, lb: (a, la, b[..., :4], lb), "out_b must have shape"),
        (lambda a, la, b, lb: (a.int(), la, b, lb), "out_a must be float32, float64"),
        (lambda a, la, b, lb: (a, la.double(), b, lb.double()), r"lse_b must be float32 \(or"),
    ],
)
def test_merge_rejects_bad_arguments(args, match):
    states = _states((2, 4, 8), torch.bfloat16)
    with pytest.raises(RuntimeError, match=match):
        attn_ext.merge_attention_states(*args(*states))


def test_merge_inplace_rejects_a_low_precision_accumulator_for_float32():
    out_b, lse_b, _, _ = _states((2, 4, 8), torch.float32)
    with pytest.raises(RuntimeError, match="out must have out_other's dtype Float, got BFloat16"):
        attn_ext.merge_attention_states_(
            torch.zeros(2, 4, 8, dtype=torch.bfloat16), lse_b.clone(), out_b, lse_b
        )


def _merge_samples():
    s = []
    for dtype, layout, grad in [
        (torch.float32, "contiguous", False),
        (torch.float32, "strided", True),
        (torch.bfloat16, "contiguous", True),
        (torch.float64, "contiguous", True),
    ]:
        states = _states((2, 3, 5, 8), dtype, layout=layout)
        s.append(tuple(t.requires_grad_(grad) for t in states))
    return s


@pytest.mark.parametrize("index", range(4))
def test_opcheck_merge_attention_states(index):
    args = _merge_samples()[index]
    torch.library.opcheck(ops.merge_attention_states.default, args)
    out_a, lse_a, out_b, lse_b = (t.detach() for t in args)
    g, gl = torch.randn_like(out_a), torch.randn_like(lse_a)
    torch.library.opcheck(
        ops.merge_attention_states_backward.default, (g, gl, out_a, lse_a, out_b, lse_b)
    )
    torch.library.opcheck(
        ops.merge_attention_states_backward.default, (g, None, out_a, lse_a, out_b, lse_b)
    )
    acc = torch.zeros(
        out_a.shape, dtype=torch.float32 if out_a.dtype != torch.float64 else out_a.dtype
    )
    torch.library.opcheck(ops.merge_attention_states_.default, (acc, lse_a.clone(), out_b, lse_b))


@pytest.mark.parametrize("empty_rows", [False, True])
def test_gradcheck_merge(empty_rows):
    states = _states((2, 3, 4), torch.float64, torch.float64, empty_rows=empty_rows)
    states = [t.requires_grad_() for t in states]

    def fn(*s):
        out, lse = attn_ext.merge_attention_states(*s)
        # -inf lse rows would make finite differences meaningless: mask them out of lse
        return out, torch.where(torch.isfinite(lse), lse, 0.0)

    assert torch.autograd.gradcheck(fn, states)


def test_merge_compiles_without_graph_break_or_recompile():
    torch._dynamo.reset()
    counts = torch._dynamo.testing.CompileCounter()
    fn = torch.compile(
        attn_ext.merge_attention_states, backend=counts, fullgraph=True, dynamic=True
    )
    for S in (5, 9, 17):
        states = _states((2, 3, S, 8), torch.float32)
        out, lse = fn(*states)
        ref_out, ref_lse = attn_ext.merge_attention_states(*states)
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert counts.frame_count == 1
