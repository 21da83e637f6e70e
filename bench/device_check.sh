#!/usr/bin/env bash
# On a machine with a GPU: build fastllm with its CUDA kernels, run the GPU tests in parallel and
# the one measuring script (bench/device_bench.py: every number issue 18 asks for, interleaved,
# one JSON and one table), then print a summary. No CPU-only work (the static kernel check and
# the LoRA compile check run in CI, .ci/run).
#
#   bash bench/device_check.sh            (outputs under $OUT, else ./device_out)
#
# Made for the lent H200 machine (no network; python3 with torch, triton, transformers, peft,
# pytest, pytest-xdist, ninja and pybind11 installed): everything fits in DEVICE_CHECK_BUDGET
# seconds (default 360), each step has its own timeout so that one hang cannot eat the rest,
# later steps run even when an earlier one failed, and the exit status is non-zero when any step
# failed. Every step's timeout is cut to what is left of the budget less 25 s (timeout's 10 s
# kill grace and 15 s for the summary), so the whole stays within it whatever the steps take.
# Timed on an H200 (2026-12-04): build 73 s, the GPU tests 50-64 s of pytest with 12 workers
# (cut at 75 s with 8), the measurements 47 s (the model case 22-28 s), 213-237 s in all; each
# step's limit leaves room over that (a run cut short keeps what it measured: the tests' log
# says which ran, and device_bench.py rewrites its JSON after every case and between the model
# case's parts).
# BENCH_CASES=packed,model (and a narrower DEVICE_TESTS) measures issue 19 alone. $OUT gets 7
# files (build, wheels, gpu, versions, bench and tests logs, the bench JSON): the device tool
# brings back 8 at most, so a `| tee $OUT/...` fits once.
#
# Python packages the machine lacks travel as wheels in .whl/ (git-ignored), downloaded here
# (any machine with pip and PyPI; Python 3.12 manylinux wheels, as the lent machine runs):
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     --platform manylinux1_x86_64 -d .whl liger-kernel==0.8.5 peft==0.21.2
#
# (1.7 MB together: liger-kernel 0.9 MB for the model case's Liger-Kernel rows, which needs only
# torch and triton; peft 0.8 MB in case the image lacks it, whose needs (transformers,
# accelerate, huggingface_hub, safetensors, ...) the image has). Name .whl in the device tool's
# `carry`. This script installs the wheels whose package the machine does not already have into
# $WHEEL_DIR and puts that on PYTHONPATH, as this does for all of them by hand:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/fastllm-wheels .whl/*.whl && export PYTHONPATH=/tmp/fastllm-wheels
#
# Without .whl the model case reports Liger-Kernel as not installed and the rest runs as usual.
#
# Environment: PYTHON (default python3), FASTLLM_CUDA_ARCHS (default 9.0), MAX_JOBS (default 16),
# DEVICE_CHECK_BUDGET (seconds, default 360), DEVICE_TESTS (pytest arguments, default the GPU
# cases: -k "cuda or gpu" tests), TEST_WORKERS (pytest-xdist workers, default 12),
# BENCH_CASES (comma-separated cases of bench/device_bench.py; default all), WHEEL_DIR (where
# .whl/*.whl is installed, default /tmp/fastllm-wheels), FASTLLM_DEVICE_COMPILE=0 (without the
# model case's last part, the full step with each decoder layer compiled as `fastllm train
# torch_compile=true` does: one layer's graph for all 30, 12.6 s of compile on a Zen 4 CPU, not
# yet timed on the GPU machine; a part of its own, so an overrun cuts only it).
set -uo pipefail
cd "$(dirname "$0")/.." || exit

PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/device_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
BUDGET=${DEVICE_CHECK_BUDGET:-360}
export FASTLLM_CUDA_ARCHS=${FASTLLM_CUDA_ARCHS:-9.0}
export MAX_JOBS=${MAX_JOBS:-16}
START=$SECONDS

log() { printf '[device-check %3ds] %s\n' $((SECONDS - START)) "$*"; }

