#!/usr/bin/env bash
# The GPU checks in one call of limited time: the CUDA tests, then the GPU measurements.
#
# Usage, in the repository root of a checkout on a machine with a CUDA GPU, PyTorch,
# transformers, peft and pytest (no internet needed):
#
#     OUT=/tmp/gpu-check bash benchmarks/gpu_check.sh [BUDGET_SECONDS]
#
# Everything ends within BUDGET_SECONDS (default 420), installs included: every step has
# its own timeout, and what each step measures is written under $OUT as it finishes, so a
# call killed early keeps what was measured before. Opacus (a benchmark peer) is
# installed from ./wheels when a wheel is there (pip download --no-deps opacus==1.6.0 -d
# wheels/ on a machine with internet access); privlearn is used from this checkout
# (PYTHONPATH, nothing installed). Under $OUT (default ./out/gpu-check):
#   gpu_check.log       this script's output
#   cuda_tests.log/.xml the CUDA tests (pytest tests/torch -k cuda, JUnit XML, durations)
#   gpu_bench.jsonl     one line per measured configuration (benchmarks/gpu_bench.py)
#   gpu_bench.log       its output; gpu_bench.md the summary table with the ratios
# PYTHON names the interpreter (default python3); GPU_CHECK_NO_INSTALL=1 skips the
# install (a dry run that leaves the Python environment as it is). Without a CUDA device
# the CUDA tests skip and the measurements record that they did not run.
set -uo pipefail

BUDGET=${1:-${GPU_CHECK_BUDGET:-420}}
OUT=${OUT:-$PWD/out/gpu-check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
START=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - START))); }
step() { echo; echo "== $* ($(left) s left)"; }
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1

step "environment"
timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
    || echo "no nvidia-smi"
timeout 60 "$PY" - <<'EOF'
import platform
import torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda",
      torch.version.cuda, "available", torch.cuda.is_available())
for name in ("transformers", "peft", "opacus", "pytest"):
    try:
        print(name, __import__(name).__version__)
    except ImportError:
        print(name, "not installed")
import privlearn
print("privlearn from", privlearn.__file__)
EOF

if [ -z "${GPU_CHECK_NO_INSTALL:-}" ]; then
    step "opacus from ./wheels"
    WHEEL=$(ls wheels/opacus-*.whl 2>/dev/null | head -n 1)
    if [ -n "$WHEEL" ]; then
        timeout 45 "$PY" -m pip install -q --no-index --no-deps "$WHEEL" \
            || echo "opacus install failed: its modes will be reported as not run"
    else
        echo "no wheels/opacus-*.whl: the Opacus modes will be reported as not run"
    fi
else
    step "no install (GPU_CHECK_NO_INSTALL is set)"
fi

step "CUDA tests"
TEST_TIME=$(( $(left) > 300 ? 110 : $(left) / 3 ))
TIMEOUT_OPT=()
if "$PY" -c "import pytest_timeout" 2>/dev/null; then TIMEOUT_OPT=(--timeout 60); fi
T0=$(date +%s)
HYPOTHESIS_PROFILE=ci timeout "$TEST_TIME" "$PY" -m pytest tests/torch -k cuda \
    -p no:cacheprovider -q -rfEs --durations 15 ${TIMEOUT_OPT[@]+"${TIMEOUT_OPT[@]}"} \
    --junitxml "$OUT/cuda_tests.xml" > "$OUT/cuda_tests.log" 2>&1
echo "pytest exit code $? after $(( $(date +%s) - T0 )) s (limit $TEST_TIME s)"
tail -n 30 "$OUT/cuda_tests.log"

step "GPU measurements"
REMAIN=$(left)
# no configuration starts after BENCH_BUDGET; one may still be running (<= ~40 s)
BENCH_BUDGET=$((REMAIN - 55))
if [ "$BENCH_BUDGET" -lt 20 ]; then
    echo "too little time left for the measurements ($REMAIN s)"
else
    timeout $((REMAIN - 12)) "$PY" benchmarks/gpu_bench.py --out "$OUT/gpu_bench.jsonl" \
        --budget-seconds "$BENCH_BUDGET" > "$OUT/gpu_bench.log" 2>&1
    echo "gpu_bench exit code $?"
fi
timeout 10 "$PY" benchmarks/gpu_bench.py --out "$OUT/gpu_bench.jsonl" \
    --summary "$OUT/gpu_bench.md" && cat "$OUT/gpu_bench.md"
step "done in $(( $(date +%s) - START )) s; files under $OUT:"
ls -l "$OUT"
