"""safepad.wrap on the recurrent families added for transformers 5.23-5.24 (``safepad.testing.tiny.NEW_FAMILIES``):
zamba (multi-head Mamba1), lfm3 (short conv), lara_mini (Gated DeltaNet, 5.24 only), bailing_hybrid (Kimi Delta
Attention with a one-projection gate), the VLM wrappers lfm2_vl / lfm3_vl / nemotron_h_omni, the Inkling short
convolutions inside attention and ZAYA's CCA projection (two stacked convs + a delayed value state).

Reference: each sequence run alone through the stock model (fp32, CPU). Each family must pass every applicable audit
scenario when wrapped, and the stock model must fail the layouts it gets wrong (packed rows, right-padded prefill
with decode, pads inside a continuation chunk). Families absent from the installed transformers skip with the
reason.
"""

from __future__ import annotations

import copy

import pytest
import torch

from safepad.testing.scenarios import SCENARIOS, cache_states, packed_loss_grad_errors, run_scenario
from safepad.testing.tiny import NEW_FAMILIES, tiny_model
from safepad.wrap import unwrap, wrap, wrapped_modules
from .helpers import family_param

MIXER_CLASS = {
    "zamba": ("ZambaMambaMixer",),
    "lfm3": ("Lfm3ShortConv",),
    "lara_mini": ("LaraMiniGatedDeltaNet",),
    "bailing_hybrid": ("BailingHybridDeltaAttention",),
    "lfm2_vl": ("Lfm2ShortConv",),
    "lfm3_vl": ("Lfm3ShortConv",),
    "nemotron_h_omni": ("NemotronHMamba2Mixer",),
    "inkling_text": ("InklingShortConvolution",),
    "inkling2_text": ("Inkling2ShortConvolution", "Inkling2DynamicShortConvolution"),
    "inkling2_loop_text": ("Inkling2LoopShortConvolution", "Inkling2LoopDynamicShortConvolution"),
    "zaya": ("ZayaCCAProjection",),
    "recurrent_gemma": ("RecurrentGemmaRecurrentBlock",),
    "qwen4_exp_text": ("Qwen4ExpTextGatedDeltaNet", "Qwen4ExpTextPLELayer"),
    "qwen4_exp": ("Qwen4ExpTextGatedDeltaNet", "Qwen4ExpTextPLELayer"),
    "glm5_next": ("Glm5NextTextLinearAttention", "Glm5NextTextIndexer"),
}
#: layouts every stock model here gets wrong (the cached states of chunked_prefill_pad, the logits of the others)
STOCK_BROKEN = ("packed_position_ids", "packed_cu_seq_lens", "right_pad_decode", "chunked_prefill_pad")
GRAD_RTOL = 1e-4


_param = family_param


pytestmark = pytest.mark.usefixtures("quiet_transformers")


@pytest.fixture(scope="module", params=[_param(f) for f in NEW_FAMILIES])
def models(request):
    """(family, stock, reference copy, wrapped copy) of one tiny strengthened model, shared by the module."""
    stock = tiny_model(request.param)
    return request.param, stock, copy.deepcopy(stock), wrap(copy.deepcopy(stock), backend="torch")


def test_every_family_has_a_mixer_class_here():
    assert set(MIXER_CLASS) == set(NEW_FAMILIES)


def test_wrap_patches_every_mixer_and_unwrap_restores(models):
    family, stock, _, _ = models
    model = wrap(copy.deepcopy(stock))
    classes = MIXER_CLASS[family]
    mixers = [m for m in stock.modules() if type(m).__name__ in classes]
    assert len({type(m).__name__ for m in mixers}) == len(classes)
    assert len(wrapped_modules(model)) == len(mixers)
    assert all(type(m).__name__.removeprefix("Safepad") in classes for _, m in wrapped_modules(model))
    unwrap(model)
    assert not wrapped_modules(model)
    ids = torch.randint(3, 250, (1, 7))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, stock(input_ids=ids).logits)


@pytest.mark.parametrize("name", SCENARIOS)
def test_wrapped_passes_every_scenario(models, name):
    family, _, ref, wrapped = models
    res = run_scenario(wrapped, ref, name)
    if not res.applicable:
        pytest.skip(res.note or "not applicable")
    assert res.passed, (family, name, res.error, res.max_abs_logits, res.state_errors)


