# safepad: `make test` and `make demo` each do the whole set-up first.
#
# Run `make test-latest` first in every session: it installs the newest releases the registry serves, unpinned,
# and a failure there is the first thing to fix (it is what users get as soon as a bound moves, and what tells
# when a bound can move). It is not in `make test`: its versions move with the registry.
#
# Version policy (pyproject.toml's comment): every bound in pyproject.toml is a version some tier runs; the upper
# bounds of torch / transformers / accelerate are the minor after the newest tested one, and `import safepad`
# refuses a torch / transformers outside them (safepad/_compat.py; SAFEPAD_ALLOW_UNTESTED=1 overrides).
#
# Version matrix: the suite runs at both ends of what pyproject.toml allows.
#   .venv         newest end: constraints/newest.txt (transformers 5.25.0, accelerate 1.16.0), what
#                 `pip install safepad` gives today; `make demo` and `make bench` use it
#   .venv-oldest  oldest supported pins: constraints/tested.txt (transformers 5.23.0)
#   .venv-floor   every dependency floor of pyproject.toml but torch's: constraints/floor.txt (a subset of the suite)
#   .venv-torch-newest  the newest torch pyproject allows (2.15.0, a ~3 GB CUDA build from the registry that
#                 runs on CPU): constraints/torch-newest.txt + newest.txt (a subset of the suite)
#   .venv-torch-floor   the oldest torch pyproject allows (2.11.0, what CUDA 13.0 GPU images ship; a ~3 GB CUDA
#                 build too): constraints/torch-floor.txt + newest.txt (the same subset)
#   test-wheel    builds the wheel, installs it into a fresh venv (not editable) with what pip resolves for a user
#                 (no constraints; torch is TORCH_SPEC's CPU build) and runs `safepad audit` from outside the repository
#   .venv-latest  (`make test-latest`, not in `make test`) the newest releases, unpinned
# `make test` runs every tier in TEST_TARGETS, one after the other (each venv: ~70 s set-up once; the kernel
# venv builds mamba-ssm / causal-conv1d from source, a few minutes; the torch-newest and torch-floor venvs each
# download ~3 GB and take ~5.3 GB of disk).
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
TEST_TARGETS ?= test-newest test-oldest test-kernels test-floor test-torch-newest test-torch-floor test-wheel
# Each tier runs what its versions can change (the suite at the newest end runs everything):
# - the newest-torch and oldest-torch tiers (torch 2.15 and 2.11; the others run 2.13): ops, the Mamba2 / Mamba1 /
#   GDN wrap tests, collators, the Trainer callback, compile
SUBSET_TESTS ?= tests/ops tests/wrap/test_mamba2_family.py tests/wrap/test_mamba1_family.py \
	tests/wrap/test_gdn_family.py tests/collators/test_collator.py \
	tests/collators/test_packing.py tests/collators/test_trainer.py tests/trainer_ext/test_padding_guard_callback.py \
	tests/test_compile.py tests/test_compat.py
# - the newest-torch tier also counts syncs and the hook's recompiles, which follow dynamo's guards (torch 2.15 guards
#   on every kwargs key for a missing one: a strict xfail there)
TORCH_NEWEST_TESTS ?= $(SUBSET_TESTS) tests/test_syncs.py tests/wrap/test_hook_recompiles.py
# - the oldest end differs from the newest in transformers alone: everything but the test files that never import
#   it (the op tests against float64 references, the layout conversions, the benchmark scripts' checks)
VERSION_FREE_TESTS ?= $(shell grep -L transformers tests/ops/test_*.py) tests/layout tests/benchmarks
# - the floor tier differs from the oldest end in accelerate, datasets, numpy and rich: the collators and packers
#   (datasets, numpy), Trainer and accelerate's dispatch (accelerate), the version checks
FLOOR_TESTS ?= tests/collators/test_collator.py tests/collators/test_packing.py tests/collators/test_trainer.py \
	tests/trainer_ext/test_padding_guard_callback.py tests/trainer_ext/test_dispatch.py tests/test_compat.py

export PIP_DISABLE_PIP_VERSION_CHECK=1
# pip's cache keeps a second copy of every download: ~3 GB for the newest-torch tier alone, and a CI machine has run
# out of disk installing that tier (its free space varies). Nothing here re-downloads often enough to need it.
export PIP_NO_CACHE_DIR=1

