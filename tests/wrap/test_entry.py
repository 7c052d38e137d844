"""Positional arguments read as their names (safepad.wrap.entry): ``model(ids, mask, positions, ...)`` is the call
``model(input_ids=ids, attention_mask=mask, position_ids=positions, ...)``, checked and answered the same way.

Before the pre-hook named them, it read ``kwargs`` only: a positional ``attention_mask`` skipped every mask check
(a 4-D mask hiding pads answered 0.37-0.61 off the row alone, a mask of 2s was accepted), positional packed
``position_ids`` were not read as packing (0.44-0.91 off each sequence alone), and a positional ``use_cache`` next to
the packed-call policy's own ended in ``TypeError: got multiple values``. Each is compared here with each row or
sequence run alone through the stock model.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

import safepad
from safepad.testing.tiny import strengthen_mixers, tiny_model
from safepad.wrap.entry import name_arguments
from safepad.wrap.plan import positional_names

from .helpers import family_param

FAMILIES = [family_param(f) for f in ("nemotron_h", "lfm2", "qwen3_next", "jamba", "bamba")]


@pytest.fixture(scope="module", params=FAMILIES)
def models(request):
    torch.manual_seed(0)
    stock = tiny_model(request.param).eval()
    strengthen_mixers(stock)
    return stock, safepad.wrap(copy.deepcopy(stock))


def _positional(model, **named):
    """``named`` as positional arguments in the forward's order (None where a parameter is skipped)."""
    names = positional_names(model.forward)
    last = max(names.index(n) for n in named)
    return tuple(named.get(n) for n in names[: last + 1])


def _close(got, want):
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # fp32: measured 1e-7 .. 8e-7 off the row alone


@torch.no_grad()
def test_positional_packed_position_ids(models):
    stock, wrapped = models
    ids = torch.randint(3, 250, (1, 10), generator=torch.Generator().manual_seed(1))
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]])
    alone = torch.cat([stock(input_ids=ids[:, :4]).logits[0], stock(input_ids=ids[:, 4:]).logits[0]])
    out = wrapped(*_positional(wrapped, input_ids=ids, position_ids=pos), use_cache=False).logits[0]
    _close(out, alone)


@torch.no_grad()
@pytest.mark.parametrize("use_cache", [pytest.param(False, id="no_cache"), pytest.param(True, id="cache")])
def test_positional_use_cache_on_a_packed_call(models, use_cache):
    """``use_cache`` positional: False is the packed call, True raises safepad's packed-cache error (not TypeError)."""
    stock, wrapped = models
    if "use_cache" not in positional_names(wrapped.forward):
        pytest.skip("use_cache is not positional in this forward")
    ids = torch.randint(3, 250, (1, 10), generator=torch.Generator().manual_seed(1))
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]])
    args = _positional(wrapped, input_ids=ids, position_ids=pos, use_cache=use_cache)
    if use_cache:
        with pytest.raises(ValueError, match="cannot be used with a cache"):
            wrapped(*args)
        return
    alone = torch.cat([stock(input_ids=ids[:, :4]).logits[0], stock(input_ids=ids[:, 4:]).logits[0]])
    _close(wrapped(*args).logits[0], alone)


@torch.no_grad()
def test_positional_four_d_mask_hiding_pads_raises(models):
    _, wrapped = models
    ids = torch.randint(3, 250, (2, 9), generator=torch.Generator().manual_seed(2))
    keep = torch.ones(2, 9, dtype=torch.bool)
    keep[1, :3] = False
    allow = torch.tril(torch.ones(9, 9, dtype=torch.bool))[None] & keep[:, None, :] | torch.eye(9, dtype=torch.bool)
    mask = torch.where(allow, 0.0, torch.finfo(torch.float32).min)[:, None]  # [B, 1, T, T]
    with pytest.raises(ValueError, match="4-D mask"):
        wrapped(ids, mask, use_cache=False)


@torch.no_grad()
def test_positional_mask_values_are_checked(models):
    _, wrapped = models
    ids = torch.randint(3, 250, (2, 6), generator=torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match="padding mask"):
        wrapped(ids, torch.full((2, 6), 2), use_cache=False)


@torch.no_grad()
def test_positional_right_padded_prefill_then_decode(models):
    """A cached right-padded prefill and one decode step, positional: each row equals it alone."""
    stock, wrapped = models
    ids = torch.randint(3, 250, (2, 7), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 4:] = 0
    nxt = torch.tensor([[11], [12]])
    out = wrapped(ids, mask, use_cache=True)
    cache = out.past_key_values if getattr(out, "past_key_values", None) is not None else out.cache
    step = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
    name = next(n for n in ("cache", "past_key_values", "cache_params") if n in positional_names(wrapped.forward))
    out2 = wrapped(*_positional(wrapped, input_ids=nxt, attention_mask=step, **{name: cache}), use_cache=True)
    for row, n in ((0, 7), (1, 4)):
        seq = torch.cat([ids[row : row + 1, :n], nxt[row : row + 1]], dim=1)
        ref = stock(input_ids=seq).logits[0]
        _close(out.logits[row, :n], ref[:n])
        _close(out2.logits[row, -1], ref[-1])


def test_name_arguments_rules():
    names = ("input_ids", "attention_mask", "position_ids")
    a, b = torch.zeros(1), torch.ones(1)
    assert name_arguments(names, (a, b), {"use_cache": False}) == ((), {"input_ids": a, "attention_mask": b,
                                                                         "use_cache": False})
    # more positional arguments than names (a forward with *args): handed on unchanged, as naming the first ones
    # would bind the rest to the same parameters
    assert name_arguments(names[:1], (a, b), {}) == ((a, b), {})
    # an argument given twice is handed on unchanged: the forward raises Python's own TypeError
    assert name_arguments(names, (a,), {"input_ids": b}) == ((a,), {"input_ids": b})


def test_positional_names_stop_at_what_cannot_be_named():
    def forward(input_ids=None, attention_mask=None, *rest, use_cache=None, **kwargs):
        return input_ids

    def positional_only(x, /, attention_mask=None):
        return x

    assert positional_names(forward) == ("input_ids", "attention_mask")
    assert positional_names(positional_only) == ()
    assert inspect.signature(forward)  # (the signature is what the plan reads)
