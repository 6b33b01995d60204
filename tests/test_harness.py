"""The benchmark harness (attn_ext.testing.harness): the interleaved timer on fake candidates and
a fake clock, the history CSV, the Markdown table, and one driver's --quick run end to end."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attn_ext.testing import harness

REPO = Path(__file__).resolve().parent.parent


class FakeClock:
    """A clock that only the fake candidates move: each call advances it by its next duration."""

    def __init__(self):
        self.now = 0.0
        self.calls = []

    def __call__(self):
        return self.now

    def candidate(self, name, durations):
        it = iter(durations)

        def run():
            self.calls.append(name)
            self.now += next(it)
            return name

        return run


def test_rounds_interleave_in_alternating_order_after_warmup():
    clock = FakeClock()
    fns = {n: clock.candidate(n, [1.0] * 10) for n in ("a", "b", "c")}
    t = harness.time_interleaved(fns, "cpu", warmup=1, min_rounds=3, max_rounds=3, clock=clock)
    assert clock.calls == ["a", "b", "c"] + ["a", "b", "c"] + ["c", "b", "a"] + ["a", "b", "c"]
    assert t.results == {"a": "a", "b": "b", "c": "c"}
    assert [sorted(r) for r in t.rounds] == [["a", "b", "c"]] * 3


def test_ratio_is_the_median_of_per_round_ratios():
    clock = FakeClock()
    # warm-up, then three rounds: a slow phase (round 2) slows both alike
    a = clock.candidate("a", [1.0, 1.0, 5.0, 1.0])
    b = clock.candidate("b", [1.0, 2.0, 10.0, 3.0])
    t = harness.time_interleaved(
        {"a": a, "b": b}, "cpu", warmup=1, min_rounds=3, max_rounds=3, clock=clock
    )
    assert t.times("a") == [1.0, 5.0, 1.0] and t.times("b") == [2.0, 10.0, 3.0]
    assert t.median_s("a") == 1.0 and t.median_s("b") == 3.0
    assert t.ratio("b", "a") == 2.0  # per-round 2, 2, 3; the ratio of the medians would be 3
    assert t.ratio("a", "b") == 0.5
    assert t.ms("a") == 1000.0


def test_rounds_follow_target_time_within_bounds_and_errors_are_kept():
    clock = FakeClock()
    cheap = clock.candidate("cheap", [0.1] * 100)
    costly = clock.candidate("costly", [1.0] * 100)

    def broken():
        raise RuntimeError("no kernel for this cell\nsecond line")

    t = harness.time_interleaved(
        {"cheap": cheap, "costly": costly, "broken": broken},
        "cpu",
        warmup=1,
        min_rounds=2,
        max_rounds=8,
        target_s=0.5,
        clock=clock,
    )
    assert len(t.times("cheap")) == 5 and len(t.times("costly")) == 2
    assert t.errors == {"broken": "RuntimeError: no kernel for this cell"}
    assert t.ratio("costly", "cheap") == pytest.approx(10.0) and t.ms("broken") is None


def test_close_call_runs_more_rounds_of_the_first_two():
    clock = FakeClock()
    fns = {"a": clock.candidate("a", [1.0] * 20), "b": clock.candidate("b", [1.05] * 20)}
    t = harness.time_interleaved(
        fns, "cpu", min_rounds=2, max_rounds=2, close_margin=0.15, close_rounds=7, clock=clock
    )
    assert len(t.times("a")) == len(t.times("b")) == 7
    far = {"a": clock.candidate("a", [1.0] * 20), "b": clock.candidate("b", [2.0] * 20)}
    t = harness.time_interleaved(
        far, "cpu", min_rounds=2, max_rounds=2, close_margin=0.15, close_rounds=7, clock=clock
    )
    assert len(t.times("a")) == 2


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError):
        harness.time_interleaved({}, "cpu", min_rounds=3, max_rounds=2)


def test_history_rows_share_one_schema(tmp_path):
    path = tmp_path / "history.csv"
    harness.append_history(
        [
            harness.history_row(
                family="decode", candidate="attn_ext", ms=0.5, S=512, Hkv=8, new_tokens=16
            )
        ],
        path,
    )
    harness.append_history(
        [
            harness.history_row(
                family="attention",
                candidate="sdpa",
                ms=2.0,
                ratio_to="attn_ext",
                ratio=1.25,
                tflops=None,
            )
        ],
        path,
    )
    with path.open() as f:
        rows = list(csv.reader(f))
    assert tuple(rows[0]) == harness.HISTORY_COLUMNS and len(rows) == 3
    first = dict(zip(rows[0], rows[1]))
    assert first["params"] == "Hkv=8;new_tokens=16" and first["S"] == "512" and first["ms"] == "0.5"
    second = dict(zip(rows[0], rows[2]))
    assert second["ratio"] == "1.25" and second["tflops"] == "" and second["params"] == ""
    other = tmp_path / "old.csv"
    other.write_text("date,candidate,ms\n")
    with pytest.raises(ValueError):
        harness.append_history([harness.history_row(candidate="x")], other)


def test_markdown_table():
    text = harness.markdown_table(["S", "ratio"], [[512, "1.20x"], [16384, "-"]])
    assert text.splitlines() == [
        "|     S | ratio |",
        "| ----: | ----: |",
        "|   512 | 1.20x |",
        "| 16384 |     - |",
    ]
    with pytest.raises(ValueError):
        harness.markdown_table(["a", "b"], [[1]])


def test_quick_driver_run_writes_table_history_and_plot(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "bench_decode.py"),
        "--quick",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = (tmp_path / "decode_cpu.md").read_text()
    assert "attn_ext step (ms)" in table and "sdpa/attn_ext gen" in table
    rows = harness.read_history(tmp_path / "history.csv")
    steps = [r for r in rows if r["mode"] == "step"]
    bd = _bench_decode_module()  # every default CPU candidate ran
    assert {r["candidate"] for r in steps} == set(bd.CANDIDATES) - set(bd.CUDA_ONLY)
    assert {"attn_ext", "fp8", "sdpa", "doc"} <= set(bd.CANDIDATES)
    assert {r["S"] for r in steps} == {"256", "1024"}  # --quick's prompts
    assert all(r["family"] == "decode" and float(r["ms"]) > 0 for r in steps)
    assert all(float(r["ratio"]) > 0 for r in steps if r["candidate"] != "attn_ext")
    pytest.importorskip("matplotlib")
    assert (tmp_path / "decode_cpu.png").stat().st_size > 0


def _bench_decode_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "bench_decode", REPO / "benchmarks" / "bench_decode.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_decode_layers_step_every_layer_and_time_per_layer():
    """bench_decode's --layers: a step appends to and reads each layer's own cache (so the
    layers' caches are distinct memory, read in turn), and times are divided by the layers."""
    bd = _bench_decode_module()
    P, layers = 5, 3
    prompt = (torch.randn(1, 2, P, 16), torch.randn(1, 2, P, 16))
    new = (torch.randn(1, 4, 1, 16), torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16))
    model = bd.build("attn_ext", prompt, 16, layers)
    caches = [c.cache for c in model.caches]
    assert len({c.k.data_ptr() for c in caches}) == layers
    out = model.step(*new)
    assert [c.lengths.tolist() for c in caches] == [[P + 1]] * layers
    one = bd.build("attn_ext", prompt, 16, 1)
    torch.testing.assert_close(out, one.step(*new), rtol=0, atol=0)
    timing = harness.Timing(rounds=[{"a": 3.0, "b": 6.0}], results={"a": 1})
    scaled = harness.divided(timing, layers)
    assert scaled.rounds == [{"a": 1.0, "b": 2.0}] and scaled.results == {"a": 1}
    assert harness.divided(timing, 1) is timing


def test_repeated_runs_back_to_back_and_returns_the_last():
    calls = []
    run = harness.repeated(lambda: calls.append(len(calls)) or len(calls), 4)
    assert run() == 4 and calls == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="calls"):
        harness.repeated(lambda: None, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_runs_the_captured_calls():
    """cuda_graph_replay's call replays all `reps` calls on the tensors they captured: a graph
    of three in-place increments adds three per replay, and the result is the last call's."""
    x = torch.zeros(4, device="cuda")
    replay = harness.cuda_graph_replay(lambda: x.add_(1.0), 3)
    after_warmup = x.clone()  # the warm-up calls ran for real (CUDA_GRAPH_WARMUP of them)
    assert torch.equal(after_warmup, torch.full_like(x, float(harness.CUDA_GRAPH_WARMUP)))
    out = replay()
    replay()
    torch.cuda.synchronize()
    assert torch.equal(x, after_warmup + 6.0)
    assert out.data_ptr() == x.data_ptr()
