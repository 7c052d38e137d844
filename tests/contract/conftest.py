"""The contract tier: what transformers' common model / generation tests check, on stock and wrapped models.

Each property is a function ``prop(model, ref)`` that raises ``AssertionError`` when ``model`` breaks it;
``ref`` is a third, never-wrapped copy of the stock model, used only to compute the row-alone reference.
:func:`contract` runs it on the stock model and on the wrapped one:

* stock passes -> wrapped must pass;
* stock fails an assertion (it is wrong: e.g. a right-padded prefill with a cache) -> the property already
  compares with each row run alone, so wrapped must pass it (counted as a *stock-fail checked against the
  row-alone reference*);
* stock raises (the family does not offer the feature) -> wrapped may raise too, and must pass if it runs.

``pytest -rA`` style counts per family are printed at the end of a session that ran contract tests.
"""

from __future__ import annotations

import collections
import copy
import functools
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch

import safepad
from safepad.testing.tiny import MODEL_TYPE_FAMILIES, family_available, family_names, tiny_model

#: every supported tiny family (the model-type aliases build one of these)
CONTRACT_FAMILIES: tuple[str, ...] = tuple(f for f in family_names() if f not in MODEL_TYPE_FAMILIES)

#: (family, property) -> "pass" | "stock-wrong" | "stock-raises"
OUTCOMES: dict[tuple[str, str], str] = {}


def family_params(families=CONTRACT_FAMILIES):
    return [pytest.param(f, id=f) for f in families]


@functools.cache
def models(family: str) -> tuple[Any, Any, Any]:
    """(stock, wrapped, ref) tiny models of ``family`` with the same weights (built once per session)."""
    ok, why = family_available(family)
    if not ok:
        pytest.skip(why)
    stock = tiny_model(family)
    return stock, safepad.wrap(copy.deepcopy(stock)), copy.deepcopy(stock)


def _run(prop: Callable, model, ref) -> BaseException | None:
    try:
        with torch.random.fork_rng(devices=[]):
            prop(model, ref)
    except Exception as exc:  # noqa: BLE001 - the outcome is judged by contract()
        return exc
    return None


def contract(family: str, name: str, prop: Callable) -> None:
    """Run ``prop`` on the stock and the wrapped model of ``family``; fail as the module docstring says."""
    stock, wrapped, ref = models(family)
    s = _run(prop, stock, ref)
    w = _run(prop, wrapped, ref)
    if s is None:
        OUTCOMES[(family, name)] = "pass"
    elif isinstance(s, AssertionError):
        OUTCOMES[(family, name)] = "stock-wrong"
    else:
        OUTCOMES[(family, name)] = "stock-raises"
        if w is not None and not isinstance(w, AssertionError):
            return  # neither offers the feature
    if w is not None:
        raise AssertionError(
            f"{family}: wrapped model breaks {name!r} (stock: {'passes' if s is None else repr(s)[:300]})"
        ) from w


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not OUTCOMES:
        return
    per = collections.defaultdict(collections.Counter)
    for (family, _), outcome in OUTCOMES.items():
        per[family][outcome] += 1
    tr = terminalreporter
    tr.section("safepad contract tier: properties per family")
    tr.write_line(f"{'family':22s} {'checked':>7s} {'stock ok':>8s} {'stock wrong -> row-alone':>25s} {'stock raises':>12s}")
    for family in sorted(per):
        c = per[family]
        tr.write_line(
            f"{family:22s} {sum(c.values()):7d} {c['pass']:8d} {c['stock-wrong']:25d} {c['stock-raises']:12d}"
        )


@pytest.fixture(autouse=True)
def _quiet_transformers():
    log = logging.getLogger("transformers")
    level = log.level
    log.setLevel(logging.ERROR)
    yield
    log.setLevel(level)
