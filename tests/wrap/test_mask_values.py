"""A 2-D attention_mask is a padding mask (1 real, 0 pad, or bool): anything else raises, naming the convention.

A float *additive* mask (0 keep, -inf pad) reads under the 2-D convention as "every token real except the ones
holding exactly 0": the stock model silently drops the real tokens and keeps the pads (checked below against each
sequence alone). The wrapped model raises once per call (one host read) in its model hook.
"""

from __future__ import annotations

import copy

import pytest
import torch

import safepad
from safepad.testing.tiny import tiny_model


@pytest.fixture(scope="module")
def models():
    stock = tiny_model("nemotron_h")
    return stock, safepad.wrap(copy.deepcopy(stock), backend="torch")


def _batch():
    ids = torch.randint(3, 250, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    return ids, mask


def _additive(mask: torch.Tensor, fill: float) -> torch.Tensor:
    return torch.zeros(mask.shape).masked_fill(mask == 0, fill)


@torch.no_grad()
def test_stock_model_is_silently_wrong_with_an_additive_mask(models):
    """-inf poisons the stock row (NaN), a finite fill keeps its pads and drops its real tokens."""
    stock, _ = models
    ids, mask = _batch()
    alone = stock(input_ids=ids[1:, :4], use_cache=False).logits
    for fill in (float("-inf"), -1e9):
        out = stock(input_ids=ids, attention_mask=_additive(mask, fill), use_cache=False).logits
        assert not torch.allclose(out[1, :4], alone[0], atol=1e-2), fill


@torch.no_grad()
@pytest.mark.parametrize("fill", [pytest.param(float("-inf"), id="-inf"), pytest.param(-1e9, id="-1e9")])
@pytest.mark.parametrize("use_cache", [pytest.param(False, id="no_cache"), pytest.param(True, id="cache")])
def test_additive_mask_raises(models, fill, use_cache):
    _, wrapped = models
    ids, mask = _batch()
    with pytest.raises(ValueError, match=r"1 for a real token and 0 for a pad.*\(additive_mask == 0\)"):
        wrapped(input_ids=ids, attention_mask=_additive(mask, fill), use_cache=use_cache)


@torch.no_grad()
def test_additive_mask_raises_in_generate(models):
    _, wrapped = models
    ids, mask = _batch()
    with pytest.raises(ValueError, match="additive mask"):
        wrapped.generate(input_ids=ids, attention_mask=_additive(mask, -1e4), max_new_tokens=2, do_sample=False,
                         pad_token_id=0)


@torch.no_grad()
def test_integer_values_other_than_0_1_raise(models):
    _, wrapped = models
    ids, mask = _batch()
    with pytest.raises(ValueError, match="holds 2"):
        wrapped(input_ids=ids, attention_mask=mask * 2, use_cache=False)


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.bool, torch.long, torch.float32])
def test_padding_masks_of_any_dtype_are_accepted_and_agree(models, dtype):
    stock, wrapped = models
    ids, mask = _batch()
    out = wrapped(input_ids=ids, attention_mask=mask.to(dtype), use_cache=False).logits
    alone = stock(input_ids=ids[1:, :4], use_cache=False).logits
    assert (out[1, :4] - alone[0]).abs().max() < 1e-4
