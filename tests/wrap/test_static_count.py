"""A static cache's token count, known on the host: no host read per eager step, and never a stale count.

transformers' static attention layer counts its tokens in a 0-d tensor (``StaticLayer.cumulative_length``, advanced
in place by each call's update). Reading it is a host sync: every eager step of a wrapped model read it (for the
mask-history check and the slot layout), one sync per decode step where stock ``generate`` makes none of its own.
The hooks now carry the count over from the call before (``safepad.cache.expect_count`` / ``settle_count``): taken
only when the tensor is the same object and advanced exactly once since (the call's own update). These tests check
the count the host uses against the tensor after every call, sequences of calls that move the count in other ways
(``reset``, a refused call, a copy), and the syncs per ``generate`` step against stock's.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import StaticCache

import safepad
from safepad.cache import _STATIC_COUNT, _known_count, cache_length
from safepad.testing.syncs import count_syncs
from safepad.testing.tiny import tiny_model

FAMILIES = [pytest.param(f, id=f) for f in ("nemotron_h", "qwen3_next", "lfm2", "jamba", "bamba")]


def _attention_layer(cache):
    from transformers.cache_utils import StaticLayer

    return next(layer for layer in cache.layers if isinstance(layer, StaticLayer))


def _true_count(cache) -> int:
    return int(getattr(_attention_layer(cache), _STATIC_COUNT))


def _batch(side: str, B: int = 3, L: int = 7, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 100, (B, L), generator=gen)
    mask = torch.ones(B, L, dtype=torch.long)
    for b in range(1, B):
        if side == "left":
            mask[b, :b] = 0
        else:
            mask[b, L - b :] = 0
    return ids, mask


def _call(model, cache, ids, mask, past: int):
    """One cached call of ``ids`` ``[B, T]`` after ``past`` tokens, with the full-length mask, as generate() does."""
    T = ids.shape[1]
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True,
                     cache_position=torch.arange(past, past + T))  # fmt: skip


def _known(cache) -> int | None:
    return _known_count(_attention_layer(cache), _STATIC_COUNT)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_count_the_host_uses_is_the_caches(family, side):
    model = safepad.wrap(tiny_model(family).eval())
    ids, mask = _batch(side)
    cache = StaticCache(config=model.config, max_cache_len=24)
    _call(model, cache, ids, mask, 0)
    full = mask
    gen = torch.Generator().manual_seed(1)
    for step, T in enumerate((1, 1, 3, 1)):  # decode steps and a chunk
        past = full.shape[1]
        assert _known(cache) == _true_count(cache) == past, (step, _known(cache), _true_count(cache))
        new = torch.randint(3, 100, (ids.shape[0], T), generator=gen)
        full = torch.cat([full, torch.ones(ids.shape[0], T, dtype=torch.long)], 1)
        _call(model, cache, new, full, past)
    assert _known(cache) == _true_count(cache) == full.shape[1]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_count_moved_by_anyone_else_is_read_again(family):
    model = safepad.wrap(tiny_model(family).eval())
    ids, mask = _batch("left")
    cache = StaticCache(config=model.config, max_cache_len=24)
    _call(model, cache, ids, mask, 0)
    assert _known(cache) == 7
    # a refused call (its mask edits a column the cache has read), then a reset: the count is 0, not 7 + 1
    edited = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)
    edited[0, 0] = 0
    with pytest.raises(ValueError):
        _call(model, cache, ids[:, :1], edited, 7)
    cache.reset()
    assert _known(cache) is None and cache_length(cache) == _true_count(cache) == 0
    _call(model, cache, ids, mask, 0)
    assert _known(cache) == _true_count(cache) == 7
    # an unwrapped model's step moves the count: read again
    stock = copy.deepcopy(model)
    safepad.unwrap(stock)
    step = torch.full((3, 1), 5)
    full = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)
    _call(stock, cache, step, full, 7)
    assert _known(cache) is None and cache_length(cache) == _true_count(cache) == 8
    # a deep copy carries the count it had
    twin = copy.deepcopy(cache)
    assert cache_length(twin) == 8


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_with_a_static_cache_syncs_no_more_than_stock_per_step(family):
    """Eager generate with ``cache_implementation="static"``: the extra syncs of 3 more new tokens, per step."""
    stock = tiny_model(family).eval()
    wrapped = safepad.wrap(copy.deepcopy(stock))
    ids, mask = _batch("left")

    def per_step(model) -> float:
        counts = []
        for n in (3, 6):
            def run(n=n):
                with torch.no_grad():
                    return model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                          pad_token_id=0, cache_implementation="static", disable_compile=True)
            out, syncs, _ = count_syncs(run)
            counts.append(syncs)
        return (counts[1] - counts[0]) / 3, out

    (n_stock, out_stock), (n_wrapped, out_wrapped) = per_step(stock), per_step(wrapped)
    assert n_wrapped <= n_stock, (n_wrapped, n_stock)
    assert torch.equal(out_wrapped, out_stock)  # left pads: stock's tokens are right
