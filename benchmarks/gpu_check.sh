#!/usr/bin/env bash
# The GPU checks in one command: install (offline), the CUDA tests, the GPU benchmark.
#
# Usage, in the repository root of a checkout on a machine with a CUDA GPU, PyTorch,
# transformers, peft, scikit-learn and pytest (no internet needed):
#
#     OUT=/tmp/gpu-check bash benchmarks/gpu_check.sh [BUDGET_SECONDS]
#
# Opacus (a benchmark peer) is installed from ./wheels when a wheel is there; fetch it
# beforehand on a machine with internet access:
#
#     pip download --no-deps opacus==1.6.0 -d wheels/
#
# Everything runs within BUDGET_SECONDS (default 540, i.e. 9 minutes), each step under
# its own timeout. Under $OUT (default ./out/gpu-check): gpu_check.log (this script's
# output), cuda_tests.log and cuda_tests.xml (JUnit), torch_hf.log, torch_hf.json (every
# round's raw results) and benchmarks.md (docs/benchmarks.md with the GPU section
# rewritten: copy it over docs/benchmarks.md to keep the figures). PYTHON names the
# interpreter (default python3); GPU_CHECK_NO_INSTALL=1 skips both installs (a dry run
# that leaves the Python environment as it is, with this checkout on PYTHONPATH).
set -uo pipefail

BUDGET=${1:-${GPU_CHECK_BUDGET:-540}}
OUT=${OUT:-$PWD/out/gpu-check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
START=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - START))); }
step() { echo; echo "== $* ($(left) s left)"; }

step "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" - <<'EOF'
import platform
import torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda",
      torch.version.cuda, "available", torch.cuda.is_available())
for name in ("transformers", "peft", "opacus", "pytest", "hypothesis", "scipy", "sklearn"):
    try:
        print(name, __import__(name).__version__)
    except ImportError:
        print(name, "not installed")
EOF

install() {
    step "opacus from ./wheels"
    if ls wheels/opacus-1.6.0-*.whl >/dev/null 2>&1; then
        timeout 60 "$PY" -m pip install -q --no-index --no-deps --find-links wheels/ \
            opacus==1.6.0 || echo "opacus install failed: its modes will be reported as not run"
    else
        echo "no wheels/opacus-1.6.0-*.whl (pip download --no-deps opacus==1.6.0 -d wheels/):" \
             "the benchmark reports the Opacus modes as not run unless opacus is installed"
    fi
    step "privlearn (editable, no dependencies, no index)"
    timeout 90 "$PY" -m pip install -q --no-deps --no-build-isolation -e . \
        || echo "editable install failed: using PYTHONPATH"
}
if [ -z "${GPU_CHECK_NO_INSTALL:-}" ]; then
    install
else  # a dry run that leaves the Python environment as it is
    step "no installs (GPU_CHECK_NO_INSTALL is set)"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
"$PY" -c "import privlearn; print('privlearn from', privlearn.__file__)"

step "CUDA tests"
TIMEOUT_OPT=()
if "$PY" -c "import pytest_timeout" 2>/dev/null; then TIMEOUT_OPT=(--timeout 120); fi
HYPOTHESIS_PROFILE=ci timeout 180 "$PY" -m pytest tests/torch -k cuda -p no:cacheprovider \
    -q -rfEs ${TIMEOUT_OPT[@]+"${TIMEOUT_OPT[@]}"} --junitxml "$OUT/cuda_tests.xml" > "$OUT/cuda_tests.log" 2>&1
echo "pytest exit code $?"
tail -n 25 "$OUT/cuda_tests.log"

step "GPU benchmark"
cp docs/benchmarks.md "$OUT/benchmarks.md"
REMAIN=$(left)
BENCH_BUDGET=$((REMAIN - 75))  # no configuration starts later; one may still be running
if [ "$BENCH_BUDGET" -lt 30 ]; then
    echo "too little time left for the benchmark ($REMAIN s)"
else
    PYTHONUNBUFFERED=1 timeout $((REMAIN - 5)) "$PY" benchmarks/torch_hf.py --device cuda \
        --size small --dtype fp32,bf16 --budget-seconds "$BENCH_BUDGET" \
        --out "$OUT/benchmarks.md" --json "$OUT/torch_hf.json" > "$OUT/torch_hf.log" 2>&1
    echo "benchmark exit code $?"
    tail -n 12 "$OUT/torch_hf.log"  # the summary table
fi
step "done in $(( $(date +%s) - START )) s; files under $OUT:"
ls -l "$OUT"
