"""Context parallelism: attention over a sequence split across the ranks of a process group.

Each rank holds one shard of the sequence (all ranks equal shards) of q, k and v, laid out
``(B, H, L, D)`` with ``L = S / world_size`` local tokens, and gets the attention of its
queries over the *whole* sequence, as ``attn_ext.attention(q_full, k_full, v_full, ...)``
would compute it (``causal`` / ``window_size`` relative to global positions; ``Sq == Sk``, so
bottom-right and top-left alignment coincide). Communication goes through ``torch.distributed``
(NCCL on GPUs, gloo on CPUs), never a transport of our own.

* :func:`ring_attention` -- K/V blocks travel around the ring of ranks (Liu et al. 2023) with
  ``batch_isend_irecv``, the transfer of block i+1 overlapping the attention on block i (on
  CUDA the transfer is issued from a side stream); the partial results are merged by their
  log-sum-exps with :func:`attn_ext.merge_attention_states_` into fp32 accumulators. The
  backward passes K/V around again, with the dK/dV accumulators travelling alongside. With
  ``layout="zigzag"`` (Megatron-LM's context parallel) rank r holds chunks r and 2W-1-r of
  the 2W equal chunks of the sequence, so every rank does the same causal work; blocks of
  (query chunk, key chunk) that a rank never sees are skipped, and ring steps that no rank
  needs (a sliding window shorter than the sequence, contiguous layout) are not run.
  GQA keeps the Hkv heads on the wire.
* :func:`ulysses_attention` -- DeepSpeed-Ulysses: an all-to-all turns sequence shards into
  head shards, each rank attends over the whole sequence for H / W heads, and a second
  all-to-all turns the result back. Needs H % W == 0 (and Hkv % W == 0, or W % Hkv == 0: the
  K/V heads are then repeated to W heads).
* :func:`shard_sequence` / :func:`unshard_sequence` / :func:`gather_sequence` /
  :func:`sequence_positions` -- the layouts (e.g. the global positions to give RoPE).

Which to pick: Ulysses moves ``4 * S * H * D / W`` elements per rank per layer (q, k, v, out:
constant in W when S grows with W) in two all-to-alls that do not overlap compute, and needs H
divisible by W; ring moves K/V ``(W - 1) * 2 * S * Hkv * D / W`` elements per rank, almost all of
it hidden behind attention while a block's attention takes longer than its transfer (large
shards, GQA), and has no head limit. ``benchmarks/bench_context_parallel.py`` models both
for a given machine; README's "Context parallelism" section gives the rule of thumb.

Precision: the forward merges partial results by their float32 lse (the operator's lse is
float32 by design), so a float64 run agrees with single-process float64 attention to the
float32 rounding of lse (about 1e-7 relative), not to float64 rounding. bfloat16 / float16
partial outputs are rounded once each before the fp32 merge, and dq / dk / dv partials once
each before fp32 accumulation.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ._ops import ops as _ops
from .functional import _as_4d, _window

__all__ = [
    "LAYOUTS",
    "gather_sequence",
    "ring_attention",
    "sequence_positions",
    "shard_sequence",
    "ulysses_attention",
    "unshard_sequence",
]

LAYOUTS = ("zigzag", "contiguous")
# Chunks per rank of each layout: zigzag holds chunk r and chunk 2W-1-r.
_CHUNKS_PER_RANK = {"zigzag": 2, "contiguous": 1}
# Integer codes of the layouts in the argument check every rank exchanges.
_LAYOUT_CODE = {name: i for i, name in enumerate(LAYOUTS)}
# Message tags of the ring's two kinds of transfer.
_TAG_KV, _TAG_DKV = 1, 2


# --------------------------------------------------------------------------------- layouts


def _check_layout(op: str, layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"{op}: layout must be one of {LAYOUTS}, got {layout!r}")


def _chunk_order(world_size: int, layout: str) -> List[int]:
    """Global chunk index of each local chunk, ranks in order: rank r owns entries
    [r * n, (r + 1) * n) with n chunks per rank."""
    if layout == "contiguous":
        return list(range(world_size))
    return [c for r in range(world_size) for c in (r, 2 * world_size - 1 - r)]


def shard_sequence(
    x: torch.Tensor, world_size: int, rank: int, *, layout: str = "zigzag", dim: int = 2
) -> torch.Tensor:
    """Rank ``rank``'s shard of the full sequence ``x`` along ``dim``: the contiguous range
    ``[rank * S / W, (rank + 1) * S / W)``, or with ``layout="zigzag"`` chunks ``rank`` and
    ``2W - 1 - rank`` of the 2W equal chunks (concatenated, the earlier first). S must divide
    into W (contiguous) or 2W (zigzag) equal parts."""
    op = "attn_ext.distributed.shard_sequence"
    _check_layout(op, layout)
    if not 0 <= rank < world_size:
        raise ValueError(f"{op}: rank must be in [0, {world_size}), got {rank}")
    chunks = world_size * _CHUNKS_PER_RANK[layout]
    S = x.size(dim)
    if S % chunks != 0:
        raise ValueError(
            f"{op}: the sequence length (x.size({dim}) = {S}) must be a multiple of "
            f"{chunks} ({layout} layout over {world_size} ranks)"
        )
    parts = x.chunk(chunks, dim)
    n = _CHUNKS_PER_RANK[layout]
    mine = _chunk_order(world_size, layout)[rank * n : (rank + 1) * n]
    return torch.cat([parts[c] for c in mine], dim)


def unshard_sequence(
    shards: Sequence[torch.Tensor], *, layout: str = "zigzag", dim: int = 2
) -> torch.Tensor:
    """The full sequence from every rank's shard (``shards[r]`` = rank r's), the inverse of
    :func:`shard_sequence`."""
    op = "attn_ext.distributed.unshard_sequence"
    _check_layout(op, layout)
    W, n = len(shards), _CHUNKS_PER_RANK[layout]
    pieces = [p for s in shards for p in s.chunk(n, dim)]
    order = _chunk_order(W, layout)
    natural = [None] * len(order)
    for local, chunk in enumerate(order):
        natural[chunk] = pieces[local]
    return torch.cat(natural, dim)


def gather_sequence(
    x: torch.Tensor, *, group=None, layout: str = "zigzag", dim: int = 2
) -> torch.Tensor:
    """All-gathers the local shards ``x`` of every rank into the full sequence (not
    differentiable; for evaluation and checks)."""
    W = dist.get_world_size(group)
    shards = [torch.empty_like(x) for _ in range(W)]
    dist.all_gather(shards, x.contiguous(), group=group)
    return unshard_sequence(shards, layout=layout, dim=dim)


def sequence_positions(
    seq_len: int, world_size: int, rank: int, *, layout: str = "zigzag", device=None
) -> torch.Tensor:
    """Global positions (int64) of rank ``rank``'s local tokens of a ``seq_len``-token
    sequence, e.g. the ``positions`` to give :func:`attn_ext.rope`."""
    return shard_sequence(
        torch.arange(seq_len, device=device), world_size, rank, layout=layout, dim=0
    )


# ------------------------------------------------------------------------ the block planner


@dataclasses.dataclass(frozen=True)
class _Segment:
    """A run of consecutive global positions held at local rows [local, local + length)."""

    start: int
    local: int
    length: int


@dataclasses.dataclass(frozen=True)
class _Call:
    """One attention call of a ring step: local query rows [q0, q1) against the block's key
    rows [k0, k1); key_offset None and window (-1, -1) for an unmasked call."""

    q0: int
    q1: int
    k0: int
    k1: int
    key_offset: Optional[int]
    window: Tuple[int, int]


_EMPTY, _FULL, _PARTIAL = range(3)


def _segments(world_size: int, rank: int, local_len: int, layout: str) -> List[_Segment]:
    n = _CHUNKS_PER_RANK[layout]
    c = local_len // n
    mine = _chunk_order(world_size, layout)[rank * n : (rank + 1) * n]
    return [_Segment(chunk * c, i * c, c) for i, chunk in enumerate(mine)]


def _relation(off: int, lq: int, lk: int, left: int, right: int) -> int:
    """Whether query rows [0, lq) aligned at key i + off see none, all or some of keys
    [0, lk) under the window (left, right), -1 unbounded. Every row's window holds at least
    one position (left, right >= 0 when bounded), so the keys seen by the rows form one run."""
    first = off - left if left >= 0 else None  # first key row 0 may see
    last = lq - 1 + off + right if right >= 0 else None  # last key the last row may see
    if (last is not None and last < 0) or (first is not None and first > lk - 1):
        return _EMPTY
    full_left = left < 0 or lq - 1 + off - left <= 0  # the last row still sees key 0
    full_right = right < 0 or off + right >= lk - 1  # row 0 already sees the last key
    return _FULL if full_left and full_right else _PARTIAL


def _consistent_offset(qs, ks, rel, window):
    """A key_offset under which one call over the query segments qs and key segments ks (each
    a run of adjacent local rows) reproduces every pair's global relation, or None for an
    unmasked call; raises LookupError when no single call does."""
    q_base, k_base = qs[0].local, ks[0].local
    if all(rel[(q, k)] == _FULL for q in qs for k in ks):
        return None
    left, right = window
    for q in qs:
        for k in ks:
            if rel[(q, k)] != _PARTIAL:
                continue
            cand = (q.start - k.start) - ((q.local - q_base) - (k.local - k_base))
            if all(
                _relation(
                    (a.local - q_base) - (b.local - k_base) + cand, a.length, b.length, left, right
                )
                == rel[(a, b)]
                and (
                    rel[(a, b)] != _PARTIAL
                    or (a.local - q_base) - (b.local - k_base) + cand == a.start - b.start
                )
                for a in qs
                for b in ks
            ):
                return cand
    raise LookupError


def _plan_step(q_segs, k_segs, window) -> List[_Call]:
    """The calls that cover every (query segment, key segment) pair a rank sees in one block:
    one call when a single mask reproduces all pairs (zigzag causal always: own block causal,
    earlier blocks unmasked), else one per query segment, else one per pair."""
    left, right = window
    rel = {
        (q, k): _relation(q.start - k.start, q.length, k.length, left, right)
        for q in q_segs
        for k in k_segs
    }

    def call(qs, ks):
        off = _consistent_offset(qs, ks, rel, window)
        q0, q1 = qs[0].local, qs[-1].local + qs[-1].length
        k0, k1 = ks[0].local, ks[-1].local + ks[-1].length
        return _Call(q0, q1, k0, k1, off, window if off is not None else (-1, -1))

    def seen(qs, ks):
        # Segments in at least one nonempty pair; adjacent in local rows for <= 2 segments.
        qs = [q for q in qs if any(rel[(q, k)] != _EMPTY for k in ks)]
        ks = [k for k in ks if any(rel[(q, k)] != _EMPTY for q in qs)]
        return qs, ks

    qs, ks = seen(q_segs, k_segs)
    if not qs:
        return []
    try:
        return [call(qs, ks)]
    except LookupError:
        pass
    calls = []
    for q in qs:
        _, kq = seen([q], k_segs)
        try:
            calls.append(call([q], kq))
        except LookupError:
            calls.extend(call([q], [k]) for k in kq)
    return calls


def _plan(world_size, rank, local_len, layout, window):
    """Per ring step t (this rank holding the block of rank (rank - t) mod W) the calls to
    make, and the number of steps every rank needs (steps beyond the last block any rank sees
    are not run)."""
    q_segs = _segments(world_size, rank, local_len, layout)
    plans = []
    for t in range(world_size):
        src = (rank - t) % world_size
        plans.append(_plan_step(q_segs, _segments(world_size, src, local_len, layout), window))

    def needed(r):
        qs = _segments(world_size, r, local_len, layout)
        return [
            t
            for t in range(world_size)
            if _plan_step(
                qs, _segments(world_size, (r - t) % world_size, local_len, layout), window
            )
        ]

    steps = 1 + max(max(needed(r), default=0) for r in range(world_size))
    return plans[:steps], steps


# ------------------------------------------------------------------------ communication


class _Ring:
    """The ring neighbours of this rank in `group` and the exchange of tensors with them."""

    def __init__(self, group, op: str):
        self.group = group
        self.op = op
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.stream = None

    def global_rank(self, group_rank: int) -> int:
        if self.group is None or self.group is dist.group.WORLD:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def start(self, send: Sequence[torch.Tensor], to: int, recv_like, frm: int, tag: int):
        """Sends ``send`` to group rank ``to`` and receives tensors shaped like ``recv_like``
        from ``frm`` (messages of one kind share a ``tag``, so that K/V blocks and dK/dV
        accumulators in flight together never match each other's receives); returns
        (requests, received buffers). On CUDA the transfers are issued
        from a side stream that first waits for the producer of ``send``."""
        recv = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in recv_like]
        to, frm = self.global_rank(to), self.global_rank(frm)
        ops = [dist.P2POp(dist.isend, t.contiguous(), to, self.group, tag) for t in send]
        ops += [dist.P2POp(dist.irecv, t, frm, self.group, tag) for t in recv]
        device = send[0].device
        ctx = contextlib.nullcontext()
        if device.type == "cuda":
            if self.stream is None:
                self.stream = torch.cuda.Stream(device)
            self.stream.wait_stream(torch.cuda.current_stream(device))
            ctx = torch.cuda.stream(self.stream)
        with ctx:
            reqs = dist.batch_isend_irecv(ops)
        return reqs, recv

    def wait(self, reqs, what: str, step: int) -> None:
        try:
            for r in reqs:
                r.wait()
        except RuntimeError as e:
            raise RuntimeError(
                f"{self.op}: exchanging {what} at ring step {step} failed on rank {self.rank} of "
                f"{self.size} (a peer exited or did not answer within the process group's "
                f"timeout): {e}"
            ) from e


def _local_error(op, q, k, v, layout, window) -> Optional[str]:
    """What is wrong with this rank's own arguments, or None."""
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype or t.device != q.device:
            return (
                f"{op}: {name} must have q's dtype and device ({q.dtype}, {q.device}), got "
                f"{t.dtype}, {t.device}"
            )
    if k.size(2) != q.size(2) or v.size(2) != q.size(2):
        return (
            f"{op}: q, k and v must be shards of one sequence (same local length), got "
            f"q {q.size(2)}, k {k.size(2)}, v {v.size(2)}"
        )
    n = _CHUNKS_PER_RANK[layout]
    if q.size(2) % n != 0:
        return (
            f"{op}: the {layout} layout holds {n} equal chunks per rank, so the local length "
            f"must be a multiple of {n}; got q.size(2) = {q.size(2)}"
        )
    if window[0] < -1 or window[1] < -1:
        return f"{op}: window_size entries must be >= -1, got {window}"
    return None


def _check_inputs(op, q, k, v, layout, window, causal, group):
    """Validates the arguments on every rank at once: one all-gather of each rank's shapes,
    flags and verdict on its own arguments, so that a rank whose inputs are wrong makes every
    rank raise (rather than leaving the others blocked in the first transfer)."""
    _check_layout(op, layout)
    error = _local_error(op, q, k, v, layout, window)
    names = (
        "batch",
        "heads",
        "kv heads",
        "local sequence length (size(2))",
        "head dim",
        "value head dim",
        "causal",
        "window left",
        "window right",
        "layout",
    )
    B, H, L, D = q.shape
    values = (
        int(error is not None),
        B,
        H,
        k.size(1),
        L,
        D,
        v.size(3),
        int(causal),
        *window,
        _LAYOUT_CODE[layout],
    )
    device = "cpu"
    if dist.get_backend(group) == dist.Backend.NCCL:
        device = torch.device("cuda", torch.cuda.current_device())
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    try:
        dist.all_gather(every, mine, group=group)
    except RuntimeError as e:
        raise RuntimeError(
            f"{op}: the argument check (an all-gather over the group) failed on rank "
            f"{dist.get_rank(group)} (a peer exited or did not answer within the process "
            f"group's timeout): {e}"
        ) from e
    table = torch.stack(every).cpu().tolist()
    if error is not None:
        raise ValueError(error)
    rejected = [r for r, row in enumerate(table) if row[0]]
    if rejected:
        raise ValueError(f"{op}: rank(s) {rejected} rejected their arguments (see their errors)")
    for i, name in enumerate(names, start=1):
        col = [row[i] for row in table]
        if any(c != col[0] for c in col):
            raise ValueError(
                f"{op}: every rank must hold an equal shard with the same arguments; {name} by "
                f"rank: {col}"
            )


# ---------------------------------------------------------------------------- ring attention


def _slices(c: _Call):
    return slice(c.q0, c.q1), slice(c.k0, c.k1)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    # bfloat16 / float16 partial results are summed in float32.
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale, window, layout):
        ring = _Ring(group, "attn_ext.ring_attention")
        plans, steps = _plan(ring.size, ring.rank, q.size(2), layout, window)
        B, H, L, _ = q.shape
        out_acc = q.new_zeros((B, H, L, v.size(3)), dtype=_acc_dtype(q.dtype))
        lse = q.new_full((B, H, L), float("-inf"), dtype=torch.float32)
        # float64 only: each call's own lse (see _RingAttention.backward).
        call_lse = [] if q.dtype == torch.float64 else None
        nxt, prv = (ring.rank + 1) % ring.size, (ring.rank - 1) % ring.size
        kv = (k, v)
        for t in range(steps):
            reqs = None
            if t + 1 < steps:
                reqs, recv = ring.start(kv, nxt, kv, prv, _TAG_KV)
            for c in plans[t]:
                qs, ks = _slices(c)
                o, l_c = _ops.attention(
                    q[:, :, qs],
                    kv[0][:, :, ks],
                    kv[1][:, :, ks],
                    scale=scale,
                    window_left=c.window[0],
                    window_right=c.window[1],
                    key_offset=c.key_offset,
                )
                _ops.merge_attention_states_(out_acc[:, :, qs], lse[:, :, qs], o, l_c)
                if call_lse is not None:
                    call_lse.append(l_c)
            if reqs is not None:
                ring.wait(reqs, "the K/V block", t)
                kv = tuple(recv)
        out = out_acc.to(q.dtype)
        ctx.group, ctx.scale, ctx.window, ctx.layout = group, scale, window, layout
        ctx.save_for_backward(q, k, v, out, lse, *(call_lse or ()))
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, *call_lse = ctx.saved_tensors
        ring = _Ring(ctx.group, "attn_ext.ring_attention (backward)")
        plans, steps = _plan(ring.size, ring.rank, q.size(2), ctx.layout, ctx.window)
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        acc = _acc_dtype(q.dtype)
        dq = torch.zeros_like(q, dtype=acc)
        nxt, prv = (ring.rank + 1) % ring.size, (ring.rank - 1) % ring.size
        kv = (k, v)
        dkv = None  # this step's block's dK/dV accumulators (fp32 for bf16 / fp16)
        dkv_reqs, dkv_recv = None, None  # the accumulators arriving for the next block
        n_call = 0
        for t in range(steps):
            kv_reqs = None
            if t + 1 < steps:
                kv_reqs, kv_recv = ring.start(kv, nxt, kv, prv, _TAG_KV)
            part = (torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc))
            for c in plans[t]:
                qs, ks = _slices(c)
                g, gl, l_c = grad_out[:, :, qs], None, lse[:, :, qs]
                if grad_lse is not None:
                    gl = grad_lse[:, :, qs]
                if call_lse:
                    # The float64 backward kernels recompute each row's lse in float64 from the
                    # keys they are given (this call's keys only), so they are handed this
                    # call's share of the global softmax instead: the gradients scaled by
                    # w = exp(lse_call - lse), which makes P_call * w the global probability.
                    l_c = call_lse[n_call]
                    w = torch.exp(l_c.double() - lse[:, :, qs].double())
                    w = torch.where(torch.isfinite(l_c), w, torch.zeros_like(w))
                    g = g * w.unsqueeze(-1)
                    gl = (gl * w).float() if gl is not None else None
                n_call += 1
                gq, gk, gv, _ = _ops.attention_backward(
                    g,
                    q[:, :, qs],
                    kv[0][:, :, ks],
                    kv[1][:, :, ks],
                    out[:, :, qs],
                    l_c,
                    grad_lse=gl,
                    scale=ctx.scale,
                    window_left=c.window[0],
                    window_right=c.window[1],
                    key_offset=c.key_offset,
                )
                dq[:, :, qs] += gq
                part[0][:, :, ks] += gk
                part[1][:, :, ks] += gv
            if t > 0:
                ring.wait(dkv_reqs, "the dK/dV accumulators", t)
                part = (part[0] + dkv_recv[0], part[1] + dkv_recv[1])
            dkv = part
            if t + 1 < steps:
                # The accumulators of this block travel on with it; the next block's arrive.
                dkv_reqs, dkv_recv = ring.start(dkv, nxt, dkv, prv, _TAG_DKV)
                ring.wait(kv_reqs, "the K/V block", t)
                kv = tuple(kv_recv)
        if steps > 1:
            # After `steps` steps this rank holds the accumulators of the block of rank
            # rank - (steps - 1): send them home and receive this rank's own.
            home = (ring.rank - (steps - 1)) % ring.size
            mine = (ring.rank + (steps - 1)) % ring.size
            reqs, dkv = ring.start(dkv, home, dkv, mine, _TAG_DKV)
            ring.wait(reqs, "the final dK/dV", steps)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def _prepare(op, q, k, v, causal, window_size, scale, layout, group):
    three_d = q.dim() == 3
    q, k, v = _as_4d("q", q), _as_4d("k", k), _as_4d("v", v)
    left, right = _window(window_size)
    if causal:
        right = 0
    _check_inputs(op, q, k, v, layout, (left, right), causal, group)
    scale = q.size(-1) ** -0.5 if scale is None else float(scale)
    return q, k, v, (left, right), scale, three_d


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    causal: bool = False,
    window_size=(-1, -1),
    scale: Optional[float] = None,
    layout: str = "zigzag",
    return_lse: bool = False,
):
    """Attention of this rank's queries over the whole sequence, K/V passed around the ring.

    q (B, H, L, D), k (B, Hkv, L, D), v (B, Hkv, L, Dv) (or 3-D (B, L, D)): this rank's shard
    of the sequence in ``layout`` (see :func:`shard_sequence`), every rank of ``group`` (the
    default group if None) with the same shapes and arguments (checked with one small
    all-gather; uneven shards raise ValueError). Returns this rank's rows of
    ``attn_ext.attention(q_full, k_full, v_full, causal=causal, window_size=window_size)``
    (and their lse, float32 (B, H, L), with ``return_lse``), differentiable in q, k, v (and
    through lse). A failed or timed-out transfer raises RuntimeError naming the step.
    """
    op = "attn_ext.ring_attention"
    q, k, v, window, scale, three_d = _prepare(
        op, q, k, v, causal, window_size, scale, layout, group
    )
    out, lse = _RingAttention.apply(q, k, v, group, scale, window, layout)
    if three_d:
        out, lse = out.squeeze(1), lse.squeeze(1)
    return (out, lse) if return_lse else out


