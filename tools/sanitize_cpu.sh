#!/usr/bin/env bash
# The CPU suite (or the tests given) under AddressSanitizer + UndefinedBehaviorSanitizer.
#   bash tools/sanitize_cpu.sh                       # a representative slice (see TESTS)
#   bash tools/sanitize_cpu.sh tests/test_varlen.py  # any pytest arguments
# Builds a sanitizer copy of the extension in a copy of the tree (/tmp/attn_ext_sanitize: the
# working tree's own build is untouched), then runs pytest there with the sanitizers' runtime
# preloaded into Python. ASan and UBSan abort on the first error. Leak detection is off by
# default (ATTN_EXT_DETECT_LEAKS=1 turns it on): LSan then also reports the process-lifetime
# allocations of CPython, torch and every shell the tests start (the preload reaches them), and
# aborts the run on them; leaks of our code are measured by tools/leak_check.py (RSS over
# 10,000 calls per op) instead.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${ATTN_EXT_SANITIZE_DIR:-/tmp/attn_ext_sanitize}
PY=${PYTHON:-python}
mkdir -p "$WORK/src"
# the tracked and untracked-but-not-ignored files, as in the working tree (build outputs stay)
(cd "$ROOT" && git ls-files -co --exclude-standard -z) |
  (cd "$ROOT" && xargs -0 cp --parents -t "$WORK/src")
cd "$WORK/src"
ATTN_EXT_SANITIZE=address,undefined MAX_JOBS=${MAX_JOBS:-2} "$PY" setup.py build_ext --inplace \
  > "$WORK/build.log" 2>&1 || { tail -30 "$WORK/build.log"; exit 1; }
cat > "$WORK/lsan.supp" <<'SUPP'
leak:libpython
leak:libtorch
leak:libc10
leak:libgomp
leak:_PyObject
leak:PyMem
SUPP
TESTS=("$@")
if [ ${#TESTS[@]} -eq 0 ]; then
  # every CPU kernel family, forward and backward, kept to minutes under the sanitizers
  TESTS=(tests/test_attention.py tests/test_varlen.py tests/test_decoding.py
         tests/test_errors.py tests/test_linear_attention.py tests/test_spatial.py
         tests/test_tpa.py tests/test_mla.py tests/test_weights.py tests/test_dropout.py
         tests/test_threads.py -k "not compile")
fi
export ASAN_OPTIONS="detect_leaks=${ATTN_EXT_DETECT_LEAKS:-0}:abort_on_error=1:halt_on_error=1:detect_odr_violation=0"
export LSAN_OPTIONS="suppressions=$WORK/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="halt_on_error=1:abort_on_error=1:print_stacktrace=1"
# the runtime preloaded into Python only (a shell or compiler it starts is not ours to check)
LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)" \
  "$PY" -m pytest -q -p no:cacheprovider -x "${TESTS[@]}"
