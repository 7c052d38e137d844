"""Assisted (speculative) generation: the families whose stock model serves it, served right wrapped.

transformers 5.23 / 5.24 serve assisted generation only where the cache can be cropped: layers that hold no
recurrent state (LFM2's / LFM3's short convolutions, Inkling's convs inside attention); stateful models (every
family with an SSM / delta-rule state) are refused up front by transformers, wrapped or not. A cache layer that
records its past keeps every conv input since its last ``crop``; the wrapped mixers keep each row's real inputs
there, so ``crop(-n)`` rolls a padded row back too. Reference: greedy decoding of the prompt alone through the
stock model without a cache (transformers' ``test_assisted_decoding_matches_greedy_search``). The prompt repeats
itself, so prompt lookup proposes candidates that are partly rejected (crops of 1-3 tokens).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import safepad
from .helpers import family_param
from safepad.testing.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("quiet_transformers")

N_NEW = 8


@functools.cache
def _models(family: str):
    stock = tiny_model(family)
    return stock, safepad.wrap(copy.deepcopy(stock), backend="torch")


@torch.no_grad()
@pytest.mark.parametrize("side", ["unpadded", "left", "right"])
@pytest.mark.parametrize("family", [family_param(f) for f in ("lfm2", "lfm3", "inkling_text")])
def test_prompt_lookup_equals_greedy_alone(family, side):
    stock, wrapped = _models(family)
    p = torch.randint(3, 250, (5,), generator=torch.Generator().manual_seed(5))
    prompt = torch.cat([p, p, p[:3]])[None]  # [1, 13]
    pads = torch.zeros(1, 2, dtype=torch.long)
    ids, mask = prompt, torch.ones_like(prompt)
    if side == "left":
        ids, mask = torch.cat([pads, prompt], 1), torch.cat([pads, mask], 1)
    elif side == "right":
        ids, mask = torch.cat([prompt, pads], 1), torch.cat([mask, pads], 1)
    out = wrapped.generate(input_ids=ids, attention_mask=mask, max_new_tokens=N_NEW, do_sample=False, pad_token_id=0,
                           prompt_lookup_num_tokens=3, return_dict_in_generate=True, output_logits=True)  # fmt: skip
    new = out.sequences[0, ids.shape[1] :]
    ref = stock(input_ids=torch.cat([prompt[0], new])[None], use_cache=False).logits[0, prompt.shape[1] - 1 : -1]
    assert torch.equal(new, ref.argmax(-1))
    got = torch.cat([step[:1] for step in out.logits])[: len(new)]  # [N, V]
    assert (got.float() - ref).abs().max() < 1e-4