.PHONY: setup setup-oldest test test-newest test-oldest test-kernels test-floor test-torch-newest test-torch-floor test-wheel \
	test-latest test-cuda gpu-check-cpu gpu-wheels demo bench fuzz clean

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
	$(BIN_OLDEST)/python -m pytest -n 2 -q $(PYTEST_ARGS) $(addprefix --ignore=,$(VERSION_FREE_TESTS)) tests

# The floor tier: the oldest version of every runtime dependency pyproject.toml allows (no dev extras: trl and
# peft are test-only, their floors are the other tiers' versions).
FVENV ?= .venv-floor
$(FVENV)/.installed: pyproject.toml constraints/floor.txt
	$(PYTHON) -m venv $(FVENV)
	$(FVENV)/bin/pip install -q $$(grep -E '^torch==' constraints/floor.txt)
	$(FVENV)/bin/pip install -q -e . pytest pytest-xdist hypothesis -c constraints/floor.txt
	@touch $@

test-floor: $(FVENV)/.installed
	@echo "== floor tier: $$($(FVENV)/bin/python -c 'import torch, transformers, accelerate, datasets, numpy; print("torch", torch.__version__, "transformers", transformers.__version__, "accelerate", accelerate.__version__, "datasets", datasets.__version__, "numpy", numpy.__version__)')"
	$(FVENV)/bin/python -m pytest -n 2 -q -p no:cacheprovider $(FLOOR_TESTS)

# The newest torch: PyPI only serves its CUDA build for x86_64 (it runs on CPU). This machine kind's pip config
# caps torch at 2.14.1 (a constraint file); PIP_CONSTRAINT=/dev/null lifts that cap for this venv only.
TNVENV ?= .venv-torch-newest
$(TNVENV)/.installed: pyproject.toml constraints/torch-newest.txt $(NEWEST)
	$(PYTHON) -m venv $(TNVENV)
	PIP_CONSTRAINT=/dev/null $(TNVENV)/bin/pip install -q $$(grep -E '^torch==' constraints/torch-newest.txt)
	PIP_CONSTRAINT=/dev/null $(TNVENV)/bin/pip install -q -e ".[dev]" -c $(NEWEST) -c constraints/torch-newest.txt
	@touch $@

test-torch-newest: $(TNVENV)/.installed
	@echo "== newest torch: $$($(TNVENV)/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
	$(TNVENV)/bin/python -m pytest -n 2 -q -p no:cacheprovider $(TORCH_NEWEST_TESTS)

# The oldest torch, same pattern: torch 2.11.0 (CUDA 13.0 GPU images ship 2.11.0+cu130) with the newest end's other
# pins, what `pip install safepad` gives on such an image. PyPI serves its CUDA build for x86_64 (it runs on CPU).
TFVENV ?= .venv-torch-floor
$(TFVENV)/.installed: pyproject.toml constraints/torch-floor.txt $(NEWEST)
	$(PYTHON) -m venv $(TFVENV)
	PIP_CONSTRAINT=/dev/null $(TFVENV)/bin/pip install -q $$(grep -E '^torch==' constraints/torch-floor.txt)
	PIP_CONSTRAINT=/dev/null $(TFVENV)/bin/pip install -q -e ".[dev]" -c $(NEWEST) -c constraints/torch-floor.txt
	@touch $@

test-torch-floor: $(TFVENV)/.installed
	@echo "== oldest torch: $$($(TFVENV)/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
	$(TFVENV)/bin/python -m pytest -n 2 -q -p no:cacheprovider $(SUBSET_TESTS)

