"""Models whose cache holds no attention layer (a Nemotron-H with only Mamba layers, ...).

Stock transformers 5.23 and 5.24 cannot ask such a cache for its length: ``get_seq_length`` /
``get_mask_sizes`` raise ``ValueError: get_seq_length can only be called on Attention layers``, and the
model's forward (eval with the default ``use_cache``), its mask construction and ``generate`` all ask. The
wrapped model hands them a cache that counts its tokens (safepad.cache). Reference: each sequence alone
through the stock model without a cache (scenario engine).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import safepad
from safepad.cache import cache_argument, output_cache
from safepad.testing.scenarios import SCENARIOS, run_scenario
from safepad.testing.tiny import tiny_model

# attention-free variants of hybrid families (the stock ones raise on every cached call)
VARIANTS = {
    "nemotron_h": {"layers_block_type": ["mamba", "mlp", "mamba"]},
    "bamba": {"attn_layer_indices": []},
    "qwen3_next": {"layer_types": ["linear_attention", "linear_attention"]},
    "lfm2": {"layer_types": ["conv", "conv"]},
}
STOCK_ERROR = "can only be called on Attention layers"


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.cache
def _models(family: str):
    stock = tiny_model(family, **VARIANTS[family])
    return stock, safepad.wrap(copy.deepcopy(stock)), copy.deepcopy(stock)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_pure_mamba_nemotron_h_every_scenario(scenario):
    """Every layout, chunked prefill and generate included, equals each sequence alone; stock raises."""
    stock, wrapped, ref = _models("nemotron_h")
    res = run_scenario(wrapped, ref, scenario)
    assert res.passed is not False, (res.status, res.error, res.max_abs_logits, res.state_errors)
    if scenario in ("chunked_prefill", "generate", "right_pad_decode", "decode_default"):
        stock_res = run_scenario(stock, ref, scenario)
        assert stock_res.error is not None and STOCK_ERROR in stock_res.error, stock_res.error


@pytest.mark.parametrize("family", [f for f in VARIANTS if f != "nemotron_h"])
@pytest.mark.parametrize("scenario", ["chunked_prefill", "generate"])
def test_other_attention_free_hybrids(family, scenario):
    stock, wrapped, ref = _models(family)
    res = run_scenario(wrapped, ref, scenario)
    assert res.passed, (res.status, res.error, res.max_abs_logits)
    assert STOCK_ERROR in (run_scenario(stock, ref, scenario).error or "")


@torch.no_grad()
def test_length_counts_every_position_and_user_caches_work():
    from transformers import DynamicCache

    stock, wrapped, _ = _models("nemotron_h")
    ids = torch.randint(3, 200, (2, 13), generator=torch.Generator().manual_seed(0))
    full = stock(input_ids=ids, use_cache=False).logits
    kw = cache_argument(wrapped)
    out = wrapped(input_ids=ids)  # eval, config use_cache=True, no position_ids: stock raises here
    assert output_cache(out).get_seq_length() == 13
    torch.testing.assert_close(out.logits, full, rtol=0, atol=1e-4)
    cache = DynamicCache(config=wrapped.config)  # the user's own, empty: tracked from its first call
    logits = []
    for a, b in ((0, 4), (4, 5), (5, 13)):
        step = wrapped(input_ids=ids[:, a:b], use_cache=True, **{kw: cache})
        assert output_cache(step) is cache and cache.get_seq_length() == b
        logits.append(step.logits)
    torch.testing.assert_close(torch.cat(logits, 1), full, rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match=STOCK_ERROR):
        stock(input_ids=ids)


@torch.no_grad()
def test_generate_equals_greedy_alone_and_unwrap_restores_stock():
    stock, wrapped, _ = _models("nemotron_h")
    model = copy.deepcopy(wrapped)
    ids = torch.randint(3, 200, (2, 7), generator=torch.Generator().manual_seed(1))
    seq = ids
    for _ in range(4):  # greedy by full forwards, no cache
        seq = torch.cat([seq, stock(input_ids=seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], 1)
    got = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4,
                         do_sample=False, pad_token_id=0)  # fmt: skip
    assert torch.equal(got, seq)
    assert copy.deepcopy(model).generate.model is not model  # a copy generates with its own weights
    safepad.unwrap(model)
    assert "generate" not in model.__dict__ and not model._forward_pre_hooks
    with pytest.raises(ValueError, match=STOCK_ERROR):
        model.generate(input_ids=ids, max_new_tokens=2, do_sample=False, pad_token_id=0)


def test_attention_caches_are_not_touched():
    wrapped = safepad.wrap(tiny_model("nemotron_h"))  # hybrid: has an attention layer
    assert not wrapped.generate.track  # generate only keeps on the cache what it has read (test_cache_reuse.py)
    with torch.no_grad():
        out = wrapped(input_ids=torch.randint(3, 200, (1, 5)), use_cache=True)
    assert type(output_cache(out)).__name__ == "DynamicCache"
