#!/usr/bin/env python
"""Generation-loop benchmark: attention of one new token per step against a growing KV cache.

Three candidates run in one process on the same inputs (B sequences, H query heads, Hkv KV
heads, head dim D), each step taking the new token's q, k, v (k already rotated: RoPE costs the
same everywhere):

* ``attn_ext`` -- :class:`attn_ext.KVCache` (preallocated) + ``kv_cache_append`` +
  ``decode_attention`` (GQA heads share each cache read; split-KV when B * Hkv is small);
* ``paged16`` / ``paged256`` -- the same through :class:`attn_ext.PagedKVCache` with pages of
  16 / 256 rows (pages taken from the free list as the sequences grow; the block table read by
  both ops), to compare with the contiguous cache (issue 21's CPU target: within 10%);
* ``mma`` / ``mma_paged16`` -- the ``attn_ext`` / ``paged16`` candidates with
  ``ATTN_EXT_UNVERIFIED_CUDA=1`` set during their calls (CUDA only), so that the tensor-core
  decode kernel (csrc/decoding/cuda/decode_mma.cu: bf16 / fp16 with at least 8 query rows per
  KV head, e.g. ``--heads 64 --kv-heads 8``) serves them until it has run green and becomes
  the default;
* ``fp8`` / ``fp8_e5m2`` -- the ``attn_ext`` candidate with a float8_e4m3fn / float8_e5m2
  cache (CPU; keys and values quantized with scale 2^-6 on append, each step reading half the
  bytes of a bf16 cache);
* ``sdpa``     -- a preallocated cache written with ``copy_`` and
  ``F.scaled_dot_product_attention(q, k[:, :, :L], v[:, :, :L], enable_gqa=True)``;
* ``sdpa_nocudnn`` -- the same with torch's cuDNN backend disabled (CUDA only; flash, efficient
  or math, torch's choice): on an H100 the default ``sdpa`` took a flat 38-54 ms a step at every
  batch and context (2026-11-27), the signature of a per-shape setup; cuDNN attention builds an
  execution plan per new shape, and every step's key length is new, so this candidate is the
  baseline for the kernel time;
* ``doc``      -- document 000's ``KVCacheAttention`` cache (``torch.cat`` of the past and the new
  keys/values every step) with document 003's ``repeat_kv`` for the grouped heads and document
  000's ``scaled_dot_product_attention`` (``attn_ext.testing.documents``).

For each prompt length P the cache is filled with P random tokens (the prefill is not timed),
then:

* ``step``: one step at context P (+ the steps already taken), timed in interleaved rounds of
  ``--step-reps`` consecutive steps per candidate (default on the CPU: 32768 // P, at least 1;
  on CUDA 1, each step synchronized before and after). Rounds of
  one step each at short contexts timed each candidate's step right after the others had
  evicted its cache: through 256-row pages such a step read 1.3-1.8x the contiguous one at
  512-4k keys, while whole generations of the same caches read 1.0-1.07x (Zen 5 VM,
  2026-11-29);
* ``gen``: a whole generation of ``--new-tokens`` (512) steps after the prompt, once per
  candidate (a fresh cache each, its construction included: one copy of the prompt against
  ``--new-tokens`` reads of it), up to ``--gen-max-context`` (above: "skip").

``--layers N`` gives every candidate N caches, one per layer of a model, each holding the
prompt: a step then appends to and reads every layer in turn, and times are per layer. A model
decodes that way: by the time a layer's cache is read again, the other layers' caches have
evicted it from the last-level cache. With one layer (the default) each step re-reads the same
cache, which stays in the last-level cache while it fits there (a 2-core Zen 5 VM with 32 MB of
L3: bf16 up to ~4k keys at H 32 / Hkv 8 / D 128), so those cells time instructions where a model
would time DRAM (docs/performance.md, "Q Kᵀ on vdpbf16ps, tried and dropped"). Pick N so that N
caches are several times the last-level cache.

Ratios ``<candidate> / attn_ext`` (> 1: attn_ext faster; for the paged caches, the cost of
paging). On CUDA also the achieved bandwidth (bytes of K and V read / time) against the
device's measured copy bandwidth, of a step and of the kernel alone: ``kernel`` replays a CUDA
graph of ``--graph-reps`` attention calls at context P (no append) per timed call, so its time
per call leaves out the host's launch and dispatch overhead, which decides a step's wall time at
batch 1 (each timed step synchronizes before and after). Graphed: attn_ext, the paged caches
and ``sdpa_nocudnn`` (cuDNN's per-shape plan cannot be captured). Timing and output:
``attn_ext.testing.harness`` (``decode_<device>.md``).

    python benchmarks/bench_decode.py --quick
    python benchmarks/bench_decode.py                      # CPU: prompts 512..32k
    python benchmarks/bench_decode.py --device cuda --batch 1 16 64
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import attn_ext
from attn_ext.testing import harness
from attn_ext.testing.documents import doc000, doc003

CANDIDATES = (
    "attn_ext",
    "paged16",
    "paged256",
    "mma",
    "mma_paged16",
    "fp8",
    "fp8_e5m2",
    "sdpa",
    "sdpa_nocudnn",
    "doc",
)
# Candidates that differ from another only on CUDA, left out of the CPU default.
CUDA_ONLY = ("sdpa_nocudnn", "mma", "mma_paged16")
CPU_ONLY = ("fp8", "fp8_e5m2")  # float8 caches have CPU kernels only
# The float8 candidate's k_scale and v_scale: unit-normal keys and values stay well inside
# e4m3's range (448) and out of its subnormals.
FP8_SCALE = 2.0**-6
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Distinct new tokens cycled through by the steps (enough that no step reuses its predecessor's).
NEW_TOKEN_POOL = 8
# The candidates timed as CUDA graphs of attention calls (``kernel``): those whose calls capture.
GRAPHED = ("attn_ext", "paged16", "paged256", "mma", "mma_paged16", "sdpa_nocudnn")


class DocCache:
    """Document 000's tuple cache, grown by torch.cat every step."""

    def __init__(self, k, v, max_len):
        self.k, self.v = k, v

    def step(self, q, k_new, v_new):
        self.k = torch.cat([self.k, k_new], dim=2)
        self.v = torch.cat([self.v, v_new], dim=2)
        n_rep = q.size(1) // self.k.size(1)
        return doc000.scaled_dot_product_attention(
            q, doc003.repeat_kv(self.k, n_rep), doc003.repeat_kv(self.v, n_rep)
        )


