"""Tiny models: every family builds in memory, has visible mixers, and strengthening is deterministic."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from safepad.testing import (
    EXTRA_FAMILIES,
    FAMILIES,
    GDN_FAMILIES,
    MAMBA1_FAMILIES,
    MAMBA2_FAMILIES,
    find_mixers,
    run_scenario,
    strengthen_mixers,
    tiny_config,
    tiny_model,
)

_ATTENTION_FREE = {"mamba", "mamba2", "falcon_mamba"}


def test_family_groups_partition_families():
    assert len(FAMILIES) == 13
    assert set(MAMBA2_FAMILIES) | set(MAMBA1_FAMILIES) | set(GDN_FAMILIES) == set(FAMILIES)
    assert len(set(MAMBA2_FAMILIES) | set(MAMBA1_FAMILIES) | set(GDN_FAMILIES)) == 13


@pytest.mark.parametrize("family", FAMILIES + EXTRA_FAMILIES)
def test_tiny_model_shape_and_logits(family):
    model = tiny_model(family)
    cfg = model.config
    assert not model.training
    assert cfg.hidden_size == 64 and cfg.vocab_size == 256
    assert 2 <= cfg.num_hidden_layers <= 4
    assert find_mixers(model), "no SSM / linear-attention mixer"
    attn = [
        n
        for n, m in model.named_modules()
        if type(m).__name__.endswith("Attention") and "Delta" not in type(m).__name__
    ]
    assert bool(attn) == (family not in _ATTENTION_FREE), attn
    ids = torch.randint(3, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits
    assert torch.isfinite(logits).all()
    assert 0.3 < logits.abs().max().item() < 50


@pytest.mark.parametrize("family", MAMBA2_FAMILIES)
def test_mamba2_family_has_small_chunks_and_groups(family):
    model = tiny_model(family)
    (_, mixer), *_ = find_mixers(model)
    assert mixer.chunk_size == 16
    assert mixer.n_groups == 2
    assert mixer.conv_kernel_size == 4


def test_config_overrides():
    assert tiny_config("mamba2", chunk_size=8).chunk_size == 8
    assert tiny_config("qwen3_next", use_cache=False).use_cache is False


def test_unknown_family_raises():
    with pytest.raises(ValueError, match="family"):
        tiny_config("mamba3")
    with pytest.raises(ValueError, match="family"):
        tiny_model("llama")


def test_strengthen_is_deterministic_and_seeded():
    a, b, c = tiny_model("bamba", seed=0), tiny_model("bamba", seed=0), tiny_model("bamba", seed=1)
    for (n, pa), (_, pb), (_, pc) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(pa, pb), n
    assert not torch.equal(a.model.layers[0].mamba.in_proj.weight, c.model.layers[0].mamba.in_proj.weight)


def test_strengthen_sets_mixer_stds_and_leaves_the_rest():
    weak = tiny_model("mamba", strengthen=False)
    strong = strengthen_mixers(copy.deepcopy(weak), proj_std=0.3, conv_std=0.5)
    mixer = strong.backbone.layers[0].mixer
    assert abs(mixer.in_proj.weight.std().item() - 0.3) < 0.03
    assert abs(mixer.conv1d.weight.std().item() - 0.5) < 0.1
    # dt_proj keeps its init, embeddings and norms are untouched
    assert torch.equal(mixer.dt_proj.weight, weak.backbone.layers[0].mixer.dt_proj.weight)
    assert torch.equal(strong.backbone.embeddings.weight, weak.backbone.embeddings.weight)


def test_strengthen_validates():
    with pytest.raises(ValueError, match="proj_std"):
        strengthen_mixers(tiny_model("mamba", strengthen=False), proj_std=0.0)
    with pytest.raises(ValueError, match="no sequence mixer"):
        strengthen_mixers(nn.Sequential(nn.Linear(4, 4)))


def test_strengthening_makes_the_state_corruption_larger():
    """Strengthened mixers carry O(10-100) states, so a corrupted cache is far above rounding noise."""
    errs = {}
    for strengthen in (False, True):
        model = tiny_model("bamba", strengthen=strengthen)
        res = run_scenario(model, copy.deepcopy(model), "right_pad_decode")
        errs[strengthen] = res.max_state_error
        assert res.details["prefill_logits"] < 1e-4  # right padding only corrupts what comes after the prefill
    assert errs[True] > 10 * errs[False] > 0


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")])
def test_low_precision_tiny_model_keeps_transformers_fp32_modules(dtype, tmp_path):
    """tiny_model(dtype=...) keeps the dtype plan transformers applies when it loads the model in that dtype
    (Inkling2: fp32 MoE router and residual convolutions); a plain ``.to(bf16)`` crashed the stock model.

    The reference is ``from_pretrained(dtype=...)``: transformers 5.23's ``from_config(dtype=...)`` does not apply
    the plan (everything comes out in ``dtype``), 5.24's does, and loading applies it in both."""
    import transformers

    model = tiny_model("inkling2_text", dtype=dtype)
    transformers.AutoModelForCausalLM.from_config(tiny_config("inkling2_text")).save_pretrained(tmp_path)
    built = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype)
    want = {n: t.dtype for n, t in [*built.named_parameters(), *built.named_buffers()] if t.is_floating_point()}
    got = {n: t.dtype for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_floating_point()}
    assert got == want
    assert torch.float32 in got.values() and dtype in got.values()
    ids = torch.randint(3, 200, (1, 12), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(model(input_ids=ids).logits).all()
