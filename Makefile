# safepad: `make test` and `make demo` each do the whole set-up first.
#
# Version matrix: the suite runs at both ends of what pyproject.toml allows.
#   .venv         newest end: constraints/newest.txt (transformers 5.24.0), what `pip install safepad` gives
#                 today; `make demo` and `make bench` use it
#   .venv-oldest  oldest supported pins: constraints/tested.txt (transformers 5.23.0)
# `make test` = test-newest + test-oldest + test-kernels, one after the other (each venv: ~70 s set-up once;
# the kernel venv builds mamba-ssm / causal-conv1d from source, a few minutes).
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
# the targets `make test` runs: the suite at both ends, then the kernel-route tier
TEST_TARGETS ?= test-newest test-oldest test-kernels

export PIP_DISABLE_PIP_VERSION_CHECK=1

.PHONY: setup setup-oldest test test-newest test-oldest test-kernels demo bench clean

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

# The kernel-route tier: the CUDA dispatch of safepad.ops run on CPU (Triton interpreter + C++ stand-ins), in its
# own venv and process (TRITON_INTERPRET must be set before triton is imported). KERNEL_TIER=full runs the whole
# audit matrix with kernels (slow). mamba-ssm / causal-conv1d are built from source without their CUDA parts and
# without their GPU-only dependencies (tilelang, quack-kernels, cutlass: optional imports, ~1 GB).
KVENV       ?= .venv-kernels
KERNEL_TIER ?= 1
KERNEL_PYTEST_ARGS ?=
KPIP        := $(KVENV)/bin/pip -q
KCONS       := -c $(OLDEST) -c constraints/kernels.txt

$(KVENV)/.installed: pyproject.toml $(OLDEST) constraints/kernels.txt
	$(PYTHON) -m venv $(KVENV)
	@if [ -n "$(TORCH_SPEC)" ]; then $(KPIP) install $(TORCH_SPEC); fi
	$(KPIP) install $(KCONS) triton einops ninja packaging setuptools wheel
	MAMBA_FORCE_BUILD=TRUE MAMBA_SKIP_CUDA_BUILD=TRUE $(KPIP) install $(KCONS) --no-build-isolation --no-deps mamba-ssm
	CAUSAL_CONV1D_FORCE_BUILD=TRUE CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE $(KPIP) install $(KCONS) --no-build-isolation --no-deps causal-conv1d
	$(KPIP) install $(KCONS) flash-linear-attention -e ".[dev]"
	@touch $@

test-kernels: $(KVENV)/.installed
	SAFEPAD_KERNEL_TIER=$(KERNEL_TIER) TRITON_INTERPRET=1 $(KVENV)/bin/python -m pytest -n 2 -q -p no:cacheprovider $(KERNEL_PYTEST_ARGS) tests/kernels

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
	rm -rf $(VENV) $(VENV_OLDEST) $(KVENV) .pytest_cache .hypothesis *.egg-info
