"""A call of sequence length 0 (``input_ids`` ``[B, 0]``, ``inputs_embeds`` ``[B, 0, D]``) raises a ``ValueError``
that names the shape and the fix, with or without an ``attention_mask`` or a cache.

Reference: the stock model, which answers no such call on any family (an ``IndexError`` or a reshape error from
inside it), so there is no answer to match. Before, the wrapped model failed from whichever op met the empty
sequence first: ``x must have at least one token (seqlen >= 1)`` from safepad's scans (GraniteMoeHybrid, Nemotron-H,
Mamba, ...), or stock's own ``IndexError`` / reshape error (Qwen3-Next, Zaya, GLM-5 Next, every family with
``use_cache=False``), none naming a fix. The refusal comes before the call touches its cache.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import safepad
from safepad.cache import cache_argument, output_cache
from safepad.testing.syncs import KIND_FAMILIES
from safepad.testing.tiny import tiny_model
from .helpers import family_param

pytestmark = pytest.mark.usefixtures("quiet_transformers")

#: GraniteMoeHybrid (where the unclear message was reported) and one family per mixer kind
FAMILIES = ("granitemoehybrid", *dict.fromkeys(KIND_FAMILIES.values()))
#: the wrapped model's refusal: the problem (no token) and the fix (skip the call, or pad the row)
REFUSAL = r"of shape \[2, 0(, \d+)?\] holds no token \(sequence length 0\).*Skip the call.*attention_mask 0 on its pads"
#: what the stock model raises on such a call (its own errors: no answer exists to compare with)
STOCK_ERRORS = (RuntimeError, IndexError, ValueError)


@functools.cache
def _models(family: str):
    stock = tiny_model(family)
    return stock, safepad.wrap(copy.deepcopy(stock))


def _calls():
    """(id, extra keyword arguments) of the ``[2, 0]`` calls."""
    empty_mask = torch.zeros(2, 0, dtype=torch.long)  # [B, 0]
    yield "plain", {}
    yield "mask", {"attention_mask": empty_mask}
    yield "use_cache", {"use_cache": True}
    yield "no_cache", {"use_cache": False}
    yield "mask_use_cache", {"attention_mask": empty_mask, "use_cache": True}


@torch.no_grad()
@pytest.mark.parametrize("call, kwargs", [pytest.param(c, kw, id=c) for c, kw in _calls()])
@pytest.mark.parametrize("family", [family_param(f) for f in FAMILIES])
def test_zero_length_call_raises_naming_the_fix(family, call, kwargs):
    """``input_ids`` ``[2, 0]``: stock raises its own error; wrapped, a ``ValueError`` naming the shape and the fix."""
    stock, wrapped = _models(family)
    ids = torch.zeros(2, 0, dtype=torch.long)  # [B, 0]
    with pytest.raises(STOCK_ERRORS):
        stock(input_ids=ids, **kwargs)
    with pytest.raises(ValueError, match=rf"input_ids {REFUSAL}"):
        wrapped(input_ids=ids, **kwargs)


@torch.no_grad()
def test_zero_length_inputs_embeds_named():
    """``inputs_embeds`` ``[2, 0, D]``: the message names ``inputs_embeds``."""
    stock, wrapped = _models("granitemoehybrid")
    embeds = torch.zeros(2, 0, stock.config.hidden_size)  # [B, 0, D]
    with pytest.raises(STOCK_ERRORS):
        stock(inputs_embeds=embeds)
    with pytest.raises(ValueError, match=rf"inputs_embeds {REFUSAL}"):
        wrapped(inputs_embeds=embeds)


@torch.no_grad()
@pytest.mark.parametrize("family", [family_param(f) for f in ("granitemoehybrid", "qwen3_next")])
def test_refused_zero_length_call_leaves_the_cache(family):
    """After a prefill, a refused ``[2, 0]`` call on its cache changes nothing: the next decode step equals, bitwise,
    the same step on a copy of the cache taken before the refused call, and the cache's length is unchanged."""
    _, wrapped = _models(family)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 250, (2, 5), generator=g)  # [B, 5]
    step = torch.randint(3, 250, (2, 1), generator=g)  # [B, 1]
    name = cache_argument(wrapped.forward)  # the forward's cache argument (past_key_values / cache)
    cache = output_cache(wrapped(input_ids=prompt, use_cache=True))
    before = copy.deepcopy(cache)
    length = int(cache.get_seq_length())
    with pytest.raises(ValueError, match=rf"input_ids {REFUSAL}"):
        wrapped(input_ids=prompt[:, :0], use_cache=True, **{name: cache})
    assert int(cache.get_seq_length()) == length == 5
    got = wrapped(input_ids=step, use_cache=True, **{name: cache}).logits  # [B, 1, V]
    expect = wrapped(input_ids=step, use_cache=True, **{name: before}).logits  # [B, 1, V]
    assert torch.equal(got, expect)


@torch.no_grad()
@pytest.mark.parametrize("kwargs", [pytest.param({}, id="plain"), pytest.param({"use_cache": False}, id="no_cache")])
def test_zero_length_call_raises_compiled(kwargs):
    """``torch.compile(model)``: the same ``ValueError`` (dynamo specialises a size-0 dimension, so the hook's check
    runs while tracing)."""
    _, wrapped = _models("nemotron_h")
    compiled = torch.compile(wrapped)
    with pytest.raises(ValueError, match=rf"input_ids {REFUSAL}"):
        compiled(input_ids=torch.zeros(2, 0, dtype=torch.long), **kwargs)
