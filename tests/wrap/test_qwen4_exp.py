"""Qwen4-Exp's PLE layers (hashed n-gram ids + dilated conv) against the stock model, each sequence run alone.

The audit scenarios (``tests/wrap/test_new_families.py``) cover packing, padded prefill + decode, chunked prefill
and generate; these cover the n-gram history: it restarts at EOS (as stock) and at packed boundaries (stock does
not), and its cached ids are each row's last real ids (stock caches EOS for the pads).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from safepad.cache import cache_argument
from safepad.mixers.ple import ngram_embedding
from safepad.testing.tiny import family_available, tiny_model
from safepad.wrap import wrap

pytestmark = pytest.mark.skipif(not family_available("qwen4_exp_text")[0], reason="qwen4_exp needs transformers >= 5.23")
EOS = 2


@pytest.fixture(scope="module")
def models():
    log = logging.getLogger("transformers")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        stock = tiny_model("qwen4_exp_text")
        yield stock, wrap(copy.deepcopy(stock), backend="torch")
    finally:
        log.setLevel(level)


def _cache_kw(model, cache) -> dict:
    return {cache_argument(model): cache}


def _ids(n: int, seed: int, eos_at: tuple[int, ...] = ()) -> torch.Tensor:
    ids = torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed))
    ids[list(eos_at)] = EOS
    return ids


@torch.no_grad()
def test_ngram_hash_is_the_stock_one(models):
    """The PLE's own n-gram computation equals the stock module's, fresh and continuing from cached ids."""
    stock, _ = models
    emb = next(m for m in stock.modules() if type(m).__name__ == "Qwen4ExpTextNGramEmbedding")
    ids = torch.stack([_ids(11, 0, (4,)), _ids(11, 1, (0, 9))])  # EOS inside, at the start, near the end
    fresh = ids.new_full((2, emb.context_len), EOS)
    torch.testing.assert_close(ngram_embedding(emb, ids, fresh, None), emb(ids, None), rtol=0, atol=0)
    from transformers import DynamicCache

    cache = DynamicCache(config=stock.config)
    emb(ids[:, :6], cache)
    previous = cache.get_conv_state(emb.layer_idx, state_idx=2).clone()
    torch.testing.assert_close(ngram_embedding(emb, ids[:, 6:], previous, None), emb(ids[:, 6:], cache), rtol=0, atol=0)


@torch.no_grad()
def test_packed_sequences_with_and_without_eos(models):
    """Packed without EOS between them, the stock n-grams hash the previous sequence's last tokens."""
    stock, wrapped = models
    seqs = [_ids(5, 2), _ids(9, 3, (3,)), _ids(1, 4), _ids(6, 5)]
    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(s.numel()) for s in seqs])[None]
    alone = torch.cat([stock(input_ids=s[None], use_cache=False).logits[0] for s in seqs])
    got = wrapped(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
    assert (got - alone).abs().max() < 1e-4
    bad = stock(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
    assert (bad - alone).abs().max() > 1e-2


@torch.no_grad()
def test_right_padded_prefill_then_decode_keeps_each_rows_ngram_history(models):
    """Rows with EOS inside, right-padded, prefilled through the cache in two chunks, then decoded: each row equals
    itself alone, and the cached n-gram ids are the row's last real ids (the stock model caches EOS for pads)."""
    stock, wrapped = models
    from transformers import DynamicCache

    seqs = [_ids(9, 6, (2,)), _ids(4, 7), _ids(7, 8, (6,))]
    W = 9
    ids = torch.zeros(3, W, dtype=torch.long)
    mask = torch.zeros(3, W, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : s.numel()], mask[b, : s.numel()] = s, 1
    nxt = torch.randint(3, 250, (3, 2), generator=torch.Generator().manual_seed(9))
    for model, ok in ((wrapped, True), (stock, False)):
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :5], attention_mask=mask[:, :5], use_cache=True, **_cache_kw(model, cache))
        out = model(input_ids=ids[:, 5:], attention_mask=mask, use_cache=True, **_cache_kw(model, cache))
        ctx = [cache.get_conv_state(i, state_idx=2).clone() for i in (0, 2)]
        full_mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)
        step = model(input_ids=nxt[:, :1], attention_mask=full_mask, position_ids=mask.sum(1, keepdim=True),
                     use_cache=True, **_cache_kw(model, cache)).logits[:, -1]
        err, ctx_ok = 0.0, True
        for b, s in enumerate(seqs):
            ref = stock(input_ids=torch.cat([s, nxt[b, :1]])[None], use_cache=False).logits[0]
            err = max(err, (out.logits[b, : max(s.numel() - 5, 0)] - ref[5 : s.numel()]).abs().max().item()
                      if s.numel() > 5 else 0.0)
            err = max(err, (step[b] - ref[-1]).abs().max().item())
            ctx_ok = ctx_ok and all(torch.equal(c[b], s[-c.shape[1] :]) for c in ctx)
        assert ctx_ok == ok, (model is wrapped, ctx)
        assert (err < 1e-4) == ok, (model is wrapped, err)


@torch.no_grad()
def test_cache_of_another_batch_size_raises_naming_it(models):
    """A 3-row cache passed to a 2-row decode: stock fails at a raw torch.cat of the indexer position ids."""
    _, wrapped = models
    ids = torch.stack([_ids(8, s) for s in range(3)])  # [3, 8]
    cache = wrapped(input_ids=ids, use_cache=True).past_key_values
    with pytest.raises(ValueError, match="cache holds states for 3 rows but this call has 2 rows"):
        wrapped(input_ids=ids[:2, -1:], **_cache_kw(wrapped, cache), use_cache=True)


@torch.no_grad()
@pytest.mark.parametrize("chunk", [pytest.param(16, id="chunk16"), pytest.param(31, id="chunk31")])
def test_chunked_prefill_with_position_ids_of_padded_rows_equals_alone(models, chunk):
    """Right-padded rows fed in chunks with the full mask and ``cumsum(mask) - 1`` position_ids: a chunk holding a
    row's last real tokens and pads moves cached slots into its columns, and the indexer's position history must
    keep those slots' own positions there (not the caller's positions of the pads)."""
    stock, wrapped = models
    N = 40
    ids = torch.randint(3, 250, (3, N), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, N - 7 :] = 0
    mask[2, N - 20 :] = 0
    ids = ids * mask
    cache, outs = None, []
    for a in range(0, N, chunk):
        b = min(a + chunk, N)
        kw = _cache_kw(wrapped, cache) if cache is not None else {}
        pos = (mask[:, :b].cumsum(-1) - 1).clamp(min=0)[:, a:b]
        out = wrapped(input_ids=ids[:, a:b], attention_mask=mask[:, :b], position_ids=pos, use_cache=True, **kw)
        cache = out.past_key_values
        outs.append(out.logits)
    logits = torch.cat(outs, 1)
    err = 0.0
    for r in range(3):
        real = mask[r].bool()
        alone = stock(input_ids=ids[r, real][None], use_cache=False).logits[0]
        err = max(err, (logits[r, real] - alone).abs().max().item())
    assert err < 1e-4, (chunk, err)