STEPS=()
FAILED=0
# run_step NAME LIMIT_S CMD...: run CMD with a timeout of LIMIT_S seconds, capped by what is left
# of the budget (keeping 25 s: timeout's 10 s kill grace, 15 s for the summary); output goes to
# $OUT/NAME.log.
run_step() {
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET - (SECONDS - START) - 25))
  ((limit > left)) && limit=$left
  if ((limit < 5)); then
    log "$name: SKIPPED (budget spent)"
    STEPS+=("$name|skipped|0")
    FAILED=1
    return 1
  fi
  log "$name (timeout ${limit}s) ..."
  local t0=$SECONDS rc=0
  timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1 || rc=$?
  local dt=$((SECONDS - t0)) status=ok
  if ((rc == 124 || rc == 137)); then
    status="TIMEOUT after ${limit}s"
  elif ((rc != 0)); then
    status="FAILED (rc=$rc)"
  fi
  log "$name: $status in ${dt}s"
  STEPS+=("$name|$status|$dt")
  if [[ $status != ok ]]; then
    FAILED=1
    tail -n 40 "$OUT/$name.log"
    return 1
  fi
  return 0
}

# 1. Build in place, CUDA kernels included.
log "nvcc: $(command -v nvcc || echo 'not on PATH') ${CUDA_HOME:+(CUDA_HOME=$CUDA_HOME)}"
build_ok=0
# --use-pep517: without it a recent setuptools' legacy `develop` re-runs pip with build
# isolation, which downloads setuptools and fails on a machine with no network.
run_step build 150 "$PY" -m pip install -v --no-index --no-build-isolation --no-deps --use-pep517 -e . &&
  build_ok=1
grep -E 'building fastllm._C with' "$OUT/build.log" | sed 's/^/    /'

