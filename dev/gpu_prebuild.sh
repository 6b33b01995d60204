#!/usr/bin/env bash
# Builds the GPU machine's attn_ext._C on this (CPU) machine, so a lent GPU session spends its
# device minutes on tests and benchmarks instead of the build (several minutes on 16 cores, out
# of 15 device-minutes a session).
#
#   bash dev/gpu_prebuild.sh          # here, before the first device call (~25 min on 2 cores)
#   bash dev/gpu_prebuild.sh check    # there (dev/gpu_session.sh's build phase): 0 if the
#                                     # carried .so was built from this tree for this torch
#
# The device image (/work/.library/device/KINDS.md) runs Python 3.12 with torch 2.11.0+cu130;
# PyPI's torch 2.11.0 wheel for Linux is that same build (same git_version), so a Python 3.12
# venv with it (~5 GB, in $PREBUILD_VENV, outside the repository) builds a `_C` the device
# imports. The build runs in a clone of HEAD ($PREBUILD_CLONE): uncommitted edits are not in
# it, and the digest below is of HEAD's files, so a later edit to a source makes `check` refuse
# the .so.
#
# Output, ignored by git, for the device tool's `carry` (with .whl): .gpu_prebuild/
#   _C.cpython-312-x86_64-linux-gnu.so   debug sections stripped (~10 MB)
#   BUILD                                what `check` compares: digest, torch, arch list
#
# Also a check in itself: it compiles the op wrappers and kernels against the device's torch
# headers in C++17 (CI's compile check uses the local torch 2.13 in C++20; a difference between
# the two broke a device build on 2026-11-26, dev/gpu_notes.md).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DEST=$ROOT/.gpu_prebuild
# What the device has (KINDS.md): change both together when its image changes.
TORCH_SPEC=torch==2.11.0
PY_VERSION=3.12
ARCHS=${TORCH_CUDA_ARCH_LIST:-9.0a}  # dev/gpu_session.sh's default

# The inputs of the build: every file setup.py compiles or reads, and the arch list (files in
# byte order, so the device computes the same digest whatever its locale).
digest() {
  (
    cd "$1"
    find csrc -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum
    sha256sum setup.py pyproject.toml
    echo "TORCH_CUDA_ARCH_LIST=$ARCHS"
  ) | sha256sum | cut -c1-16
}

if [ "${1:-}" = check ]; then
  PY=${PYTHON:-python3}
  [ -f "$DEST/BUILD" ] || { echo "prebuilt: none carried"; exit 1; }
  want="digest=$(digest "$ROOT") torch=$("$PY" -c 'import torch; print(torch.__version__, torch.version.git_version)')"
  have=$(grep -E '^digest=' "$DEST/BUILD")
  if [ "$want" != "$have" ]; then
    echo "prebuilt: stale (carried: $have; here: $want)"
    exit 1
  fi
  so=$(ls "$DEST"/_C*"$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')" 2>/dev/null || true)
  [ -n "$so" ] || { echo "prebuilt: no .so for this Python"; exit 1; }
  echo "prebuilt: matches ($have)"
  exit 0
fi

VENV=${PREBUILD_VENV:-/tmp/attn_ext_prebuild_venv}
CLONE=${PREBUILD_CLONE:-/tmp/attn_ext_prebuild_src}
if [ ! -x "$VENV/bin/python" ]; then
  # The first candidate that runs: pyenv's shim for python3.12 exists whether or not that
  # version is selected, and fails when it is not.
  py=
  for c in "$(command -v "python$PY_VERSION")" $(ls ~/.pyenv/versions/"$PY_VERSION".*/bin/python 2>/dev/null); do
    [ -n "$c" ] && "$c" -c '' 2>/dev/null && { py=$c; break; }
  done
  [ -n "$py" ] || { echo "gpu_prebuild: no Python $PY_VERSION here"; exit 1; }
  "$py" -m venv "$VENV"
  # torch with its CUDA libraries (import torch loads them), the build tools, CUTLASS headers.
  "$VENV/bin/pip" install -q "$TORCH_SPEC" numpy setuptools ninja wheel
  "$VENV/bin/pip" install -q --no-deps "nvidia-cutlass==${ATTN_EXT_CUTLASS_VERSION:-4.2.0.0}"
fi
# A clone kept between runs: its build/ objects make a rebuild after an edit incremental (ninja
# compares times, and the reset rewrites only the files that differ).
if [ -d "$CLONE/.git" ]; then
  git -C "$CLONE" fetch -q "$ROOT" HEAD && git -C "$CLONE" reset -q --hard FETCH_HEAD
  git -C "$CLONE" clean -qfdx -e build
else
  git clone -q "$ROOT" "$CLONE"
fi
dig=$(digest "$CLONE")  # before the build: what the device's copy of the tree will hold
# Hand-set CUDA_HOME: torch finds no CUDA runtime without a GPU and guesses /usr/local (where
# this machine's nvcc is a wrapper script, not the toolkit).
cuda_home=${CUDA_HOME:-/usr/local/cuda}
[ -x "$cuda_home/bin/nvcc" ] || cuda_home=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
t0=$(date +%s)
(cd "$CLONE" && CUDA_HOME=$cuda_home TORCH_CUDA_ARCH_LIST=$ARCHS ATTN_EXT_CUDA=1 \
  MAX_JOBS=${MAX_JOBS:-$(nproc)} "$VENV/bin/python" setup.py build_ext --inplace > build.log 2>&1) ||
  { tail -30 "$CLONE/build.log"; echo "gpu_prebuild: build failed (log: $CLONE/build.log)"; exit 1; }
so=$(ls "$CLONE"/attn_ext/_C*.so)
# Import it with the device's torch (CPU only here: no GPU needed to load the CUDA kernels).
(cd "$CLONE" && "$VENV/bin/python" -c "
import attn_ext, torch
assert torch._C._dispatch_has_kernel_for_dispatch_key('attn_ext::attention', 'CUDA'), 'no CUDA kernels in _C'")
rm -rf "$DEST" && mkdir -p "$DEST"
strip --strip-debug -o "$DEST/$(basename "$so")" "$so"
{
  echo "digest=$dig torch=$("$VENV/bin/python" -c 'import torch; print(torch.__version__, torch.version.git_version)')"
  echo "commit=$(git -C "$CLONE" rev-parse --short HEAD) arch=$ARCHS built=$(date -u +%FT%TZ) seconds=$(( $(date +%s) - t0 ))"
} > "$DEST/BUILD"
cat "$DEST/BUILD"
du -h "$DEST"/_C*.so
