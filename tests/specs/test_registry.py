"""The spec registry: per-class forwards are bound to the right patched classes, and bad specs are refused."""

from __future__ import annotations

import pytest

from safepad.specs.registry import MixerSpec, register
from safepad.testing.tiny import family_available, tiny_model
from safepad.wrap import wrap


def _gdn(*a, **k):  # stand-ins: never called
    raise AssertionError


def _other(*a, **k):
    raise AssertionError


def test_forward_by_class_must_name_mixer_classes():
    spec = MixerSpec(
        model_type="fake_two_kinds", kind="gated_delta", mixer_classes=("FakeMixer",), forward=_gdn,
        forward_by_class={"FakeIndexer": _other},
    )  # fmt: skip
    with pytest.raises(ValueError, match="forward_by_class names classes that are not mixer_classes"):
        register(spec)
    assert spec.forward_for("FakeMixer") is _gdn and spec.forward_for("FakeIndexer") is _other


@pytest.mark.parametrize(
    ("family", "special", "module"),
    [
        pytest.param("qwen4_exp_text", "Qwen4ExpTextPLELayer", "safepad.mixers.ple", id="qwen4_exp_text"),
        pytest.param("glm5_next", "Glm5NextTextIndexer", "safepad.mixers.dsa_indexer", id="glm5_next"),
    ],
)
def test_each_patched_class_gets_its_own_forward(family, special, module):
    """A family with two kinds of stateful module: each patched class calls the forward its spec names."""
    ok, why = family_available(family)
    if not ok:
        pytest.skip(why)
    model = wrap(tiny_model(family))
    patched = {type(m).__name__: type(m) for m in model.modules() if hasattr(type(m), "_safepad_spec")}
    spec = patched[f"Safepad{special}"]._safepad_spec
    assert spec.forward_for(special).__module__ == module
    others = [n for n in patched if n != f"Safepad{special}"]
    assert others and all(spec.forward_for(n[len("Safepad"):]) is spec.forward for n in others)


@pytest.mark.parametrize(
    ("kind", "options", "match"),
    [
        pytest.param("mamba2", {"gated_nrom": "X"}, r"unknown option 'gated_nrom' \(did you mean 'gated_norm'\?\)", id="typo"),
        pytest.param("gated_delta", {"in_multiplier": "x"}, r"unknown option 'in_multiplier'", id="other-kind-key"),
        pytest.param("mamba2", {"router_loss_mask": "yes"}, r"option 'router_loss_mask' must be bool", id="wrong-type"),
        pytest.param("gated_delta", {"decay": "exp"}, r"must be one of \['mamba', 'module'\]", id="bad-choice"),
    ],
)
def test_misspelled_or_mistyped_option_raises_where_declared(kind, options, match):
    """A spec option is declared in safepad.specs.options: a typo raises when the spec is built, naming the valid keys."""
    with pytest.raises(ValueError, match=match) as err:
        MixerSpec(model_type="fake_typo", kind=kind, mixer_classes=("FakeTypoMixer",), forward=_gdn, options=options)
    assert "fake_typo" in str(err.value)
    if "unknown option" in match:
        assert "valid options: [" in str(err.value) and "'accelerate_children'" in str(err.value)


def test_unknown_kind_refused_at_registration():
    spec = MixerSpec(model_type="fake_kind", kind="rwkv7", mixer_classes=("FakeKindMixer",), forward=_gdn)
    with pytest.raises(ValueError, match=r"unknown kind 'rwkv7'; known kinds: \["):
        register(spec)


def test_glm5_combined_kind_takes_both_schemas():
    from safepad.specs.registry import specs_for_model_type

    spec = specs_for_model_type("glm5_next_text")
    assert spec.kind == "gated_delta+dsa_indexer" and spec.options["decay"] == "module"