# The installed wheel: built from this checkout, installed into a fresh venv (not editable) the way a user installs
# it, with no constraints file, so pip resolves every dependency inside pyproject.toml's bounds (today's newest
# releases there) -- except torch, which is TORCH_SPEC's CPU build installed first (the registry's newest torch
# is a ~3 GB CUDA build; test-torch-newest runs it). Then it is checked for its contents, imported and audited
# from a directory outside the repository.
WHEEL_DIR ?= build/wheel
test-wheel: setup
	rm -rf $(WHEEL_DIR) build/wheel-venv
	$(BIN)/pip wheel -q --no-deps -w $(WHEEL_DIR) .
	$(PYTHON) -m venv build/wheel-venv
	build/wheel-venv/bin/pip install -q $(TORCH_SPEC)
	build/wheel-venv/bin/pip install -q $(WHEEL_DIR)/safepad-*.whl
	@echo "== wheel venv: $$($(call versions,build/wheel-venv))"
	cd $$(mktemp -d) && $(CURDIR)/build/wheel-venv/bin/python $(CURDIR)/tests/packaging/check_wheel.py $(CURDIR)/$(WHEEL_DIR)

# The newest releases, unpinned: a fresh .venv-latest on every run, where pip installs the newest transformers,
# accelerate, TRL, datasets and peft the registry serves (no -c constraints, PIP_CONSTRAINT=/dev/null so that no
# machine-wide constraints file pins them either), then safepad with --no-deps (pyproject.toml's caps would
# otherwise hold the versions back: this tier is what tells whether a cap can move). SAFEPAD_ALLOW_UNTESTED=1 lets
# `import safepad` through when a release is newer than the tested range. It prints the resolved versions, then
# runs `safepad audit` on every supported family's tiny model (all of them, then fails naming those that failed),
# the transformers contract tier (tests/contract) and the fuzzer's fixed-seed tier (tests/fuzz).
# torch: on x86_64 the registry's newest torch is its ~3 GB CUDA build (and PyTorch's CPU index is not reachable
# from every CI machine), so by default this tier keeps TORCH_SPEC's CPU build (torch 2.13.0, the one most tiers
# run) and tries the newest of everything else. LATEST_TORCH=1 installs the newest torch the registry serves (the ~3 GB
# download of test-torch-newest); where download.pytorch.org is reachable,
#   make test-latest LATEST_TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cpu"
# gets the newest torch's CPU build instead.
# Not in TEST_TARGETS: its versions move with the registry, so a run that passed can fail the next day.
LVENV             ?= .venv-latest
LATEST_TORCH      ?=
LATEST_TORCH_SPEC ?= $(if $(LATEST_TORCH),torch,$(TORCH_SPEC))
LATEST_PACKAGES   ?= transformers accelerate trl datasets peft
LATEST_TESTS      ?= tests/contract tests/fuzz
# every tiny family (safepad.testing.tiny: the 31 distinct models; the model-type aliases build the same ones), or
# LATEST_FAMILIES="jamba qwen3_next" for a quick look
LATEST_FAMILIES   ?=
# $(call versions,VENV): the resolved versions of the packages the policy is about, on one line
versions = $(1)/bin/pip list --format=freeze 2>/dev/null | grep -iE '^(torch|transformers|accelerate|trl|datasets|peft|numpy)==' | paste -sd' '
test-latest: export PIP_CONSTRAINT := /dev/null
test-latest: export SAFEPAD_ALLOW_UNTESTED := 1
test-latest:
	rm -rf $(LVENV)
	$(PYTHON) -m venv $(LVENV)
	@if [ -n "$(LATEST_TORCH_SPEC)" ]; then $(LVENV)/bin/pip install -q $(LATEST_TORCH_SPEC); fi
	$(LVENV)/bin/pip install -q $(LATEST_PACKAGES) numpy rich pytest pytest-xdist hypothesis mambapy matplotlib
	$(LVENV)/bin/pip install -q --no-deps -e .
	@echo "== latest releases, unpinned: $$($(call versions,$(LVENV)))"
	@failed=""; for f in $(or $(LATEST_FAMILIES),$$($(LVENV)/bin/python -c 'from safepad.testing.tiny import FAMILIES, EXTRA_FAMILIES, NEW_FAMILIES; print(*FAMILIES, *EXTRA_FAMILIES, *NEW_FAMILIES)')); do \
		echo "== safepad audit --family $$f"; \
		$(LVENV)/bin/safepad audit --no-progress --family $$f || failed="$$failed $$f"; \
	done; \
	if [ -n "$$failed" ]; then echo "== safepad audit FAILED on:$$failed"; fi; \
	$(LVENV)/bin/python -m pytest -n 2 -q -p no:cacheprovider $(LATEST_TESTS); tests=$$?; \
	echo "== latest releases: $$($(call versions,$(LVENV)))"; \
	if [ -n "$$failed" ]; then echo "== safepad audit FAILED on:$$failed"; fi; \
	test -z "$$failed" && test $$tests -eq 0

