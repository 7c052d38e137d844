"""RecurrentGemma (Griffin): the wrapped recurrent blocks against each sequence run alone through the stock model.

The audit scenarios (``tests/wrap/test_new_families.py``) cover packing, padded prefill + decode, chunked prefill
and generate; these cover what is particular to a family whose stock code keeps its states on the modules.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from safepad.cache import cache_argument
from safepad.testing.scenarios import module_states
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


def _fresh_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def _cache_kw(model, cache) -> dict:
    return {cache_argument(model): cache}


@torch.no_grad()
def test_left_padded_forward_without_position_ids(models):
    """Without position_ids the stock model counts pads as positions: its RG-LRU never resets at the first real
    token and its conv reads the pads. Wrapped, each row equals the row alone."""
    stock, wrapped = models
    ids = torch.randint(3, 250, (2, 9), generator=torch.Generator().manual_seed(0))
    alone = stock(input_ids=ids, use_cache=False).logits
    lids = torch.cat([torch.zeros(2, 3, dtype=torch.long), ids], 1)
    lmask = torch.cat([torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 9, dtype=torch.long)], 1)
    got = wrapped(input_ids=lids, attention_mask=lmask, use_cache=False).logits[:, 3:]
    assert (got - alone).abs().max() < 1e-4
    bad = stock(input_ids=lids, attention_mask=lmask, use_cache=False).logits[:, 3:]
    assert (bad - alone).abs().max() > 1e-2


@torch.no_grad()
def test_module_storage_holds_each_rows_real_token_states(models):
    """After a right-padded cached prefill the module attributes (where stock code reads them) hold each row's
    states at its last real token, as after the row's own prefill; the stock block caches the pads'."""
    stock, wrapped = models
    g = torch.Generator().manual_seed(1)
    lengths = (7, 12, 2)
    seqs = [torch.randint(3, 250, (n,), generator=g) for n in lengths]
    ids = torch.zeros(3, 12, dtype=torch.long)
    mask = torch.zeros(3, 12, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : s.numel()], mask[b, : s.numel()] = s, 1
    alone = []
    for s in seqs:
        stock._setup_cache(stock.config, 1, torch.device("cpu"), torch.float32)
        stock(input_ids=s[None], use_cache=True, **_cache_kw(stock, _fresh_cache(stock)))
        alone.append(module_states(stock))
    for model, ok in ((wrapped, True), (stock, False)):
        if model is stock:
            stock._setup_cache(stock.config, 3, torch.device("cpu"), torch.float32)
        model(input_ids=ids, attention_mask=mask, use_cache=True, **_cache_kw(model, _fresh_cache(model)))
        got = module_states(model)
        assert set(got) == {"layer0.conv", "layer0.recurrent", "layer2.conv", "layer2.recurrent"}
        err = max((got[k][b] - alone[b][k][0]).abs().max().item() for b in range(3) for k in got)
        assert (err < 1e-4) == ok, (model is wrapped, err)


@torch.no_grad()
def test_a_fresh_cache_starts_fresh_whatever_the_modules_hold(models):
    """The module attributes still hold another batch's states; a new cache means new sequences."""
    _, wrapped = models
    g = torch.Generator().manual_seed(2)
    ids, other = torch.randint(3, 250, (2, 5), generator=g), torch.randint(3, 250, (2, 6), generator=g)
    full = wrapped(input_ids=ids, use_cache=False).logits
    wrapped(input_ids=other, use_cache=True, **_cache_kw(wrapped, _fresh_cache(wrapped)))
    cache = _fresh_cache(wrapped)
    out = [wrapped(input_ids=ids[:, :1], use_cache=True, **_cache_kw(wrapped, cache)).logits]  # a 1-token prompt
    for t in range(1, 5):
        out.append(wrapped(input_ids=ids[:, t : t + 1], use_cache=True, **_cache_kw(wrapped, cache)).logits)
    assert (torch.cat(out, 1) - full).abs().max() < 1e-4


def test_a_cache_without_recurrent_layers_raises(models):
    from transformers import DynamicCache

    _, wrapped = models
    with pytest.raises(ValueError, match=r"DynamicCache\(config=model.config\)"):
        wrapped(input_ids=torch.randint(3, 250, (1, 4)), use_cache=True, **_cache_kw(wrapped, DynamicCache()))


@torch.no_grad()
def test_packed_nan_stays_in_its_sequence_in_the_recurrent_blocks(models):
    """A NaN embedding in one packed sequence: the blocks keep it there (checked on a recurrent-only copy: the
    stock attention layers would pass a NaN across sequences, see README limits)."""
    stock, _ = models
    model = tiny_model("recurrent_gemma", block_types=["recurrent"], num_hidden_layers=2)
    ref = copy.deepcopy(model)
    wrap(model, backend="torch")
    g = torch.Generator().manual_seed(3)
    lengths = (4, 6, 5)
    seqs = [torch.randint(3, 250, (n,), generator=g) for n in lengths]
    emb = torch.cat([ref.get_input_embeddings()(s) for s in seqs])[None].clone()  # [1, T, D]
    emb[0, 4 + 2, 5] = torch.nan
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    out = model(inputs_embeds=emb, position_ids=pos, use_cache=False).logits[0]
    start = 0
    for i, (s, n) in enumerate(zip(seqs, lengths)):
        if i != 1:
            alone = ref(inputs_embeds=emb[:, start : start + n], use_cache=False).logits[0]
            assert (out[start : start + n] - alone).abs().max() < 1e-4
        else:
            assert not torch.isfinite(out[start + 2 : start + n]).all()
        start += n
