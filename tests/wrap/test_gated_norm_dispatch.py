"""The mixer runs the fused gated norm only for an unmodified stock norm; hooks and subclasses get the module."""

from __future__ import annotations

import torch

import safepad
from safepad.mixers.common import gated_norm
from safepad.testing.tiny import tiny_model

NORM = "NemotronHRMSNormGated"  # what the nemotron_h spec declares as its fusable norm


def test_stock_norm_is_fused_and_equal_to_the_module(monkeypatch):
    model = tiny_model("nemotron_h", seed=0)
    norm = next(m for m in model.modules() if type(m).__name__ == "NemotronHRMSNormGated")
    y, gate = torch.randn(2, 5, norm.weight.numel()), torch.randn(2, 5, norm.weight.numel())
    calls = []
    norm.register_forward_hook(lambda *a: calls.append(1))
    via_module = gated_norm(norm, y, gate, NORM)  # a hook: the module runs, and the hook sees it
    assert calls == [1]
    norm._forward_hooks.clear()
    fused = gated_norm(norm, y, gate, NORM)  # no hook: the fused op, same result
    assert calls == [1]
    torch.testing.assert_close(fused, via_module, rtol=1e-6, atol=1e-6)

    def fused_op_called(*args):
        raise AssertionError("the fused op ran although the spec declares no fusable norm")

    monkeypatch.setattr("safepad.mixers.common.gated_rms_norm", fused_op_called)
    torch.testing.assert_close(gated_norm(norm, y, gate, None), via_module)  # no declared norm: the module


def test_hook_on_the_norm_fires_inside_a_wrapped_model():
    model = safepad.wrap(tiny_model("nemotron_h", seed=0))
    seen = []
    for m in model.modules():
        if type(m).__name__ == "NemotronHRMSNormGated":
            m.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    model(input_ids=torch.randint(3, 100, (1, 9)))
    assert seen, "the wrapped mixers must call a hooked norm as a module"


def test_subclassed_norm_is_called_as_module():
    model = tiny_model("nemotron_h", seed=0)
    norm = next(m for m in model.modules() if type(m).__name__ == "NemotronHRMSNormGated")

    class Doubled(type(norm)):
        def forward(self, hidden_states, gate=None):
            return 2 * super().forward(hidden_states, gate)

    y, gate = torch.randn(1, 4, norm.weight.numel()), torch.randn(1, 4, norm.weight.numel())
    ref = gated_norm(norm, y, gate, NORM)
    norm.__class__ = Doubled
    torch.testing.assert_close(gated_norm(norm, y, gate, NORM), 2 * ref)


def test_a_stock_named_norm_with_other_math_is_called_as_module(caplog):
    """A future transformers release that changes the norm's math must not be silently replaced by ours."""

    class Changed(torch.nn.Module):  # same name and package as a stock class, different math (no gate)
        def __init__(self, n):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(n))
            self.group_size, self.variance_epsilon = n, 1e-6

        def forward(self, hidden_states, gate=None):
            return self.weight * hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + 1e-6)

    Changed.__name__ = Changed.__qualname__ = "NemotronHRMSNormGated"
    Changed.__module__ = "transformers.models.nemotron_h.modeling_nemotron_h"
    norm = Changed(8)
    y, gate = torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    with caplog.at_level("WARNING", logger="safepad.mixers.common"):
        out = gated_norm(norm, y, gate, NORM)
    torch.testing.assert_close(out, norm(y, gate))
    assert "calls it as a module" in caplog.text


def test_instance_forward_override_is_called_as_module():
    """accelerate's device/offload hooks replace ``module.forward`` on the instance: it must still run."""
    model = tiny_model("nemotron_h", seed=0)
    norm = next(m for m in model.modules() if type(m).__name__ == "NemotronHRMSNormGated")
    original = norm.forward
    calls = []

    def hooked(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    norm.forward = hooked
    y, gate = torch.randn(1, 4, norm.weight.numel()), torch.randn(1, 4, norm.weight.numel())
    gated_norm(norm, y, gate, NORM)
    assert calls == [1]


def test_wrapped_families_use_the_norm_their_spec_declares(monkeypatch):
    """The spec option reaches the mixer: nemotron_h fuses its stock norm, falcon_h1 (none declared) does not."""
    import safepad.mixers.common as common

    used = []
    real = common.gated_rms_norm

    def spy(*args):
        used.append(1)
        return real(*args)

    monkeypatch.setattr(common, "gated_rms_norm", spy)
    ids = torch.randint(3, 100, (1, 9))
    safepad.wrap(tiny_model("nemotron_h", seed=0))(input_ids=ids)
    assert used, "nemotron_h's stock norm should run fused"
    used.clear()
    safepad.wrap(tiny_model("falcon_h1", seed=0))(input_ids=ids)
    assert not used, "falcon_h1 declares no fusable norm"
