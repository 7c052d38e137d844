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
from safepad.testing import run_scenario, tiny_model

#: one family per mixer kind
KINDS = {"mamba2": "nemotron_h", "mamba1": "mamba", "gated_delta": "qwen3_next", "short_conv": "lfm2"}
LENGTHS = (5, 1, 13, 9)  # a length-1 sequence, one shorter than the conv width, one across the chunk (16) edge
TOL = 1e-5
#: inductor's graph pipeline without its code generation (see test_inductor_training_step_equals_eager)
BACKEND = "aot_eager_decomp_partition"


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


#: every kind packed via position_ids and padded; the other boundary encodings (one shared pre-hook) on mamba2
BREAK_CASES = [(k, lay) for k in KINDS for lay in ("position_ids", "padded")] + [
    ("mamba2", "seq_idx"), ("mamba2", "cu_seq_lens")
]


@pytest.mark.parametrize(("kind", "layout"), BREAK_CASES, ids=[f"{k}-{lay}" for k, lay in BREAK_CASES])
def test_training_forward_has_no_graph_break(kind: str, layout: str):
    family = KINDS[kind]
    model = _model(family)
    kw = _padded_batch() if layout == "padded" else _packed_batch(layout)
    kw = _accepts(model, kw)
    if layout == "position_ids":  # stock takes this layout (it gets packing wrong) with no break, padded too
        ex_stock = _explain(_model(family, wrapped=False), kw)
        assert ex_stock.graph_break_count == 0, [r.reason for r in ex_stock.break_reasons]
    ex = _explain(model, kw)
    assert ex.graph_break_count == 0, [r.reason for r in ex.break_reasons]
    assert ex.graph_count == 1


# ------------------------------------------------------------------------------------------------------------
# compiled training step == eager training step (inductor, forward + backward)
# ------------------------------------------------------------------------------------------------------------


def _compare_steps(family: str, batches: list[dict], backend: str) -> None:
    eager = _model(family)
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, backend=backend)
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


@pytest.mark.parametrize("kind", list(KINDS))
def test_compiled_training_step_equals_eager(kind: str):
    """Packed (cu_seq_lens + position_ids), then left-padded (a recompile): dynamo, AOT autograd's joint graph
    through the custom ops, inductor's decompositions and partitioner, run without inductor's C++ build (minutes
    per model on these machines; ``aot_eager`` itself fails on the stock Qwen3-Next backward with a padded batch)."""
    batches = [_packed_batch("cu_seq_lens", seed=1), _padded_batch(seed=2, left=True)]
    _compare_steps(KINDS[kind], batches, BACKEND)


@pytest.mark.slow
def test_inductor_training_step_equals_eager():
    """The default backend (inductor) on the family whose compile crashed in inductor before the custom ops."""
    _compare_steps("nemotron_h", [_packed_batch("position_ids", seed=1)], "inductor")


@pytest.mark.parametrize("kind", list(KINDS))
def test_compiled_cached_inference_equals_sequences_alone(kind: str):
    """``model.forward = torch.compile(model.forward)`` (the usual way to compile generate): right-padded prefill
    then decode, and greedy generate on a left-padded batch, each against every sequence run alone (stock)."""
    family = KINDS[kind]
    stock = _model(family, wrapped=False).eval()
    model = safepad.wrap(copy.deepcopy(stock))
    model.forward = torch.compile(model.forward, backend=BACKEND)
    for name in ("right_pad_decode", "generate"):
        res = run_scenario(model, stock, name)
        assert res.error is None, res.error
        assert res.passed, (name, res.max_abs_logits, res.mismatched_tokens)


def _cached_calls(model, family: str) -> tuple[dict, dict]:
    """A right-padded prefill with a cache and the one-token step after it (kwargs of each call)."""
    import inspect

    from safepad.cache import cache_argument, output_cache

    ids = torch.randint(3, 250, (2, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
    step = {"input_ids": ids[:, :1], "use_cache": True, cache_argument(model): output_cache(out)}
    step["attention_mask"] = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
    if "cache_position" in inspect.signature(type(model).forward).parameters:
        step["cache_position"] = torch.tensor([9])
    return {"input_ids": ids, "attention_mask": mask, "use_cache": True}, step


@pytest.mark.parametrize("kind", list(KINDS))
def test_cached_inference_graph_breaks_only_where_stock_breaks(kind: str):
    family = KINDS[kind]
    counts = {}
    for wrapped in (False, True):
        model = _model(family, wrapped=wrapped).eval()
        prefill, step = _cached_calls(model, family)

        def fwd(**kw):
            return model(**kw).logits

        with torch.no_grad():
            counts[wrapped] = [dynamo.explain(fwd)(**kw).graph_break_count for kw in (prefill, step)]
        dynamo.reset()
    assert all(w <= st for w, st in zip(counts[True], counts[False], strict=True)), counts


# ------------------------------------------------------------------------------------------------------------
# checks stay on under compile (device-side, the eager message)
# ------------------------------------------------------------------------------------------------------------


def _bad_inputs(case: str) -> tuple[dict, str]:
    kw = _packed_batch("seq_idx")
    T = kw["input_ids"].shape[1]
    if case == "seq_idx_decreasing":
        kw["seq_idx"] = kw["seq_idx"].flip(1).contiguous()
        return kw, "seq_idx decreases inside"
    if case == "cu_seq_lens_short":
        cu = torch.tensor([0, 5, T - 1], dtype=torch.int32)
        kw.pop("seq_idx")
        kw.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu)
        return kw, "cu_seq_lens_q (ends at .* but the packed input has|does not end at the) 28 tokens"
    if case == "position_ids_disagree":
        kw["position_ids"] = torch.arange(T)[None].remainder(7)
        return kw, "position_ids disagree with seq_idx"
    if case == "packed_with_cache":
        kw.pop("labels")
        kw.pop("seq_idx")
        kw["use_cache"] = True
        return kw, "cannot be used with a cache"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["seq_idx_decreasing", "cu_seq_lens_short", "position_ids_disagree", "packed_with_cache"])
def test_invalid_boundaries_raise_under_compile(case: str):
    model = _model("nemotron_h").eval()
    kw, message = _bad_inputs(case)
    kw.setdefault("use_cache", False)
    with pytest.raises(ValueError, match=message):
        with torch.no_grad():
            model(**kw)  # eager: the ValueError
    compiled = torch.compile(model, backend="eager", fullgraph=True)  # fullgraph: no graph break hides a check
    with pytest.raises(RuntimeError, match=message):
        with torch.no_grad():
            compiled(**kw)
