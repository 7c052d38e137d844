"""Padded rows under ``torch.compile``: a compiled one-token step re-lays a justified cache on the device, as an
eager step does (``safepad.wrap.traced_slot_calls.traced_slot_step``): after an eager right-padded prefill (a re-laid
cache), and after an eager step whose token is a pad in some row (slot-counting attention re-lays it on the device
without the host knowing), compiled steps equal each row alone; so do compiled chunks of several tokens (a chunked
prefill, a verify call), re-laid on the device too; a compiled call on a re-laid cache without the full-length mask
raises naming the fixes. ``generate`` with a static cache (whose mask it builds itself), compiled or not, lays a
right-padded prompt pads first before the prefill: right- and left-padded prompts both equal each row alone."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo as dynamo
from transformers import CompileConfig, DynamicCache

import safepad
from safepad.cache import cache_argument, output_cache
from safepad.testing.tiny import family_available, tiny_model

from ..contract.helpers import gen_kwargs, greedy_alone, logits_alone, pad, prompts

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


def _cached_steps(family: str, side: str, step_mask: list[int], n_compiled: int = 1):
    """Prefill ``side``-padded rows eagerly, one eager step whose token is a pad where ``step_mask`` is 0, then
    ``n_compiled`` compiled one-token steps (``fullgraph=True``). Returns (max |logits - row alone| over the
    compiled steps' real rows, the compiled callable, the last step's kwargs)."""
    stock, wrapped = _models(family)
    rows = prompts((6, 3), seed=5)
    ids, mask = pad(rows, side)
    name = cache_argument(wrapped)
    cache = DynamicCache(config=wrapped.config)  # (RecurrentGemma's output carries none: the caller's own)
    out = wrapped(input_ids=ids, attention_mask=mask, use_cache=True, **{name: cache})
    cache = output_cache(out) or cache
    seen = [r.clone() for r in rows]
    tok, m = torch.tensor([[11], [12]]), torch.cat([mask, torch.tensor(step_mask)[:, None].to(mask.dtype)], 1)
    out = wrapped(input_ids=tok, attention_mask=m, use_cache=True, **{name: cache})
    cache = output_cache(out) or cache
    seen = [torch.cat([s, t]) if k else s for s, t, k in zip(seen, tok, step_mask)]
    compiled = torch.compile(wrapped.__call__, backend="eager", fullgraph=True)  # as generate(compile_config=...)
    worst = 0.0
    for j in range(n_compiled):
        tok, m = torch.tensor([[13 + j], [23 + j]]), torch.cat([m, torch.ones(2, 1, dtype=m.dtype)], 1)
        step = {"input_ids": tok, "attention_mask": m, "use_cache": True, name: cache}
        out = compiled(**step)
        cache = output_cache(out) or cache
        seen = [torch.cat([s, t]) for s, t in zip(seen, tok)]
        for i, s in enumerate(seen):
            worst = max(worst, (out.logits[i, -1].float() - logits_alone(stock, s)[-1]).abs().max().item())
    return worst, compiled, {**step, "input_ids": torch.tensor([[5, 6], [7, 8]]),
                             "attention_mask": torch.cat([m, torch.ones(2, 2, dtype=m.dtype)], 1)}  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_compiled_steps_on_a_cache_an_eager_call_relaid_equal_alone(family):
    """Eager right-padded prefill (re-lays the rows), then compiled decode steps on that cache: re-laid on the
    device as eager steps are (raised before: the traced hook did no slot justification)."""
    worst, compiled, chunk = _cached_steps(family, "right", [1, 1])
    assert worst < 1e-4, worst
    chunk.pop("attention_mask")  # without the full-length mask the cached slots' layout is unknown: refused
    with pytest.raises(Exception, match="re-laid in an eager call") as err:
        compiled(**chunk)
    assert isinstance(err.value, (ValueError, RuntimeError)), type(err.value)


#: one family per kind of hybrid cache (attention beside Mamba2, gated delta rule, short convolutions, RG-LRU,
#: a dynamic convolution with slot-distance attention)
CHUNK_FAMILIES = [
    pytest.param(f, id=f) for f in ("nemotron_h", "qwen3_next", "lfm2", "recurrent_gemma", "inkling2_text")
]


@pytest.mark.parametrize("family", CHUNK_FAMILIES)
@torch.no_grad()
def test_compiled_chunk_on_a_relaid_cache_equals_eager_and_alone(family):
    """``torch.compile(model)`` on a chunked prefill: an eager right-padded prefill re-lays the cache, then a compiled
    3-token chunk (row 1 right-padded inside the chunk) and a compiled step. The chunk is re-laid on the device
    (``traced_slot_step``): its real tokens' logits equal the eager chunk's on a copy of the cache and each row alone
    (stock, no padding, no cache). Raised before ("re-laid in an eager call") on every one of these families."""
    stock, wrapped = _models(family)
    rows = prompts((6, 3), seed=5)
    ids, mask = pad(rows, "right")
    name = cache_argument(wrapped)
    cache = DynamicCache(config=wrapped.config)
    out = wrapped(input_ids=ids, attention_mask=mask, use_cache=True, **{name: cache})
    cache = output_cache(out) or cache
    chunk, cmask = torch.tensor([[5, 6, 7], [8, 9, 10]]), torch.tensor([[1, 1, 1], [1, 0, 0]])
    m = torch.cat([mask, cmask], 1)
    twin = copy.deepcopy(cache)
    eager = wrapped(input_ids=chunk, attention_mask=m, use_cache=True, **{name: twin}).logits
    compiled = torch.compile(wrapped, backend="eager")
    got = compiled(input_ids=chunk, attention_mask=m, use_cache=True, **{name: cache}).logits
    real = cmask.bool()
    assert (got[real] - eager[real]).abs().max().item() < 1e-5
    seen = [torch.cat([r, c[k]]) for r, c, k in zip(rows, chunk, real)]
    for i, s in enumerate(seen):
        n = int(real[i].sum())
        assert (got[i][real[i]].float() - logits_alone(stock, s)[-n:]).abs().max().item() < 1e-4, i
    tok, m = torch.tensor([[40], [41]]), torch.cat([m, torch.ones(2, 1, dtype=m.dtype)], 1)
    out = compiled(input_ids=tok, attention_mask=m, use_cache=True, **{name: cache})
    for i, s in enumerate(seen):
        want = logits_alone(stock, torch.cat([s, tok[i]]))[-1]
        assert (out.logits[i, -1].float() - want).abs().max().item() < 1e-4, i


@torch.no_grad()
def test_compiled_chunk_after_eager_steps_without_pads_equals_alone():
    """Eager decode steps of a model whose attention counts slots (RecurrentGemma's sliding window) re-lay the cache
    on the device and mark it re-laid, whether or not a token is a pad: an unpadded prompt, two eager steps, then a
    compiled 3-token chunk (an assisted-decoding verify call's shape) equals each row alone. Raised before ("re-laid
    in an eager call"), though no row ever held a pad."""
    stock, wrapped = _models("recurrent_gemma")
    rows = prompts((4, 4), seed=9)
    ids = torch.stack(rows)
    m = torch.ones_like(ids)
    name = cache_argument(wrapped)
    cache = DynamicCache(config=wrapped.config)  # (RecurrentGemma's output carries none: the caller's own)
    wrapped(input_ids=ids, attention_mask=m, use_cache=True, **{name: cache})
    seen = list(rows)
    for t in (11, 12):
        tok, m = torch.full((2, 1), t), torch.cat([m, torch.ones(2, 1, dtype=m.dtype)], 1)
        wrapped(input_ids=tok, attention_mask=m, use_cache=True, **{name: cache})
        seen = [torch.cat([s, k]) for s, k in zip(seen, tok)]
    chunk, m = torch.tensor([[5, 6, 7], [8, 9, 10]]), torch.cat([m, torch.ones(2, 3, dtype=m.dtype)], 1)
    got = torch.compile(wrapped, backend="eager")(input_ids=chunk, attention_mask=m, use_cache=True,
                                                   **{name: cache}).logits  # fmt: skip
    for i, s in enumerate(seen):
        want = logits_alone(stock, torch.cat([s, chunk[i]]))[-3:]
        assert (got[i].float() - want).abs().max().item() < 1e-4, i


def _dynamic_decode_frames(model, ref, rows, side: str, steps: int = 4) -> list[int]:
    """``torch.compile(model, dynamic=True)``: an eager ``side``-padded prefill of ``rows``, then ``steps`` compiled
    one-token steps, each row's logits checked against the row alone (``ref``: stock, no cache; None: unchecked, for
    stock itself, whose cached step skips the ``time_step_limit`` clamp). Returns the frames dynamo has compiled
    after each step."""
    from torch._dynamo.utils import counters

    ids, mask = pad(rows, side)
    name = cache_argument(model)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, attention_mask=mask, use_cache=True, **{name: cache})
    cache = output_cache(out) or cache
    compiled = torch.compile(model, backend="eager", dynamic=True)
    counters.clear()
    frames, seen, m = [], list(rows), mask
    for j in range(steps):
        tok, m = torch.tensor([[13 + j], [23 + j]]), torch.cat([m, torch.ones(2, 1, dtype=m.dtype)], 1)
        out = compiled(input_ids=tok, attention_mask=m, use_cache=True, **{name: cache})
        cache = output_cache(out) or cache
        frames.append(counters["stats"]["unique_graphs"])
        seen = [torch.cat([s, t]) for s, t in zip(seen, tok)]
        for i, s in enumerate(seen if ref is not None else ()):
            assert (out.logits[i, -1].float() - logits_alone(ref, s)[-1]).abs().max().item() < 1e-4, (j, i)
    return frames


@torch.no_grad()
def test_dynamic_compiled_decode_on_a_relaid_cache_recompiles_no_more_than_stock():
    """``torch.compile(model, dynamic=True)`` decode steps after a right-padded prefill (a re-laid cache): every
    frame compiles in the first step and none after it, as stock's on an unpadded cache (the wrapped model's frame
    count is higher by the hook frames dynamo compiles apart from the forward: ``torch.compile(model)`` runs
    ``Module.__call__`` itself uncompiled). Before, the step's re-lay indexed the mask at ``past_len`` (a symbolic
    size), which specialised the mask's length: one recompile per step (frames 3, 4, 5, 6)."""
    stock, wrapped = _models("nemotron_h")
    want = _dynamic_decode_frames(stock, None, prompts((6, 6), seed=5), "right")
    dynamo.reset()
    got = _dynamic_decode_frames(wrapped, stock, prompts((6, 3), seed=5), "right")
    assert got[-1] - got[0] <= want[-1] - want[0] == 0, (got, want)


@torch.no_grad()
def test_compiled_generate_traces_the_hooks_into_the_forward_frame():
    """``generate(compile_config=...)`` compiles as many frames as stock's (1): the wrapped ``get_compiled_call``
    compiles the model call from a frame dynamo traces, so the hooks join the forward's frame. transformers' own
    compiles ``model.__call__``, whose hooks dynamo compiled as frames of their own (2 frames before), the
    pre-hook's guarded on the mask's length (a recompile more than stock per new prompt length).
    The tokens equal each row alone."""
    from torch._dynamo.utils import counters

    stock, wrapped = _models("nemotron_h")
    rows = prompts((6, 4), seed=7)
    ids, mask = pad(rows, "left")  # (stock's own tokens are right on left pads)
    frames = []
    for model in (stock, wrapped):
        dynamo.reset()
        counters.clear()
        got = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, cache_implementation="static",
                             compile_config=_compile_config(), **gen_kwargs(2))  # fmt: skip
        frames.append(counters["stats"]["unique_graphs"])
        for i, r in enumerate(rows):
            want, _ = greedy_alone(stock, r, 2)
            assert torch.equal(got[i, ids.shape[1] :], want), (i, got[i].tolist(), want.tolist())
    assert frames[1] <= frames[0], f"wrapped compiled {frames[1]} frames, stock {frames[0]}"
