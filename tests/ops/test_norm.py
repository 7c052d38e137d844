"""safepad.ops.norm.gated_rms_norm against transformers' gated RMSNorm modules (the code it replaces)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.bamba.modeling_bamba import BambaRMSNormGated
from transformers.models.mamba2 import modeling_mamba2

# renamed in transformers 5.25
MambaRMSNormGated = getattr(modeling_mamba2, "Mamba2RMSNormGated", None) or modeling_mamba2.MambaRMSNormGated
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHRMSNormGated

import safepad.ops.norm as norm_mod
from safepad.ops.norm import gated_rms_norm


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


@pytest.fixture(params=[pytest.param(None, id="one-block"), pytest.param(1, id="block-per-row")])
def norm_blocks(request, monkeypatch):
    if request.param is not None:
        monkeypatch.setattr(norm_mod, "_BLOCK_BYTES", request.param)


@pytest.mark.usefixtures("norm_blocks")
@pytest.mark.parametrize("cls", [NemotronHRMSNormGated, MambaRMSNormGated, BambaRMSNormGated], ids=lambda c: c.__name__)
@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["fp64", "fp32", "bf16"])
def test_matches_the_transformers_module_outputs_and_grads(cls, groups, dtype):
    I = 32  # noqa: E741
    torch.manual_seed(0)
    norm = cls(I, group_size=I // groups, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    if dtype == torch.float64:
        norm = norm.double()
    proj = torch.randn(2, 7, 3 * I, dtype=dtype) * 3  # y and gate are strided views, as in a mixer
    g_out = torch.randn(2, 7, I, dtype=torch.float64)
    results = []
    for fused in (False, True):
        p = proj.clone().requires_grad_(True)
        norm.weight.grad = None
        y, gate = p[..., :I], p[..., 2 * I :]
        out = gated_rms_norm(y, gate, norm.weight, norm.group_size, norm.variance_epsilon) if fused else norm(y, gate)
        (out.double() * g_out).sum().backward()
        results.append((out.detach(), p.grad, norm.weight.grad.clone()))
    (o0, gp0, gw0), (o1, gp1, gw1) = results
    assert o1.dtype == o0.dtype and o1.shape == o0.shape
    # the module computes in float32 whatever the input dtype (float64 too), and so does the fused op
    tol = {torch.float64: 1e-5, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    assert rel_err(o1, o0) < tol
    assert gp1.dtype == gp0.dtype and rel_err(gp1, gp0) < tol
    assert rel_err(gw1, gw0) < tol


def test_grouping_matters():
    """Per-group normalisation is not whole-row normalisation: the test above would see a wrong group size."""
    torch.manual_seed(1)
    y, gate, w = torch.randn(3, 16), torch.randn(3, 16), torch.randn(16)
    assert rel_err(gated_rms_norm(y, gate, w, 4, 1e-6), gated_rms_norm(y, gate, w, 16, 1e-6)) > 1e-2


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="same shape"):
        gated_rms_norm(torch.zeros(2, 8), torch.zeros(2, 4), torch.ones(8), 4, 1e-6)
    with pytest.raises(ValueError, match="group_size"):
        gated_rms_norm(torch.zeros(2, 8), torch.zeros(2, 8), torch.ones(8), 3, 1e-6)
