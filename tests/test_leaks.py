"""Leaks and stability, in CI's budget: tools/leak_check.py's calls of every op family (forward +
backward where it has one) and two KVCache generation loops (one through a float8 cache), 300
times each after a warm-up, keep the process's resident set within a few MB (a leak of ~30 kB
per call would show). The 10,000-call figures of the README come from
`python tools/leak_check.py`."""

import importlib.util
from pathlib import Path

import pytest
import torch

CALLS = 300
MAX_GROWTH_MB = 8.0  # allocator and page-cache noise on a 2-core VM; no op grows per call


def _leak_check():
    path = Path(__file__).resolve().parent.parent / "tools" / "leak_check.py"
    spec = importlib.util.spec_from_file_location("leak_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LEAK = _leak_check()
CASES = LEAK.cases() + LEAK.generation_loops(CALLS)


@pytest.mark.parametrize("idx", range(len(CASES)), ids=[name for name, _ in CASES])
def test_rss_stays_flat(idx):
    name, fn = CASES[idx]
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        r = LEAK.measure(fn, CALLS)
    finally:
        torch.set_num_threads(old)
    growth = r["end"] - r["start"]
    assert growth <= MAX_GROWTH_MB, f"{name}: RSS grew {growth:.1f} MB over {CALLS} calls"
