"""Inkling families with a cache and padding after real tokens: the slot-justified layout (``safepad.layout.slots``).

Inkling's attention measures relative positions (and its sliding window) in cache slots, so a right-padded
prefill, a hole or trailing pads inside a continuation chunk, or a padded decode step leave every later token's
distances wrong in the stock model, and the stock sliding cache may keep pads instead of real keys. The wrapped
model keeps each row's real tokens contiguous at the end of the cache; every token must then match its sequence
run alone (no padding, no cache) through the stock model. The tiny models here use a sliding window (6) shorter
than the rows and a stronger relative-position bias than the audit's, so slot errors cannot hide.
"""

from __future__ import annotations

import copy

import pytest
import torch

from safepad.cache import cache_argument
from safepad.testing.tiny import family_available, tiny_model
from safepad.wrap import wrap
from .helpers import family_param

FAMILIES = ("inkling_text", "inkling2_text", "inkling2_loop_text")
TOL = 1e-4
WINDOW = 6


_param = family_param


pytestmark = pytest.mark.usefixtures("quiet_transformers")


def _build(family: str, **overrides):
    model = tiny_model(family, sliding_window_size=WINDOW, rel_extent=12, **overrides)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__.endswith("RelativeLogits"):
                m.proj.copy_(torch.randn(m.proj.shape, generator=g) * 1.5)  # distances matter
    return model


@pytest.fixture(scope="module", params=[_param(f) for f in FAMILIES])
def models(request):
    """(family, stock, wrapped copy)."""
    stock = _build(request.param)
    return request.param, stock, wrap(copy.deepcopy(stock), backend="torch")


def _cache_name(model) -> str:
    return cache_argument(model)


def _cache_of(out):
    return getattr(out, "cache", None) if getattr(out, "cache", None) is not None else out.past_key_values


def _alone(stock, seq: torch.Tensor) -> torch.Tensor:
    """``[L, V]`` logits of ``seq`` ``[L]`` run alone: no padding, no cache."""
    return stock(input_ids=seq[None], use_cache=False).logits[0]


def _positions(mask: torch.Tensor, T: int) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)[:, -T:]  # generate()'s convention


def _run_chunks(model, ids, mask, bounds, steps_ids=None, steps_mask=None):
    """Feed ``ids`` ``[B, N]`` through the cache in chunks ``bounds``, then one-token steps; full-length masks.

    Returns (``[B, N, V]`` chunk logits, list of ``[B, V]`` step logits, cache)."""
    cache, outs, steps = None, [], []
    name = _cache_name(model)
    for a, b in zip(bounds[:-1], bounds[1:]):
        kw = {name: cache} if cache is not None else {}
        out = model(input_ids=ids[:, a:b], attention_mask=mask[:, :b], position_ids=_positions(mask[:, :b], b - a),
                    use_cache=True, **kw)
        cache = _cache_of(out)
        outs.append(out.logits)
    full = mask
    for k in range(0 if steps_ids is None else steps_ids.shape[1]):
        full = torch.cat([full, steps_mask[:, k : k + 1]], dim=1)
        out = model(input_ids=steps_ids[:, k : k + 1], attention_mask=full, position_ids=_positions(full, 1),
                    use_cache=True, **{name: cache})
        cache = _cache_of(out)
        steps.append(out.logits[:, -1])
    return torch.cat(outs, dim=1), steps, cache


def _errors(stock, ids, mask, logits, steps_ids, steps_mask, steps):
    """Max |Δ| of every real token's logits vs its sequence alone (chunks, then steps whose token is real)."""
    err = 0.0
    for b in range(ids.shape[0]):
        real = mask[b].bool()
        seq = ids[b, real]
        if seq.numel():
            err = max(err, (logits[b, real] - _alone(stock, seq)).abs().max().item())
        for k, lg in enumerate(steps):
            if steps_mask[b, k]:
                seq = torch.cat([seq, steps_ids[b, k : k + 1]])
                err = max(err, (lg[b] - _alone(stock, seq)[-1]).abs().max().item())
    return err


def _batch(lengths, width, seed, left=False):
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for b, n in enumerate(lengths):
        sl = slice(width - n, width) if left else slice(0, n)
        ids[b, sl] = torch.randint(3, 250, (n,), generator=g)
        mask[b, sl] = 1
    return ids, mask, g


