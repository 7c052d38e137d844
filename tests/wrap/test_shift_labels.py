"""``shift_labels`` (pre-shifted targets, as context-parallel training passes them) reach the loss of a wrapped call.

A call with labels and a cache on rows with pads after real tokens is re-laid and scored by the post-hook over the
logits put back in the caller's order; its loss took ``num_items_in_batch`` only, so ``shift_labels`` were dropped
(re-laid with the inputs, to a forward that computes no loss) and the loss silently scored ``labels`` shifted
instead (transformers' ``test_causal_lm_loss_honors_shift_labels``, nemotron_h with its tester's ``tril`` mask).
Reference: the stock model without a cache, pads' targets ignored (-100).
"""

from __future__ import annotations

import copy

import pytest
import torch

import safepad
from safepad.testing.tiny import tiny_model

from .helpers import family_param

pytestmark = pytest.mark.usefixtures("quiet_transformers")


@pytest.mark.parametrize("family", [family_param("nemotron_h"), family_param("qwen3_next")])
@pytest.mark.parametrize("train", [pytest.param(False, id="eval"), pytest.param(True, id="train")])
def test_shift_labels_are_scored_with_a_cache(family, train):
    stock = tiny_model(family)
    wrapped = safepad.wrap(copy.deepcopy(stock))
    stock.train(train)
    wrapped.train(train)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (4, 7), generator=g)
    mask = torch.tril(torch.ones_like(ids))[:, :7]  # row b: b + 1 real tokens, then pads (transformers' tester)
    labels = ids.masked_fill(mask == 0, -100)
    shift = torch.randint(3, 200, (4, 7), generator=g).masked_fill(mask == 0, -100)  # unrelated to labels
    ref = stock(input_ids=ids, attention_mask=mask, labels=labels, shift_labels=shift, use_cache=False).loss
    shifted = stock(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    assert not torch.allclose(ref, shifted, atol=1e-3)  # the two targets give other losses
    got = wrapped(input_ids=ids, attention_mask=mask, labels=labels, shift_labels=shift, use_cache=True).loss
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
