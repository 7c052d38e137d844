"""Every recurrent model type of the installed transformers is supported or listed as unsupported.

The discovery (``safepad.specs.discovery``) walks every ``config.model_type`` of the installed transformers and
finds those whose modules keep conv / recurrent cache state, from the cache layer types their config declares and
from the classes of their modeling package that read or write that state (no hand-kept list). The check fails for
a family that is neither served by specs nor listed in ``safepad/specs/unsupported.py``; a fake family injected
at run time shows it does.
"""

from __future__ import annotations

import copy
import textwrap
import warnings

import pytest
import torch
import transformers
from transformers import AutoConfig, PretrainedConfig

import safepad
from safepad.errors import PaddingError, PaddingWarning, UnsupportedModelError
from safepad.guard import KIND_RIGHT_PADDING, find_ssm_layers, guard
from safepad.specs import discovery
from safepad.specs.discovery import RecurrentFamily, coverage, discover_recurrent_families, recurrent_cache_layer_types
from safepad.specs.unsupported import UNSUPPORTED_FAMILIES
from safepad.testing.tiny import tiny_model


def uncovered(families: dict[str, RecurrentFamily]) -> dict[str, str]:
    """``{model_type: what is wrong}`` for every discovered family that is neither supported nor listed."""
    return {mt: why for mt, fam in families.items() for status, why in [coverage(fam)] if status == "missing"}


@pytest.fixture(scope="module")
def families() -> dict[str, RecurrentFamily]:
    return discover_recurrent_families()


def test_every_recurrent_family_is_supported_or_listed(families):
    bad = uncovered(families)
    assert not bad, "recurrent families neither supported nor listed as unsupported:\n" + "\n".join(
        f"  {mt}: {why}" for mt, why in sorted(bad.items())
    )


def test_discovery_is_not_vacuous(families):
    """Known families are found with the classes safepad patches (so an empty discovery cannot pass)."""
    expected = {
        "nemotron_h": "NemotronHMamba2Mixer",
        "mamba": "MambaMixer",
        "jamba": "JambaMambaMixer",
        "qwen3_next": "Qwen3NextGatedDeltaNet",
        "lfm2": "Lfm2ShortConv",  # its default config has no conv layer: found from the modeling classes
        "recurrent_gemma": "RecurrentGemmaRecurrentBlock",  # state kept on the module, not in the cache
        "minimax": "MiniMaxLightningAttention",  # its own linear cache, no conv
    }
    for mt, cls in expected.items():
        assert mt in families, f"{mt} not discovered"
        assert cls in families[mt].stateful_classes, (mt, families[mt].stateful_classes)
    # wrappers whose language model is recurrent are found through their text config
    assert families["lfm2_vl"].text_model_type == "lfm2"
    assert "Lfm2ShortConv" in families["lfm2_vl"].stateful_classes
    assert families["nemotron_h_omni"].text_model_type == "nemotron_h"
    # plain attention models are not
    for mt in ("llama", "gpt2", "qwen3", "mistral", "bert"):
        assert mt not in families


def test_each_unsupported_entry_is_a_recurrent_family_or_absent_from_this_version(families):
    configs = transformers.models.auto.configuration_auto.CONFIG_MAPPING
    for mt, reason in UNSUPPORTED_FAMILIES.items():
        assert reason and "\n" not in reason, f"{mt}: the reason must be one line"
        if mt in configs:
            assert mt in families, f"{mt} is listed as unsupported but not discovered as recurrent (stale entry?)"
            assert coverage(families[mt])[0] == "unsupported"


# ----------------------------------------------------------------------------------------------------------
# the check fails for a family nobody has looked at
# ----------------------------------------------------------------------------------------------------------


class _FakeRecurrentConfig(PretrainedConfig):
    model_type = "safepad_fake_recurrent"

    def __init__(self, num_hidden_layers: int = 2, **kwargs):
        self.num_hidden_layers = num_hidden_layers
        self.layer_types = ["linear_attention", "full_attention"][:num_hidden_layers]
        super().__init__(**kwargs)


