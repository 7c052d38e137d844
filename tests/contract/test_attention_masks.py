"""``attention_mask`` layouts transformers' common tests feed a model: left-padded, right-padded ``tril``
and random (holes), through a forward, a cached prefill + decode step and ``generate``. Reference: each
row's real tokens run alone through the stock model (positions 0.. of the real tokens).

Stock SSM / hybrid models are wrong on right-padded and holed masks with a cache (they read the pads): those
cases are the ones counted as "stock wrong -> row-alone". Right-padded ``generate`` needs slot
justification (helper A's branch); until it is merged the wrapped model raises there and the case fails.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from safepad.cache import cache_argument, output_cache

from .conftest import contract, family_params
from .helpers import PAD, close, gen_kwargs, greedy_alone, logits_alone, pad, prompts


def _positions(model, mask):
    """``position_ids`` of the real tokens (what ``generate`` derives), for forwards that declare them."""
    if "position_ids" not in inspect.signature(model.forward).parameters:
        return {}
    return {"position_ids": (mask.long().cumsum(-1) - 1).clamp(min=0)}


def _tril_mask():
    """transformers' right-padded ``tril`` mask: row i has ``3 + i`` real tokens, then pads."""
    return torch.tril(torch.ones(3, 5, dtype=torch.long), diagonal=2)


def _holed_mask():
    """Random-looking holes, first token real (``random_attention_mask`` sets one column real)."""
    return torch.tensor([[1, 1, 0, 1, 1, 0, 1], [1, 0, 1, 1, 0, 1, 1], [1, 1, 1, 0, 0, 1, 1]])


def _rows(mask, seed=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 200, mask.shape, generator=g).masked_fill(mask == 0, PAD)
    return ids, [ids[i][mask[i].bool()] for i in range(mask.shape[0])]


def _forward_real_tokens(mask_fn):
    @torch.no_grad()
    def prop(model, ref):
        mask = mask_fn()
        ids, rows = _rows(mask)
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False, **_positions(model, mask)).logits
        for i, r in enumerate(rows):
            close(logits[i][mask[i].bool()], logits_alone(ref, r), what=f"row {i} real-token logits")

    return prop


def _prefill_decode(mask_fn):
    """Cached prefill with the mask, then one token per row: its logits equal the row + token alone."""

    @torch.no_grad()
    def prop(model, ref):
        mask = mask_fn()
        ids, rows = _rows(mask)
        name = cache_argument(model)
        first = {}
        setup = getattr(model, "_setup_cache", None)
        if callable(setup):  # a stateful model (RecurrentGemma): what generate hands it, fresh module states
            from transformers import DynamicCache

            setup(model.config, ids.shape[0], ids.device, next(model.parameters()).dtype)
            first[name] = DynamicCache(config=model.config)
        out = model(input_ids=ids, attention_mask=mask, use_cache=True, **_positions(model, mask), **first)
        cache = output_cache(out) or first.get(name)
        assert cache is not None, "no cache returned"
        nxt = torch.randint(3, 200, (mask.shape[0], 1), generator=torch.Generator().manual_seed(9))
        mask2 = torch.cat([mask, torch.ones_like(nxt)], 1)
        kw = {} if "position_ids" not in inspect.signature(model.forward).parameters else {
            "position_ids": mask.sum(-1, keepdim=True)}  # fmt: skip
        if cache is not None:
            kw[name] = cache
        step = model(input_ids=nxt, attention_mask=mask2, use_cache=True, **kw).logits[:, -1]
        for i, r in enumerate(rows):
            close(step[i], logits_alone(ref, torch.cat([r, nxt[i]]))[-1], what=f"row {i} decode logits")

    return prop


def _left_mask():
    _, mask = pad(prompts((5, 3, 4)), "left")
    return mask


def _generate(side):
    @torch.no_grad()
    def prop(model, ref):
        rows = prompts((6, 4), seed=5)
        ids, mask = pad(rows, side)
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, **gen_kwargs())
        for i, r in enumerate(rows):
            want, _ = greedy_alone(ref, r)
            assert torch.equal(out[i, ids.shape[1] :], want), (side, i, out[i].tolist(), want.tolist())

    return prop


PROPERTIES = {
    "left_pad_forward": _forward_real_tokens(_left_mask),
    "left_pad_prefill_decode": _prefill_decode(_left_mask),
    "right_pad_tril_forward": _forward_real_tokens(_tril_mask),
    "right_pad_tril_prefill_decode": _prefill_decode(_tril_mask),
    "random_mask_forward": _forward_real_tokens(_holed_mask),
    "random_mask_prefill_decode": _prefill_decode(_holed_mask),
    "left_pad_generate": _generate("left"),
    "right_pad_generate": _generate("right"),  # passes once slot justification (helper A) is merged
}


@pytest.mark.parametrize("name", list(PROPERTIES))
@pytest.mark.parametrize("family", family_params())
def test_attention_mask_contract(family, name):
    contract(family, name, PROPERTIES[name])
