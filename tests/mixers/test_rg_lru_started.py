"""The RG-LRU block's per-row "has read a real token" flags on the cache (``STARTED_ATTR``): a row of pads only
starts its first real token from a reset; after a call of real tokens only (a ``generate`` step) the flags go
(their absence says every row has started: a step then selects nothing), and the recurrent layers of one call
share one computation of them. Each row
against its real tokens alone through the stock model, without a cache."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from safepad.cache import cache_argument
from safepad.mixers.rg_lru import STARTED_ATTR
from safepad.testing.tiny import tiny_model
from safepad.wrap import wrap


@pytest.fixture(scope="module")
def models():
    log = logging.getLogger("transformers")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        stock = tiny_model("recurrent_gemma")
        yield stock, wrap(copy.deepcopy(stock), backend="torch")
    finally:
        log.setLevel(level)


def _recurrent_layers(cache) -> list:
    layers = [layer for layer in cache.layers if hasattr(layer, "conv_states")]
    assert len(layers) == 2, "the tiny model has two recurrent blocks"
    return layers


def _steps(models, step_masks: list[list[int]]):
    """A prefill (row 1 all pads, row 2 left-padded) then one token per row per entry of ``step_masks`` (0: the
    row's token is a pad). Returns ``(logits [B, T, V], mask [B, T], ids [B, T], flags after each step)``."""
    stock, wrapped = models
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 250, (3, 5), generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [0, 0, 1, 1, 1]])
    cache = DynamicCache(config=wrapped.config)
    kw = {cache_argument(wrapped): cache}
    outs = [wrapped(input_ids=ids, attention_mask=mask, use_cache=True, **kw).logits]
    flags = []
    for col in step_masks:
        new = torch.randint(3, 250, (3, 1), generator=g)
        ids = torch.cat([ids, new], 1)
        mask = torch.cat([mask, torch.tensor(col)[:, None]], 1)
        outs.append(wrapped(input_ids=new, attention_mask=mask, use_cache=True, **kw).logits)
        flags.append([vars(layer).get(STARTED_ATTR) for layer in _recurrent_layers(cache)])
    return torch.cat(outs, 1), mask, ids, flags


def _check_rows_alone(stock, logits, mask, ids) -> None:
    for b in range(ids.shape[0]):
        keep = mask[b].bool()
        alone = stock(input_ids=ids[b][keep][None], use_cache=False).logits[0]
        assert (logits[b][keep] - alone).abs().max() <= 1e-4 * alone.abs().max(), b


@torch.no_grad()
def test_the_flags_go_in_a_generate_step(models):
    """Inside ``generate`` a step's tokens are all real (generate appends a column of ones): after the first step no
    recurrent layer holds flags (every row has started, which their absence says: the later steps select nothing),
    and each row's logits are the row's alone (row 1 brings one real token: stock ``generate`` of that prompt alone
    takes its decode path, so the reference is the stock forward over the row's tokens, without a cache)."""
    stock, wrapped = models
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 250, (3, 5), generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 0, 1], [0, 0, 1, 1, 1]])
    ids = ids.masked_fill(mask == 0, 0)
    cache = DynamicCache(config=wrapped.config)
    gen = {"do_sample": False, "max_new_tokens": 3, "min_new_tokens": 3, "pad_token_id": 0, "eos_token_id": None,
           "output_logits": True, "return_dict_in_generate": True}
    out = wrapped.generate(input_ids=ids, attention_mask=mask, **{cache_argument(wrapped): cache}, **gen)
    assert all(STARTED_ATTR not in vars(layer) for layer in _recurrent_layers(cache))
    got = torch.stack(out.logits, 1)  # [B, 3, V]
    for b in range(3):
        seq = torch.cat([ids[b][mask[b].bool()], out.sequences[b, 5:]])  # the row's real tokens, then its new ones
        ref = stock(input_ids=seq[None, :-1], use_cache=False).logits[0, -3:]  # [3, V]
        assert (got[b] - ref).abs().max() <= 1e-4 * ref.abs().max(), b
        assert torch.equal(out.sequences[b, 5:], ref.argmax(-1)), b  # greedy


@torch.no_grad()
def test_the_layers_of_one_call_share_the_flags(models):
    """Hand-written steps (their mask column may hold pads, so they keep the flags): every recurrent layer holds
    the same tensor (computed once per call), row 1 not started until its first real token."""
    logits, mask, ids, flags = _steps(models, [[1, 0, 1], [1, 0, 1], [1, 1, 0], [1, 1, 1]])
    _check_rows_alone(models[0], logits, mask, ids)
    expected = ([True, False, True], [True, False, True], [True, True, True], [True, True, True])
    for step, started in zip(flags, expected, strict=True):
        assert all(f is step[0] for f in step), step
        assert step[0].tolist() == started
