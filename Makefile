# Set-up and everyday commands. `make test` and `make serve` work on a fresh clone:
# they create .venv, install the project (CPU torch from the pinned wheel) and run.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
HOST   ?= 127.0.0.1
PORT   ?= 30000
MODEL  ?= configs/tiny

.PHONY: venv test lint serve bench bench-quick soak clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q -x tests

lint: $(STAMP)
	$(PY) -m ruff check .

serve: $(STAMP)
	$(PY) -m server --model-path $(MODEL) --host $(HOST) --port $(PORT)

# Benchmarks (docs/benchmarks/): the full suite (~10-15 min on 2 cores), or a ~2-minute smoke run that
# writes docs/benchmarks/quick/. BENCH_ARGS passes more flags, e.g. BENCH_ARGS="--only decode".
bench: $(STAMP)
	$(PY) -m pip install -q -e ".[test,bench]"
	$(PY) -m bench.run $(BENCH_ARGS)

bench-quick: $(STAMP)
	$(PY) -m pip install -q -e ".[test,bench]"
	$(PY) -m bench.run --quick $(BENCH_ARGS)

# 10 minutes of mixed load against a live server; fails on any error or >= 10% RSS growth (not in CI)
soak: $(STAMP)
	$(PY) scripts/soak.py --duration 600

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