@torch.no_grad()
@pytest.mark.parametrize("lengths", [(3, 13, 8, 1), (WINDOW - 1, WINDOW + 1, 2 * WINDOW)], ids=["mixed", "window"])
def test_right_padded_prefill_then_decode_equals_alone(models, lengths):
    family, stock, wrapped = models
    width = max(lengths)
    ids, mask, g = _batch(lengths, width, seed=len(lengths))
    steps_ids = torch.randint(3, 250, (len(lengths), 4), generator=g)
    steps_mask = torch.ones_like(steps_ids)
    logits, steps, cache = _run_chunks(wrapped, ids, mask, [0, width], steps_ids, steps_mask)
    assert "update" not in vars(cache), "the per-call cache.update must be removed after the call"
    err = _errors(stock, ids, mask, logits, steps_ids, steps_mask, steps)
    assert err < TOL, (family, err)
    s_logits, s_steps, _ = _run_chunks(stock, ids, mask, [0, width], steps_ids, steps_mask)
    stock_err = _errors(stock, ids, mask, s_logits, steps_ids, steps_mask, s_steps)
    assert stock_err > 1e-2, (family, stock_err)  # the stock model is wrong on this layout


@torch.no_grad()
def test_pads_inside_chunks_and_padded_steps_equal_alone(models):
    """Trailing pads and holes inside continuation chunks, an all-pad chunk, left pads, and a padded decode step."""
    family, stock, wrapped = models
    ids, mask, g = _batch((20, 20, 20), 20, seed=3)
    mask[1, [2, 3, 8, 9, 10]] = 0  # trailing pads of chunk 0, a hole in chunk 1
    mask[1, 16:20] = 0  # the last chunk is all pads in row 1
    mask[2, :6] = 0  # left pads over the first chunk and into the second
    ids = ids * mask
    steps_ids = torch.randint(3, 250, (3, 3), generator=g)
    steps_mask = torch.ones_like(steps_ids)
    steps_mask[1, 0] = 0  # row 1's first step is padding
    steps_mask[0, 2] = 0
    bounds = [0, 4, 11, 16, 20]
    logits, steps, _ = _run_chunks(wrapped, ids, mask, bounds, steps_ids, steps_mask)
    err = _errors(stock, ids, mask, logits, steps_ids, steps_mask, steps)
    assert err < TOL, (family, err)
    s_logits, s_steps, _ = _run_chunks(stock, ids, mask, bounds, steps_ids, steps_mask)
    assert _errors(stock, ids, mask, s_logits, steps_ids, steps_mask, s_steps) > 1e-2


@torch.no_grad()
def test_left_padded_decode_is_untouched_and_right(models):
    """A left-padded prompt is already justified: no re-layout, and the result is the per-sequence one."""
    family, stock, wrapped = models
    ids, mask, g = _batch((4, 9), 9, seed=5, left=True)
    steps_ids = torch.randint(3, 250, (2, 2), generator=g)
    logits, steps, _ = _run_chunks(wrapped, ids, mask, [0, 9], steps_ids, torch.ones_like(steps_ids))
    assert _errors(stock, ids, mask, logits, steps_ids, torch.ones_like(steps_ids), steps) < TOL


@torch.no_grad()
def test_outputs_come_back_in_the_callers_order(models):
    """hidden states and logits_to_keep of a re-laid call match the same call without a cache (no re-layout)."""
    family, _, wrapped = models
    ids, mask, _ = _batch((2, 7, 5), 7, seed=9)
    plain = wrapped(input_ids=ids, attention_mask=mask, use_cache=False, output_hidden_states=True)
    cached = wrapped(input_ids=ids, attention_mask=mask, use_cache=True, output_hidden_states=True)
    real = mask.bool()
    assert (cached.logits[real] - plain.logits[real]).abs().max() < TOL
    for h_c, h_p in zip(cached.hidden_states, plain.hidden_states):
        assert (h_c[real] - h_p[real]).abs().max() < TOL
    kept = wrapped(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=2).logits
    assert kept.shape[1] == 2 and torch.allclose(kept, cached.logits[:, -2:], atol=TOL)


