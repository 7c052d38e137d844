"""The guard decides from what safepad patches, on every family of the spec registry.

For each tiny family: the stock model on a packed row (``position_ids`` restarting inside it, then trailing pads)
leaks state from one sequence into the next, and the guard says so (``error`` raises, ``warn`` warns); the same
model wrapped by :func:`safepad.wrap` computes that row correctly, and the guard stays silent in every mode, as
does :class:`~trainer_ext.PaddingGuardCallback` at train begin. Kimi-Linear's full-attention class
``KimiLinearAttention`` once matched the guard's ``LinearAttention`` name pattern and was taken for an unwrapped
mixer on the wrapped model.
"""

from __future__ import annotations

import copy
import logging
import types
import warnings

import pytest
import torch

import safepad
from safepad.errors import PaddingError, PaddingWarning
from safepad.guard import guard
from safepad.specs.registry import spec_for_module, supported_model_types
from safepad.testing.tiny import family_available, family_names, tiny_model
from safepad.wrap import wrapped_modules

FAMILIES = [f for f in family_names() if family_available(f)[0]]


@pytest.fixture(scope="module", autouse=True)
def _quiet():
    log = logging.getLogger("transformers")
    level = log.level
    log.setLevel(logging.ERROR)
    yield
    log.setLevel(level)


def _packed_row():
    """``[1, 18]``: sequences of 6 and 9 tokens, then 3 pads."""
    ids = torch.randint(3, 200, (1, 18), generator=torch.Generator().manual_seed(11))
    pos = torch.cat([torch.arange(6), torch.arange(9), torch.zeros(3, dtype=torch.long)])[None]
    mask = torch.cat([torch.ones(15, dtype=torch.long), torch.zeros(3, dtype=torch.long)])[None]
    return ids, pos, mask


def test_every_registry_family_is_covered():
    """The tiny families span the registry: each supported model type is one of them (or their text model)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    built = {f.removesuffix("_text") for f in FAMILIES} | set(FAMILIES)
    installed = [t for t in supported_model_types() if t in CONFIG_MAPPING]  # (5.23 lacks lara_mini, inkling2_loop)
    missing = [t for t in installed if t not in built and f"{t}_text" not in built]
    assert installed and not missing, missing


@pytest.mark.parametrize("family", FAMILIES)
def test_wrapped_model_raises_no_alarm_and_stock_model_alarms(family):
    stock = tiny_model(family)
    wrapped = safepad.wrap(copy.deepcopy(stock))
    assert wrapped_modules(wrapped), family
    ids, pos, mask = _packed_row()
    kw = dict(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)

    # the stock model leaks: the guard alarms in error and warn mode
    with guard(stock, "error"), pytest.raises(PaddingError, match="packed"):
        stock(**kw)
    with guard(stock, "warn"), pytest.warns(PaddingWarning, match="packed"), torch.no_grad():
        stock(**kw)

    # the wrapped model is correct (the first sequence as run alone through the stock model) and the guard is silent
    with torch.no_grad():
        alone = stock(input_ids=ids[:, :6], use_cache=False).logits
    for mode in ("error", "warn", "fix"):
        with guard(wrapped, mode) as handle, warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("error", PaddingWarning)
            assert handle.is_wrapped(), (family, mode)
            out = wrapped(**kw).logits
        assert (out[:, :6] - alone).abs().max().item() < 1e-4, (family, mode)
        assert not handle.detections or handle.is_wrapped()

    # every module the guard counts as a mixer is one safepad patches
    handle = guard(wrapped, "error")
    try:
        assert handle._mixers and all(spec_for_module(m) is not None for m in handle._mixers), family
    finally:
        handle.remove()


@pytest.mark.parametrize("family", ["kimi_linear", "nemotron_h"])
@pytest.mark.parametrize("mode", ["warn", "error"])
def test_padding_guard_callback_is_silent_on_a_wrapped_model(family, mode):
    """``on_train_begin`` with a right-padding tokenizer: the callback warns only about an unwrapped model."""
    from trainer_ext import PaddingGuardCallback

    tokenizer = types.SimpleNamespace(padding_side="right")
    args = types.SimpleNamespace(remove_unused_columns=False)
    wrapped = safepad.wrap(tiny_model(family))
    callback = PaddingGuardCallback(mode=mode)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PaddingWarning)
        callback.on_train_begin(args, None, None, model=wrapped, processing_class=tokenizer)
        ids, pos, mask = _packed_row()
        with torch.no_grad():
            wrapped(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
    callback.on_train_end(args, None, None, model=wrapped)

    stock = tiny_model(family)
    callback = PaddingGuardCallback(mode=mode)
    with pytest.warns(PaddingWarning, match="not wrapped"):
        callback.on_train_begin(args, None, None, model=stock, processing_class=tokenizer)
    callback.on_train_end(args, None, None, model=stock)