class SdpaCache:
    """A preallocated cache and torch's SDPA over its valid prefix (one length for the batch)."""

    def __init__(self, k, v, max_len):
        B, Hkv, P, D = k.shape
        self.k = k.new_zeros(B, Hkv, max_len, D)
        self.v = v.new_zeros(B, Hkv, max_len, v.size(3))
        self.k[:, :, :P] = k
        self.v[:, :, :P] = v
        self.length = P

    def step(self, q, k_new, v_new):
        L = self.length
        self.k[:, :, L : L + 1].copy_(k_new)
        self.v[:, :, L : L + 1].copy_(v_new)
        self.length = L + 1
        return self.read(q)

    def read(self, q):
        """Attention of q over the cache as it is (no append)."""
        L = self.length
        return F.scaled_dot_product_attention(
            q, self.k[:, :, :L], self.v[:, :, :L], enable_gqa=True
        )


class SdpaNoCudnnCache(SdpaCache):
    """SdpaCache with every SDPA backend but cuDNN's enabled (see the module docstring)."""

    BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

    def read(self, q):
        with sdpa_kernel(self.BACKENDS):
            return super().read(q)


class AttnExtCache:
    """attn_ext.KVCache (preallocated); its step and read serve PagedCache too."""

    def __init__(self, k, v, max_len):
        B, Hkv, P, D = k.shape
        self.cache = attn_ext.KVCache(B, Hkv, max_len, D, v.size(3), dtype=k.dtype, device=k.device)
        self.cache.append(k, v)

    def step(self, q, k_new, v_new):
        self.cache.append(k_new, v_new)
        return self.read(q)

    def read(self, q):
        return self.cache.attend(q)


