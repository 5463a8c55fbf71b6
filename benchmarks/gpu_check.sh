#!/usr/bin/env bash
# One command on a GPU machine: the CUDA tests, then the transfer and attention benchmarks,
# ending with a short table. `make gpu-check` runs it inside the project's .venv.
set -uo pipefail
PY=${PYTHON:-.venv/bin/python}
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')" \
  || exit 1
"$PY" -c "import cupy" || { echo "cupy missing: pip install -e '.[cuda]'"; exit 1; }
status=0
"$PY" -m pytest -q -rs tests/test_transfer_kernels.py tests/test_paged_attention.py \
  tests/test_transfer.py tests/test_model.py tests/test_hiradix_cache.py || status=1
"$PY" benchmarks/bench_transfer.py --geometries tiny llama3-8b --page-sizes 16 64 \
  --repeats 5 --out benchmarks/results/transfer_gpu.json || status=1
"$PY" benchmarks/bench_attention.py --out benchmarks/results/attention_gpu.json || status=1
exit $status
