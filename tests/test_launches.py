"""Kernel launches: a wrapped cached decode step dispatches at most 1.1x the aten ops of the stock model's same
step (issue 38's target), after a right- or a left-padded prefill, for every mixer kind, in a hand-written decode
loop and inside ``generate``; where the target is not met yet, at most the ratio measured now (a ceiling). Counted
on CPU by ``safepad.testing.launches`` (a TorchDispatchMode): each aten op a step dispatches approximates a CUDA
launch."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import safepad
from safepad.testing import tiny_model
from safepad.testing.launches import OpCounter, count_ops, decode_step_ops, generate_step_ops
from safepad.testing.syncs import KIND_FAMILIES

#: the target of issue 38: aten ops of a wrapped decode step over the stock model's same step
TARGET = 1.1

#: the other Mamba2 and Mamba1 families of issue 38, next to the one family per kind of
#: :data:`~safepad.testing.syncs.KIND_FAMILIES`: test id -> family
OTHER_FAMILIES: dict[str, str] = {"mamba2_bamba": "bamba", "mamba1_falcon": "falcon_mamba", "mamba1_jamba": "jamba"}


def _kind_id(kind: str) -> str:
    """The test id of a ``KIND_FAMILIES`` key, as tests/test_syncs.py writes it: ``"mamba2 (hybrid)"`` ->
    ``"mamba2_hybrid"``."""
    return kind.replace(" ", "_").replace("(", "").replace(")", "")


#: one tiny family per mixer kind (``MixerSpec.kind``; the one list of ``safepad.testing.syncs``), with the Mamba2 and
#: Mamba1 families of issue 38: test id -> family
KINDS: dict[str, str] = {_kind_id(kind): family for kind, family in KIND_FAMILIES.items()} | OTHER_FAMILIES

#: (family, dtype, padding side) whose wrapped hand-written decode step is still over :data:`TARGET`: the ratio
#: measured on this tree (transformers 5.25, torch 2.13), which the step may not exceed by more than :data:`SLACK`
#: (a regression fails; a case that meets the target asserts the target once removed from here). The excess: the
#: step on a cache a right-padded prefill re-laid (and every step of slot-counting attention: recurrent_gemma,
#: inkling) re-lays each attention layer's cached keys on the device (``layout.slots.justify_kv``: whether a row's
#: step token is a pad is unknown on the host), and the hook's device checks of a hand-written step's mask
#: (docs/limits.md D1, D9) and the mixers' hold of pad rows cost ops a 2-layer tiny model does not amortise.
OVER_TARGET: dict[tuple[str, str, str], float] = {
    ("nemotron_h", "float32", "right"): 1.200,
    ("nemotron_h", "bfloat16", "right"): 1.234,
    ("bamba", "float32", "right"): 1.155,
    ("bamba", "bfloat16", "right"): 1.185,
    ("jamba", "float32", "right"): 1.236,
    ("jamba", "bfloat16", "right"): 1.253,
    ("qwen3_next", "float32", "right"): 1.235,
    ("qwen3_next", "float32", "left"): 1.122,
    ("qwen3_next", "bfloat16", "right"): 1.227,
    ("qwen3_next", "bfloat16", "left"): 1.125,
    ("kimi_linear", "float32", "right"): 1.274,
    ("kimi_linear", "float32", "left"): 1.145,
    ("kimi_linear", "bfloat16", "right"): 1.255,
    ("kimi_linear", "bfloat16", "left"): 1.138,
    ("lfm2", "float32", "right"): 1.335,
    ("lfm2", "float32", "left"): 1.114,
    ("lfm2", "bfloat16", "right"): 1.345,
    ("lfm2", "bfloat16", "left"): 1.143,
    ("recurrent_gemma", "float32", "right"): 1.378,
    ("recurrent_gemma", "float32", "left"): 1.378,
    ("recurrent_gemma", "bfloat16", "right"): 1.407,
    ("recurrent_gemma", "bfloat16", "left"): 1.407,
    ("zaya", "float32", "right"): 1.293,
    ("zaya", "float32", "left"): 1.160,
    ("zaya", "bfloat16", "right"): 1.294,
    ("zaya", "bfloat16", "left"): 1.169,
    ("inkling_text", "float32", "right"): 1.360,
    ("inkling_text", "float32", "left"): 1.360,
    ("qwen4_exp_text", "float32", "right"): 1.160,
    ("qwen4_exp_text", "bfloat16", "right"): 1.159,
    ("glm5_next", "float32", "right"): 1.105,
    ("glm5_next", "bfloat16", "right"): 1.102,
}
#: the same for a decode step inside the wrapped ``generate``, whose own next token is real in every row (a host
#: fact: no hold of pad rows, no key re-lay, no mask check); over the target where the family's own step costs more
#: (the conv / delta-rule / CCA mixers' dtype round trips, the sliding-window re-lay of slot-counting attention)
GENERATE_OVER_TARGET: dict[tuple[str, str, str], float] = {
    ("qwen3_next", "float32", "right"): 1.109,
    ("qwen3_next", "bfloat16", "right"): 1.113,
    ("kimi_linear", "float32", "right"): 1.128,
    ("kimi_linear", "bfloat16", "right"): 1.123,
    ("lfm2", "float32", "right"): 1.152,
    ("lfm2", "bfloat16", "right"): 1.176,
    ("recurrent_gemma", "float32", "right"): 1.203,
    ("recurrent_gemma", "float32", "left"): 1.203,
    ("recurrent_gemma", "bfloat16", "right"): 1.245,
    ("recurrent_gemma", "bfloat16", "left"): 1.245,
    ("zaya", "float32", "right"): 1.163,
    ("zaya", "float32", "left"): 1.105,
    ("zaya", "bfloat16", "right"): 1.171,
    ("zaya", "bfloat16", "left"): 1.117,
    ("inkling_text", "float32", "right"): 1.158,
    ("inkling_text", "float32", "left"): 1.158,
}
#: op counts differ a little between transformers releases (stock's own ops): the ceilings' margin
SLACK = 0.02


#: the ratios and ceilings are measured against transformers 5.25's stock steps; older releases' stock dispatches
#: fewer ops of its own (Nemotron-H fp32 after right pads: 250 on 5.23, 260 on 5.25, wrapped 310 / 312), which moves
#: every ratio without a change on safepad's side: the tier of the newest release checks them
_STOCK_OPS_AS_MEASURED = tuple(int(v) for v in transformers.__version__.split(".")[:2]) >= (5, 25)


def _cases():
    for kind, family in KINDS.items():
        for dtype in ("float32", "bfloat16"):
            for side in ("right", "left"):
                marks = [] if _STOCK_OPS_AS_MEASURED else [
                    pytest.mark.skip(reason="ratios measured against transformers 5.25's stock op counts")]
                if family == "inkling_text" and dtype == "bfloat16":
                    marks.append(pytest.mark.skip(reason="bf16 Inkling's wrapped decode step raises in sdpa (noted)"))
                yield pytest.param(family, dtype, side, id=f"{kind}-{dtype}-{side}", marks=marks)


def _check(ratio: float, ceiling: float | None, stock, wrapped) -> None:
    """``ratio`` (wrapped's ops over stock's) within :data:`TARGET`, or within a recorded ``ceiling`` plus
    :data:`SLACK`."""
    extra = wrapped.ops.copy()
    extra.subtract(stock.ops)
    limit = TARGET if ceiling is None else ceiling + SLACK
    assert ratio <= limit, (round(ratio, 3), limit, wrapped.count, stock.count, {k: v for k, v in extra.items() if v})


# ---------------------------------------------------------------------------------------------------------------
# the counter itself
# ---------------------------------------------------------------------------------------------------------------


def test_counts_each_dispatched_op():
    x = torch.randn(4, 3)
    _, n, ops = count_ops(lambda: (x + 1).sum())
    assert n == 2 and ops["aten.add"] == 1 and ops["aten.sum"] == 1, ops


def test_views_count_but_do_not_launch():
    x = torch.randn(4, 3)
    out = count_ops(lambda: x.t().unsqueeze(0).mul(2))
    assert out.count == 3 and out.launches == 1, out.ops


def test_counts_backward_ops_and_where():
    x = torch.randn(3, requires_grad=True)
    with OpCounter(where=True) as c:
        (x * 2).sum().backward()
    assert c.ops["aten.mul"] >= 2 and c.count >= 4, c.ops  # forward mul, sum; backward expand, mul
    assert all(site == "stock" for site, _ in c.where), c.where  # no safepad code ran


def test_decode_step_ops_counts_the_step_alone():
    """Stock against itself: the same step, the same ops (the cache copy and the warm-up are outside the count)."""
    model = tiny_model("mamba2")
    a, b = decode_step_ops(model, model, padding_side="left")
    assert a.count == b.count > 0 and a.ops == b.ops
    assert a.ops["aten.clone"] == b.ops["aten.clone"]


# ---------------------------------------------------------------------------------------------------------------
# the target, for every mixer kind
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family, dtype, side", list(_cases()))
def test_decode_step_ops_within_target_of_stock(family, dtype, side):
    """A decode step after a prefill of rows of 6, 5 and 4 real tokens padded on ``side``: the wrapped step's aten
    ops over stock's same step at most :data:`TARGET`, or at most the ceiling :data:`OVER_TARGET` records (that the
    step computes each row alone, as the stock model does, is tests/test_syncs.py's)."""
    stock = tiny_model(family, dtype=getattr(torch, dtype))
    wrapped = safepad.wrap(copy.deepcopy(stock))
    s, w = decode_step_ops(stock, wrapped, padding_side=side)
    _check(w.count / s.count, OVER_TARGET.get((family, dtype, side)), s, w)


@pytest.mark.parametrize("family, dtype, side", list(_cases()))
def test_generate_step_ops_within_target_of_stock(family, dtype, side):
    """One decode step inside ``generate`` (greedy; 3 new tokens minus 2) on a prompt padded on ``side``: the wrapped
    model's aten ops over stock's at most :data:`TARGET`, or at most the ceiling :data:`GENERATE_OVER_TARGET`
    records (that wrapped ``generate`` gives each row's own tokens is tests/contract/test_generate.py's)."""
    stock = tiny_model(family, dtype=getattr(torch, dtype))
    s, w = generate_step_ops(stock, safepad.wrap(copy.deepcopy(stock)), padding_side=side)
    _check(w.count / s.count, GENERATE_OVER_TARGET.get((family, dtype, side)), s, w)
