"""torch.compile on wrapped models: graph breaks, compiled training step vs eager, cached inference, checks.

One family per mixer kind (mamba2: nemotron_h, mamba1: mamba, gated_delta: qwen3_next, short_conv: lfm2), tiny
shapes. Graph breaks are counted with ``torch._dynamo.explain`` (tracing only); the numeric tests compile with
inductor (forward + backward) and compare loss and every gradient with the eager wrapped model, which the
rest of the suite checks against each sequence run alone through the stock model.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo as dynamo

import safepad
from safepad.testing import tiny_model

#: one family per mixer kind
KINDS = {"mamba2": "nemotron_h", "mamba1": "mamba", "gated_delta": "qwen3_next", "short_conv": "lfm2"}
LENGTHS = (5, 1, 13, 9)  # a length-1 sequence, one shorter than the conv width, one across the chunk (16) edge
TOL = 1e-5


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    dynamo.reset()
    yield
    dynamo.reset()


def _model(family: str, wrapped: bool = True):
    torch.manual_seed(0)
    model = tiny_model(family)
    if wrapped:
        safepad.wrap(model)
    return model.train()


def _packed_batch(boundaries: str, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    T = sum(LENGTHS)
    ids = torch.randint(3, 250, (1, T), generator=g)
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]  # [1, T] restarting at 0
    labels = ids.clone()
    labels[0, torch.tensor(LENGTHS).cumsum(0)[:-1]] = -100  # no loss across a boundary (as the collator)
    kw = {"input_ids": ids, "labels": labels, "position_ids": pos}
    if boundaries == "seq_idx":
        kw["seq_idx"] = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(LENGTHS)])[None]
    elif boundaries == "cu_seq_lens":
        cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
        kw.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(LENGTHS), max_length_k=max(LENGTHS))
    return kw


def _padded_batch(seed: int = 0, left: bool = False) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 250, (3, 14), generator=g)
    mask = torch.ones(3, 14, dtype=torch.long)
    if left:
        mask[1, :5] = 0
        mask[2, :13] = 0
    else:
        mask[1, 9:] = 0
        mask[2, 1:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _accepts(model, kw: dict) -> dict:
    """Mamba-only models take no position_ids in their forward; keep the rest (boundaries travel via safepad)."""
    import inspect

    params = inspect.signature(type(model).forward).parameters
    if "position_ids" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kw = {k: v for k, v in kw.items() if k != "position_ids"}
    return kw


def _step(model, kw: dict) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = model(**kw, use_cache=False).loss
    loss.backward()
    grads = {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _explain(model, kw: dict):
    def fwd(**kw):
        return model(**kw, use_cache=False).loss

    return dynamo.explain(fwd)(**kw)


# ------------------------------------------------------------------------------------------------------------
# graph breaks
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("layout", ["position_ids", "seq_idx", "cu_seq_lens", "padded"])
def test_training_forward_has_no_graph_break(kind: str, layout: str):
    family = KINDS[kind]
    stock = _model(family, wrapped=False)
    model = _model(family)
    kw = _padded_batch() if layout == "padded" else _packed_batch(layout)
    kw = _accepts(model, kw)
    if layout in ("padded", "position_ids"):  # the stock model takes these layouts (it gets packing wrong)
        ex_stock = _explain(stock, kw)
        assert ex_stock.graph_break_count == 0, [r.reason for r in ex_stock.break_reasons]
    ex = _explain(model, kw)
    assert ex.graph_break_count == 0, [r.reason for r in ex.break_reasons]
    assert ex.graph_count == 1


# ------------------------------------------------------------------------------------------------------------
# compiled training step == eager training step (inductor, forward + backward)
# ------------------------------------------------------------------------------------------------------------


def _compare_steps(family: str, batches: list[dict]) -> None:
    eager = _model(family)
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model)
    for kw in batches:
        kw = _accepts(eager, kw)
        loss_e, grads_e = _step(eager, kw)
        loss_c, grads_c = _step(compiled, kw)
        assert torch.isfinite(loss_e)
        assert abs(loss_c.item() - loss_e.item()) <= TOL * max(1.0, abs(loss_e.item()))
        assert grads_c.keys() == grads_e.keys()
        for name, g in grads_e.items():
            err = (grads_c[name] - g).abs().max().item()
            assert err <= TOL * max(1.0, g.abs().max().item()), (name, err)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_compiled_training_step_equals_eager(kind: str):
    """Packed (cu_seq_lens + position_ids), then padded with holes on the left: the same compiled module."""
    _compare_steps(KINDS[kind], [_packed_batch("cu_seq_lens", seed=1), _padded_batch(seed=2, left=True)])
