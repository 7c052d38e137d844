"""The cause of the fp32 CUDA discrepancy (issue "GPU-real"), reproduced on CPU, and the audit's answer to it.

On one H200 in fp32, wrapped Mamba2-family and gated-DeltaNet models were 2e-4 to 3e-3 off the stock reference in
every audit scenario, while Mamba1 (jamba, mamba) and the short-conv families (lfm2) agreed to 1.6e-5. The cause is
stock's side: transformers dispatches the SSD scan and the delta rule to mamba-ssm's / FLA's Triton kernels on CUDA
whenever they import, and ``tl.dot`` rounds float32 inputs to TF32 there (safepad.testing.tf32). Emulating exactly
that on CPU (those ops' matrix products rounded to TF32, nothing else) reproduces the report family by family; the
audit then measures the reference's own rounding against float64 and judges against it, so it still passes a
correct wrapped model and fails stock right padding.
"""

from __future__ import annotations

import pytest
import torch

import safepad
from safepad.testing.scenarios import audit
from safepad.testing.tf32 import package_ops, round_to_tf32, stock_package_ops_in_tf32, tf32_matmuls
from safepad.testing.tiny import tiny_model
from tests.wrap.helpers import family_param

SCENARIOS = ["packed_position_ids", "right_pad_decode", "chunked_prefill"]


def test_round_to_tf32_keeps_ten_mantissa_bits():
    x = torch.randn(10_000, dtype=torch.float64).to(torch.float32)
    r = round_to_tf32(x)
    rel = ((r.double() - x.double()).abs() / x.double().abs()).max().item()
    assert 0 < rel <= 2.0**-11  # round to nearest: at most half of TF32's 2^-10 spacing
    assert torch.equal(round_to_tf32(r), r)  # TF32 values are fixed points
    ties = torch.tensor([1 + 2.0**-11, -(1 + 2.0**-11), 1 + 3 * 2.0**-11])
    assert round_to_tf32(ties).tolist() == [1 + 2.0**-10, -(1 + 2.0**-10), 1 + 2 * 2.0**-10]  # ties away from zero
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0])
    assert torch.equal(round_to_tf32(special)[:2], special[:2]) and round_to_tf32(special)[2].isnan()
    assert torch.equal(round_to_tf32(x.double()), x.double())  # float64 untouched


def test_tf32_matmuls_round_every_float32_product():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    want = round_to_tf32(a).double() @ round_to_tf32(b).double()
    with tf32_matmuls():
        outs = [a @ b, torch.matmul(a, b), torch.einsum("ij,jk->ik", a, b), torch.nn.functional.linear(a, b.T)]
    for out in outs:
        assert (out.double() - want).abs().max() < 1e-5
        assert (out.double() - a.double() @ b.double()).abs().max() > 1e-4  # rounding visible


@pytest.mark.parametrize(
    "family, ops",
    [
        ("mamba2", {"mamba2_chunk_scan", "mamba2_split_conv1d_scan_combined", "mamba2_selective_state_update"}),
        ("qwen3_next", {"torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"}),
        ("jamba", {"mamba_selective_state_update"}),  # its scan (selective_scan_fn) needs mamba-ssm's CUDA extension
        ("lfm2", set()),
    ],
)
def test_the_package_ops_transformers_dispatches_to(family, ops):
    """The ops transformers sends to a Triton-only package on CUDA, read from its modeling source."""
    model = tiny_model(family)
    found = set()
    for name in {type(m).__module__ for m in model.modules() if type(m).__module__.startswith("transformers.models.")}:
        found |= set(package_ops(name))
    if not found and ops:
        pytest.skip("this transformers does not dispatch per op (< 5.24)")
    assert found == ops


@pytest.mark.parametrize("family", [family_param(f) for f in ("nemotron_h", "mamba2", "qwen3_next", "jamba", "lfm2")])
def test_tf32_package_ops_reproduce_the_cuda_report_and_the_audit_measures_them(family):
    model = tiny_model(family)
    with stock_package_ops_in_tf32(model) as patched:
        plain = audit(model, safepad.wrap, SCENARIOS, measure_rounding=False)
        measured = audit(model, safepad.wrap, SCENARIOS, measure_rounding=True)
    if family in ("jamba", "lfm2"):  # no TF32 matmul in their dispatched ops: agreed on CUDA, agree here
        assert plain.passed and max(r.max_abs_logits for r in plain.wrapped) < 1e-5
    else:
        if not patched:
            pytest.skip("this transformers does not dispatch per op (< 5.24)")
        worst = max(r.max_abs_logits for r in plain.wrapped)
        assert not plain.passed and 1e-4 < worst < 1e-2, worst  # the CUDA report: 2e-4 to 3e-3
        assert 1e-5 < measured.reference_rounding < 1e-2  # relative to the logits' scale
    assert measured.passed, [(r.name, r.max_abs_logits, r.tol) for r in measured.wrapped]
    stock = {r.name: r for r in measured.stock}
    assert stock["right_pad_decode"].passed is False and stock["packed_position_ids"].passed is False
