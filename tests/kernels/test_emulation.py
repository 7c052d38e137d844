"""The emulation itself: the stand-ins equal the packages' references and keep the C++ checks; the device
seam and the import side effects of the optional packages."""

from __future__ import annotations

import pytest
import torch

from safepad.ops import kernels
from safepad.testing import kernel_emulation


def test_installed_and_every_kernel_imports():
    assert kernel_emulation.installed()
    assert all(kernels.kernels_available().values()), kernels.kernels_available()


def test_device_seam_is_the_one_check(monkeypatch):
    x = torch.zeros(2)
    assert kernels.use_kernels(x, need=("causal_conv1d_fn",))
    prev = kernels.set_kernel_device_check(None)  # the default: tensor.is_cuda
    try:
        assert not kernels.use_kernels(x, need=("causal_conv1d_fn",))
        with pytest.raises(ValueError, match="not on CUDA"):
            kernels.use_kernels(x, backend="kernels")
    finally:
        kernels.set_kernel_device_check(prev)
    monkeypatch.setenv("SAFEPAD_BACKEND", "torch")
    assert not kernels.use_kernels(x, need=("causal_conv1d_fn",))


def test_conv_standins_equal_the_reference_and_keep_the_cxx_checks():
    from causal_conv1d import causal_conv1d_fn, causal_conv1d_update
    from causal_conv1d.causal_conv1d_interface import causal_conv1d_ref, causal_conv1d_update_ref

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 16, generator=g).transpose(1, 2)  # [B, D=16, T=8] channel-last
    w, b = torch.randn(16, 4, generator=g), torch.randn(16, generator=g)
    assert torch.allclose(causal_conv1d_fn(x, w, b, activation="silu"), causal_conv1d_ref(x, w, b, activation="silu"))
    st = torch.randn(2, 16, 4, generator=g)
    st2 = st.clone()
    y = causal_conv1d_update(x[:, :, 0].contiguous(), st, w, b, activation="silu")
    assert torch.allclose(y, causal_conv1d_update_ref(x[:, :, 0].contiguous(), st2, w, b, activation="silu"))
    assert torch.equal(st, st2)
    with pytest.raises(RuntimeError, match="width between 2 and 4"):
        causal_conv1d_fn(x, torch.randn(16, 5), None)
    with pytest.raises(RuntimeError, match="divisible by 8"):
        causal_conv1d_fn(torch.randn(1, 5, 12).transpose(1, 2), torch.randn(12, 4), None)
    with pytest.raises(RuntimeError, match="channel last"):
        causal_conv1d_fn(torch.randn(1, 16, 5), w, None, seq_idx=torch.zeros(1, 5, dtype=torch.int32))


def test_scan_standin_equals_the_reference_fwd_bwd():
    from mamba_ssm.ops.selective_scan_interface import selective_scan_fn, selective_scan_ref

    g = torch.Generator().manual_seed(1)
    u, dl, z = (torch.randn(2, 6, 7, generator=g).requires_grad_() for _ in range(3))
    A = (-torch.rand(6, 4, generator=g)).requires_grad_()
    B, C = (torch.randn(2, 4, 7, generator=g).requires_grad_() for _ in range(2))
    D = torch.randn(6, generator=g).requires_grad_()
    outs = []
    for fn in (selective_scan_fn, selective_scan_ref):
        y, last = fn(u, dl, A, B, C, D=D, z=z, delta_softplus=True, return_last_state=True)
        grads = torch.autograd.grad(y.square().sum(), (u, dl, A, B, C, D, z))
        outs.append((y, last, *grads))
    for a, b in zip(*outs):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
    with pytest.raises(RuntimeError, match="state dimension <= 256"):
        selective_scan_fn(u, dl, -torch.rand(6, 300), torch.randn(2, 300, 7), torch.randn(2, 300, 7))


def test_autotuner_takes_the_first_config_without_timing():
    from mamba_ssm.ops.triton.ssd_bmm import _bmm_chunk_fwd, _bmm_chunk_fwd_kernel

    a = torch.randn(1, 8, 1, 4)
    _bmm_chunk_fwd(a, a, chunk_size=4)
    assert _bmm_chunk_fwd_kernel.best_config == _bmm_chunk_fwd_kernel.configs[0]


def test_fla_import_does_not_shadow_transformers_model_types():
    """Regression: importing fla (safepad does, to find its kernels) registered FLA's own mamba / mamba2 configs
    over transformers': AutoModelForCausalLM then built FLA's Mamba2 and safepad.wrap found no mixer."""
    import fla  # noqa: F401
    from transformers import AutoConfig, Mamba2Config, MambaConfig

    from safepad.testing import tiny_model

    assert type(AutoConfig.for_model("mamba2")) is Mamba2Config
    assert type(AutoConfig.for_model("mamba")) is MambaConfig
    mixers = {type(m).__name__ for m in tiny_model("mamba2").modules()}
    assert "Mamba2Mixer" in mixers, mixers
