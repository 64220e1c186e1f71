# Set-up and everyday commands. `make test` and `make serve` work on a fresh clone:
# they create .venv, install the project (CPU torch from the pinned wheel) and run.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
HOST   ?= 127.0.0.1
PORT   ?= 30000
MODEL  ?= configs/tiny

.PHONY: venv test lint serve clean

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

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
