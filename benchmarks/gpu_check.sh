#!/usr/bin/env bash
# One command on a GPU machine: the CUDA tests (kernels, transfer engine, the engine end to end
# on the GPU, the server process on the GPU), then the transfer, decode attention, prefill
# attention and tier-TTFT benchmarks, ending with a short table. `make gpu-check` runs it inside the project's .venv;
# elsewhere set PYTHON (and PYTHONPATH to the repository root).
#   GPU_RESULTS   where JSON and logs go (default benchmarks/results)
#   GPU_BENCHES   which benchmarks run (default "transfer attention prefill tier")
#   GPU_TESTS     which test files run (default: every file with a CUDA path, below)
set -uo pipefail
PY=${PYTHON:-.venv/bin/python}
RESULTS=${GPU_RESULTS:-benchmarks/results}
BENCHES=${GPU_BENCHES:-transfer attention prefill tier}
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}
mkdir -p "$RESULTS"
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')" \
  || exit 1
"$PY" -c "import cupy" || { echo "cupy missing: pip install -e '.[cuda]'"; exit 1; }
"$PY" -c "import torch, cupy; print('torch', torch.__version__, '| cupy', cupy.__version__,
'|', torch.cuda.get_device_name())"
"$PY" -c "import flashinfer; print('flashinfer', flashinfer.__version__)" \
  || echo "flashinfer missing: its tests skip, the attention benchmarks lose their flashinfer column"

status=0
per_test=()  # a hung test fails with its traceback instead of eating the whole run
"$PY" -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout=150)
tests=(tests/test_transfer_kernels.py tests/test_paged_attention.py tests/test_attention.py
       tests/test_flashinfer_attention.py tests/test_transfer.py
       tests/test_model.py tests/test_cuda_engine.py tests/test_stack.py
       tests/test_server_process.py tests/test_vllm_connector_sides.py)
[ -n "${GPU_TESTS:-}" ] && read -r -a tests <<< "$GPU_TESTS"
# The server-process tests start `python -m hicache_server.launch` with `model.device: cuda`; the vLLM
# connector's worker side copies blocks of caches on the GPU through pinned buffers.
HICACHE_TEST_DEVICE=cuda timeout "${GPU_TEST_TIMEOUT:-400}" "$PY" -m pytest -q -rs \
  -p no:cacheprovider "${per_test[@]}" --junitxml="$RESULTS/gpu_tests.xml" "${tests[@]}" \
  > "$RESULTS/gpu_tests.log" 2>&1
test_rc=$?
tail -n 40 "$RESULTS/gpu_tests.log"
[ $test_rc -eq 0 ] || { echo "pytest exited with $test_rc"; status=1; }

bench() {  # name, then the command; output to $RESULTS/<name>_gpu.log
  local name=$1; shift
  [[ " $BENCHES " == *" $name "* ]] || return 0
  timeout "${GPU_BENCH_TIMEOUT:-240}" "$@" > "$RESULTS/${name}_gpu.log" 2>&1 \
    || { echo "$name benchmark failed:"; tail -n 20 "$RESULTS/${name}_gpu.log"; status=1; }
}
bench transfer "$PY" -m benchmarks.bench_transfer --geometries tiny llama3-8b \
  --page-sizes 16 64 --repeats 5 --out "$RESULTS/transfer_gpu.json"
bench attention "$PY" -m benchmarks.bench_attention --out "$RESULTS/attention_gpu.json"
bench prefill "$PY" -m benchmarks.bench_prefill_attention --out "$RESULTS/prefill_attention_gpu.json"
bench tier "$PY" -m benchmarks.bench_tier_ttft --random-model llama-1b \
  --prompt-lens 1024 4096 16384 --repeats 3 --out "$RESULTS/tier_gpu.json"

echo
echo "== gpu-check summary =="
grep -E "(passed|failed)" "$RESULTS/gpu_tests.log" | tail -1
for name in transfer attention prefill tier; do
  [ -f "$RESULTS/${name}_gpu.log" ] && grep -E "^(\||goal|page )" "$RESULTS/${name}_gpu.log"
done
exit $status
