# safepad: `make test` and `make demo` each do the whole set-up first.
#
# Version matrix: the suite runs at both ends of what pyproject.toml allows.
#   .venv         newest end: constraints/newest.txt (transformers 5.24.0), what `pip install safepad` gives
#                 today; `make demo` and `make bench` use it
#   .venv-oldest  oldest supported pins: constraints/tested.txt (transformers 5.23.0)
# `make test` = test-newest + test-oldest, one after the other (each end: ~70 s set-up once, ~1-2 min suite).
#
# The CPU build of torch is installed before the package so that pip never pulls
# a multi-GB CUDA build.  Override it for your own machine, e.g.
#   make test TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu130"
# or keep whatever torch your environment already has with TORCH_SPEC=
PYTHON      ?= python3
VENV        ?= .venv
VENV_OLDEST ?= .venv-oldest
NEWEST      ?= constraints/newest.txt
OLDEST      ?= constraints/tested.txt
TORCH_SPEC  ?= torch==2.13.0
PYTEST_ARGS ?=
BIN         := $(VENV)/bin
BIN_OLDEST  := $(VENV_OLDEST)/bin
# the targets `make test` runs (other tiers, e.g. a kernel tier, are appended here)
TEST_TARGETS ?= test-newest test-oldest

export PIP_DISABLE_PIP_VERSION_CHECK=1

.PHONY: setup setup-oldest test test-newest test-oldest demo bench clean

# $(1): venv directory, $(2): constraints file
define make_venv
	$(PYTHON) -m venv $(1)
	@if [ -n "$(TORCH_SPEC)" ]; then $(1)/bin/pip install -q $(TORCH_SPEC); fi
	$(1)/bin/pip install -q -e ".[dev]" -c $(2)
	@touch $(1)/.installed
endef

$(VENV)/.installed: pyproject.toml $(NEWEST)
	$(call make_venv,$(VENV),$(NEWEST))

$(VENV_OLDEST)/.installed: pyproject.toml $(OLDEST)
	$(call make_venv,$(VENV_OLDEST),$(OLDEST))

setup: $(VENV)/.installed

setup-oldest: $(VENV_OLDEST)/.installed

test: $(TEST_TARGETS)

test-newest: setup
	@echo "== test suite, newest end: $$($(BIN)/python -c 'import transformers; print("transformers", transformers.__version__)')"
	$(BIN)/python -m pytest -n 2 -q $(PYTEST_ARGS) tests

test-oldest: setup-oldest
	@echo "== test suite, oldest end: $$($(BIN_OLDEST)/python -c 'import transformers; print("transformers", transformers.__version__)')"
	$(BIN_OLDEST)/python -m pytest -n 2 -q $(PYTEST_ARGS) tests

demo: setup
	$(BIN)/safepad audit
	$(BIN)/python examples/train_packed.py --max-steps 30

bench: setup
	$(BIN)/python benchmarks/bench_ops.py
	$(BIN)/python benchmarks/bench_wrap.py
	$(BIN)/python benchmarks/bench_collator.py
	$(BIN)/python benchmarks/bench_guard.py
	$(BIN)/python benchmarks/bench_train.py
	$(BIN)/python benchmarks/bench_compile.py
	$(BIN)/python benchmarks/bench_sequence_parallel.py

clean:
	rm -rf $(VENV) $(VENV_OLDEST) .pytest_cache .hypothesis *.egg-info
