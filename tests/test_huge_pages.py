"""Large fresh CPU outputs of the memory-bound ops are advised onto transparent huge pages
(common/tensors.cpp says why; the attention kernels' outputs, bound by their products, are not).

Each case builds one output of at least 32 MB (the size from which glibc always maps a fresh
allocation of its own) through one allocation site, then reads the flags of the mapping that
holds the output's middle from /proc/self/smaps: ``hg`` is MADV_HUGEPAGE. Below 32 MB, and under
ATTN_EXT_HUGE_PAGES=0, no advice is given. The flag, not a timing, is checked: whether Linux
then hands out 2 MB pages depends on the machine (THP mode, free memory)."""

import os
import subprocess
import sys

import pytest
import torch

import attn_ext

_ops = torch.ops.attn_ext
MIN_BYTES = 32 << 20  # kHugePageMinBytes (common/tensors.h)
THP = "/sys/kernel/mm/transparent_hugepage/enabled"

pytestmark = [
    pytest.mark.skipif(
        not sys.platform.startswith("linux") or not os.path.exists(THP),
        reason="transparent huge pages are a Linux feature this kernel lacks",
    ),
    pytest.mark.skipif(
        os.environ.get("THP_MEM_ALLOC_ENABLE") == "1",
        reason="torch itself advises every large allocation under THP_MEM_ALLOC_ENABLE=1",
    ),
]


def _vm_flags(address: int) -> set:
    """VmFlags of the mapping of this process that holds `address`."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def _middle(t: torch.Tensor) -> int:
    return t.data_ptr() + t.nbytes // 2


def _rows(elems_per_row: int, nbytes: int, dtype=torch.float32) -> int:
    return -(-nbytes // (elems_per_row * torch.finfo(dtype).bits // 8))


def _weights(nbytes):
    """fp32 and bf16 weights, from attention_weights and from attention_with_weights."""
    outs = []
    for dtype in (torch.float32, torch.bfloat16):
        s = int((nbytes / (torch.finfo(dtype).bits // 8)) ** 0.5) + 1
        q = torch.randn(1, 1, s, 8, dtype=dtype)
        outs.append(attn_ext.attention_weights(q, q))
        outs.append(attn_ext.attention_with_weights(q, q, q)[1])
    return outs


def _merge(nbytes):
    s = _rows(64, nbytes)
    o, lse = torch.randn(1, 1, s, 64), torch.randn(1, 1, s)
    out, _ = _ops.merge_attention_states(o, lse, o, lse)
    grads = _ops.merge_attention_states_backward(out, None, o, lse, o, lse)
    return [out, grads[0], grads[2]]


def _spatial(nbytes):
    side = 64
    x = (
        torch.randn(_rows(2 * side * side, nbytes), 1, side, side)
        .expand(-1, 2, -1, -1)
        .contiguous()
    )
    gate = torch.randn(x.size(0), 1, side, side)
    out = attn_ext.spatial_gate(x, gate)
    grad_x, _ = _ops.spatial_gate_backward(out, x, gate)
    pooled, argmax = _ops.channel_pool(x)
    pool_grad = _ops.channel_pool_backward(pooled, argmax, 2)
    return [out, grad_x, pool_grad]


def _rope(nbytes):
    return [attn_ext.rope(torch.randn(1, _rows(64, nbytes), 1, 64))]


def _linear(nbytes):
    q, k, v = (torch.randn(1, 1, _rows(16, nbytes), 16, requires_grad=True) for _ in range(3))
    out = attn_ext.linear_attention(q, k, v)
    return [out, *torch.autograd.grad(out.sum(), (q, k, v))]


def _tpa(nbytes):
    s = _rows(64, nbytes)
    return [attn_ext.tpa_expand(torch.randn(1, s, 1, 1), torch.randn(1, s, 1, 64))]


SITES = {
    "weights": _weights,
    "merge": _merge,
    "spatial": _spatial,
    "rope": _rope,
    "linear": _linear,
    "tpa": _tpa,
}


@pytest.mark.parametrize("site", SITES)
def test_large_outputs_are_advised(site, monkeypatch):
    monkeypatch.delenv("ATTN_EXT_HUGE_PAGES", raising=False)
    outs = SITES[site](MIN_BYTES + (4 << 20))
    for i, t in enumerate(outs):
        assert t.nbytes >= MIN_BYTES, f"{site} output {i}: {t.nbytes} bytes, test too small"
        assert "hg" in _vm_flags(_middle(t)), f"{site} output {i} ({t.nbytes} B) not advised"


def _advised_outputs(site: str, nbytes: int) -> list:
    """Descriptions of the outputs of `site` at `nbytes` whose mapping is advised."""
    return [
        f"{site}: a {t.nbytes} B output was advised"
        for t in SITES[site](nbytes)
        if "hg" in _vm_flags(_middle(t))
    ]


NEGATIVE_SITES = ["merge", "spatial", "rope"]


def test_small_outputs_and_opt_out_are_not_advised():
    """In a fresh process: a long-lived one may serve a large request from a free stretch of its
    heap (glibc's mmap threshold applies only when the heap has none), which the advice then
    marks, and a later small output can land there."""
    code = (
        "import os, sys; sys.path.insert(0, sys.argv[1]); import test_huge_pages as t\n"
        "bad = [m for s in t.NEGATIVE_SITES for m in t._advised_outputs(s, t.MIN_BYTES // 2)]\n"
        "os.environ['ATTN_EXT_HUGE_PAGES'] = '0'\n"
        "bad += [m + ' under ATTN_EXT_HUGE_PAGES=0' for s in t.NEGATIVE_SITES\n"
        "        for m in t._advised_outputs(s, t.MIN_BYTES + (4 << 20))]\n"
        "print('\\n'.join(bad))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "ATTN_EXT_HUGE_PAGES"}
    proc = subprocess.run(
        [sys.executable, "-c", code, os.path.dirname(os.path.abspath(__file__))],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "", proc.stdout


def test_advice_changes_no_value(monkeypatch):
    x = torch.randn(40, 16, 128, 128)
    gate = torch.randn(40, 1, 128, 128)
    monkeypatch.setenv("ATTN_EXT_HUGE_PAGES", "1")
    on = attn_ext.spatial_gate(x, gate)
    monkeypatch.setenv("ATTN_EXT_HUGE_PAGES", "0")
    off = attn_ext.spatial_gate(x, gate)
    assert on.nbytes >= MIN_BYTES
    assert torch.equal(on, off)


def test_bad_setting_is_named(monkeypatch):
    monkeypatch.setenv("ATTN_EXT_HUGE_PAGES", "yes")
    with pytest.raises(RuntimeError, match="ATTN_EXT_HUGE_PAGES: expected 0 or 1, got 'yes'"):
        attn_ext.rope(torch.randn(1, _rows(64, MIN_BYTES), 1, 64))
