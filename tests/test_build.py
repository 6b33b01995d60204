"""The built extension links the C++ runtime the way torch does: dynamically. A copy of
libstdc++ inside attn_ext._C (seen on a GPU image's toolchain) crashed the first error
message that formatted a number, so every bad-input test there segfaulted."""

import shutil
import subprocess

import pytest

import attn_ext


def _dynamic_section(path):
    if shutil.which("readelf") is None:
        pytest.skip("readelf (binutils) not installed")
    return subprocess.run(
        ["readelf", "-d", "-W", path], capture_output=True, text=True, check=True
    ).stdout


def _exported_symbols(path):
    if shutil.which("nm") is None:
        pytest.skip("nm (binutils) not installed")
    out = subprocess.run(
        ["nm", "-D", "--defined-only", path], capture_output=True, text=True, check=True
    ).stdout
    return out.splitlines()


def test_links_libstdcxx_dynamically():
    so = attn_ext._C.__file__
    needed = [line for line in _dynamic_section(so).splitlines() if "(NEEDED)" in line]
    assert any("libstdc++.so" in line for line in needed), (
        f"{so} does not load libstdc++ dynamically:\n" + "\n".join(needed)
    )


def test_carries_no_copy_of_libstdcxx():
    # _ZNSt8ios_base4InitC1Ev is std::ios_base::Init::Init(), defined only by libstdc++ itself.
    syms = _exported_symbols(attn_ext._C.__file__)
    own = [
        s for s in syms if s.split()[-1] in ("_ZNSt8ios_base4InitC1Ev", "_ZNSt6locale7classicEv")
    ]
    assert not own, f"attn_ext._C defines libstdc++'s own symbols: {own}"
