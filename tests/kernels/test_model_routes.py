"""Wrapped tiny models with the kernel routes taken: the audit scenarios give the same table as the torch core.

Every family runs with ``backend="auto"`` on "CUDA" (the emulation's device check), so each call that a
kernel can express goes to it. The CI tier runs a subset that takes every route of every mixer kind
(packed prefill, padded prefill + decode, chunked prefill through the cache, dt-limited decode, generate);
``SAFEPAD_KERNEL_TIER=full`` runs every scenario of every family.
"""

from __future__ import annotations

import copy
import os

import pytest

import safepad
from safepad.testing import (
    FAMILIES,
    GDN_FAMILIES,
    MAMBA1_FAMILIES,
    MAMBA2_FAMILIES,
    SCENARIOS,
    run_scenario,
    tiny_model,
)

FULL = os.environ.get("SAFEPAD_KERNEL_TIER") == "full"

# The CI subset: every kernel route of every mixer kind is taken by some cell. A Mamba2-family cell costs 1-2
# minutes under the interpreter (a Mamba1 / GDN cell seconds), so the six Mamba2 families share three
# cells: padded prefill + decode, packed prefill, chunked prefill with pads (initial states).
SUBSET = {
    "nemotron_h": ("right_pad_decode",),
    "mamba2": ("packed_seq_idx",),
    "bamba": ("chunked_prefill_pad",),
    "jamba": ("right_pad_decode", "packed_position_ids"),
    "mamba": ("decode_default", "chunked_prefill"),
    "falcon_mamba": ("right_pad_decode", "decode_default"),
    "qwen3_next": ("right_pad_decode", "packed_seq_idx"),
    "olmo_hybrid": ("right_pad_decode",),
    "kimi_linear": ("right_pad_decode",),
    "lfm2": ("right_pad_decode", "chunked_prefill"),
}

# kernels that must be reached in a cell, by mixer kind (layouts where the kernel cannot run take the torch core)
EXPECTED = {
    **{f: {"mamba_chunk_scan_combined", "causal_conv1d_fn"} for f in MAMBA2_FAMILIES},
    **{f: {"causal_conv1d_fn"} for f in (*MAMBA1_FAMILIES, *GDN_FAMILIES)},
}
# scenarios with single-token decode steps (chunked prefill feeds chunks of >= 5 tokens)
DECODES = {"right_pad_decode", "left_pad_decode", "decode_default", "decode_dt_min", "decode_dt_max", "generate"}

CELLS = [
    pytest.param(fam, name, id=f"{fam}-{name}")
    for fam in FAMILIES
    for name in (SCENARIOS if FULL else SUBSET.get(fam, ()))
]


@pytest.fixture(scope="module")
def models():
    cache: dict = {}

    def get(family: str):
        if family not in cache:
            stock = tiny_model(family)
            cache[family] = (
                copy.deepcopy(stock),  # the stock reference: transformers' torch path (see conftest)
                safepad.wrap(copy.deepcopy(stock), backend="torch").eval(),
                safepad.wrap(copy.deepcopy(stock), backend="auto").eval(),
            )
        return cache[family]

    return get


@pytest.mark.parametrize("family, name", CELLS)
def test_scenario_with_kernels_same_as_torch_core(family, name, models, kernel_calls):
    reference, torch_core, with_kernels = models(family)
    want = run_scenario(torch_core, reference, name)
    assert kernel_calls.total() == 0, "the torch-core run reached a kernel"
    got = run_scenario(with_kernels, reference, name)
    assert got.status == want.status, (got.status, got.error, got.max_error, want.max_error)
    if want.status == "n/a":
        return
    assert got.error is None and got.passed, (got.error, got.max_error)
    expected = set(EXPECTED.get(family, {"causal_conv1d_fn"}))
    if name in DECODES:
        expected |= {"causal_conv1d_update"}
        if family in (*MAMBA2_FAMILIES, *MAMBA1_FAMILIES):
            expected |= {"selective_state_update"}
    missing = {k for k in expected if kernel_calls[k] == 0}
    assert not missing, f"kernel routes not taken: {sorted(missing)} (calls: {dict(kernel_calls)})"
