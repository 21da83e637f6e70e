#!/usr/bin/env bash
# Before a GPU run, on a machine without one: the lent H200 machine's software in a venv of its
# own, and everything bench/device_check.sh will do there that a CPU can do, so that the
# machine's few minutes are not spent on an import error or a version difference.
#
#   bash bench/device_rehearsal.sh        (or: make device-rehearsal; 12-20 min, 10-13 of them
#                                          the tests; 5 GB of wheels the first time)
#
# The machine (the device tool's KINDS.md, 2026-11): Python 3.12, torch 2.11.0+cu130, triton
# 3.6.0, transformers 5.17.0, peft, numpy 2.5. Here: .venv-device with those releases
# (DEVICE_PYTHON, DEVICE_TORCH, DEVICE_TRITON, DEVICE_TRANSFORMERS to change them), then
#
#   1. fastllm built against that torch (C++ CPU kernels), in a mirror of the working tree
#      (.device-rehearsal/src, as .ci/cuda_build_check.sh mirrors it): the repository's own
#      build is never touched;
#   2. csrc/cuda compiled by nvcc against that torch (.ci/cuda_build_check.sh with this venv);
#   3. every Triton kernel compiled for sm_90 by that Triton and torch (.ci/kernel_check.py);
#   4. the test suite on the CPU, the Triton kernels under 3.6's interpreter (REHEARSAL_TESTS
#      to narrow it);
#   5. bench/device_bench.py --smoke: every case of the GPU measurements, tiny, on the CPU.
#
# NumPy is 2.3 here, not the machine's 2.5: Triton 3.6's interpreter converts 1-element arrays
# with int(), which NumPy 2.4 turned from a deprecation into an error (TypeError: only
# 0-dimensional arrays can be converted to Python scalars). The GPU compiles the kernels, so the
# machine never interprets them.
#
# Not part of .ci/run (the wheels are 5 GB); run it after changes that touch the Python API
# of torch or transformers, the build, or the device scripts, before a session's GPU run.
set -uo pipefail
cd "$(dirname "$0")/.." || exit
ROOT=$PWD
START=$SECONDS
log() { printf '[device-rehearsal %3ds] %s\n' $((SECONDS - START)) "$*"; }

DEVICE_PYTHON=${DEVICE_PYTHON:-python3.12}
DEVICE_TORCH=${DEVICE_TORCH:-2.11.0}
DEVICE_TRITON=${DEVICE_TRITON:-3.6.0}
DEVICE_TRANSFORMERS=${DEVICE_TRANSFORMERS:-5.17.0}
VENV=$ROOT/.venv-device
PY=$VENV/bin/python
DIR=$ROOT/.device-rehearsal
SPEC="torch==$DEVICE_TORCH triton==$DEVICE_TRITON transformers==$DEVICE_TRANSFORMERS"
FAILED=()

# --- the venv -------------------------------------------------------------------------------------
if [[ -x $PY && $(cat "$VENV/.fastllm-deps" 2>/dev/null) == "torch==$DEVICE_TORCH" &&
      $(cat "$VENV/.rehearsal-spec" 2>/dev/null) == "$SPEC" ]]; then
  log "reusing $VENV ($SPEC)"
