"""Holes (a pad between real tokens) in the mask of a call without a cache, on every hybrid family.

The reference is each row alone through the stock model *without its masked tokens*: no padding, no cache,
positions ``0 .. n - 1``. The stock model (and safepad before) ran such a row in the caller's layout, so its
attention counted the holes: rotary positions derived from the row's columns when no ``position_ids`` are given
(Qwen3-Next, Bamba, ...), sliding windows counting columns instead of real tokens (LFM3, LaRA-mini,
recurrent_gemma, Inkling), and Inkling's slot-relative positions. Wrapped, the call is re-laid like a first cached
call (each row ``[pads | real tokens]``, positions from the mask) and the outputs come back in the caller's order.
"""

from __future__ import annotations

import copy

import pytest
import torch

from safepad.testing.tiny import EXTRA_FAMILIES, FAMILIES, NEW_FAMILIES, tiny_model
from safepad.wrap import wrap
from .helpers import family_param

pytestmark = pytest.mark.usefixtures("quiet_transformers")

TOL = 1e-4
#: families whose tiny model has no attention layer (a hole changes nothing there but the recurrence)
_RECURRENT_ONLY = ("mamba", "mamba2", "falcon_mamba")
#: windows shorter than the rows (the tiny defaults are longer than every row)
_WINDOWS = {
    "lfm3": {"sliding_window": 6},
    "lara_mini": {"sliding_window": 6},
    "recurrent_gemma": {"attention_window_size": 8},
    "inkling_text": {"sliding_window_size": 8},
    "inkling2_text": {"sliding_window_size": 8},
    "inkling2_loop_text": {"sliding_window_size": 8},
}
CASES = [
    pytest.param((p.values[0], True), id=p.id, marks=p.marks)
    for f in FAMILIES + EXTRA_FAMILIES + NEW_FAMILIES if f not in _RECURRENT_ONLY for p in [family_param(f)]
] + [pytest.param(("inkling_text", False), id="inkling_text-no-window")]


def _build(family: str, window: bool):
    model = tiny_model(family, **(_WINDOWS.get(family, {}) if window else {}))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__.endswith("RelativeLogits"):  # Inkling: slot distances matter
                m.proj.copy_(torch.randn(m.proj.shape, generator=g) * 1.5)
    return model


@pytest.fixture(scope="module", params=CASES)
def models(request):
    family, window = request.param
    stock = _build(family, window=window)
    return family, stock, wrap(copy.deepcopy(stock), backend="torch")


def _batch(T: int = 14, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 250, (2, T), generator=g)
    mask = torch.ones(2, T, dtype=torch.long)
    mask[0, [2, 5, 6, 9]] = 0  # holes
    mask[1, [0, 3, 4, 5, 11]] = 0  # a left pad, then holes
    return ids, mask


@torch.no_grad()
def _alone(stock, ids: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """Per row, ``[n, V]`` logits of its real tokens run alone (masked tokens dropped)."""
    return [stock(input_ids=ids[b][mask[b].bool()][None], use_cache=False).logits[0] for b in range(ids.shape[0])]


def test_holes_without_cache_equal_each_row_alone(models):
    """No ``position_ids``, no cache: every real token's logits equal its row alone without the masked tokens."""
    family, stock, wrapped = models
    ids, mask = _batch()
    with torch.no_grad():
        out = wrapped(input_ids=ids, attention_mask=mask, use_cache=False).logits
    for b, ref in enumerate(_alone(stock, ids, mask)):
        got = out[b][mask[b].bool()]
        err = (got - ref).abs().max().item() / ref.abs().max().item()
        assert err < TOL, f"{family} row {b}: max |Δ| / max |ref| = {err:.2e}"


@pytest.mark.parametrize("family", [family_param(f) for f in ("qwen3_next", "olmo_hybrid", "lfm3")])
def test_loss_with_holes_in_a_training_step(family):
    """A training step with labels and holes: the loss is the caller's labels over the row-alone logits, and its
    gradients flow (the loss is taken over the logits put back in the caller's order)."""
    stock = _build(family, window=True)
    wrapped = wrap(copy.deepcopy(stock), backend="torch").train()
    ids, mask = _batch(T=12)
    # a pad's logits predict the next label: ignore the labels right after a pad too (the row alone has no pad)
    after_pad = torch.cat([torch.zeros_like(mask[:, :1]), 1 - mask[:, :-1]], 1).bool()
    labels = ids.masked_fill((mask == 0) | after_pad, -100)
    out = wrapped(input_ids=ids, attention_mask=mask, labels=labels)
    ref_logits = torch.zeros(*ids.shape, stock.config.get_text_config().vocab_size)
    for b, ref in enumerate(_alone(stock, ids, mask)):
        ref_logits[b, mask[b].bool()] = ref
    ref_loss = stock.loss_function(logits=ref_logits, labels=labels, vocab_size=ref_logits.shape[-1])
    assert abs(out.loss.item() - ref_loss.item()) < 1e-5 * max(1.0, ref_loss.item())
    out.loss.backward()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in wrapped.parameters())


@pytest.mark.parametrize("family", [family_param(f) for f in ("qwen3_next", "lfm3")])
@torch.no_grad()
def test_holes_with_logits_to_keep_and_position_ids(family):
    """``logits_to_keep`` keeps the caller's last columns; given ``position_ids`` travel with their tokens."""
    stock = _build(family, window=True)
    wrapped = wrap(copy.deepcopy(stock), backend="torch")
    ids, mask = _batch()
    full = wrapped(input_ids=ids, attention_mask=mask, use_cache=False).logits
    kept = wrapped(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=3).logits
    assert kept.shape[1] == 3 and torch.allclose(kept, full[:, -3:], atol=1e-6)
    positions = (mask.cumsum(1) - 1).clamp(min=0)  # the row alone's positions at its real tokens
    given = wrapped(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    for b, ref in enumerate(_alone(stock, ids, mask)):
        got = given[b][mask[b].bool()]
        assert (got - ref).abs().max().item() / ref.abs().max().item() < TOL
