"""Shared pytest fixtures for the attn_ext tests.

Every test that touches a tensor takes the ``device`` fixture: it runs on
"cpu" and on "cuda", the latter skipped when no GPU is visible, so the suite
passes on a CPU-only machine and means the same on a GPU one.
"""

import pytest
import torch

CUDA = torch.cuda.is_available()

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="no CUDA device visible")),
]


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(autouse=True)
def _deterministic_seed():
    """Every test starts from the same RNG state, so failures reproduce."""
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session", autouse=True)
def _exact_float32_matmul():
    """The float32 references must not run in TF32 on a GPU (that would
    loosen the numerics rule, which measures against the torch reference)."""
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def pytest_addoption(parser):
    parser.addoption(
        "--fuzz",
        action="store_true",
        help="property fuzzing at full size (tests/test_fuzz.py: 10,000 examples per family, "
        "random seeds) instead of CI's fixed-seed profile",
    )
    parser.addoption(
        "--fuzz-examples",
        type=int,
        default=10_000,
        help="examples per family of --fuzz (default 10,000)",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a test that takes more than a second or two")
    try:
        from hypothesis import HealthCheck, settings
    except ImportError:  # tests/test_fuzz.py skips without hypothesis
        return
    # CI: a few hundred derandomized examples per family (reproducible, within CI's budget);
    # --fuzz: 10,000 fresh ones per family. No deadline: example times vary with the shapes.
    common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("ci", max_examples=150, derandomize=True, **common)
    settings.register_profile("fuzz", max_examples=config.getoption("--fuzz-examples"), **common)
    settings.load_profile("fuzz" if config.getoption("--fuzz") else "ci")


def pytest_terminal_summary(terminalreporter):
    """Examples run per family by tests/test_fuzz.py (the figure the README reports)."""
    counts = getattr(terminalreporter.config, "_attn_ext_fuzz_counts", None)
    if counts:
        terminalreporter.write_sep("-", "fuzz examples per family")
        for family, n in sorted(counts.items()):
            terminalreporter.write_line(f"{family:24s} {n}")


@pytest.fixture(scope="session")
def setup_py():
    """The repository's setup.py as a module, for its build logic (setup() itself runs only
    when the file is __main__)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "setup.py"
    spec = importlib.util.spec_from_file_location("attn_ext_setup", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
