"""A cache object used again: continuing twice from one returned cache, a ``StaticCache`` reused for a new prompt.

A cache is advanced in place by every call that reads it. Continuing twice from the same object, or reusing a
``StaticCache`` for another prompt without ``reset()``, would go on from states of other tokens: stock transformers
slices the sequence by the cache's length (attention caches) or feeds it whole on top of the old states
(recurrent-only ones), silently. The wrapped ``generate`` does it right where the cache holds a prefix of the
sequence (a ``copy.deepcopy`` taken before the first continuation, a ``reset()`` cache) and otherwise raises for
every family, naming ``copy.deepcopy(cache)`` and ``cache.reset()``. What the cache has read is kept on the cache
(so a deepcopy carries it). Reference: greedy generate of each sequence alone through the stock model, no cache.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import safepad
from safepad.cache import cache_argument, output_cache
from safepad.testing.tiny import tiny_model
from .helpers import family_param

pytestmark = pytest.mark.usefixtures("quiet_transformers")

N_NEW = 3
#: recurrent-only variants (their cache has no attention layer)
VARIANTS = {"nemotron_h_recurrent": ("nemotron_h", {"layers_block_type": ["mamba", "mlp", "mamba"]})}
FAMILIES = ("mamba", "mamba2", "falcon_mamba", "nemotron_h_recurrent", "jamba", "lfm2")


def _param(name: str):
    """The family's ``pytest.param`` (skipped where transformers lacks it), under the variant's name."""
    return pytest.param(name, id=name, marks=family_param(VARIANTS.get(name, (name,))[0]).marks)


@functools.cache
def _models(name: str):
    family, kw = VARIANTS.get(name, (name, {}))
    stock = tiny_model(family, **kw)
    return stock, safepad.wrap(copy.deepcopy(stock), backend="torch")


def _gen(model, ids, **kw):
    return model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_NEW, min_new_tokens=N_NEW, pad_token_id=0,
        do_sample=False, return_dict_in_generate=True, **kw,
    )


def _alone(stock, ids):
    """Greedy continuation of every row alone through the stock model, without a cache: ``[B, L + N_NEW]``."""
    rows = [
        stock.generate(input_ids=r[None], attention_mask=torch.ones_like(r[None]), max_new_tokens=N_NEW,
                       min_new_tokens=N_NEW, pad_token_id=0, do_sample=False, use_cache=False)[0]
        for r in ids
    ]
    return torch.stack(rows)


def _prompt(seed: int, length: int = 6):
    return torch.randint(3, 250, (2, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
@pytest.mark.parametrize("name", [_param(f) for f in FAMILIES])
def test_continue_twice_from_one_cache(name):
    """Two continuations from copies of one returned cache both equal the rows alone; from the object itself, the
    second one raises (every family: stock and the old wrapped model continued from the advanced states)."""
    stock, wrapped = _models(name)
    kw = cache_argument(wrapped)
    first = _gen(wrapped, _prompt(0))
    seqs, cache = first.sequences, output_cache(first)
    ref = _alone(stock, seqs)
    for _ in range(2):  # copies: each continuation starts from the state the first generate left
        assert torch.equal(_gen(wrapped, seqs, **{kw: copy.deepcopy(cache)}).sequences, ref)
    assert torch.equal(_gen(wrapped, seqs, **{kw: cache}).sequences, ref)
    with pytest.raises(ValueError, match=r"copy\.deepcopy\(cache\)"):
        _gen(wrapped, seqs, **{kw: cache})


@torch.no_grad()
@pytest.mark.parametrize(
    "name, static",
    [pytest.param(*_param(f).values, True, id=f"{f}-static", marks=_param(f).marks) for f in ("mamba", "mamba2")]
    + [pytest.param(*_param(f).values, False, id=f"{f}-dynamic", marks=_param(f).marks)
       for f in ("nemotron_h_recurrent", "jamba")],
)
def test_a_cache_reused_for_a_new_prompt(name, static):
    """A cache handed to a second generate with another prompt: without ``reset()`` it raises naming the fix (the
    old wrapped model went on from the first prompt's states: a ``StaticCache`` on Mamba / Mamba2 rel 1.1-1.3, a
    longer prompt on a ``DynamicCache`` sliced by the cache's length), after ``reset()`` it is right."""
    from transformers import DynamicCache, StaticCache

    stock, wrapped = _models(name)
    kw = cache_argument(wrapped)
    cache = StaticCache(config=wrapped.config, max_cache_len=32) if static else DynamicCache(config=wrapped.config)
    a = _prompt(1)
    assert torch.equal(_gen(wrapped, a, **{kw: cache}).sequences, _alone(stock, a))
    for b in (_prompt(2), _prompt(3, length=12)):  # shorter than what the cache read, and longer (another prefix)
        with pytest.raises(ValueError, match=r"cache\.reset\(\)"):
            _gen(wrapped, b, **{kw: cache})
    cache.reset()
    b = _prompt(2)
    assert torch.equal(_gen(wrapped, b, **{kw: cache}).sequences, _alone(stock, b))


@torch.no_grad()
def test_reset_forgets_safepad_bookkeeping_and_survives_deepcopy():
    """``cache.reset()`` of a cache a wrapped model met empties what safepad keeps beside it (the pad slots of a decode
    step, the re-lay flags): the emptied cache is a fresh one to the next call, whatever rows that call has."""
    from safepad.wrap.cache_rows import _bookkeeping_names

    _, wrapped = _models("jamba")
    ids = torch.randint(3, 250, (2, 6), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0  # right-padded second row: a re-laid cache
    cache = output_cache(wrapped(input_ids=ids, attention_mask=mask, use_cache=True))
    step_mask = torch.cat([mask, torch.tensor([[1], [0]])], 1)  # the second row's step token is a pad too
    kw = cache_argument(wrapped)
    cache = output_cache(wrapped(input_ids=ids[:, :1], attention_mask=step_mask, **{kw: cache}, use_cache=True))
    held = [n for n in _bookkeeping_names() if n in cache.__dict__]
    assert held, "the padded calls left no bookkeeping on the cache: this test checks nothing"
    twin = copy.deepcopy(cache)
    for c in (cache, twin):
        c.reset()
        assert [n for n in _bookkeeping_names() if n in c.__dict__] == []
    assert twin.reset.cache is twin  # the copy's reset is bound to the copy
