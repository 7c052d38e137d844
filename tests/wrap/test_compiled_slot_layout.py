"""Right-padded rows under ``torch.compile``: the traced model hook does no slot justification, so a cache an
eager call re-laid raises instead of silently generating from the caller's pads. ``generate`` with a static cache
(whose mask it builds itself), compiled or not, lays a right-padded prompt pads first before the prefill: right-
and left-padded prompts both equal each row alone."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo as dynamo
from transformers import CompileConfig

import safepad
from safepad.cache import cache_argument, output_cache
from safepad.testing.tiny import family_available, tiny_model

from ..contract.helpers import gen_kwargs, greedy_alone, pad, prompts

#: hybrids whose attention layers hold the slots a re-lay moves
FAMILIES = [pytest.param(f, id=f) for f in ("nemotron_h", "qwen3_next")]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    dynamo.reset()
    yield
    dynamo.reset()


def _models(family: str):
    ok, why = family_available(family)
    if not ok:
        pytest.skip(why)
    stock = tiny_model(family).eval()
    return stock, safepad.wrap(copy.deepcopy(stock))


def _compile_config() -> CompileConfig:
    cc = CompileConfig(fullgraph=False, dynamic=False, backend="eager", mode=None)
    cc._compile_all_devices = True  # compile on CPU too, as transformers' tests do
    return cc


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_compiled_call_on_a_cache_an_eager_call_relaid_raises(family):
    """Eager right-padded prefill (re-lays the rows), then a compiled decode step on that cache."""
    _, wrapped = _models(family)
    rows = prompts((6, 3), seed=5)
    ids, mask = pad(rows, "right")
    out = wrapped(input_ids=ids, attention_mask=mask, use_cache=True)
    step = {"input_ids": out.logits[:, -1].argmax(-1, keepdim=True), "use_cache": True,
            cache_argument(wrapped): output_cache(out),
            "attention_mask": torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)}  # fmt: skip
    compiled = torch.compile(wrapped.__call__, backend="eager")  # as generate(compile_config=...) compiles it
    with pytest.raises(Exception, match="re-laid in an eager call") as err:
        compiled(**step)
    assert isinstance(err.value, (ValueError, RuntimeError)), type(err.value)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("compiled", [pytest.param(False, id="eager"), pytest.param(True, id="compiled")])
@torch.no_grad()
def test_static_cache_generate_serves_right_and_left_pads(family, compiled):
    """generate() builds the mask itself for a static cache (the cache compiled generation needs): right- and
    left-padded prompts equal each row alone (stock, full forwards, no cache), and the caller's prompt is kept."""
    stock, wrapped = _models(family)
    rows = prompts((6, 3), seed=5)
    kw = dict(do_sample=False, cache_implementation="static", **gen_kwargs(3))
    if compiled:
        kw["compile_config"] = _compile_config()
    for side in ("right", "left"):
        ids, mask = pad(rows, side)
        got = wrapped.generate(input_ids=ids, attention_mask=mask, **kw)
        assert torch.equal(got[:, : ids.shape[1]], ids), side
        for i, r in enumerate(rows):
            want, _ = greedy_alone(stock, r, 3)
            assert torch.equal(got[i, ids.shape[1] :], want), (side, i, got[i].tolist(), want.tolist())
