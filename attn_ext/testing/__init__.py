"""Checking helpers that ship with attn_ext (like ``torch.testing``), used by the test suite,
``python -m attn_ext`` and the benchmarks; not imported by ``import attn_ext``. Plain PyTorch
throughout: nothing here calls an attn_ext kernel.

- :mod:`attn_ext.testing.documents`: the source documents' attention classes and functions,
  reproduced in plain PyTorch, which :mod:`attn_ext.compat` must match.
- References per op family, written for the tests: :mod:`~attn_ext.testing.attention`
  (masks, attention, SDPA, attention weights), :mod:`~attn_ext.testing.decoding` (RoPE, KV-cache
  decode), :mod:`~attn_ext.testing.linear`, :mod:`~attn_ext.testing.mla`,
  :mod:`~attn_ext.testing.tpa`, :mod:`~attn_ext.testing.spatial` (CBAM, temporal).
- :mod:`attn_ext.testing.numerics`: the float64 ground truth, the error rule and input makers.
- :mod:`attn_ext.testing.harness`: the one benchmark harness (interleaved timer, memory child,
  environment header, Markdown table, ``benchmarks/results/history.csv``, PNG plots).
- ``python -m attn_ext`` is a thin driver over :mod:`~attn_ext.testing.selfcheck` (every op
  against the references above), :mod:`~attn_ext.testing.selfcheck_compat` (the compat drop-ins
  against the documents' code) and :mod:`~attn_ext.testing.selftime` (its short timing table).
"""
