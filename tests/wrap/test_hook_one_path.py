"""The model pre-hook has one body for eager and traced calls (``safepad.wrap.hooks``): both read the same masks.

``generate()`` with a compileable cache (a ``StaticCache``) hands a hybrid's forward per-layer-type masks, a dict
``{"full_attention": [B, 1, T, S], "linear_attention": [B, T]}``, together with positions that put the left pads
at 1 and count each row's real tokens from 0. The eager hook read the 2-D entry as the padding mask; the traced
one (``torch.compile(model)``: the hooks are traced with the forward) read no mask, took those positions for
packed sequences and refused the cached call ("packed rows ... cannot be used with a cache"). Reference: every
real token's logits against its row alone through the stock model (no padding, no cache).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo as dynamo
from transformers import StaticCache
from transformers.masking_utils import create_masks_for_generate

import safepad
from safepad.testing.tiny import tiny_model
from .helpers import family_param, strengthen_attention

TOL = 1e-4

pytestmark = pytest.mark.usefixtures("quiet_transformers")


def _masks(model, mask: torch.Tensor, T: int, cache, position_ids: torch.Tensor):
    """What generate() hands the forward for a compileable cache: ``mask`` ``[B, S]`` as per-layer-type masks."""
    make = getattr(model, "create_masks_for_generate", create_masks_for_generate)
    # the cache positionally: transformers 5.23 names the parameter past_key_values, 5.24 cache
    return make(model.config, torch.empty(mask.shape[0], T, 0), mask, cache, position_ids=position_ids)


@pytest.mark.parametrize("compiled", [pytest.param(False, id="eager"), pytest.param(True, id="compiled-object")])
@pytest.mark.parametrize("family", [family_param("nemotron_h")])
@torch.no_grad()
def test_static_cache_per_layer_masks_left_padded_equal_alone(family: str, compiled: bool):
    stock = strengthen_attention(tiny_model(family)).eval()
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, 200, (n,), generator=g) for n in (6, 4)]
    steps = torch.randint(3, 200, (2, 1), generator=g)  # one new token per row
    L = 6
    ids = torch.zeros(2, L, dtype=torch.long)
    mask = torch.zeros(2, L, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, L - len(r) :], mask[i, L - len(r) :] = r, 1
    model = safepad.wrap(copy.deepcopy(stock), backend="torch")
    dynamo.reset()
    call = torch.compile(model, backend="eager") if compiled else model
    cache = StaticCache(config=model.config, max_cache_len=L + 2)
    pos = (mask.cumsum(1) - 1).masked_fill(mask == 0, 1)  # [B, L] as generate() builds them
    masks = _masks(model, mask, L, cache, pos)
    assert isinstance(masks, dict) and any(m.dim() == 2 for m in masks.values()), type(masks)
    try:
        prefill = call(input_ids=ids, attention_mask=masks, position_ids=pos, past_key_values=cache, use_cache=True)
        full = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)  # [B, L + 1]
        step_pos = mask.sum(1, keepdim=True)  # [B, 1]
        step = call(
            input_ids=steps, attention_mask=_masks(model, full, 1, cache, step_pos), position_ids=step_pos,
            past_key_values=cache, use_cache=True,
        )
    finally:
        dynamo.reset()
    for i, r in enumerate(rows):
        alone = stock(input_ids=torch.cat([r, steps[i]])[None], use_cache=False).logits[0]  # [n + 1, V]
        got = torch.cat([prefill.logits[i, L - len(r) :], step.logits[i]])  # [n + 1, V]
        err = (got - alone).abs().max().item()
        assert err < TOL, (i, err)


@pytest.mark.parametrize("compiled", [pytest.param(False, id="eager"), pytest.param(True, id="compiled-object")])
@pytest.mark.parametrize("family", [family_param("mamba2")])
@torch.no_grad()
def test_additive_mask_refused_eager_and_traced(family: str, compiled: bool):
    """A float additive mask (0 keep, -1e9 pad) reads as "every token real but the zeros" under transformers' 2-D
    convention: refused by the one hook body, eagerly (``ValueError``) and traced (``RuntimeError`` from the device),
    with the same message. (The traced hook used to skip the check and return the wrong rows.)"""
    model = safepad.wrap(tiny_model(family), backend="torch").eval()
    ids = torch.randint(3, 200, (2, 6), generator=torch.Generator().manual_seed(1))
    additive = torch.zeros(2, 6)
    additive[1, 4:] = -1e9  # row 1: two right pads
    dynamo.reset()
    call = torch.compile(model, backend="eager") if compiled else model
    try:
        with pytest.raises(RuntimeError if compiled else ValueError, match="additive mask"):
            call(input_ids=ids, attention_mask=additive, use_cache=False)
    finally:
        dynamo.reset()
