"""Qwen4-Exp (PLE) under bf16 autocast: a packed forward + backward errs like stock's own autocast rounding.

An adversarial round reported, for a packed bf16-autocast training step of the tiny Qwen4-Exp, a global gradient
0.646 (relative) away from each sequence alone through stock under the same autocast, against a "noise" of 0.153
taken from stock on one sequence. Both sides of that comparison carry bf16 rounding. Measured against the float64
stock model (each sequence alone; two sequences of [15, 25] tokens, next-token cross-entropy; rms / max over the
38 per-token losses, global gradient relative error), seeds 0-3:

| seed | stock alone, autocast: rms / max / grad | wrapped packed, autocast | wrapped, leaking pack (no boundaries) |
|---|---|---|---|
| 0 | 2.1e-3 / 7.3e-3 / 1.26 | 3.1e-3 / 1.6e-2 / 1.12 | 7.3e-2 / 0.28 / 2.12 |
| 1 | 4.7e-3 / 2.6e-2 / 0.59 | 2.4e-3 / 1.1e-2 / 0.20 | 7.1e-2 / 0.20 / 0.93 |
| 2 | 5.1e-3 / 1.8e-2 / 0.51 | 8.8e-3 / 4.8e-2 / 0.83 | 5.9e-2 / 0.17 / 0.59 |
| 3 | 2.0e-3 / 7.3e-3 / 0.15 | 2.2e-3 / 7.2e-3 / 0.19 | 6.1e-2 / 0.16 / 2.93 |

The wrapped model errs within 1.75x (rms) and 1.63x (gradient) of stock, sometimes less; in float32 (no autocast)
both are at ~1e-5 gradient error. The gradient error is bf16 rounding of the PLE n-gram embedding's gradient, a sum
over hashed n-gram rows (seed 0: ``model.layers.0.ple.ple_embedding.ngram_embedding``, float64 norm 2.9, stock's
error 3.8, wrapped's 3.4), in stock as in the wrapped model. It is so large that the global gradient cannot tell a
leaking pack from rounding (seed 2 above); the per-token losses can. Packing itself adds nothing: the wrapped
packed step equals the wrapped model on each sequence alone (bitwise on seeds 0-1, within stock's noise on 2-3).
Rounding, not a defect; the tests pin it (seed 0, :data:`FACTOR` from the table).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F

import safepad
from safepad.testing.tiny import family_available, tiny_model

pytestmark = pytest.mark.skipif(not family_available("qwen4_exp_text")[0], reason="qwen4_exp needs transformers >= 5.23")

LENGTHS = (15, 25)
#: wrapped error / stock error allowed against float64 (measured at most 1.75 on seeds 0-3, table above)
FACTOR = 3.0


def _seqs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 250, (n,), generator=g) for n in LENGTHS]


def _token_losses(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy ``[n - 1]`` (float64) of one sequence's logits ``[n, V]`` and ids ``[n]``."""
    return F.cross_entropy(logits[:-1].double(), ids[1:], reduction="none")


def _step(model, seqs, packed: bool, autocast: bool, boundaries: bool = True):
    """Per-token losses ``[sum(n - 1)]`` and the flat gradient of their sum over every parameter (float64)."""
    losses = []
    if packed:
        ids = torch.cat(seqs)[None]  # [1, T]
        pos = torch.cat([torch.arange(len(s)) for s in seqs]) if boundaries else torch.arange(ids.shape[1])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=ids, position_ids=pos[None]).logits[0]  # [T, V]
        start = 0
        for s in seqs:
            losses.append(_token_losses(logits[start : start + len(s)], s))
            start += len(s)
        torch.cat(losses).sum().backward()
    else:
        for s in seqs:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits = model(input_ids=s[None]).logits[0]  # [n, V]
            losses.append(_token_losses(logits, s))
            losses[-1].sum().backward()
    grad = torch.cat([p.grad.flatten().double() for p in model.parameters() if p.grad is not None])
    model.zero_grad()
    return torch.cat(losses).detach(), grad


@pytest.fixture(scope="module")
def runs():
    log = logging.getLogger("transformers")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        stock = tiny_model("qwen4_exp_text").train()
        wrapped = safepad.wrap(copy.deepcopy(stock), backend="torch").train()
        ref = copy.deepcopy(stock).double()
        if callable(getattr(ref, "set_experts_implementation", None)):
            ref.set_experts_implementation("eager")  # grouped_mm has no float64
        seqs = _seqs()
        yield {
            "ref": _step(ref, seqs, packed=False, autocast=False),
            "stock": _step(stock, seqs, packed=False, autocast=True),
            "wrapped": _step(wrapped, seqs, packed=True, autocast=True),
            "wrapped_alone": _step(wrapped, seqs, packed=False, autocast=True),
            "leaky": _step(wrapped, seqs, packed=True, autocast=True, boundaries=False),
        }
    finally:
        log.setLevel(level)


def _errors(run, ref) -> tuple[float, float]:
    """(rms of the per-token loss errors, global gradient relative error) of ``run`` against ``ref``."""
    (losses, grad), (ref_losses, ref_grad) = run, ref
    return (losses - ref_losses).pow(2).mean().sqrt().item(), ((grad - ref_grad).norm() / ref_grad.norm()).item()


def test_packed_autocast_step_errs_like_stock_against_float64(runs):
    stock_loss, stock_grad = _errors(runs["stock"], runs["ref"])
    loss, grad = _errors(runs["wrapped"], runs["ref"])
    print(f"per-token loss rms err vs float64: stock {stock_loss:.3e} wrapped {loss:.3e}; "
          f"gradient rel err: stock {stock_grad:.3e} wrapped {grad:.3e}")  # fmt: skip
    assert loss <= FACTOR * stock_loss
    assert grad <= FACTOR * stock_grad


def test_packing_adds_nothing_to_the_wrapped_rounding(runs):
    """The wrapped packed step against the wrapped model on each sequence alone (same ops, same autocast): within
    stock's own autocast error against float64, on the per-token losses and on the gradient."""
    stock_loss, stock_grad = _errors(runs["stock"], runs["ref"])
    loss, grad = _errors(runs["wrapped"], runs["wrapped_alone"])
    assert loss <= stock_loss
    assert grad <= stock_grad


def test_negative_control_a_leaking_pack_is_outside_the_bounds(runs):
    """The same packed row without boundaries (the second sequence continues the first's state) is outside both
    bounds above on the per-token losses: they tell rounding from a layout error."""
    stock_loss, _ = _errors(runs["stock"], runs["ref"])
    assert _errors(runs["leaky"], runs["ref"])[0] > FACTOR * stock_loss
    assert _errors(runs["leaky"], runs["wrapped_alone"])[0] > stock_loss