@pytest.fixture
def fake_family():
    AutoConfig.register(_FakeRecurrentConfig.model_type, _FakeRecurrentConfig)
    mapping = transformers.models.auto.configuration_auto.CONFIG_MAPPING
    try:
        yield _FakeRecurrentConfig.model_type
    finally:
        mapping._extra_content.pop(_FakeRecurrentConfig.model_type, None)


def test_injected_recurrent_family_fails_the_check(fake_family, monkeypatch):
    found = discover_recurrent_families([fake_family, "llama"])
    assert set(found) == {fake_family}
    assert found[fake_family].cache_layer_types == ("linear_attention",)
    bad = uncovered(found)
    assert fake_family in bad and "safepad/specs/unsupported.py" in bad[fake_family]
    # listing it with a reason makes the check pass
    monkeypatch.setattr(discovery, "UNSUPPORTED_FAMILIES", {fake_family: "a fake family"})
    assert not uncovered(found)
    assert coverage(found[fake_family]) == ("unsupported", "a fake family")


def test_unclaimed_stateful_class_fails_and_a_stale_listing_is_caught(tmp_path, monkeypatch):
    src = tmp_path / "modeling_fake.py"
    src.write_text(
        textwrap.dedent(
            """
            class FakeMixer:
                def forward(self, x, cache=None):
                    return cache.update_conv_state(x, 0)

            class FakeRecurrence:
                def forward(self, x):
                    self.recurrent_states = x
                    return x

            class FakeAttention:
                def forward(self, q, k, cache=None):
                    return cache.update(k, q, 0)
            """
        )
    )
    assert discovery._file_stateful_classes(str(src)) == frozenset({"FakeMixer", "FakeRecurrence"})
    fam = RecurrentFamily("fake", (), ("FakeMixer", "Lfm2ShortConv"), None)
    status, why = coverage(fam)
    assert status == "missing" and "FakeMixer" in why and "Lfm2ShortConv" not in why
    # a family whose every class is claimed by a spec but is still listed as unsupported: stale entry
    claimed = RecurrentFamily("lfm2", (), ("Lfm2ShortConv",), None)
    assert coverage(claimed)[0] == "supported"
    monkeypatch.setattr(discovery, "UNSUPPORTED_FAMILIES", {"lfm2": "stale"})
    assert coverage(claimed)[0] == "missing"


def test_recurrent_cache_layer_types_reads_the_text_config():
    cfg = AutoConfig.for_model("lfm2", layer_types=["conv", "full_attention"], num_hidden_layers=2)
    assert recurrent_cache_layer_types(cfg) == ("conv",)
    assert recurrent_cache_layer_types(AutoConfig.for_model("llama")) == ()


# ----------------------------------------------------------------------------------------------------------
# the guard detects every discovered family, and warns for the unsupported ones
# ----------------------------------------------------------------------------------------------------------

_QSA = {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 256, "indexer_budget": 64,
        "indexer_compress_ratio": 4}
#: default configs that do not build as they are (fields left None by transformers); only what building needs
_BUILD_OVERRIDES: dict[str, dict] = {
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_hidden_layers": 2},
    "qwen4_exp_text": {**_QSA},
    "qwen4_exp": {"text_config": {**_QSA}},
}
#: auto classes tried in order to build a model type (then any class of another auto mapping that knows it)
_AUTO_CLASSES = ("AutoModelForCausalLM", "AutoModelForImageTextToText", "AutoModelForMultimodalLM", "AutoModel")


_BUILT: dict[str, torch.nn.Module] = {}


def _build_on_meta(model_type: str) -> torch.nn.Module:
    """The model type's model from its default config, on the meta device (no memory, no weights); memoised."""
    if model_type not in _BUILT:
        _BUILT[model_type] = _build(model_type)
    return _BUILT[model_type]