@torch.no_grad()
def test_loss_with_labels(models):
    """Labels with the config-default cache, or with an explicit cache: the loss of the no-cache call (the explicit
    cache's call re-lays the rows for the cache and scores the caller's rows)."""
    family, _, wrapped = models
    ids, mask, _ = _batch((3, 8), 8, seed=11)
    labels = ids.masked_fill(mask == 0, -100)
    want = wrapped(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    got = wrapped(input_ids=ids, attention_mask=mask, labels=labels)
    assert torch.allclose(got.loss, want, atol=1e-6)
    cached = wrapped(input_ids=ids, attention_mask=mask, labels=labels, use_cache=True)
    assert torch.allclose(cached.loss, want, atol=1e-6)


@torch.no_grad()
def test_a_padded_cache_needs_the_full_mask(models):
    family, _, wrapped = models
    ids, mask, _ = _batch((3, 8), 8, seed=13)
    cache = _cache_of(wrapped(input_ids=ids, attention_mask=mask, use_cache=True))
    step = torch.randint(3, 250, (2, 1))
    with pytest.raises(ValueError, match="without an attention_mask"):
        wrapped(input_ids=step, use_cache=True, **{_cache_name(wrapped): cache})
    with pytest.raises(ValueError, match="full-length mask"):
        wrapped(input_ids=step, attention_mask=torch.ones(2, 1, dtype=torch.long), use_cache=True,
                **{_cache_name(wrapped): cache})


@torch.no_grad()
def test_a_pad_decode_step_on_an_unpadded_cache_needs_the_full_mask_after(models):
    """A decode step's pad is re-laid on the device (the host never reads it): the cache keeps its per-row pad
    counts, so a later call without an attention_mask still raises, and one with the mask equals each row alone."""
    family, stock, wrapped = models
    ids, mask, g = _batch((8, 8), 8, seed=17)  # no padding: a cache in the caller's layout
    name = _cache_name(wrapped)
    cache = _cache_of(wrapped(input_ids=ids, attention_mask=mask, use_cache=True))
    steps = torch.randint(3, 250, (2, 2), generator=g)
    m = torch.cat([mask, torch.tensor([[1], [0]])], 1)  # row 1's step token is a pad
    wrapped(input_ids=steps[:, :1], attention_mask=m, use_cache=True, **{name: cache})
    with pytest.raises(ValueError, match="without an attention_mask"):
        wrapped(input_ids=steps[:, 1:], use_cache=True, **{name: copy.deepcopy(cache)})
    m = torch.cat([m, torch.ones(2, 1, dtype=m.dtype)], 1)
    out = wrapped(input_ids=steps[:, 1:], attention_mask=m, use_cache=True, **{name: cache}).logits[:, -1]
    for b, row in enumerate((torch.cat([ids[0], steps[0]]), torch.cat([ids[1], steps[1, 1:]]))):
        ref = stock(input_ids=row[None], use_cache=False).logits[0, -1]
        torch.testing.assert_close(out[b], ref, atol=TOL, rtol=TOL)


@torch.no_grad()
def test_inkling_log_scaling_exact_below_the_floor_and_raises_past_it():
    """Inkling scales queries by their cache slot (``tau(slot + 1)``): exact while padded rows stay within the
    floor, a clear error once a real token after pads sits past it (the stock left-padded result is wrong there)."""
    ok, why = family_available("inkling_text")
    if not ok:
        pytest.skip(why)
    stock = _build("inkling_text", log_scaling_n_floor=4, log_scaling_alpha=8.0)
    wrapped = wrap(copy.deepcopy(stock), backend="torch")
    # unpadded rows past the floor: slots are positions, exact
    ids, mask, _ = _batch((9, 9), 9, seed=1)
    logits, _, _ = _run_chunks(wrapped, ids, mask, [0, 9])
    assert _errors(stock, ids, mask, logits, None, None, []) < TOL
    # padded rows within the floor: exact
    ids, mask, g = _batch((2, 4), 4, seed=2)
    logits, _, _ = _run_chunks(wrapped, ids, mask, [0, 4])
    assert _errors(stock, ids, mask, logits, None, None, []) < TOL
    # padded rows past the floor: stock left padding is wrong, safepad raises
    ids, mask, g = _batch((3, 9), 9, seed=3, left=True)
    s_logits, _, _ = _run_chunks(stock, ids, mask, [0, 9])
    assert _errors(stock, ids, mask, s_logits, None, None, []) > 1e-3
    with pytest.raises(ValueError, match="log_scaling_n_floor"):
        _run_chunks(wrapped, ids, mask, [0, 9])
