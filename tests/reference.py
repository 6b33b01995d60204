"""Reference implementations the attn_ext kernels are tested against.

Everything here is plain PyTorch written for the tests (no attn_ext import).
It reproduces what the source documents under ``shared/seeds`` compute:

* document 000 (TorchCode, chapter 3): scaled dot-product attention on
  (B, S, D) tensors, self and cross attention (Sq != Sk, Dv != D), the causal
  mask built from ``triu`` of ``-inf``, the KV-cache prefill mask
  (``triu(..., diagonal=S_total - S_new + 1)``, i.e. bottom-right causal),
  grouped-query attention that expands the KV heads with
  ``repeat_interleave`` on dim 1, the symmetric sliding window
  ``|i - j| <= w`` and the tiled "flash attention" that walks over key blocks
  with an online softmax (running max, running sum, rescaled accumulator);
* document 001 (LLMs from scratch, chapter 3): causal attention that fills the
  strict upper triangle with ``-inf`` before the softmax and applies dropout
  to the attention weights;
* document 003 (textbook 4.2): masked stable attention with a bool mask
  (True = visible), the softmax taken in float32 and cast back, dropout on the
  probabilities, ``repeat_kv`` (expand + reshape) and temperature
  ``softmax(s / tau)`` where ``s = q.k / sqrt(d_h)``;
* document 004 (attention zoo): self / cross attention are plain scaled
  dot-product attention; ``GroupedAttention`` maps query head ``h`` to KV head
  ``h % (num_heads // num_groups)``.

Corrections of the documents (see design.md, "Where a document's code is
wrong"): a query row that can see no key yields zeros (document 003 would
give a uniform average because it fills with ``finfo.min``; documents 000/001
would give NaN), and document 004's ``GroupedAttention`` lets query group
``g`` read the keys of *batch element* ``g``; the reference below keeps only
its head mapping, applied within each batch element.

Mask conventions are those of attn_ext (SPEC): causal and windows are
bottom-right aligned, query ``i`` sits at key position ``i + Sk - Sq``;
``window_size=(left, right)`` keeps keys ``j`` in
``[i + Sk - Sq - left, i + Sk - Sq + right]`` with ``-1`` = unbounded; causal
means ``right = 0``. A bool ``attn_mask`` keeps True entries, a floating one is
added to the scaled scores.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

LOW_PRECISION = (torch.float16, torch.bfloat16)
ALL_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------- #
# Masks
# --------------------------------------------------------------------------- #
def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def window_keep(sq: int, sk: int, window_size=(-1, -1), causal: bool = False,
                device=None) -> torch.Tensor:
    """Bool (sq, sk), True where query i may read key j (bottom-right aligned)."""
    left, right = window_size
    if causal:
        right = 0
    i = torch.arange(sq, device=device).unsqueeze(1) + (sk - sq)
    j = torch.arange(sk, device=device).unsqueeze(0)
    keep = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    return keep


def top_left_causal_keep(sq: int, sk: int, device=None) -> torch.Tensor:
    """torch SDPA's ``is_causal``: query i reads keys j <= i (top-left aligned)."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril()


def symmetric_window_keep(s: int, w: int, device=None) -> torch.Tensor:
    """Document 000's sliding window: position i reads j iff |i - j| <= w."""
    pos = torch.arange(s, device=device)
    return (pos.unsqueeze(0) - pos.unsqueeze(1)).abs() <= w


def kv_cache_additive_mask(s_new: int, s_total: int, device=None,
                           dtype=torch.float32) -> torch.Tensor:
    """Document 000's KV-cache prefill mask: -inf strictly above the diagonal
    that is shifted by the cached length (s_total - s_new)."""
    full = torch.full((s_new, s_total), float("-inf"), device=device, dtype=dtype)
    return torch.triu(full, diagonal=s_total - s_new + 1)