def _build(model_type: str) -> torch.nn.Module:
    from transformers.models.auto import modeling_auto

    config = AutoConfig.for_model(model_type, **_BUILD_OVERRIDES.get(model_type, {}))
    with torch.device("meta"):
        for auto in _AUTO_CLASSES:
            try:
                return getattr(transformers, auto).from_config(config)
            except ValueError as exc:  # "Unrecognized configuration class ... for this kind of AutoModel"
                if "Unrecognized configuration class" not in str(exc):
                    raise
        for key, mapping in sorted(vars(modeling_auto).items()):  # e.g. jev: only a decision-model class
            name = mapping.get(model_type) if key.endswith("_MAPPING_NAMES") and isinstance(mapping, dict) else None
            cls = getattr(transformers, name, None) if isinstance(name, str) else None
            if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
                return cls._from_config(config)
    raise AssertionError(f"{model_type}: no transformers model class to build")


def _right_padded_call():
    ids = torch.randint(3, 200, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, 4:] = 0  # row 0 ends in two pads
    return {"input_ids": ids, "attention_mask": mask, "use_cache": True}


class _Stop(Exception):
    """Raised by a pre-hook placed after the guard's: the (meta-device) forward never runs."""


def _stop(module, args, kwargs):
    raise _Stop


def test_guard_detects_every_discovered_family(families):
    missed = []
    for mt in families:
        info = find_ssm_layers(_build_on_meta(mt))
        if info is None:
            missed.append(mt)
    assert not missed, f"safepad.guard finds no recurrent layer in: {missed}"


def test_guard_warns_for_each_unsupported_family_under_right_padding_with_a_cache(families):
    unsupported = [mt for mt, fam in families.items() if coverage(fam)[0] == "unsupported"]
    assert "minimax" in unsupported  # exists in 5.23 and 5.24
    for mt in unsupported:
        model = _build_on_meta(mt)
        with guard(model, mode="error"):
            with pytest.raises(PaddingError) as err:
                model(**_right_padded_call())
        assert KIND_RIGHT_PADDING in err.value.kinds, mt
        handle = guard(model, mode="warn")
        stop = model.register_forward_pre_hook(_stop, with_kwargs=True)
        try:
            with pytest.warns(PaddingWarning, match="padding token") as rec, pytest.raises(_Stop):
                model(**_right_padded_call())
            assert any(w.message.kind == KIND_RIGHT_PADDING for w in rec), mt
            left = _right_padded_call()
            left["attention_mask"] = left["attention_mask"].flip(-1)  # left padding: nothing to report
            with warnings.catch_warnings():
                warnings.simplefilter("error", PaddingWarning)
                with pytest.raises(_Stop):
                    model(**left)
        finally:
            stop.remove()
            handle.remove()


def test_guard_warns_on_a_real_unsupported_tiny_model_and_wrap_says_why():
    """A full forward of a tiny minimax (unsupported: lightning attention with its own cache) under the guard."""
    model = tiny_model("minimax")
    with pytest.raises(UnsupportedModelError, match="minimax is a recurrent family safepad does not support"):
        safepad.wrap(copy.deepcopy(model))
    with guard(model, mode="warn"), pytest.warns(PaddingWarning, match="padding token"):
        out = model(**_right_padded_call())
    assert out.logits.shape == (2, 6, 256)


def test_guard_detects_injected_fake_families():
    class FakeModel(torch.nn.Module):  # config-only: layer types transformers caches recurrently
        def __init__(self):
            super().__init__()
            self.config = _FakeRecurrentConfig()
            self.proj = torch.nn.Linear(4, 4)

    assert find_ssm_layers(FakeModel()) is not None
    assert find_ssm_layers(_FakeStatefulModel()).mixer_classes == ("_FakeStatefulMixer",)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert find_ssm_layers(plain) is None


class _FakeStatefulMixer(torch.nn.Module):
    """A mixer that keeps its conv state in the cache (found by its source, whatever its name)."""

    def forward(self, x, cache=None):
        if cache is not None:
            x = cache.update_conv_state(x, 0)
        return x


class _FakeStatefulModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = _FakeStatefulMixer()
