"""safepad.ops.dsa_index (through the patched GLM-5 Next indexer) against the stock indexer run on each sequence alone.

Reference: ``Glm5NextTextIndexer.forward`` of transformers on each sequence's real tokens alone (one unpadded row,
no cache), whose selection is then mapped to the slots of the packed / holed row. A selection is compared as a
set (the attention builds a set mask from it). The indexer's weights are redrawn so that scores are far from ties.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from safepad.cache import cache_argument
from safepad.testing.tiny import family_available, tiny_model
from safepad.wrap import wrap

pytestmark = pytest.mark.skipif(not family_available("glm5_next")[0], reason="no glm5_next in this transformers")


@pytest.fixture(scope="module")
def indexers():
    """(stock indexer, safepad-patched copy) of a tiny glm5_next with redrawn indexer weights."""
    log = logging.getLogger("transformers")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        model = tiny_model("glm5_next")
    finally:
        log.setLevel(level)
    stock = next(m for m in model.modules() if type(m).__name__ == "Glm5NextTextIndexer")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in (stock.wq_b.weight, stock.wk.weight, stock.weights_proj.weight, stock.index_kpool_compress_gate,
                  stock.index_kpool_compress_ape):
            p.copy_(torch.randn(p.shape, generator=g))
    wrapped_model = wrap(copy.deepcopy(model), backend="torch")
    patched = next(m for m in wrapped_model.modules() if type(m).__name__ == "SafepadGlm5NextTextIndexer")
    return stock, patched


def _no_cache(module) -> dict:
    """The indexer's cache argument set to None, under this transformers version's name."""
    return {cache_argument(module): None}


def _selection(idx: torch.Tensor, n: int) -> torch.Tensor:
    """``[T, W]`` selected slots (``-1`` none) -> ``[T, n]`` bool."""
    out = torch.zeros(idx.shape[0], n, dtype=torch.bool)
    for t in range(idx.shape[0]):
        sel = idx[t][idx[t] >= 0].long()
        out[t, sel] = True
    return out


def _inputs(stock, T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(1, T, stock.hidden_size, generator=g)
    r = torch.randn(1, T, stock.q_lora_rank, generator=g)
    return h, r


def _alone(stock, h, r, slots: list[int]) -> torch.Tensor:
    """Stock selection of the tokens at ``slots`` run alone, mapped back to row slots: ``[len, T]`` bool."""
    n = len(slots)
    idx = stock(hidden_states=h[:, slots], q_resid=r[:, slots], attention_mask=torch.ones(1, n, dtype=torch.bool),
                **_no_cache(stock))[0]
    sel = _selection(idx, n)  # [n, n]
    out = torch.zeros(n, h.shape[1], dtype=torch.bool)
    out[:, slots] = sel
    return out


@pytest.mark.parametrize("lengths", [(1, 5, 9, 14), (3, 4, 17), (29,)], ids=["1-5-9-14", "3-4-17", "29"])
def test_packed_row_selects_as_each_sequence_alone(indexers, lengths):
    stock, patched = indexers
    T = sum(lengths)
    h, r = _inputs(stock, T, seed=T)
    seq_idx = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])[None]
    got = patched(hidden_states=h, q_resid=r, attention_mask=torch.ones(1, T, dtype=torch.bool), **_no_cache(stock),
                  seq_idx=seq_idx)[0]
    got = _selection(got, T)
    stock_packed = _selection(stock(hidden_states=h, q_resid=r, attention_mask=torch.ones(1, T, dtype=torch.bool),
                                    **_no_cache(stock))[0], T)
    start = 0
    for n in lengths:
        slots = list(range(start, start + n))
        want = _alone(stock, h, r, slots)
        assert torch.equal(got[start : start + n], want), (lengths, start)
        start += n
    if len(lengths) > 1:
        assert not torch.equal(stock_packed, got)  # the stock indexer pools and looks across the boundaries


def test_pads_inside_a_row_shift_nothing(indexers):
    """Pads before, between and after real tokens: each real query selects what the real tokens select alone."""
    stock, patched = indexers
    T = 24
    h, r = _inputs(stock, T, seed=5)
    mask = torch.ones(1, T, dtype=torch.bool)
    mask[0, [0, 1, 6, 7, 8, 15, 22, 23]] = False
    got = _selection(patched(hidden_states=h, q_resid=r, attention_mask=mask, **_no_cache(stock))[0], T)
    slots = mask[0].nonzero()[:, 0].tolist()
    want = _alone(stock, h, r, slots)
    assert torch.equal(got[slots], want)
    assert not got[~mask[0]].any() and not got[:, ~mask[0]].any()  # pads select and are selected by nothing
    stock_sel = _selection(stock(hidden_states=h, q_resid=r, attention_mask=mask, **_no_cache(stock))[0], T)
    assert not torch.equal(stock_sel[slots], want)  # the stock pools straddle the holes


@pytest.mark.parametrize("layout", [pytest.param("packed", id="packed-seq_idx"), pytest.param("holes", id="holes")])
def test_selection_traces_without_graph_break(indexers, layout):
    """Under torch.compile the selection is one graph: the number of pools is a static bound, not a host read
    (``int(starts.sum(1).max())`` broke the graph in every indexer call: 13 breaks per glm5_next_text forward),
    and the traced selection is the eager one."""
    import torch._dynamo as dynamo

    _, patched = indexers
    T = 17
    h, r = _inputs(patched, T, seed=11)
    kw = {"hidden_states": h, "q_resid": r, **_no_cache(patched)}
    mask = torch.ones(1, T, dtype=torch.bool)
    if layout == "packed":
        kw["seq_idx"] = torch.tensor([[0] * 3 + [1] * 9 + [2] * 5], dtype=torch.int32)
    else:
        mask[0, [0, 4, 5, 12]] = False
    kw["attention_mask"] = mask
    dynamo.reset()
    try:
        ex = dynamo.explain(patched)(**kw)
        assert ex.graph_break_count == 0, [b.reason for b in ex.break_reasons]
        compiled = torch.compile(patched, backend="eager", fullgraph=True)
        assert torch.equal(_selection(compiled(**kw)[0], T), _selection(patched(**kw)[0], T))
    finally:
        dynamo.reset()
