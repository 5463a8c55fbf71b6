#!/usr/bin/env bash
# One command on a GPU machine: the CUDA tests (kernels, transfer engine, the engine end to end
# on the GPU), then the transfer and attention benchmarks, ending with a short table.
# `make gpu-check` runs it inside the project's .venv; elsewhere set PYTHON (and PYTHONPATH to
# the repository root). JSON results go to $GPU_RESULTS (default benchmarks/results).
set -uo pipefail
PY=${PYTHON:-.venv/bin/python}
RESULTS=${GPU_RESULTS:-benchmarks/results}
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}
mkdir -p "$RESULTS"
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')" \
  || exit 1
"$PY" -c "import cupy" || { echo "cupy missing: pip install -e '.[cuda]'"; exit 1; }
"$PY" -c "import torch, cupy; print('torch', torch.__version__, '| cupy', cupy.__version__,
'|', torch.cuda.get_device_name())"

status=0
tests=(tests/test_transfer_kernels.py tests/test_paged_attention.py tests/test_transfer.py
       tests/test_model.py tests/test_cuda_engine.py)
per_test=()  # a hung test fails with its traceback instead of eating the whole run
"$PY" -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout=120)
timeout "${GPU_TEST_TIMEOUT:-300}" "$PY" -m pytest -q -rs -p no:cacheprovider "${per_test[@]}" \
  --junitxml="$RESULTS/gpu_tests.xml" "${tests[@]}" 2>&1 | tee "$RESULTS/gpu_tests.log" \
  || status=1
timeout "${GPU_BENCH_TIMEOUT:-120}" "$PY" benchmarks/bench_transfer.py \
  --geometries tiny llama3-8b --page-sizes 16 64 --repeats 5 \
  --out "$RESULTS/transfer_gpu.json" 2>&1 | tee "$RESULTS/transfer_gpu.log" || status=1
timeout "${GPU_BENCH_TIMEOUT:-120}" "$PY" benchmarks/bench_attention.py \
  --out "$RESULTS/attention_gpu.json" 2>&1 | tee "$RESULTS/attention_gpu.log" || status=1

echo
echo "== gpu-check summary =="
grep -E "^[0-9]+ (passed|failed)|passed|failed" "$RESULTS/gpu_tests.log" | tail -1
grep -E "^\|" "$RESULTS/transfer_gpu.log" | head -20
grep -E "^goal" "$RESULTS/transfer_gpu.log"
grep -E "^\|" "$RESULTS/attention_gpu.log" | head -12
exit $status