@pytest.mark.parametrize("name", STOCK_BROKEN)
def test_stock_fails_where_it_breaks(models, name):
    family, stock, ref, _ = models
    res = run_scenario(stock, ref, name)
    assert res.passed is False, (family, name, res.max_abs_logits, res.state_errors)


@pytest.mark.parametrize("boundaries", ["position_ids", "cu_seq_lens", "seq_idx"])
def test_packed_loss_and_grads_equal_per_sequence(models, boundaries):
    family, stock, ref, wrapped = models
    wrapped.train()
    try:
        err = packed_loss_grad_errors(wrapped, ref, boundaries=boundaries)
    finally:
        wrapped.eval()
    assert err["loss_rel"] < 1e-5 and err["grad_rel"] < GRAD_RTOL, (family, err)
    if boundaries == "position_ids":
        stock_err = packed_loss_grad_errors(copy.deepcopy(stock), ref, boundaries=boundaries)
        assert stock_err["grad_rel"] > 1e-2, (family, stock_err)


@torch.no_grad()
@pytest.mark.parametrize("splits", [(1, 4), (3, 5, 9), (16, 17)], ids=lambda s: "-".join(map(str, s)))
def test_chunked_prefill_then_masked_decode_equals_one_forward(models, splits):
    """Any split of a prefill through the cache, then a decode step whose token is masked in one row."""
    family, _, ref, wrapped = models
    g = torch.Generator().manual_seed(len(splits))
    ids = torch.randint(3, 250, (2, 24), generator=g)
    full = ref(input_ids=ids, use_cache=False).logits
    for m in wrapped.modules():  # qwen4_exp (5.24) keeps M-RoPE deltas of its last call, batch size included
        if getattr(m, "rope_deltas", None) is not None:
            m.rope_deltas = None
    cache, outs, start = _stateful_cache(wrapped), [], 0
    for end in (*splits, 24):
        kw = {"cache": cache} if cache is not None else {}
        out = wrapped(input_ids=ids[:, start:end], use_cache=True, **_cache_kw(wrapped, kw))
        cache = _cache_of(out) or cache
        outs.append(out.logits)
        start = end
    assert (torch.cat(outs, 1) - full).abs().max() < 1e-4
    # a decode step whose token is padding in row 1: row 0 decodes as alone, row 1's recurrent states do not move
    before = cache_states(cache)
    assert before, "no conv / recurrent state cached"
    nxt = torch.randint(3, 250, (2, 1), generator=g)
    mask = torch.ones(2, 25, dtype=torch.long)
    mask[1, -1] = 0
    out = wrapped(input_ids=nxt, attention_mask=mask, use_cache=True, **_cache_kw(wrapped, {"cache": cache}))
    ref_row0 = ref(input_ids=torch.cat([ids[:1], nxt[:1]], 1), use_cache=False).logits[0, -1]
    assert (out.logits[0, -1] - ref_row0).abs().max() < 1e-4
    after = cache_states(_cache_of(out) or cache)
    for key, old in before.items():
        assert torch.equal(after[key][1], old[1]), key  # row 1 held
        assert not torch.equal(after[key][0], old[0]), key  # row 0 moved on


def _cache_kw(model, kw: dict) -> dict:
    """The cache under the keyword this transformers version's forward takes (``cache`` / ``past_key_values``)."""
    import inspect

    if "cache" not in kw:
        return kw
    params = inspect.signature(model.forward).parameters
    name = "cache" if "cache" in params else "past_key_values"
    return {name: kw["cache"]}


def _cache_of(out):
    """The cache a forward returned (``None`` for stateful models such as RecurrentGemma, which return none)."""
    return getattr(out, "cache", None) if getattr(out, "cache", None) is not None else getattr(out, "past_key_values", None)


def _stateful_cache(model):
    """A fresh ``DynamicCache(config)`` for models that return no cache (RecurrentGemma), else ``None``."""
    if not callable(getattr(model, "_setup_cache", None)):
        return None
    from transformers import DynamicCache

    return DynamicCache(config=model.config)
