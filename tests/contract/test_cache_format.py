"""The cache a model hands back, and generation that depends on it: the cache class (issue 21 item 3: a wrapped
model keeps the classes the caller and stock use), the state shapes, continuing ``generate`` from returned
``past_key_values``, a static cache, and generation from ``inputs_embeds``. References: the stock model's
cache class and state shapes; each prompt alone, greedy by full forwards without a cache.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from safepad.cache import cache_argument, output_cache
from safepad.testing.scenarios import cache_states

from .conftest import contract, family_params
from .helpers import N_NEW, gen_kwargs, greedy_alone, pad, prompts


def _gen_cache(out):
    return getattr(out, "past_key_values", None) if not hasattr(out, "cache") else out.cache


@torch.no_grad()
def cache_class_and_states(model, ref):
    """Forward and generate return the cache class stock returns; a caller's DynamicCache stays that object
    and that class; its states have stock's shapes."""
    ids = prompts((5, 5), seed=2)
    ids = torch.stack(ids)
    name = cache_argument(model)
    stateful = callable(getattr(model, "_setup_cache", None))
    out, want = model(input_ids=ids, use_cache=True), ref(input_ids=ids, use_cache=True)
    assert type(output_cache(out)) is type(output_cache(want)), (type(output_cache(out)), type(output_cache(want)))
    if not stateful:
        mine = DynamicCache(config=model.config)
        got = output_cache(model(input_ids=ids, use_cache=True, **{name: mine}))
        assert got is mine and type(mine) is DynamicCache, type(mine)
        theirs = output_cache(ref(input_ids=ids, use_cache=True, **{name: DynamicCache(config=ref.config)}))
        a, b = cache_states(mine), cache_states(theirs)
        assert {k: tuple(v.shape) for k, v in a.items()} == {k: tuple(v.shape) for k, v in b.items()}
    g = model.generate(input_ids=ids, do_sample=False, return_dict_in_generate=True, **gen_kwargs())
    g_ref = ref.generate(input_ids=ids, do_sample=False, return_dict_in_generate=True, **gen_kwargs())
    assert type(_gen_cache(g)) is type(_gen_cache(g_ref)), (type(_gen_cache(g)), type(_gen_cache(g_ref)))


@torch.no_grad()
def continue_from_past_key_values(model, ref):
    """transformers' ``test_generate_continue_from_past_key_values``: 1 token, then N more from the returned
    cache and the full sequence, equals N + 1 tokens at once (and the prompt alone).

    Open (fails wrapped for mamba / mamba2 / falcon_mamba): with an all-linear cache ``generate`` cannot slice
    the sequence by the cache's length, so it feeds the whole sequence again with the cache. Stock Mamba1
    mixers restart their states on every multi-token call (right here, wrong for chunked prefill); safepad
    continues from the cache (right for chunked prefill), so the prompt is read twice. Stock mamba2 is wrong
    here too (its left-padded row).
    """
    rows = prompts((6, 4), seed=4)
    ids, mask = pad(rows, "left")
    kw = {"do_sample": False, "return_dict_in_generate": True, "pad_token_id": 0}
    first = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=1, min_new_tokens=1, **kw)
    cache = _gen_cache(first)
    assert cache is not None, "generate returned no cache"
    mask2 = torch.cat([mask, torch.ones(mask.shape[0], 1, dtype=mask.dtype)], 1)
    second = model.generate(input_ids=first.sequences, attention_mask=mask2, max_new_tokens=N_NEW,
                            min_new_tokens=N_NEW, **{cache_argument(model): cache}, **kw)  # fmt: skip
    for i, r in enumerate(rows):
        want, _ = greedy_alone(ref, r, N_NEW + 1)
        assert torch.equal(second.sequences[i, ids.shape[1] :], want), (i, second.sequences[i].tolist(), want.tolist())


@torch.no_grad()
def static_cache(model, ref):
    rows = prompts((6, 4), seed=6)
    ids, mask = pad(rows, "left")
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, cache_implementation="static",
                         return_dict_in_generate=True, **gen_kwargs())  # fmt: skip
    assert not isinstance(_gen_cache(out), DynamicCache)
    for i, r in enumerate(rows):
        want, _ = greedy_alone(ref, r)
        assert torch.equal(out.sequences[i, ids.shape[1] :], want), (i, out.sequences[i].tolist(), want.tolist())


@torch.no_grad()
def generate_from_inputs_embeds(model, ref):
    """transformers' ``test_generate_from_inputs_embeds``: the new tokens from embeddings equal those from ids."""
    rows = prompts((6, 4), seed=8)
    ids, mask = pad(rows, "left")
    embeds = model.get_input_embeddings()(ids)
    from_ids = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, **gen_kwargs())
    from_embeds = model.generate(inputs_embeds=embeds, attention_mask=mask, do_sample=False, **gen_kwargs())
    assert torch.equal(from_embeds, from_ids[:, ids.shape[1] :]), (from_embeds.tolist(), from_ids.tolist())
    for i, r in enumerate(rows):
        want, _ = greedy_alone(ref, r)
        assert torch.equal(from_embeds[i], want), (i, from_embeds[i].tolist(), want.tolist())


PROPERTIES = {
    "cache_class_and_states": cache_class_and_states,
    "continue_from_past_key_values": continue_from_past_key_values,
    "static_cache": static_cache,
    "generate_from_inputs_embeds": generate_from_inputs_embeds,
}


@pytest.mark.parametrize("name", list(PROPERTIES))
@pytest.mark.parametrize("family", family_params())
def test_cache_contract(family, name):
    contract(family, name, PROPERTIES[name])
