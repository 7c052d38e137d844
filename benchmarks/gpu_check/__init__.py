"""safepad's GPU check: a package of parts, each runnable alone, with one JSON report rewritten after every part.

    python -m benchmarks.gpu_check                       # a lent GPU: the 8-minute plan, each part in its own process
    python -m benchmarks.gpu_check --dry-run             # the plan, each part's budget and the JSON schema
    python -m benchmarks.gpu_check --parts audit,routes  # some parts, by name
    python -m benchmarks.gpu_check --device cpu          # the CPU smoke run: every part's code path, small shapes
    python -m benchmarks.gpu_check --emulate             # CPU, kernels emulated (Triton interpreter; kernel venv)

Parts, most valuable first (:mod:`.parts` holds their budgets on a bare machine, cold Triton cache included):

1. ``audit`` - ``safepad audit`` of every family's tiny model on the device, fp32 and bf16 (:mod:`.audit`);
2. ``routes`` - every kernel route == the torch core, then wrapped packed logits (:mod:`.routes`);
3. ``generate`` - wrapped models on the kernels: right-padded decode, chunked prefill, generate (:mod:`.generate`);
4. the speed parts (:mod:`.speed`): ``decode_cuda_graph``, ``gdn_time_per_token``, ``train_tokens_per_s``,
   ``syncs_per_step``, ``mixer_vs_mamba_ssm`` (needs causal-conv1d), ``mamba1_time_per_token`` (needs mamba-ssm's
   CUDA selective scan); then ``fsdp2_accelerate`` (:mod:`.fsdp2`).

The plan keeps the parts that fit ``--max-total`` (480 s) and skips, with the reason, the parts whose packages are
missing (mamba-ssm's Triton kernels import without its CUDA extension: ``safepad.ops.kernels``). On a GPU each part
runs in its own process, killed 10 s past its budget (a Triton compile is not interruptible by SIGALRM, and a
device-side assert ends only that part's CUDA context). Progress: one line per part start and end, a
``GPU_CHECK_PART {json}`` line per part, and the whole report last on a ``GPU_CHECK_JSON`` line; the report file
(``--json``, default ``$OUT/gpu_check.json``) is rewritten after every part. Exit status 0 when no part failed,
errored or timed out (skipped parts are fine), 1 otherwise.
"""

from __future__ import annotations

import os
import sys


def _early_setup(argv: list[str]) -> None:
    """Before anything imports triton: Triton's caches, or the kernel emulation; the stock models' torch paths."""
    from . import env

    if "--emulate" in argv:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    else:
        env.triton_caches()
    env.stock_models_on_torch_paths()
    if "--emulate" in argv:
        from safepad.testing import kernel_emulation

        kernel_emulation.install()


# `python -m benchmarks.gpu_check ...`: sys.argv[0] is "-m" while the package is imported
if sys.argv and sys.argv[0] == "-m":
    _early_setup(sys.argv[1:])
