"""generate() on a wrapped model with left padding: the same tokens as each prompt alone.

Right-padded and mixed-side batches are covered by ``test_right_padded_generate.py`` (every family, every
generation mode). Reference: each prompt alone through the stock model's generate().
"""

from __future__ import annotations

import copy

import pytest
import torch

import safepad
from safepad.testing.tiny import tiny_model

LENS = (7, 4, 5)


def _batch(side: str):
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 250, (n,), generator=g) for n in LENS]
    T = max(LENS)
    ids = torch.zeros(len(LENS), T, dtype=torch.long)
    mask = torch.zeros(len(LENS), T, dtype=torch.long)
    for i, p in enumerate(prompts):
        sl = slice(0, len(p)) if side == "right" else slice(T - len(p), T)
        ids[i, sl], mask[i, sl] = p, 1
    return prompts, ids, mask


def _gen(model, ids, mask):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("family", ["nemotron_h", "mamba2"])
def test_left_padded_generate_equals_each_prompt_alone(family):
    stock = tiny_model(family)
    model = safepad.wrap(copy.deepcopy(stock))
    prompts, ids, mask = _batch("left")
    out = _gen(model, ids, mask)
    for i, p in enumerate(prompts):
        alone = _gen(stock, p[None], torch.ones(1, len(p), dtype=torch.long))
        assert torch.equal(out[i, -4:], alone[0, -4:]), f"row {i}"


def test_right_padded_forward_with_cache_stays_accepted():
    """Outside generate() a right-padded prefill with a cache is correct and accepted (README)."""
    model = safepad.wrap(tiny_model("mamba2"))
    _, ids, mask = _batch("right")
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=True)
