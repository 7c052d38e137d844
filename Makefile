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

.PHONY: setup test test-kernels demo bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/python pyproject.toml constraints/tested.txt
	@if [ -n "$(TORCH_SPEC)" ]; then $(BIN)/pip install -q $(TORCH_SPEC); fi
	$(BIN)/pip install -q -e ".[dev]" -c constraints/tested.txt
	@touch $@

setup: $(VENV)/.installed

test: setup
	$(BIN)/python -m pytest -n 2 -q $(PYTEST_ARGS) tests
	$(MAKE) test-kernels

# The kernel-route tier: the CUDA dispatch of safepad.ops run on CPU (Triton interpreter + C++ stand-ins), in its
# own venv and process (TRITON_INTERPRET must be set before triton is imported). KERNEL_TIER=full runs the whole
# audit matrix with kernels (slow). mamba-ssm / causal-conv1d are built from source without their CUDA parts and
# without their GPU-only dependencies (tilelang, quack-kernels, cutlass: optional imports, ~1 GB).
KVENV       ?= .venv-kernels
KERNEL_TIER ?= 1
KERNEL_PYTEST_ARGS ?=
KPIP        := $(KVENV)/bin/pip -q
KCONS       := -c constraints/tested.txt -c constraints/kernels.txt

$(KVENV)/.installed: pyproject.toml constraints/tested.txt constraints/kernels.txt
	$(PYTHON) -m venv $(KVENV)
	@if [ -n "$(TORCH_SPEC)" ]; then $(KPIP) install $(TORCH_SPEC); fi
	$(KPIP) install $(KCONS) triton einops ninja packaging setuptools wheel
	MAMBA_FORCE_BUILD=TRUE MAMBA_SKIP_CUDA_BUILD=TRUE $(KPIP) install $(KCONS) --no-build-isolation --no-deps mamba-ssm
	CAUSAL_CONV1D_FORCE_BUILD=TRUE CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE $(KPIP) install $(KCONS) --no-build-isolation --no-deps causal-conv1d
	$(KPIP) install $(KCONS) flash-linear-attention -e ".[dev]"
	@touch $@

test-kernels: $(KVENV)/.installed
	SAFEPAD_KERNEL_TIER=$(KERNEL_TIER) TRITON_INTERPRET=1 $(KVENV)/bin/python -m pytest -n 2 -q -p no:cacheprovider $(KERNEL_PYTEST_ARGS) tests/kernels

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
	rm -rf $(VENV) $(KVENV) .pytest_cache .hypothesis *.egg-info