# ------------------------------------------------------------------------- Ulysses attention


def _all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Splits x into W parts along scatter_dim, sends part j to rank j, and concatenates the
    parts received (rank order) along gather_dim."""
    W = dist.get_world_size(group)
    send = torch.stack(x.chunk(W, scatter_dim)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), gather_dim)


class _AllToAll(torch.autograd.Function):
    """The all-to-all and, as its backward, the one that undoes it."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None


def _natural_order(x: torch.Tensor, W: int, layout: str, dim: int, inverse: bool = False):
    """Reorders the rank-order concatenation of the shards along dim into the natural
    sequence (or back, with inverse)."""
    if layout == "contiguous":
        return x
    order = _chunk_order(W, layout)
    index = [order.index(c) for c in range(len(order))] if not inverse else order
    parts = x.chunk(len(order), dim)
    return torch.cat([parts[i] for i in index], dim)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    causal: bool = False,
    window_size=(-1, -1),
    scale: Optional[float] = None,
    layout: str = "contiguous",
    return_lse: bool = False,
):
    """:func:`ring_attention`'s result computed the DeepSpeed-Ulysses way: an all-to-all gives
    each rank the whole sequence for H / W of the heads, :func:`attn_ext.attention` runs
    locally, and a second all-to-all returns each rank its shard for every head. Needs
    H % W == 0, and Hkv % W == 0 or W % Hkv == 0 (the K/V heads are then repeated to W
    heads, each rank receiving the one its query heads read). Differentiable (the backward is
    the reverse all-to-all around the attention backward)."""
    op = "attn_ext.ulysses_attention"
    q, k, v, window, scale, three_d = _prepare(
        op, q, k, v, causal, window_size, scale, layout, group
    )
    W = dist.get_world_size(group)
    H, Hkv = q.size(1), k.size(1)
    if H % W != 0:
        raise ValueError(
            f"{op}: the query heads must divide among the {W} ranks (H % W == 0), got H = {H}; "
            "use ring_attention"
        )
    if Hkv % W != 0:
        if W % Hkv != 0:
            raise ValueError(
                f"{op}: the key/value heads must divide among the ranks or the ranks among "
                f"them (Hkv % W == 0 or W % Hkv == 0), got Hkv = {Hkv}, W = {W}; "
                "use ring_attention"
            )
        k = k.repeat_interleave(W // Hkv, dim=1)
        v = v.repeat_interleave(W // Hkv, dim=1)

    def to_heads(x):
        return _natural_order(_AllToAll.apply(x, group, 1, 2), W, layout, 2)

    out, lse = _ops.attention(
        to_heads(q),
        to_heads(k),
        to_heads(v),
        scale=scale,
        window_left=window[0],
        window_right=window[1],
    )
    out = _AllToAll.apply(_natural_order(out, W, layout, 2, inverse=True), group, 2, 1)
    lse = _AllToAll.apply(
        _natural_order(lse.unsqueeze(-1), W, layout, 2, inverse=True), group, 2, 1
    ).squeeze(-1)
    if three_d:
        out, lse = out.squeeze(1), lse.squeeze(1)
    return (out, lse) if return_lse else out
