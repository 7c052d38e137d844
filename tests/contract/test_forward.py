"""Forward-level promises of transformers' ``ModelTesterMixin``: ``logits_to_keep``, batching equivalence and
save / load round trips. References: each row alone through the stock model; the saved model's own logits.
"""

from __future__ import annotations

import tempfile

import pytest
import torch

import safepad

from .conftest import contract, family_params
from .helpers import close, logits_alone, pad, prompts


@torch.no_grad()
def logits_to_keep(model, ref):
    ids = torch.stack(prompts((6, 6), seed=10))
    full = model(input_ids=ids, use_cache=False).logits
    for k in (1, 3):
        kept = model(input_ids=ids, use_cache=False, logits_to_keep=k).logits
        assert kept.shape[1] == k, kept.shape
        close(kept, full[:, -k:], what=f"logits_to_keep={k}")
    for i in range(ids.shape[0]):
        close(full[i], logits_alone(ref, ids[i]), what=f"row {i}")


@torch.no_grad()
def batching_equivalence(model, ref):
    """Row i of an unpadded batch equals row i alone (transformers' ``test_batching_equivalence``)."""
    ids = torch.stack(prompts((7, 7, 7), seed=11))
    batched = model(input_ids=ids, use_cache=False).logits
    for i in range(ids.shape[0]):
        close(batched[i], model(input_ids=ids[i : i + 1], use_cache=False).logits[0], what=f"row {i} vs alone")
        close(batched[i], logits_alone(ref, ids[i]), what=f"row {i} vs stock alone")


@torch.no_grad()
def save_load_round_trip(model, ref):
    """save_pretrained -> from_pretrained gives the same logits (re-wrapped if the saved model was wrapped)."""
    rows = prompts((6, 4), seed=12)
    ids, mask = pad(rows, "left")
    before = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        back = type(model).from_pretrained(tmp).eval()
    assert not safepad.is_wrapped(back)  # what is saved is the stock model
    if safepad.is_wrapped(model):
        safepad.wrap(back)
    after = back(input_ids=ids, attention_mask=mask, use_cache=False).logits
    close(after, before, atol=1e-6, what="reloaded logits")


PROPERTIES = {
    "logits_to_keep": logits_to_keep,
    "batching_equivalence": batching_equivalence,
    "save_load_round_trip": save_load_round_trip,
}


@pytest.mark.parametrize("name", list(PROPERTIES))
@pytest.mark.parametrize("family", family_params())
def test_forward_contract(family, name):
    contract(family, name, PROPERTIES[name])
