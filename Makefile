# safepad: `make test` and `make demo` each do the whole set-up first.
#
# The CPU build of torch is installed before the package so that pip never pulls
# a multi-GB CUDA build.  Override it for your own machine, e.g.
#   make test TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu130"
# or keep whatever torch your environment already has with TORCH_SPEC=
PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
BIN        := $(VENV)/bin

export PIP_DISABLE_PIP_VERSION_CHECK=1

.PHONY: setup test demo bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/python pyproject.toml constraints/tested.txt
	@if [ -n "$(TORCH_SPEC)" ]; then $(BIN)/pip install -q $(TORCH_SPEC); fi
	$(BIN)/pip install -q -e ".[dev]" -c constraints/tested.txt
	@touch $@

setup: $(VENV)/.installed

test: setup
	$(BIN)/python -m pytest -n 2 -q $(PYTEST_ARGS) tests

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
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
