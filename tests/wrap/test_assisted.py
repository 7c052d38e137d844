"""Assisted (speculative) generation: the families whose stock model serves it, served right wrapped.

transformers 5.23 / 5.24 serve assisted generation only where the cache can be cropped: layers that hold no
recurrent state (LFM2's / LFM3's short convolutions, Inkling's convs inside attention); stateful models (every
family with an SSM / delta-rule state) are refused up front by transformers, wrapped or not. A cache layer that
records its past keeps every conv input since its last ``crop``; the wrapped mixers keep each row's real inputs
there, so ``crop(-n)`` rolls a padded row back too. Reference: greedy decoding of the prompt alone through the
stock model without a cache (transformers' ``test_assisted_decoding_matches_greedy_search``). The prompt repeats
itself, so prompt lookup proposes candidates that are partly rejected (crops of 1-3 tokens).

From transformers 5.25 on, a linear-attention cache layer can record its recurrent states as well
(``activate_past_recording(recurrent_states_to_keep=N)``): every stateful family serves assisted generation, and the
wrapped mixers hand the cache the states ``crop`` rolls back to (safepad.mixers.history). On 6f377ff the wrapped
models refused it ("this safepad-wrapped mixer cannot roll its states back").
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
    _check_assisted(family, side, prompt_lookup_num_tokens=3)


def _stock_crops_recurrent_states() -> bool:
    from transformers.cache_utils import LinearAttentionLayer

    return LinearAttentionLayer.is_croppable is True  # a class attribute; 5.23 / 5.24: a property refusing states


# one or more families of every stateful mixer kind: Mamba2 (SSD), Mamba1, Zamba's per-head Mamba1, gated DeltaNet, KDA
STATEFUL = ("nemotron_h", "bamba", "mamba2", "zamba2", "jamba", "mamba", "zamba", "qwen3_next", "kimi_linear")
needs_recurrent_crop = pytest.mark.skipif(
    not _stock_crops_recurrent_states(), reason="transformers < 5.25 cannot crop a recurrent state"
)


@needs_recurrent_crop
@torch.no_grad()
@pytest.mark.parametrize("side", ["unpadded", "left", "right"])
@pytest.mark.parametrize("family", [family_param(f) for f in STATEFUL])
def test_prompt_lookup_on_stateful_families_equals_greedy_alone(family, side):
    _check_assisted(family, side, prompt_lookup_num_tokens=3)


@needs_recurrent_crop
@torch.no_grad()
@pytest.mark.parametrize("family", [family_param(f) for f in ("nemotron_h", "jamba", "qwen3_next")])
def test_assistant_model_on_stateful_families_equals_greedy_alone(family):
    """A wrapped assistant of another seed: its candidates are mostly rejected, and its own cache records its past
    from its prefill on (transformers marks an assistant's cache so)."""
    draft = safepad.wrap(tiny_model(family, seed=1), backend="torch")
    _check_assisted(family, "left", assistant_model=draft)


@needs_recurrent_crop
@torch.no_grad()
@pytest.mark.parametrize("family", [family_param(f) for f in ("nemotron_h", "jamba", "qwen3_next", "mamba")])
def test_crop_rolls_a_left_padded_batch_back(family):
    """The cache API itself, two rows: a left-padded prefill and a 4-token chunk on a recording cache, crop(-n),
    then a step: each row's logits equal the row alone at that length."""
    from transformers import DynamicCache

    from safepad.cache import cache_argument

    stock, wrapped = _models(family)
    ids = torch.randint(3, 250, (2, 12), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # row 0: 3 left pads
    arg = cache_argument(wrapped)
    for n in (0, 1, 3):
        cache = DynamicCache(config=wrapped.config)
        cache.activate_past_recording(recurrent_states_to_keep=3)
        wrapped(ids[:, :7], attention_mask=mask[:, :7], use_cache=True, **{arg: cache})
        wrapped(ids[:, 7:11], attention_mask=mask[:, :11], use_cache=True, **{arg: cache})
        cache.crop(-n)
        L = 11 - n
        step = torch.cat([mask[:, :L], torch.ones(2, 1, dtype=mask.dtype)], 1)
        got = wrapped(ids[:, 11:12], attention_mask=step, use_cache=True, **{arg: cache}).logits[:, -1]
        for row in range(2):
            alone = torch.cat([ids[row, :L][mask[row, :L].bool()], ids[row, 11:12]])[None]
            ref = stock(alone, use_cache=False).logits[0, -1]
            assert (got[row] - ref).abs().max() < 1e-4, (n, row)


def _check_assisted(family: str, side: str, **assist) -> None:
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
                           return_dict_in_generate=True, output_logits=True, **assist)  # fmt: skip
    new = out.sequences[0, ids.shape[1] :]
    ref = stock(input_ids=torch.cat([prompt[0], new])[None], use_cache=False).logits[0, prompt.shape[1] - 1 : -1]
    assert torch.equal(new, ref.argmax(-1))
    got = torch.cat([step[:1] for step in out.logits])[: len(new)]  # [N, V]
    assert (got.float() - ref).abs().max() < 1e-4
