"""Checking helpers that ship with attn_ext (like ``torch.testing``), used by
``python -m attn_ext`` and by the test suite; not imported by ``import attn_ext``.

- :mod:`attn_ext.testing.documents`: the source documents' attention classes and functions,
  reproduced in plain PyTorch, which :mod:`attn_ext.compat` must match.
"""
