"""The ops' autocast boundary (``safepad.ops.amp.fp32_core``) holds for keyword calls too.

``safepad.parallel.ops`` calls the ops with keyword arguments only; under ``torch.autocast`` the core then
ran its matmuls in bf16 and the backward mixed float and BFloat16. Reference: the same call without autocast.
"""

from __future__ import annotations

import pytest
import torch

import safepad.ops as ops


def _ssd_inputs(gen):
    Bsz, T, H, P, G, N = 2, 24, 4, 8, 2, 8
    return dict(
        x=torch.randn(Bsz, T, H, P, generator=gen),
        dt=torch.randn(Bsz, T, H, generator=gen),
        A=-torch.rand(H, generator=gen) - 0.5,
        B=torch.randn(Bsz, T, G, N, generator=gen),
        C=torch.randn(Bsz, T, G, N, generator=gen),
        D=torch.randn(H, generator=gen),
        dt_bias=torch.randn(H, generator=gen),
    )


def _run(fn, inputs, **extra):
    leaves = {k: v.clone().requires_grad_(True) for k, v in inputs.items()}
    y = fn(**leaves, **extra)
    y = y[0] if isinstance(y, tuple) else y
    (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return y.float(), {k: v.grad for k, v in leaves.items()}


@pytest.mark.parametrize(
    "fn, make, extra",
    [
        pytest.param(ops.ssd_scan, _ssd_inputs, dict(chunk_size=8), id="ssd_scan"),
    ],
)
def test_keyword_call_under_autocast_backward(fn, make, extra):
    inputs = make(torch.Generator().manual_seed(0))
    y_ref, g_ref = _run(fn, inputs, **extra)
    bf16 = {k: (v.bfloat16() if k in ("x", "u", "B", "C") else v) for k, v in inputs.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, g = _run(fn, bf16, **extra)
    assert torch.allclose(y, y_ref, atol=0.1, rtol=0.05), (y - y_ref).abs().max()
    for k, ref in g_ref.items():
        assert g[k] is not None and g[k].dtype == bf16[k].dtype, k
        assert torch.allclose(g[k].float(), ref, atol=0.2, rtol=0.05), (k, (g[k].float() - ref).abs().max())