else
  # a pyenv shim answers for versions that are installed but not selected: ask pyenv's folder
  python=$DEVICE_PYTHON
  if ! "$python" -c pass 2>/dev/null; then
    python=$(ls -d "$(pyenv root 2>/dev/null || echo ~/.pyenv)"/versions/*/bin/"$DEVICE_PYTHON" \
      2>/dev/null | tail -n 1)
    [[ -n $python ]] || { log "FAILED: no $DEVICE_PYTHON (set DEVICE_PYTHON)"; exit 1; }
  fi
  log "creating $VENV: $python, $SPEC (about 5 GB from the package index)"
  rm -rf "$VENV"
  "$python" -m venv "$VENV" || exit 1
  # shellcheck disable=SC2086
  "$PY" -m pip install -q --no-compile $SPEC "numpy>=2,<2.4" peft safetensors accelerate \
    pytest pytest-xdist pytest-benchmark ninja pybind11 pyyaml tqdm matplotlib setuptools wheel ||
    { log "FAILED: pip install into $VENV"; exit 1; }
  # .ci/cuda_build_check.sh reuses a venv whose stamp names its torch
  echo "torch==$DEVICE_TORCH" >"$VENV/.fastllm-deps"
  echo "$SPEC" >"$VENV/.rehearsal-spec"
fi
"$PY" -c 'import sys, numpy, torch, triton, transformers
print("python", sys.version.split()[0], "| torch", torch.__version__, "| triton",
      triton.__version__, "| transformers", transformers.__version__, "| numpy", numpy.__version__)'

# --- 1. fastllm against that torch, in a mirror of the working tree -----------------------------
SRC=$DIR/src
counts=$(bash .ci/mirror_tree.sh "$SRC") || { log "FAILED: mirroring the tree to $SRC"; exit 1; }
log "working tree mirrored to $SRC ($counts)"
log "building fastllm against torch $DEVICE_TORCH (C++ CPU kernels) in $SRC ..."
# -g0: no debug info, half the compile time (as make build)
if (cd "$SRC" && CFLAGS="${CFLAGS:-} -g0" FASTLLM_SKIP_CUDA_BUILD=1 MAX_JOBS=${MAX_JOBS:-2} \
    "$PY" -m pip install -q \
    --no-index --no-build-isolation --no-deps --use-pep517 -e . >"$DIR/build.log" 2>&1); then
  log "build: ok"
else
  tail -n 30 "$DIR/build.log"
  log "build: FAILED ($DIR/build.log)"
  exit 1
fi

# --- 2. csrc/cuda with nvcc against that torch ----------------------------------------------------
log "csrc/cuda against torch $DEVICE_TORCH (.ci/cuda_build_check.sh) ..."
if FASTLLM_CUDA_VENV=$VENV FASTLLM_CUDA_TORCH=torch==$DEVICE_TORCH \
    FASTLLM_CUDA_CHECK_DIR=$DIR/cuda bash .ci/cuda_build_check.sh >"$DIR/cuda.log" 2>&1; then
  tail -n 1 "$DIR/cuda.log"
else
  tail -n 30 "$DIR/cuda.log"
  FAILED+=(cuda)
fi

# --- 3. the Triton kernels compiled for sm_90 by that torch and Triton ---------------------------
log "Triton kernels for sm_90 (.ci/kernel_check.py) ..."
if (cd "$SRC" && "$PY" .ci/kernel_check.py >"$DIR/kernel_check.log" 2>&1); then
  tail -n 1 "$DIR/kernel_check.log"
else
  grep -E '^FAIL' "$DIR/kernel_check.log" | head -n 20
  tail -n 1 "$DIR/kernel_check.log"
  FAILED+=(kernel-check)
fi

# --- 4. the tests on the CPU ----------------------------------------------------------------------
log "tests (CPU; Triton under triton $DEVICE_TRITON's interpreter) ..."
# shellcheck disable=SC2086
# (-W: the interpreter's int() of 1-element arrays warns ~16,000 times under NumPy 2.3)
if (cd "$SRC" && TRITON_INTERPRET=1 "$PY" -m pytest -q -rfE -p no:cacheprovider \
    -W ignore::DeprecationWarning ${REHEARSAL_TESTS:-tests} >"$DIR/tests.log" 2>&1); then
  tail -n 1 "$DIR/tests.log"
else
  grep -E '^(FAILED|ERROR)' "$DIR/tests.log" | head -n 40
  tail -n 1 "$DIR/tests.log"
  FAILED+=(tests)
fi

# --- 5. the GPU measurements' script, tiny, on the CPU --------------------------------------------
log "bench/device_bench.py --smoke ..."
if (cd "$SRC" && "$PY" bench/device_bench.py --smoke --json "$DIR/smoke.json" \
    >"$DIR/smoke.log" 2>&1); then
  grep -c '' "$DIR/smoke.log" | sed 's/^/  smoke: lines of output: /'
else
  tail -n 30 "$DIR/smoke.log"
  FAILED+=(smoke)
fi

if ((${#FAILED[@]})); then
  log "FAILED: ${FAILED[*]} (logs in $DIR)"
  exit 1
fi
log "passed: the device machine's software builds, tests and runs the smoke bench (logs in $DIR)"
