# Slipstream developer commands. `make` lists them.
.DEFAULT_GOAL := help
SHELL := /bin/bash

PYTHON ?= python3
VENV ?= .venv
# pip takes this torch from the local wheel cache on the project machines; elsewhere override it,
# e.g. `make test TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cpu"`.
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.slipstream-installed
BASE_BRANCH ?= main

.PHONY: help venv train test compat-hf compat matrix bench format clean

help: ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-9s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml setup.py version.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

venv: $(STAMP) ## create .venv with torch and slipstream (editable, dev extras)

train: $(STAMP) ## train a small GPT end to end: 2 ranks, ZeRO-2, the shipped text (about a minute)
	$(VENV)/bin/slipstream run --num_gpus 2 examples/gpt/train.py --deepspeed_config examples/gpt/ds_config_zero2.json

# The suite runs in a random order (pytest-random-order: the modules shuffled, and the tests within each), so a
# test that passes only after some other test fails here. The seed changes daily and is printed before and after
# the run; `make test TEST_SEED=<seed>` replays that order.
TEST_SEED ?= $(shell date -u +%Y%m%d)
test: $(STAMP) ## run the test suite in a random order (replay one: TEST_SEED=...; tests/compat_hf: `make compat-hf`)
	@echo "make test: random test order, seed $(TEST_SEED); replay it with: make test TEST_SEED=$(TEST_SEED)"
	$(PY) -m pytest -q -p random_order --random-order-bucket=module --random-order-seed=$(TEST_SEED) \
		--ignore=tests/compat_hf --durations=15

# The tests elsewhere in tests/ that skip without Transformers (`make test` does not install it) run here too.
HF_GATED_TESTS = $(shell grep -rl --include='*.py' 'importorskip("transformers")' tests | grep -v '^tests/compat_hf/' | sort)

compat-hf: $(STAMP) ## Transformers, Accelerate, PEFT on Slipstream end to end (installs them into .venv; ~8 min)
	$(PY) -m pip install --quiet -e ".[dev,compat-hf]"
	$(PY) -m pytest -q tests/compat_hf $(HF_GATED_TESTS)

matrix: ## the fast tests on each supported (Python, torch) cell of docs/support.md (installs each; ~3 min a cell)
	./.ci/matrix

bench: $(STAMP) ## run the benchmarks (creates .bench-venv with DeepSpeed as a peer when possible)
	-bash bench/make_peer_venv.sh
	$(PY) bench/import_time.py
	$(PY) bench/cpu_adam.py
	$(PY) bench/zero_step.py

# What DeepSpeed's unit tests import beyond torch and the package under test (pure Python; no torch reinstall).
SUITE_REQS := pytest pytest-timeout py-cpuinfo hjson
compat: $(STAMP) ## DeepSpeed's unit tests against DeepSpeed and Slipstream, per-folder table (tens of minutes; not in `make test`)
	@test -x .bench-venv/bin/python || bash bench/make_peer_venv.sh
	.bench-venv/bin/pip install --quiet $(SUITE_REQS)
	$(PY) -m pip install --quiet $(SUITE_REQS)
	@$(PY) -c "import torch; print('torch', torch.__version__, 'in $(VENV)')"
	$(PY) compat/deepspeed_suite/run.py $(COMPAT_ARGS)

format: $(STAMP) ## lint and format the Python files changed since the merge base with main (BASE_BRANCH)
	@base=$$(git merge-base HEAD "$(BASE_BRANCH)" 2>/dev/null || git merge-base HEAD "origin/$(BASE_BRANCH)" 2>/dev/null || git rev-parse HEAD); \
	files=$$( { git diff --name-only --diff-filter=d "$$base" -- '*.py'; git ls-files --others --exclude-standard -- '*.py'; } | sort -u); \
	if [ -z "$$files" ]; then echo "no changed Python files since $$base"; exit 0; fi; \
	$(VENV)/bin/ruff format $$files && $(VENV)/bin/ruff check --fix $$files

clean: ## remove build outputs (keeps .venv)
	rm -rf build dist *.egg-info slipstream/git_version_info_installed.py build.txt