# The call-sequence fuzzer, open-ended: every supported family round-robin for FUZZ_MINUTES (FUZZ_FAMILIES=a,b
# picks families); prints calls / sequences per family, skipped draws (known defects) and each failure's repro.
# `make test` runs its fixed-seed tier (tests/fuzz).
FUZZ_MINUTES ?= 10
fuzz: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m safepad.testing.fuzz --minutes $(FUZZ_MINUTES) $(if $(FUZZ_FAMILIES),--families $(FUZZ_FAMILIES))

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
	$(BIN)/python benchmarks/bench_rl.py

# The CUDA tier, on a lent GPU machine: its own python3 (torch 2.11, no venv; the wheels from `make gpu-wheels` on
# PYTHONPATH), the cuda-marked tests, then the GPU check's 8-minute plan (each part in its own process, its report
# rewritten after every part under $$OUT). docs/benchmarks.md has the one command to run it with.
CUDA_PYTHON    ?= python3
CUDA_TEST_S    ?= 90
GPU_CHECK_ARGS ?=
# The check runs even when a cuda test fails (its report is what a lease brings back); the target fails if either did.
# `make test-cuda EMULATE=1` runs the same two steps on CPU, in the kernel venv: the cuda-marked tests on CPU tensors
# through the Triton interpreter and the C++ stand-ins (tests/kernels/test_device_kernels.py, smaller shapes), then
# `gpu_check --emulate` (its routes part through the same emulation; the other parts need a GPU). `make test`
# runs both inside test-kernels.
ifeq ($(EMULATE),1)
test-cuda: $(KVENV)/.installed
	status=0; SAFEPAD_KERNEL_TIER=1 TRITON_INTERPRET=1 $(KVENV)/bin/python -m pytest -q -p no:cacheprovider -m cuda \
		tests/kernels || status=$$?; \
	TRITON_INTERPRET=1 $(KVENV)/bin/python -m benchmarks.gpu_check --emulate $(GPU_CHECK_ARGS) || status=$$?; exit $$status
else
test-cuda:
	status=0; SAFEPAD_KERNEL_TIER=cuda timeout $(CUDA_TEST_S) $(CUDA_PYTHON) -m pytest -q -p no:cacheprovider -m cuda \
		tests/kernels || status=$$?; \
	$(CUDA_PYTHON) -m benchmarks.gpu_check $(GPU_CHECK_ARGS) || status=$$?; exit $$status
endif

# The GPU check's CPU smoke run: every part's code path at small shapes (tests/benchmarks runs it in `make test`)
gpu-check-cpu: setup
	$(BIN)/python -m benchmarks.gpu_check --device cpu

# What a GPU run carries (pure-Python wheels for python 3.12, into .whl/, git-ignored): transformers, FLA, mamba-ssm
# built without its CUDA extension (a py3-none-any wheel of its Triton kernels; built in the kernel venv, which has
# torch), and safepad itself. ~25 MB; run it on the CPU machine before a GPU session.
GPU_WHEELS ?= .whl
GPU_WHEEL_PINS ?= transformers==5.25.0 flash-linear-attention==0.6.0 fla-core==0.6.0
gpu-wheels: $(KVENV)/.installed
	mkdir -p $(GPU_WHEELS)
	$(PYTHON) -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d $(GPU_WHEELS) $(GPU_WHEEL_PINS)
	MAMBA_FORCE_BUILD=TRUE MAMBA_SKIP_CUDA_BUILD=TRUE $(KVENV)/bin/pip wheel -q --no-deps --no-build-isolation \
		-w $(GPU_WHEELS) mamba-ssm==2.3.2.post1
	$(KVENV)/bin/pip wheel -q --no-deps -w $(GPU_WHEELS) .
	ls -la $(GPU_WHEELS)

clean:
	rm -rf $(VENV) $(VENV_OLDEST) $(KVENV) $(FVENV) $(TNVENV) $(TFVENV) $(LVENV) build .pytest_cache .hypothesis \
		*.egg-info .triton-cache