# Wheels carried in .whl/ (see the top): those whose package the machine lacks go into WHEEL_DIR,
# which goes on PYTHONPATH for the steps below.
WHEEL_DIR=${WHEEL_DIR:-/tmp/fastllm-wheels}
# install_wheels PY DIR WHEEL...: installs into DIR the wheels whose package PY does not have.
install_wheels() {
  local py=$1 dir=$2 missing
  shift 2
  mapfile -t missing < <("$py" -c '
import importlib.metadata as md
import os
import sys

for wheel in sys.argv[1:]:
    name = os.path.basename(wheel).split("-")[0]
    try:
        print(f"{name}: the machine has {md.version(name)}", file=sys.stderr)
    except md.PackageNotFoundError:
        print(wheel)
' "$@")
  ((${#missing[@]})) || return 0
  printf 'installing %s\n' "${missing[@]}"
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$dir" "${missing[@]}"
}
if compgen -G '.whl/*.whl' >/dev/null; then
  export -f install_wheels
  # shellcheck disable=SC2016
  run_step wheels 60 bash -c 'install_wheels "$@"' wheels "$PY" "$WHEEL_DIR" .whl/*.whl &&
    sed 's/^/    /' "$OUT/wheels.log"
  [[ -d $WHEEL_DIR ]] && export PYTHONPATH=$WHEEL_DIR${PYTHONPATH:+:$PYTHONPATH}
fi

# 2. The machine.
run_step gpu 15 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader &&
  sed 's/^/    /' "$OUT/gpu.log"
# Fails when fastllm._C lacks the CUDA kernels (e.g. setup.py found no nvcc): the tests and
# benchmarks below would then silently leave the cuda backend out.
run_step versions 40 "$PY" -c 'import importlib.metadata as md, sys, torch, triton, fastllm
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "none"
print("python", sys.version.split()[0], "| torch", torch.__version__, "CUDA", torch.version.cuda,
      "| triton", triton.__version__, "| transformers", version("transformers"), "| peft",
      version("peft"), "| liger-kernel", version("liger-kernel"))
print("fastllm has_cpp", fastllm.has_cpp(), "has_cuda_kernels", fastllm.has_cuda_kernels())
sys.exit(0 if fastllm.has_cuda_kernels() else "fastllm._C was built without CUDA kernels")' &&
  sed 's/^/    /' "$OUT/versions.log"

# 3. The GPU tests, at most 110 s (12 workers; a cut run keeps what it ran: -v writes each result
# as it ends): every case whose name or id says cuda or gpu (conftest adds the cuda backend cases
# when a GPU is visible: the kernels against their references, the CUDA-graph-captured optimizer
# step, multi-launch tensor lists). The CPU cases ran in CI already; the whole suite does not fit
# the budget here. DEVICE_TESTS overrides the selection.
if ((build_ok)); then
  # -n: the GPU cases in parallel (pytest-xdist; one process when it is missing).
  WORKERS=()
  "$PY" -c 'import xdist' 2>/dev/null && WORKERS=(-n "${TEST_WORKERS:-12}")
  # -v: one line per test as it ends, so a run cut by its timeout still says what passed (and
  # no junit XML: $OUT brings back at most 8 files)
  # shellcheck disable=SC2086
  run_step tests 110 "$PY" -m pytest -v -rfEs -p no:cacheprovider "${WORKERS[@]}" \
    ${DEVICE_TESTS:--k "cuda or gpu" tests} &&
    tail -n 1 "$OUT/tests.log" | sed 's/^/    /'
  # the verdicts of the tests that ended (all of them, or those before a cut)
  for verdict in PASSED FAILED ERROR SKIPPED; do
    printf '    %s %s\n' "$(grep -c " $verdict" "$OUT/tests.log")" "$verdict"
  done
else
  log "tests: SKIPPED (build failed)"
  STEPS+=("tests|skipped: build failed|0")
fi

# 4. The measurements, with what is left of the budget (at least ~125 s): one process,
# interleaved, one JSON (bench_cuda.json) and one table.
if ((build_ok)); then
  # ~120 s for the cases of issue 18, seconds for the packed attention (the varlen route), ~60 s
  # for issue 19's model case
  # shellcheck disable=SC2086
  run_step bench 180 "$PY" bench/device_bench.py --json "$OUT/bench_cuda.json" \
    ${BENCH_CASES:+--cases "$BENCH_CASES"} &&
    cat "$OUT/bench.log"
else
  log "bench: SKIPPED (build failed)"
  STEPS+=("bench|skipped: build failed|0")
fi

# 5. Summary: the steps, then the benchmark rows.
echo
echo "== summary ($((SECONDS - START)) s) =="
printf '  %-8s %-28s %6s\n' step status seconds
for s in "${STEPS[@]}"; do
  IFS='|' read -r name status dt <<<"$s"
  printf '  %-8s %-28s %6s\n' "$name" "$status" "$dt"
done
if [[ -s $OUT/bench_cuda.json ]]; then
  timeout 15 "$PY" - "$OUT/bench_cuda.json" <<'EOF' || FAILED=1
import json
import sys

data = json.load(open(sys.argv[1]))
rows = data
if isinstance(data, dict):
    print(f"\n{data.get('device', '?')}: {data.get('machine', '?')}")
    rows = data.get("rows") or next((v for v in data.values() if isinstance(v, list)), [])
rows = [r for r in rows if isinstance(r, dict)]
if not rows:
    sys.exit("bench_cuda.json holds no rows")
try:
    from fastllm.bench.harness import format_table

    print(format_table(rows))
    sys.exit(0)
except Exception as exc:  # the harness's own table if it can; a plain one otherwise
    print(f"(harness.format_table failed: {exc!r}; plain table follows)")

cols = list(dict.fromkeys(k for r in rows for k in r))


def fmt(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


cells = [[fmt(r.get(c)) for c in cols] for r in rows]
widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
print("  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip())
print("  ".join("-" * w for w in widths))
for row in cells:
    print("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())
EOF
fi
rm -f "$OUT"/*.tmp  # a JSON cut mid-write (its last whole version stays)
echo "outputs in $OUT"
if ((FAILED)); then
  log "device check FAILED"
  exit 1
fi
log "device check passed"