class PagedCache(AttnExtCache):
    """attn_ext.PagedKVCache with room for max_len rows per sequence, pages in order of need."""

    def __init__(self, k, v, max_len, page_size):
        B, Hkv, P, D = k.shape
        pages_per_seq = -(-max_len // page_size)
        self.cache = attn_ext.PagedKVCache(
            B * pages_per_seq,
            page_size,
            Hkv,
            D,
            v.size(3),
            max_batch=B,
            max_pages_per_seq=pages_per_seq,
            dtype=k.dtype,
            device=k.device,
        )
        self.cache.append(k, v)


class Float8Cache(AttnExtCache):
    """attn_ext.KVCache holding float8 rows (scales FP8_SCALE)."""

    def __init__(self, k, v, max_len, dtype=torch.float8_e4m3fn):
        B, Hkv, P, D = k.shape
        self.cache = attn_ext.KVCache(
            B,
            Hkv,
            max_len,
            D,
            v.size(3),
            dtype=dtype,
            device=k.device,
            k_scale=FP8_SCALE,
            v_scale=FP8_SCALE,
        )
        self.cache.append(k, v)


def paged(page_size):
    return lambda k, v, max_len: PagedCache(k, v, max_len, page_size)


class OptedIn:
    """Another candidate's cache whose steps and reads run with ATTN_EXT_UNVERIFIED_CUDA=1 (the
    kernel is chosen on the host at each call, and at capture for a CUDA graph)."""

    def __init__(self, cache):
        self.step = harness.with_unverified_cuda(cache.step)
        self.read = harness.with_unverified_cuda(cache.read)


def opted_in(make):
    return lambda k, v, max_len: OptedIn(make(k, v, max_len))


class Layers:
    """One candidate's caches for ``n`` layers, each holding the prompt: a step appends the new
    token to every layer's cache and reads it, layer by layer, as a model's decode step does
    (the same q, k, v for every layer: the data does not change the time)."""

    def __init__(self, make, prompt, max_len, n):
        self.caches = [make(*prompt, max_len) for _ in range(n)]

    def step(self, q, k_new, v_new):
        return [c.step(q, k_new, v_new) for c in self.caches][-1]

    def read(self, q):
        return [c.read(q) for c in self.caches][-1]


MAKERS = {
    "attn_ext": AttnExtCache,
    "paged16": paged(16),
    "paged256": paged(256),
    "mma": opted_in(AttnExtCache),
    "mma_paged16": opted_in(paged(16)),
    "fp8": Float8Cache,
    "fp8_e5m2": lambda k, v, max_len: Float8Cache(k, v, max_len, torch.float8_e5m2),
    "sdpa": SdpaCache,
    "sdpa_nocudnn": SdpaNoCudnnCache,
    "doc": DocCache,
}


def build(name, prompt, max_len, layers):
    """Candidate ``name``'s cache holding the prompt, or its ``layers`` caches (Layers)."""
    if layers == 1:
        return MAKERS[name](*prompt, max_len)
    return Layers(MAKERS[name], prompt, max_len, layers)


# Keys per step of --step-reps' default: consecutive steps per timed call = this // P.
STEP_REPS_KEYS = 32768


def step_reps(requested, prompt, device):
    """Consecutive steps per timed call of ``step``: ``requested``, or by default
    STEP_REPS_KEYS // prompt (at least 1) on the CPU and 1 on CUDA."""
    if requested:
        return requested
    return 1 if device.type == "cuda" else max(1, STEP_REPS_KEYS // prompt)


def stepper(cache, new, reps=1):
    """A zero-argument call taking the next ``reps`` steps, cycling through the new tokens;
    returns the last step's output."""
    i = [0]

    def step():
        for _ in range(reps):
            j = i[0] % NEW_TOKEN_POOL
            i[0] += 1
            out = cache.step(new[0][j], new[1][j], new[2][j])
        return out

    return step


def generation(name, prompt, new, n_new, max_len, layers):
    def run():
        step = stepper(build(name, prompt, max_len, layers), new)
        for _ in range(n_new):
            step()

    return run


def reader(cache, q):
    """A zero-argument call of one attention read of the cache at its current length."""
    return lambda: cache.read(q)


def kernel_timing(bench, args, names, prompt, new, max_len, params):
    """The ``kernel`` timing of one cell (CUDA): each candidate in ``names`` on fresh caches
    holding the prompt (``--layers`` of them, read in turn), ``--graph-reps`` reads of them per
    CUDA graph; per-read times (ms) and the bytes of K and V read per read / time (GB/s).
    (None, {}) when nothing is graphed."""
    if not names:
        return None, {}
    reps, layers = args.graph_reps, args.layers
    calls, notes = {}, {}
    for n in names:
        try:
            calls[n] = harness.cuda_graph_replay(
                reader(build(n, prompt, max_len, layers), new[0][0]), reps
            )
        except Exception as e:  # a candidate whose call does not capture: reported, not fatal
            notes[n] = harness.error_text(e)
    timing = bench.time(calls)
    del calls  # the graphs and their caches: the whole generations need the memory next
    per_call = harness.divided(timing, reps * layers, notes)
    k, v = prompt
    read_bytes = k.numel() * k.element_size() + v.numel() * v.element_size()
    gbps = {
        n: {"gbps": read_bytes / per_call.median_s(n) / 1e9} for n in names if per_call.median_s(n)
    }
    bench.record_timing(
        per_call,
        "attn_ext" if "attn_ext" in names else None,
        gbps,
        mode="kernel",
        graph_reps=reps,
        **params,
    )
    return per_call, gbps


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    harness.add_common_args(ap, min_repeats=3, max_repeats=20, target_time=1.0)
    ap.add_argument(
        "--dtype",
        default=None,
        choices=sorted(DTYPES),
        help="default float32 on CPU, bfloat16 on CUDA",
    )
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument(
        "--prompts", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384, 32768]
    )
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument(
        "--step-reps",
        type=int,
        default=0,
        help=f"consecutive steps per timed call of `step` (0: on the CPU {STEP_REPS_KEYS} // "
        "prompt, at least 1; on CUDA 1)",
    )
    ap.add_argument(
        "--layers",
        type=int,
        default=1,
        help="caches per candidate, read in turn each step as a model's layers are; times per "
        "layer (1: one cache re-read every step)",
    )
    ap.add_argument(
        "--gen-max-context",
        type=int,
        default=32768,
        help="whole generations only for prompts up to this length",
    )
    ap.add_argument(
        "--graph-reps",
        type=int,
        default=20,
        help="attention calls per CUDA graph of the kernel timing (CUDA; 0: no kernel timing)",
    )
    ap.add_argument(
        "--candidates",
        nargs="+",
        default=None,
        choices=CANDIDATES,
        help="default: all (on CPU, all but "
        + ", ".join(CUDA_ONLY)
        + "; on CUDA, all but "
        + ", ".join(CPU_ONLY)
        + ")",
    )
    args = ap.parse_args(argv)
    if args.layers < 1:
        ap.error(f"--layers: expected at least 1, got {args.layers}")
    if args.step_reps < 0:
        ap.error(f"--step-reps: expected 0 (automatic) or more, got {args.step_reps}")
    if args.quick:
        args.prompts, args.new_tokens, args.max_repeats = [256, 1024], 16, 4
        args.heads, args.kv_heads, args.head_dim = 8, 2, 64
    bench = harness.Bench("decode", args, __file__)
    device = bench.device
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    H, Hkv, D = args.heads, args.kv_heads, args.head_dim
    elt = torch.finfo(dtype).bits // 8
    bw = harness.copy_bandwidth_gbs(device) if device.type == "cuda" else None
    names = list(
        args.candidates
        or [c for c in CANDIDATES if c not in (CPU_ONLY if device.type == "cuda" else CUDA_ONLY)]
    )
    others = [n for n in names if n != "attn_ext"]
    graphed = [n for n in names if n in GRAPHED] if bw and args.graph_reps > 0 else []

    cells = [(B, P) for B in args.batch for P in args.prompts]
    bar = harness.progress(len(cells), "decode")
    rows = []
    for B, P in cells:
        gen = torch.Generator(device="cpu").manual_seed(0)

        def rnd(*shape, gen=gen):
            return torch.randn(*shape, generator=gen, dtype=torch.float32).to(
                device=device, dtype=dtype
            )

        prompt = (rnd(B, Hkv, P, D), rnd(B, Hkv, P, D))
        new = tuple([rnd(B, h, 1, D) for _ in range(NEW_TOKEN_POOL)] for h in (H, Hkv, Hkv))
        reps = step_reps(args.step_reps, P, device)
        # room for the warm-up, every round (close calls included) and a generation
        max_len = P + args.new_tokens + (args.warmup + 2 * args.max_repeats + 2) * reps
        params = dict(dtype=str(dtype).replace("torch.", ""), B=B, H=H, S=P, D=D, Hkv=Hkv)
        if args.layers > 1:
            params["layers"] = args.layers
        if reps > 1:
            params["step_reps"] = reps
        L = args.layers
        step = harness.divided(
            bench.time({n: stepper(build(n, prompt, max_len, L), new, reps) for n in names}),
            L * reps,
        )
        gbps = {}
        if bw and step.median_s("attn_ext"):
            # bytes of K and V read per step at context P (+ the new token)
            gbps = {
                "attn_ext": {
                    "gbps": B * Hkv * (P + 1) * 2 * D * elt / step.median_s("attn_ext") / 1e9
                }
            }
        bench.record_timing(
            step, "attn_ext" if "attn_ext" in names else None, gbps, mode="step", **params
        )
        kernel, kernel_gbps = kernel_timing(bench, args, graphed, prompt, new, max_len, params)
        res = step.results
        # against the first reference that ran ("-" without one: the paged caches are not one)
        ref = next((n for n in ("sdpa", "doc") if n in res), None)
        diff = (
            harness.max_abs_diff([res["attn_ext"]], [res[ref]])
            if "attn_ext" in res and ref is not None
            else None
        )
        whole = None
        if P <= args.gen_max_context:
            whole = harness.divided(
                bench.time(
                    {n: generation(n, prompt, new, args.new_tokens, max_len, L) for n in names},
                    warmup=0,
                    min_rounds=1,
                    max_rounds=1,
                ),
                L,
            )
            bench.record_timing(
                whole,
                "attn_ext" if "attn_ext" in names else None,
                mode="gen",
                new_tokens=args.new_tokens,
                **params,
            )
        row = [B, P]
        for t in (step, whole):
            row += [harness.fmt(t.ms(n) if t else None, ".2f", "skip") for n in names]
            row += [harness.fmt_ratio(t.ratio(n, "attn_ext") if t else None) for n in others]
        if bw:
            g = gbps.get("attn_ext", {}).get("gbps")
            row += [harness.fmt(g, ".0f"), harness.fmt(g and 100 * g / bw, ".0f") + "%"]
        for n in graphed:
            t = kernel.ms(n)
            row.append(harness.fmt(t and 1e3 * t, ".1f", kernel.errors.get(n, "-")[:24]))
        for n in graphed:
            g = kernel_gbps.get(n, {}).get("gbps")
            row.append(harness.fmt(g and 100 * g / bw, ".0f") + "%")
        rows.append(row + [harness.fmt(diff, ".1e")])
        bar.update(1)
    bar.close()

    cols = ["B", "prompt"]
    for kind in ("step", "gen"):
        cols += [f"{c} {kind} (ms)" for c in names] + [f"{c}/attn_ext {kind}" for c in others]
    if bw:
        cols += ["attn_ext GB/s", "% of copy bw"]
    cols += [f"{c} kernel (us)" for c in graphed] + [f"{c} kernel % of copy bw" for c in graphed]
    if args.step_reps:
        reps_text = str(args.step_reps)
    else:
        reps_text = "1" if device.type == "cuda" else f"max(1, {STEP_REPS_KEYS} // P)"
    head = (
        f"H={H}, Hkv={Hkv}, D={D}, {params['dtype']}; one new token per step. `step` = median ms "
        f"of one step at context P (interleaved rounds of {reps_text} consecutive steps); "
        f"`gen` = ms for {args.new_tokens} "
        "new tokens "
        "after the prompt. Ratios > 1: attn_ext faster."
        + (
            f" Each candidate holds {args.layers} layers' caches, read in turn every step as a "
            "model's are (no layer's cache is still in the last-level cache when read); times are "
            "per layer."
            if args.layers > 1
            else ""
        )
        + (f" Copy bandwidth {bw:.0f} GB/s." if bw else "")
        + (
            f" `kernel` = us of one attention read at context P, from CUDA graphs of "
            f"{args.graph_reps} reads (no launch overhead; no append)."
            if graphed
            else ""
        )
    )
    bench.finish(
        f"Decode benchmark ({device.type})",
        [head, harness.markdown_table(cols + ["max abs diff"], rows)],
    )


if __name__ == "__main__":
    main()