# --------------------------------------------------------------------------- #
# GQA helpers
# --------------------------------------------------------------------------- #
def expand_kv_heads(x: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """Document 000: repeat each KV head (dim 1) H // Hkv times, so that query
    head h reads KV head h // (H // Hkv)."""
    hkv = x.shape[1]
    assert num_q_heads % hkv == 0, (num_q_heads, hkv)
    if hkv == num_q_heads:
        return x
    return x.repeat_interleave(num_q_heads // hkv, dim=1)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Document 003: the same expansion as a stride trick (expand + reshape)."""
    if n_rep == 1:
        return x
    b, h, t, d = x.shape
    return x.unsqueeze(2).expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


# --------------------------------------------------------------------------- #
# The general reference
# --------------------------------------------------------------------------- #
def attention_reference(q, k, v, *, scale=None, causal=False, window_size=(-1, -1),
                        attn_mask=None, dropout_p: float = 0.0,
                        dropout_keep: Optional[torch.Tensor] = None,
                        return_lse: bool = False, return_probs: bool = False):
    """Plain scaled dot-product attention with attn_ext's semantics.

    Runs at the dtype of its inputs, like document 003's masked stable
    attention: the scores and both matmuls in the input dtype, the softmax in
    float32 for float16/bfloat16 (float32/float64 keep their own dtype).
    Call it on float64 tensors (``ground_truth``) to get the float64 truth.

    q (B, H, Sq, D) or (B, Sq, D); k (B, Hkv, Sk, D); v (B, Hkv, Sk, Dv).
    ``dropout_keep``: bool keep mask broadcastable to (B, H, Sq, Sk) applied
    after the softmax with 1 / (1 - dropout_p) rescaling (for 3-D inputs a
    (B, Sq, Sk) or (B, 1, Sq, Sk) mask is accepted).
    Returns out, and optionally the lse (natural log, scale included, -inf for
    empty rows) and the post-dropout-free probabilities.
    """
    three_d = q.dim() == 3
    if three_d:
        q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
        if attn_mask is not None and attn_mask.dim() == 3:
            attn_mask = attn_mask.unsqueeze(1)
        if dropout_keep is not None and dropout_keep.dim() == 3:
            dropout_keep = dropout_keep.unsqueeze(1)
    B, H, Sq, D = q.shape
    Sk = k.shape[2]
    k = expand_kv_heads(k, H)
    v = expand_kv_heads(v, H)
    if scale is None:
        scale = default_scale(D)

    scores = (q @ k.transpose(-2, -1)) * scale  # input dtype
    neg_inf = float("-inf")
    if causal or tuple(window_size) != (-1, -1):
        keep = window_keep(Sq, Sk, window_size, causal, device=q.device)
        scores = scores.masked_fill(~keep, neg_inf)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, neg_inf)
        else:
            scores = scores + attn_mask
    work = scores.float() if scores.dtype in LOW_PRECISION else scores

    if Sk == 0:
        probs = work * 0  # (B, H, Sq, 0), keeps the autograd graph
        lse = torch.full(work.shape[:-1], neg_inf, dtype=work.dtype, device=work.device)
    else:
        row_max = work.amax(dim=-1, keepdim=True)
        empty = row_max == neg_inf  # row sees no key
        # Stable softmax with empty rows sent to 0 without producing NaN
        # (neither in the forward nor in the backward).
        probs = torch.softmax(work.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
        lse = torch.logsumexp(work, dim=-1)
    weights = probs
    if dropout_p > 0.0 or dropout_keep is not None:
        assert dropout_keep is not None, "pass the keep mask explicitly"
        probs = probs * dropout_keep.to(probs.dtype) / (1.0 - dropout_p)
    out = probs.to(v.dtype) @ v
    if three_d:
        out = out.squeeze(1)
        lse = lse.squeeze(1)
        weights = weights.squeeze(1)
    res = [out]
    if return_lse:
        res.append(lse)
    if return_probs:
        res.append(weights.to(q.dtype))
    return res[0] if len(res) == 1 else tuple(res)


def attention_weights_reference(q, k, **kw):
    """Probability matrix (B, H, Sq, Sk) in q's dtype (softmax in fp32)."""
    v = q.new_zeros(*k.shape[:-1], 1)
    return attention_reference(q, k, v, return_probs=True, **kw)[1]


def sdpa_reference(query, key, value, attn_mask=None, is_causal=False, scale=None,
                   enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention semantics (top-left
    is_causal), with empty rows -> 0 (attn_ext's documented difference)."""
    sq, sk = query.shape[-2], key.shape[-2]
    mask = attn_mask
    if is_causal:
        tl = top_left_causal_keep(sq, sk, device=query.device)
        if mask is None:
            mask = tl
        elif mask.dtype == torch.bool:
            mask = mask & tl
        else:
            mask = mask.masked_fill(~tl, float("-inf"))
    if not enable_gqa:
        assert query.dim() < 4 or query.shape[-3] == key.shape[-3]
    return attention_reference(query, key, value, scale=scale, attn_mask=mask)


# --------------------------------------------------------------------------- #
# Document-specific references
# --------------------------------------------------------------------------- #
def doc000_sdpa(Q, K, V):
    """000: softmax(Q K^T / sqrt(d_k)) V on (B, S, D) tensors (self or cross)."""
    scores = Q @ K.transpose(-1, -2) / math.sqrt(Q.shape[-1])
    return torch.softmax(scores, dim=-1) @ V


def doc000_causal_attention(Q, K, V):
    """000: additive -inf strictly above the main diagonal (Sq == Sk)."""
    scores = Q @ K.transpose(-1, -2) / math.sqrt(Q.shape[-1])
    bias = torch.triu(torch.full_like(scores, float("-inf")), diagonal=1)
    return torch.softmax(scores + bias, dim=-1) @ V


def doc000_gqa_attention(q, k, v):
    """000 GroupQueryAttention core: q (B,H,S,dk), k/v (B,Hkv,S,dk)."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(scores, dim=-1) @ v


def doc000_sliding_window_attention(Q, K, V, w: int):
    """000: position i attends to j iff |i - j| <= w (Sq == Sk)."""
    scores = Q @ K.transpose(-1, -2) / math.sqrt(Q.shape[-1])
    far = ~symmetric_window_keep(Q.shape[-2], w, device=Q.device)
    scores = scores.masked_fill(far, float("-inf"))
    return torch.softmax(scores, dim=-1) @ V


def doc000_kv_cache_attention(q, k, v):
    """000 KVCacheAttention core: q holds the S_new newest positions, k/v all
    S_total positions; prefill (S_new > 1) adds the shifted triu mask."""
    s_new, s_total = q.shape[-2], k.shape[-2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if s_new > 1:
        scores = scores + kv_cache_additive_mask(s_new, s_total, q.device, scores.dtype)
    return torch.softmax(scores, dim=-1) @ v


def doc000_tiled_flash_attention(q, k, v, *, block_size: int = 32, scale=None,
                                 keep: Optional[torch.Tensor] = None):
    """000 flash_attention: one pass over key blocks with an online softmax.

    Generalised to any leading dims, Sq != Sk, Dv != D and an optional bool
    keep mask (broadcastable to (..., Sq, Sk)). Per key block: new running max,
    rescale accumulator and running sum by exp(old_max - new_max), add
    exp(s - new_max) @ V_block. Returns (out, lse); empty rows give 0 / -inf.
    """
    *lead, sq, d = q.shape
    sk, dv = k.shape[-2], v.shape[-1]
    if scale is None:
        scale = default_scale(d)
    if keep is not None:
        keep = torch.broadcast_to(keep, (*lead, sq, sk))
    neg_inf = float("-inf")
    acc = q.new_zeros(*lead, sq, dv)
    row_max = q.new_full((*lead, sq, 1), neg_inf)
    row_sum = q.new_zeros(*lead, sq, 1)
    for start in range(0, sk, block_size):
        end = min(start + block_size, sk)
        s = (q @ k[..., start:end, :].transpose(-1, -2)) * scale
        if keep is not None:
            s = s.masked_fill(~keep[..., start:end], neg_inf)
        new_max = torch.maximum(row_max, s.amax(dim=-1, keepdim=True))
        # a row that has seen no visible key yet keeps max -inf; measure
        # its exponentials from 0 so that they are exactly 0 and not NaN.
        ref_point = new_max.masked_fill(new_max == neg_inf, 0.0)
        correction = torch.exp(row_max - ref_point)
        p = torch.exp(s - ref_point)
        acc = acc * correction + p @ v[..., start:end, :]
        row_sum = row_sum * correction + p.sum(dim=-1, keepdim=True)
        row_max = new_max
    seen = row_sum > 0
    out = torch.where(seen, acc / torch.where(seen, row_sum, torch.ones_like(row_sum)), 0.0)
    lse = torch.where(seen, row_max + torch.log(torch.where(seen, row_sum, torch.ones_like(row_sum))),
                      neg_inf).squeeze(-1)
    return out, lse


def doc001_causal_attention(queries, keys, values, *, dropout_keep=None, dropout_p=0.0):
    """001 CausalAttention core: scores.masked_fill(triu(ones, 1), -inf), softmax
    of scores / sqrt(d_k), dropout on the weights, weights @ values.
    Dropout is given as an explicit keep mask (nn.Dropout scales by 1/(1-p))."""
    n = queries.shape[-2]
    scores = queries @ keys.transpose(-2, -1)
    future = torch.triu(torch.ones(n, keys.shape[-2], device=queries.device), diagonal=1).bool()
    scores = scores.masked_fill(future, float("-inf"))
    weights = torch.softmax(scores / keys.shape[-1] ** 0.5, dim=-1)
    if dropout_keep is not None:
        weights = weights * dropout_keep.to(weights.dtype) / (1.0 - dropout_p)
    return weights @ values


def doc003_masked_stable_attention(q, k, v, mask=None, *, dropout_keep=None, dropout_p=0.0):
    """003 ``attention``: scores / sqrt(Dh), masked_fill(~mask, finfo.min)
    (mask True = visible), softmax in float32 cast back to q's dtype, dropout on
    the probabilities, probs @ v. Correction: a row with no visible key -> 0
    (the document's finfo.min fill would average every value there)."""
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    # "softmax in a stable dtype": at least float32 (float64 stays float64)
    work = scores.float() if scores.dtype in LOW_PRECISION else scores
    probs = torch.softmax(work, dim=-1).to(q.dtype)
    if mask is not None:
        empty = ~mask.any(dim=-1, keepdim=True)
        probs = probs.masked_fill(empty, 0.0)
    if dropout_keep is not None:
        probs = probs * dropout_keep.to(probs.dtype) / (1.0 - dropout_p)
    return probs @ v


def doc003_temperature_attention(q, k, v, tau: float):
    """003: alpha = softmax(s / tau) with s = q.k / sqrt(d_h); the same as
    scaled attention with scale = 1 / (tau * sqrt(d_h))."""
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    s = s / tau
    work = s.float() if s.dtype in LOW_PRECISION else s
    return torch.softmax(work, dim=-1).to(q.dtype) @ v


def doc004_grouped_attention_heads(q, k, v):
    """004 GroupedAttention's head mapping, applied within each batch element:
    q (B, H, S, d), k/v (B, Hkv, S, d); query head h reads KV head h % Hkv
    (the document tiles the KV heads instead of repeat_interleave)."""
    reps = q.shape[1] // k.shape[1]
    k = k.repeat(1, reps, 1, 1)
    v = v.repeat(1, reps, 1, 1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return torch.softmax(scores, dim=-1) @ v


# --------------------------------------------------------------------------- #
# Float64 ground truth
# --------------------------------------------------------------------------- #
def _to_f64(x):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().to(torch.float64)
    if isinstance(x, (list, tuple)):
        return type(x)(_to_f64(y) for y in x)
    return x


def ground_truth(fn, *args, **kwargs):
    """Run a reference on float64 copies of every floating tensor argument
    (bool masks are passed as they are). The inputs are the values actually
    given to the kernel, so the truth is exact up to float64 rounding."""
    return fn(*_to_f64(args), **{k: _to_f64(v) for k, v in kwargs.items()})


def autograd_grads(fn, inputs: Sequence[torch.Tensor], grad_out, **kwargs):
    """Gradients of <fn(*inputs, **kwargs), grad_out> w.r.t. inputs (fresh leaves)."""
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*leaves, **kwargs)
    grads = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads)]


def ground_truth_grads(fn, inputs, grad_out, **kwargs):
    return autograd_grads(fn, _to_f64(list(inputs)), _to_f64(grad_out),
                          **{k: _to_f64(v) for k, v in kwargs.items()})


# --------------------------------------------------------------------------- #
# Numerics rule (design.md): error against the float64 truth, at most twice
# the error of the plain PyTorch reference run at the same dtype.
# --------------------------------------------------------------------------- #
F64_RTOL = 1e-10
F64_ATOL = 1e-10


def _check_nonfinite(actual, truth, name):
    a_nan, t_nan = torch.isnan(actual), torch.isnan(truth)
    assert torch.equal(a_nan, t_nan), f"{name}: NaN pattern differs from the truth"
    t_inf = torch.isinf(truth)
    assert torch.equal(torch.isinf(actual), t_inf), f"{name}: inf pattern differs from the truth"
    if t_inf.any():
        assert torch.equal(actual[t_inf], truth[t_inf]), f"{name}: wrong sign of inf"


def max_abs_err(x, truth) -> float:
    x = x.detach().to(torch.float64)
    truth = truth.detach().to(torch.float64)
    fin = torch.isfinite(truth)
    if not fin.any():
        return 0.0
    return (x[fin] - truth[fin]).abs().max().item()


def assert_error_rule(actual, ref_same_dtype, truth, *, name="out", factor=2.0,
                      slack_ulps: float = 1.0):
    """err(actual) <= factor * err(ref_same_dtype) + slack, errors = max-abs
    difference to the float64 truth over the finite entries (non-finite entries
    must match the truth exactly). float64 results must equal the truth to
    ~1e-10 instead.

    slack = slack_ulps * eps(actual.dtype) * max(1, max|truth|): one rounding
    unit of the result dtype at the scale of the result. Reason: the kernel
    rounds its fp32 accumulator to the output dtype once, which the reference
    can avoid by luck (e.g. rows whose probabilities are exactly 0/1 give the
    reference zero error), so a pure 2x rule would demand bit-exactness there.
    """
    truth = truth.detach().to(torch.float64)
    assert tuple(actual.shape) == tuple(truth.shape), f"{name}: shape {tuple(actual.shape)} != {tuple(truth.shape)}"
    a64 = actual.detach().to(torch.float64).cpu()
    truth = truth.cpu()
    _check_nonfinite(a64, truth, name)
    if actual.dtype == torch.float64:
        fin = torch.isfinite(truth)
        torch.testing.assert_close(a64[fin], truth[fin], rtol=F64_RTOL, atol=F64_ATOL,
                                   msg=lambda m: f"{name} (float64): {m}")
        return
    err_a = max_abs_err(a64, truth)
    err_r = max_abs_err(ref_same_dtype.detach().cpu(), truth)
    fin = torch.isfinite(truth)
    mag = truth[fin].abs().max().item() if fin.any() else 0.0
    slack = slack_ulps * torch.finfo(actual.dtype).eps * max(1.0, mag)
    assert err_a <= factor * err_r + slack, (
        f"{name} ({actual.dtype}): kernel error {err_a:.3e} > {factor} x reference error "
        f"{err_r:.3e} + slack {slack:.3e}")


def grad_slack_ulps(dtype) -> float:
    """Slack (in ulps of max|truth|) for gradients.

    float32 is looser (4 ulps): the kernel's backward recomputes the
    probabilities as exp(scale * q.k - lse) from the saved float32 lse, a
    relative error of ~|s| * eps per probability that torch's autograd (which
    keeps the forward's probabilities) does not have, and every gradient is a
    reduction over Sq or Sk such terms. On the small tensors of the tests
    the max-abs error of the reference is itself often only ~1 ulp, so a pure
    2x rule measures luck. bf16/fp16 keep one ulp: there the reference's own
    rounding to the low-precision dtype dominates by far.
    """
    return 4.0 if dtype == torch.float32 else 1.0


def assert_lse_close(lse, ref_lse_same_dtype, truth_lse, *, name="lse"):
    """lse is float32 for every input dtype. Rule as above with the reference's
    lse stored in float32, and a slack of 4 float32 ulps at |lse| (the lse is
    only as exact as a float32 log/sum of exponentials: a few roundings)."""
    assert lse.dtype == torch.float32, f"{name}: dtype {lse.dtype}, expected float32"
    ref32 = ref_lse_same_dtype.detach().float()
    assert_error_rule(lse, ref32, truth_lse, name=name, slack_ulps=4.0)


# --------------------------------------------------------------------------- #
# Inputs
# --------------------------------------------------------------------------- #
def rand(shape, dtype, device, layout="contiguous", requires_grad=False, scale=1.0):
    """Random normal tensor of logical shape (B, H, S, D) (or any shape for
    layout='contiguous').

    layout:
      'contiguous'  plain tensor;
      'bshd'        made as (B, S, H, D) then transpose(1, 2) (4-D only): the
                    layout of a projected sequence, last dim contiguous;
      'noncontig'   every other element of a wider last dim (stride 2 in D);
      'expand_b'    batch dim broadcast with stride 0 (4-D only).
    """
    shape = tuple(shape)
    if layout == "contiguous":
        x = torch.randn(shape, device=device) * scale
        x = x.to(dtype)
    elif layout == "bshd":
        b, h, s, d = shape
        x = (torch.randn(b, s, h, d, device=device) * scale).to(dtype).transpose(1, 2)
    elif layout == "noncontig":
        *lead, d = shape
        x = (torch.randn(*lead, 2 * d, device=device) * scale).to(dtype)[..., ::2]
    elif layout == "expand_b":
        b = shape[0]
        x = (torch.randn(1, *shape[1:], device=device) * scale).to(dtype).expand(b, *shape[1:])
    else:
        raise ValueError(layout)
    assert tuple(x.shape) == shape
    if requires_grad:
        x.requires_grad_(True)
    return x


def make_qkv(B, H, Hkv, Sq, Sk, D, Dv=None, *, dtype=torch.float32, device="cpu",
             layout="contiguous", requires_grad=False):
    Dv = D if Dv is None else Dv
    q = rand((B, H, Sq, D), dtype, device, layout, requires_grad)
    k = rand((B, Hkv, Sk, D), dtype, device, layout, requires_grad)
    v = rand((B, Hkv, Sk, Dv), dtype, device, layout, requires_grad)
    return q, k, v


def random_bool_mask(shape, device, p_keep=0.7, ensure_row=True):
    """Random keep mask; with ensure_row the last dim has at least one True."""
    m = torch.rand(shape, device=device) < p_keep
    if ensure_row and m.shape[-1] > 0:
        m[..., 0] = True
    return m


def random_float_mask(shape, dtype, device, p_neg_inf=0.2, ensure_row=True):
    """Additive mask: normal values with some -inf entries."""
    m = torch.randn(shape, device=device)
    m = m.masked_fill(torch.rand(shape, device=device) < p_neg_inf, float("-inf"))
    if ensure_row and m.shape[-1] > 0:
        m[..., 0] = 0.0
    return m.to(dtype)
