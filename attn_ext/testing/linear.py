"""Reference implementations of linear attention for the tests (plain PyTorch, no attn_ext).

* ``doc000_linear_attention`` -- document 000's function (from attn_ext.testing.documents):
  feature map ``elu(x) + 1``, ``phi(Q) (phi(K)^T V) / (phi(Q) sum phi(K) + 1e-6)`` on (B, S, D)
  tensors, every step at the input dtype.
* ``linear_attention_quadratic`` -- the masked quadratic form
  ``A = phi(Q) phi(K)^T`` (lower-triangular, diagonal included, when causal),
  ``out = (A V + phi(Q) S0) / (A 1 + phi(Q) z0 + eps)``; the causal reference, and the
  non-causal one for the other feature maps and for an initial state.
* ``linear_attention_recurrent`` -- the "transformers are RNNs" recurrence, one position at a
  time: ``S += phi(k_i) v_i^T``, ``z += phi(k_i)``, ``out_i = phi(q_i) S / (phi(q_i) z + eps)``.

Inputs are (B, H, S, D) (or 3-D (B, S, D) where noted); the state is ``(kv (B, H, D, Dv),
k (B, H, D))``. Each runs at the dtype of its inputs (the "plain reference at the same dtype" of
the numerics rule); call it on float64 copies for the ground truth.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from attn_ext.testing.documents import doc000
from attn_ext.testing.numerics import ground_truth_grads

FEATURE_MAPS = ("elu+1", "relu", "identity")
# The gradients of q, k and the key-sum state are differences of a numerator term and a
# normalizer term that cancel along phi(q) up to eps (at D = 1 entirely: the exact dq is
# S dO eps / den^2), so any float32 evaluation rounds them at the terms' size, not the
# result's. Their floor is GRADIENT_TERM_ULPS float32 ulps of the numerator term (the kernels
# form the terms in float32 at every input dtype but float64). Measured on the CPU kernel: at
# most 8.1 such ulps (D in {1, 2, 3, 8, 33}, eps in {1e-6, 1e-3, 0.5}, 30 seeds each, 72 keys),
# the plain float32 reference as large; the --fuzz run of 2026-11-26 had failed at D = 1 with
# the kernel 3.8x the reference's error, both about 1 ulp of a ~600 term around a dq of ~1e-2.
GRADIENT_TERM_ULPS = 32.0


# Document 000's function (attn_ext.testing.documents reproduces the documents' code).
doc000_linear_attention = doc000.linear_attention


def feature(x: torch.Tensor, feature_map: str) -> torch.Tensor:
    if feature_map == "elu+1":
        return F.elu(x) + 1
    if feature_map == "relu":
        return F.relu(x)
    if feature_map == "identity":
        return x
    raise ValueError(feature_map)


def final_state(
    k, v, *, feature_map="elu+1", initial_state=None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(S0 + phi(K)^T V, z0 + sum phi(K)) over every key, at the inputs' dtype."""
    fk = feature(k, feature_map)
    kv, ks = fk.transpose(-1, -2) @ v, fk.sum(-2)
    if initial_state is not None:
        kv, ks = kv + initial_state[0], ks + initial_state[1]
    return kv, ks


def linear_attention_quadratic(
    q,
    k,
    v,
    *,
    causal=False,
    eps=1e-6,
    feature_map="elu+1",
    initial_state: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    normalizer_grad: bool = True,
):
    """The masked quadratic form (materializes Sq x Sk); causal needs Sq == Sk.

    ``normalizer_grad=False`` detaches the denominator, so that autograd gives the numerator's
    share of the gradients alone: the error rule's scale for gradients that cancel
    (``linear_gradient_term_scale``)."""
    fq, fk = feature(q, feature_map), feature(k, feature_map)
    a = fq @ fk.transpose(-1, -2)
    if causal:
        a = a.tril()
    num, den = a @ v, a.sum(-1, keepdim=True)
    if initial_state is not None:
        s0, z0 = initial_state
        num = num + fq @ s0.to(q.dtype)
        den = den + fq @ z0.to(q.dtype).unsqueeze(-1)
    den = den + eps
    return num / (den if normalizer_grad else den.detach())


def gradient_term_floors(numerator_only, inputs, grad_out, *, ulps=GRADIENT_TERM_ULPS):
    """Per input, an absolute floor for the error rule's gradient check (``floor`` of
    ``assert_error_rule``): ``ulps`` float32 rounding units of the largest float64 gradient of
    ``numerator_only`` (the reference called with ``normalizer_grad=False``) w.r.t. that input
    at ``grad_out``. Gradients without a normalizer term (v, the kv state) get a floor at their
    own size, below the suite's gradient slack."""
    ulp = torch.finfo(torch.float32).eps
    terms = ground_truth_grads(numerator_only, inputs, grad_out)
    return [ulps * ulp * t.abs().max().item() if t.numel() else 0.0 for t in terms]


def linear_attention_recurrent(q, k, v, *, eps=1e-6, feature_map="elu+1", initial_state=None):
    """Causal linear attention one position at a time; returns (out, (kv, k) final state)."""
    B, H, S, D = q.shape
    Dv = v.size(-1)
    if initial_state is None:
        s = q.new_zeros(B, H, D, Dv)
        z = q.new_zeros(B, H, D)
    else:
        s, z = (t.to(q.dtype).clone() for t in initial_state)
    fq, fk = feature(q, feature_map), feature(k, feature_map)
    outs = []
    for i in range(S):
        s = s + fk[:, :, i, :, None] * v[:, :, i, None, :]
        z = z + fk[:, :, i]
        num = torch.einsum("bhd,bhde->bhe", fq[:, :, i], s)
        den = (fq[:, :, i] * z).sum(-1, keepdim=True)
        outs.append(num / (den + eps))
    out = torch.stack(outs, dim=2) if outs else q.new_zeros(B, H, 0, Dv)
    return out, (s, z)
