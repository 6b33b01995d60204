#!/usr/bin/env bash
# Sets up a machine for attn_ext and builds it in place (editable install).
#   bash tools/bootstrap.sh        what `python -m attn_ext` needs
#   bash tools/bootstrap.sh test   ... plus the test dependencies
# Installs only what is missing, so it also works offline where torch and pytest are
# preinstalled (GPU machines). The build uses the installed torch (--no-build-isolation):
# an isolated build environment would download a second, multi-GB torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
missing() { ! "$PY" -c "import $1" >/dev/null 2>&1; }

# torch first: the build imports it. The pinned version is the CPU build this project is
# developed and tested with; any torch >= 2.6 already present is used as it is.
if missing torch; then "$PY" -m pip install "torch==${ATTN_EXT_TORCH_VERSION:-2.13.0}"; fi

pkgs=()
missing ninja && pkgs+=(ninja)
missing setuptools && pkgs+=("setuptools>=64")
missing wheel && pkgs+=(wheel)
if [ "${1:-}" = "test" ]; then
  missing pytest && pkgs+=("pytest>=7")
  missing numpy && pkgs+=(numpy)
  missing hypothesis && pkgs+=(hypothesis)
fi
if [ ${#pkgs[@]} -gt 0 ]; then "$PY" -m pip install "${pkgs[@]}"; fi
# The lint check (tests/test_lint.py) at the versions .pre-commit-config.yaml pins; offline
# machines without them skip it.
if [ "${1:-}" = "test" ]; then
  lint=()
  missing_cmd() { ! command -v "$1" >/dev/null 2>&1; }
  missing_cmd ruff && lint+=("ruff==0.17.6")
  missing_cmd clang-format && lint+=("clang-format==19.1.7")
  if [ ${#lint[@]} -gt 0 ]; then
    "$PY" -m pip install "${lint[@]}" || echo "bootstrap: could not install ${lint[*]} (offline?): tests/test_lint.py will be skipped"
  fi
fi
# transformers is optional for the suite (its tests skip without it): an offline machine goes on.
if [ "${1:-}" = "test" ] && missing transformers; then
  "$PY" -m pip install "transformers==5.23.0" ||
    echo "bootstrap: could not install transformers (offline?): tests/test_transformers.py will be skipped"
fi

# The CuTe/CUTLASS headers of the CUDA kernels, wherever nvcc is (the CUDA build and CI's
# compile check, tests/test_cuda_build.py, need them): headers only, so none of the package's
# Python dependencies.
if command -v nvcc >/dev/null 2>&1 && missing cutlass_library; then
  "$PY" -m pip install --no-deps "nvidia-cutlass==${ATTN_EXT_CUTLASS_VERSION:-4.2.0.0}" ||
    echo "bootstrap: could not install nvidia-cutlass (offline?): the CUDA build leaves the CuTe forward out"
fi

# The objects persist in build/ (setup.py's BUILD_TEMP): running this again, or after editing a
# kernel, recompiles only what changed (ninja), then links.
MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PY" -m pip install --no-build-isolation --no-deps -e .
"$PY" -c "import attn_ext, torch; print('attn_ext', attn_ext.__version__, 'built against torch', torch.__version__)"
