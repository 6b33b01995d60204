"""Integrations of attn_ext with other libraries.

Each submodule imports its library lazily (only when the submodule itself is imported), so
``import attn_ext`` never needs them:

- :mod:`attn_ext.integrations.transformers`: ``register()`` makes
  ``attn_implementation="attn_ext"`` work in HuggingFace transformers models.
"""
