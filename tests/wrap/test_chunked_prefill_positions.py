"""The documented chunked-prefill recipe: a padded prefill with a cache, then the next chunks and one-token steps with
the cache and the full-length mask, with or without ``position_ids``.

The wrapped model keeps every cached row ``[pads | real tokens]`` (``safepad.layout.slots``) and gives attention
each token's real position (the cached real tokens plus the chunk's ``cumsum(mask) - 1``) when the caller gives
none, so RoPE hybrids (Qwen3-Next, LFM2, Bamba), sliding windows (LFM3 / Lara-Mini with a window of 6, shorter
than the rows) and masks with holes all come out as each sequence alone. Bamba restarts its positions at 0 on
every call in transformers 5.24 even without padding: an unpadded chunked prefill without ``position_ids`` is
checked too. Reference: every real token's logits against its sequence run alone (no padding, no cache) through
the stock model (GLM-5 Next: its DSA indexer's slot state moves with the keys). The attention projections are strengthened (std 0.3) so that position errors cannot hide.
"""

from __future__ import annotations

import copy

import pytest
import torch

import safepad
from safepad.cache import cache_argument, output_cache
from safepad.testing.tiny import tiny_model
from .helpers import family_param, strengthen_attention

TOL = 1e-4

#: (family, config overrides): RoPE hybrids, a Mamba2 hybrid with RoPE, sliding-window families, slot attention
CASES = {
    "qwen3_next": {},
    "lfm2": {},
    "bamba": {},
    "nemotron_h": {},
    "lfm3": {"sliding_window": 6},
    "lara_mini": {"sliding_window": 6},
    "inkling_text": {"sliding_window_size": 6},
    "inkling2_text": {"sliding_window_size": 6},
    "glm5_next": {},  # a DSA indexer selects key slots: its state is re-laid with the keys
    "qwen4_exp_text": {},  # its indexer keeps a per-slot position history in the cache: re-laid too
}


_param = family_param


pytestmark = pytest.mark.usefixtures("quiet_transformers")


@pytest.fixture(scope="module", params=[_param(f) for f in CASES])
def models(request):
    """(family, stock, wrapped copy), attention q/k projections strengthened."""
    stock = strengthen_attention(tiny_model(request.param, **CASES[request.param]))
    return request.param, stock, safepad.wrap(copy.deepcopy(stock), backend="torch")


def _batches(kind: str):
    """``(ids [B, N], mask [B, N], chunk bounds)``."""
    g = torch.Generator().manual_seed(0)
    if kind == "recipe":  # right-padded prefill (width 9), a 4-token chunk, two one-token steps
        ids = torch.randint(3, 250, (3, 15), generator=g)
        mask = torch.ones_like(ids)
        for i, n in enumerate((3, 9, 6)):
            mask[i, n:9] = 0
        return ids * mask, mask, [0, 9, 13, 14, 15]
    if kind == "holes":  # trailing pads and a hole inside chunks, an all-pad chunk, left pads over two chunks
        ids = torch.randint(3, 250, (3, 20), generator=g)
        mask = torch.ones_like(ids)
        mask[1, [2, 3, 8, 9, 10]] = 0
        mask[1, 16:20] = 0
        mask[2, :6] = 0
        return ids * mask, mask, [0, 4, 11, 16, 20]
    ids = torch.randint(3, 250, (2, 12), generator=g)  # unpadded chunks and steps
    return ids, torch.ones_like(ids), [0, 5, 9, 10, 11, 12]


@torch.no_grad()
def _run(model, ids, mask, bounds, positions: bool, pass_mask: bool = True):
    """``[B, N, V]`` logits of the chunks fed through the cache with the full-length mask."""
    name = cache_argument(model)
    cache, outs = None, []
    for a, b in zip(bounds[:-1], bounds[1:]):
        kw = {name: cache} if cache is not None else {}
        if positions:
            kw["position_ids"] = (mask[:, :b].cumsum(-1) - 1).clamp(min=0)[:, a:b]
        if pass_mask:
            kw["attention_mask"] = mask[:, :b]
        out = model(input_ids=ids[:, a:b], use_cache=True, **kw)
        cache = output_cache(out)
        outs.append(out.logits)
    return torch.cat(outs, dim=1)


@torch.no_grad()
def _error(stock, ids, mask, logits) -> float:
    err = 0.0
    for b in range(ids.shape[0]):
        real = mask[b].bool()
        if real.any():
            alone = stock(input_ids=ids[b, real][None], use_cache=False).logits[0]
            err = max(err, (logits[b, real] - alone).abs().max().item())
    return err


@pytest.mark.parametrize("positions", [pytest.param(False, id="no_position_ids"), pytest.param(True, id="position_ids")])
@pytest.mark.parametrize("kind", ["recipe", "holes"])
def test_padded_chunked_prefill_equals_alone(models, kind, positions):
    family, stock, wrapped = models
    ids, mask, bounds = _batches(kind)
    err = _error(stock, ids, mask, _run(wrapped, ids, mask, bounds, positions))
    assert err < TOL, (family, kind, err)
    stock_err = _error(stock, ids, mask, _run(stock, ids, mask, bounds, positions))
    assert stock_err > 1e-2, (family, kind, stock_err)  # the stock model is wrong on these layouts


@pytest.mark.parametrize("pass_mask", [pytest.param(True, id="ones_mask"), pytest.param(False, id="no_mask")])
def test_unpadded_chunks_without_position_ids_equal_alone(models, pass_mask):
    """No padding, no position_ids: positions continue from the cache (Bamba 5.24 restarts them at 0 on its own)."""
    family, stock, wrapped = models
    ids, mask, bounds = _batches("unpadded")
    err = _error(stock, ids, mask, _run(wrapped, ids, mask, bounds, False, pass_mask))
    assert err < TOL, (family, err)


def test_bamba_stock_restarts_positions():
    """The reference check of the test above: stock Bamba (5.24) is wrong on unpadded chunks without positions."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version("5.24"):
        pytest.skip("Bamba keeps its positions across calls before transformers 5.24")
    stock = strengthen_attention(tiny_model("bamba"))
    ids, mask, bounds = _batches("unpadded")
    assert _error(stock, ids, mask, _run(stock, ids, mask, bounds, False)) > 10 * TOL
