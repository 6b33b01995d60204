"""The registered operators as the package's Python modules call them.

``ops.<name>(...)`` calls ``torch.ops.attn_ext.<name>.default`` with the arguments that differ
from the schema's defaults: torch parses every argument passed by keyword against the schema
(~0.2 us each on the 2-core build machines), and the attention ops take up to 16, so
passing only what a call sets saves ~1 us of a ~10 us small-shape call (docs/performance.md,
"Per-call overhead"). Arguments are dropped only when they are the default itself: ``None``
for ``None``, or a plain bool / int / float equal to it, never a tensor or a symbolic size.
"""

import torch

_PLAIN = (bool, int, float)
# Marks an argument without a default: always passed.
_REQUIRED = object()


class _Op:
    __slots__ = ("_op", "_defaults")

    def __init__(self, packet):
        self._op = packet.default
        self._defaults = {
            a.name: a.default_value for a in self._op._schema.arguments if a.has_default_value()
        }

    def __call__(self, *args, **kwargs):
        defaults = self._defaults
        passed = {}
        for name, value in kwargs.items():
            default = defaults.get(name, _REQUIRED)
            # the default itself: None for None, an equal plain bool / int / float of its type
            if value is default or (
                value is not None
                and type(value) is type(default)
                and type(value) in _PLAIN
                and value == default
            ):
                continue
            passed[name] = value
        return self._op(*args, **passed)


class _Ops:
    """``torch.ops.attn_ext`` with every operator wrapped in :class:`_Op`, built at import (after
    ``_C`` registered them) so that nothing is created while torch.compile traces a call."""

    def __init__(self):
        from . import _C  # noqa: F401  (registers the operators)

        prefix = "attn_ext::"
        for qualified in torch._C._dispatch_get_all_op_names():
            if qualified.startswith(prefix):
                name = qualified[len(prefix) :]
                setattr(self, name, _Op(getattr(torch.ops.attn_ext, name)))


ops = _Ops()
