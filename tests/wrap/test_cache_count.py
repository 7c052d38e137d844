"""The cache's own token count after every wrapped call (transformers >= 5.25).

From 5.25 on, a linear-attention cache layer counts the tokens it has seen (``cumulative_length_linear``):
``get_seq_length`` answers from it (on a hybrid, layer 0 is often a recurrent layer), masks, positions and ``crop``
read it, and the stock update paths advance it by the width of the conv inputs they cache. safepad's mixers hand the
cache exactly K conv columns, so on 6f377ff the count read 4 after a 20-token prefill, and every padded decode,
padded chunked prefill and ``generate`` of a wrapped hybrid raised (``attention_mask has 20 columns but the cache
holds 4 tokens``), or, without position_ids, ran the attention layers at the wrong positions (silently 2-5e-4 off on
Qwen3-Next, LFM2 and Bamba). Reference: the stock model's per-layer count on the same unpadded calls (its count is
right there), and each sequence alone through the stock model for the outputs.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import safepad
from safepad.cache import cache_argument, output_cache
from safepad.testing.scenarios import run_scenario
from safepad.testing.tiny import family_names, tiny_model
from .helpers import family_param


def _counts_tokens() -> bool:
    from transformers import DynamicCache
    from transformers.cache_utils import LinearAttentionLayer

    return hasattr(LinearAttentionLayer(), "cumulative_length_linear") and DynamicCache is not None


pytestmark = [
    pytest.mark.skipif(not _counts_tokens(), reason="transformers < 5.25: linear-attention layers count no tokens"),
    pytest.mark.usefixtures("quiet_transformers"),
]


@functools.cache
def _models(family: str):
    stock = tiny_model(family)
    return stock, safepad.wrap(copy.deepcopy(stock), backend="torch")


def _layer_counts(cache) -> list[int | None]:
    """Each linear-attention layer's own count (None for the other layers)."""
    out = []
    for layer in getattr(cache, "layers", ()):
        count = getattr(layer, "cumulative_length_linear", None)
        out.append(None if count is None else int(count))
    return out


def _calls(model, ids, mask=None):
    """prefill 6 columns, a 3-column chunk, a decode step; the per-layer counts after each."""
    arg = cache_argument(model)
    m = None if mask is None else mask[:, :6]
    out = model(ids[:, :6], attention_mask=m, use_cache=True)
    cache = output_cache(out)
    counts = [_layer_counts(cache)]
    for lo, hi in ((6, 9), (9, 10)):
        m = None if mask is None else mask[:, :hi]
        model(ids[:, lo:hi], attention_mask=m, use_cache=True, **{arg: cache})
        counts.append(_layer_counts(cache))
    return cache, counts


# every family whose cache holds transformers' linear-attention layers (RecurrentGemma keeps its own cache)
COUNTED = [f for f in family_names() if f != "recurrent_gemma"]


@torch.no_grad()
@pytest.mark.parametrize("family", [family_param(f) for f in COUNTED])
def test_count_equals_stock_after_prefill_chunk_and_decode(family):
    stock, wrapped = _models(family)
    ids = torch.randint(3, 250, (2, 10), generator=torch.Generator().manual_seed(0))
    _, want = _calls(stock, ids)
    cache, got = _calls(wrapped, ids)
    assert any(c is not None for c in got[0]), "no linear-attention layer in this family's cache"
    assert got == want
    assert [c for c in got[-1] if c is not None] == [10] * sum(c is not None for c in got[-1])


@torch.no_grad()
@pytest.mark.parametrize("family", [family_param(f) for f in ("nemotron_h", "qwen3_next", "lfm2", "bamba", "jamba")])
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_calls_count_every_column(family, side):
    """A padded row counts its pads, as an attention layer does (and as stock counts the same call)."""
    stock, wrapped = _models(family)
    ids = torch.randint(3, 250, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if side == "left":
        mask[0, :2] = 0
    else:
        mask[0, 4:6] = 0  # the prefill's last two columns of row 0 are pads; the chunk and the step continue it
    _, got = _calls(wrapped, ids, mask)
    assert [[c for c in step if c is not None] for step in got] == [
        [n] * sum(c is not None for c in got[0]) for n in (6, 9, 10)
    ]


@torch.no_grad()
@pytest.mark.parametrize("family", [family_param(f) for f in ("nemotron_h", "qwen3_next", "lfm2", "kimi_linear")])
def test_generate_count_and_cache_operations_follow_stock(family):
    stock, wrapped = _models(family)
    ids = torch.randint(3, 250, (2, 7), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    want = output_cache(stock.generate(ids, **kw))
    got = output_cache(wrapped.generate(ids, **kw))
    assert _layer_counts(got) == _layer_counts(want)
    assert int(got.get_seq_length()) == int(want.get_seq_length())
    for cache in (want, got):
        cache.reorder_cache(torch.tensor([1, 0]))
    assert _layer_counts(got) == _layer_counts(want)
    for cache in (want, got):
        cache.reset()
    assert _layer_counts(got) == _layer_counts(want)


@pytest.mark.parametrize("family", [family_param(f) for f in ("qwen3_next", "lfm2", "bamba")])
@pytest.mark.parametrize("scenario", ["chunked_prefill_no_pos", "chunked_prefill_pad_no_pos"])
def test_chunked_prefill_without_positions_equals_each_row_alone(family, scenario):
    """No position_ids: the model takes the next chunk's positions from the cache's count (silently 2-5e-4 off on
    6f377ff with transformers 5.25)."""
    stock, wrapped = _models(family)
    res = run_scenario(wrapped, copy.deepcopy(stock), scenario)
    assert res.passed is True, (res.status, res.error, res.max_abs_logits)
