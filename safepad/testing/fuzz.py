"""The stateful differential call-sequence fuzzer: random call programs on a wrapped model, each call checked
against every row run alone through the stock model.

A :class:`Session` holds one family's tiny model wrapped by :func:`safepad.wrap`, its stock twin (the same
weights, unwrapped) and the live state a user builds up: a batch of rows that share one cache (each row carries
its own token history and the columns of the mask it was fed), and a saved copy of it. Each public method of
:class:`Session` is one user call (a rule): an uncached forward of a padded / holed batch with labels and
backward, a packed row (``position_ids`` restarts, ``seq_idx``, ``cu_seq_lens_q/k``), a cached prefill, a
chunk or decode step continuing the live cache, ``generate`` (greedy, seeded sampling, beams, both pad sides,
``use_cache`` on and off, continuing from the returned cache), cache operations (deepcopy, reuse, reorder,
select) and output options (``output_hidden_states``, ``output_attentions``, ``logits_to_keep``,
``return_dict=False``).

The oracle: every returned tensor (logits of real tokens, hidden states, attention weights over real keys,
loss, parameter gradients, generated tokens and their logits) equals what each row gives alone through the
stock model without padding and without a cache (generated tokens: the stock model's greedy continuation of the
prompt alone, a full forward per step). The tolerance is relative: ``max |Δ| <= tol * max(1, max |ref|)``,
``tol`` 1e-4 in float32 (:func:`safepad.testing.scenarios.default_tol`); a generated token may differ only
where the reference's top two logits are within that tolerance (a tie). A call may instead raise an error
raised by safepad itself (its raise site inside the ``safepad`` package) that names the problem; any other
exception (from deep inside transformers or torch) is a failure.

Every failure raises :class:`FuzzFailure` whose message is a standalone Python repro: the session calls that
led to it, which re-run the same comparisons. :class:`FuzzMachine` drives a session with hypothesis'
``RuleBasedStateMachine`` (shrinking to a minimal call sequence); :func:`machine_for` makes one per family and
:func:`main` (``python -m safepad.testing.fuzz``, ``make fuzz``) runs them time-bounded over every family.

Known open defects are skipped, not hidden: :data:`KNOWN_DEFECTS` names each (the issue item, the predicate of
the draws it skips, why) and every skipped draw is counted and printed.
"""

from __future__ import annotations

import argparse
import copy
import functools
import logging
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

logger = logging.getLogger(__name__)

__all__ = [
    "KNOWN_DEFECTS",
    "FuzzFailure",
    "FuzzStats",
    "KnownDefect",
    "Session",
    "fuzz_families",
    "machine_for",
    "main",
    "run_family",
]

PAD_ID = 0
FIRST_TOKEN = 3  # drawn tokens avoid the pad / bos / eos ids
_SAFEPAD_DIR = Path(__file__).resolve().parents[1]
_TESTING_DIR = Path(__file__).resolve().parent


class FuzzFailure(AssertionError):
    """A call returned a wrong tensor, or raised an error that is not safepad's; the message is a repro."""


# --------------------------------------------------------------------------------------------------------------
# Known open defects: skipped draws, each named and counted
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KnownDefect:
    """One open defect the fuzzer finds: draws matching ``applies(family, rule, call)`` are skipped and counted.

    ``call`` holds the rule's keyword arguments plus ``right`` / ``left`` / ``holes`` (whether any row of the
    batch is right-padded, left-padded, or has a hole), ``cached`` (a cache goes in or comes out) and ``stream``
    (the live batch's flags, a dict, or None).
    """

    item: str
    applies: Callable[[str, str, dict[str, Any]], bool]
    reason: str



def _output_carries_cache(model: nn.Module) -> bool:
    """Whether ``model``'s forward returns a cache (its output dataclass has a cache field); True when unknown."""
    import inspect
    import typing

    ann = inspect.signature(type(model).forward).return_annotation
    for t in typing.get_args(ann) or (ann,):
        fields = getattr(t, "__dataclass_fields__", None)
        if fields is not None:
            return any(n in fields for n in ("past_key_values", "cache_params", "cache"))
    return True


#: The open defects of issue 28 that the fuzzer reaches; the coordinator removes an entry when its fix merges.
KNOWN_DEFECTS: tuple[KnownDefect, ...] = (
    KnownDefect(
        "new-2",
        lambda f, r, c: r == "generate" and c.get("mode") == "lookup" and bool(c.get("static", False)),
        "assisted (prompt-lookup) generate with a static cache on the conv-only families that serve it (lfm2_moe "
        "1.1e-3, lfm2_vl 4.8e-4 against the prompt alone): transformers' own, not state carried across calls: a "
        "fresh stock model gives the very same numbers (lfm2_vl [9, 9, 9, 9]: 1.19e-4 wrapped and stock, in float64 "
        "as well; a dynamic cache or plain greedy 3e-7), near the tolerance, so a draw crosses it or not",
    ),
)


# --------------------------------------------------------------------------------------------------------------
# Models: one stock / wrapped pair per (family, dtype) and process
# --------------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _models(family: str, dtype: torch.dtype = torch.float32, wrap: bool = True) -> tuple[nn.Module, nn.Module]:
    """(stock, subject) tiny models of ``family``: the same weights, the subject a deep copy, wrapped by
    :func:`safepad.wrap` (``wrap=False``: left stock, to check that the oracle catches stock's defects)."""
    import safepad
    from .tiny import tiny_model

    stock = tiny_model(family, dtype=dtype)
    subject = copy.deepcopy(stock)
    return stock, safepad.wrap(subject) if wrap else subject


def _io(model: nn.Module):
    from .scenarios import _ModelIO

    return _ModelIO(model)


def _is_safepad_error(exc: BaseException) -> bool:
    """Whether ``exc`` was raised by safepad itself (its raise site in the package, not in safepad.testing)."""
    from ..errors import PaddingError, UnsupportedModelError

    if isinstance(exc, (PaddingError, UnsupportedModelError)):
        return True
    if not isinstance(exc, (ValueError, TypeError, NotImplementedError, RuntimeError)):
        return False
    tb = exc.__traceback__
    last = None
    while tb is not None:
        last = tb
        tb = tb.tb_next
    if last is None:
        return False
    path = Path(last.tb_frame.f_code.co_filename).resolve()
    return _SAFEPAD_DIR in path.parents and _TESTING_DIR not in path.parents and path.parent != _TESTING_DIR


def _rel(got: Tensor, ref: Tensor) -> float:
    """max |got - ref| / max(1, max |ref|), inf on a shape mismatch."""
    if got.shape != ref.shape:
        return math.inf
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(got).all():
        return math.inf
    return (got - ref).abs().max().item() / max(1.0, ref.abs().max().item()) if ref.numel() else 0.0


# --------------------------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------------------------


@dataclass
class FuzzStats:
    """Counts of one family's fuzzing: call sequences (examples), calls made, calls refused by a safepad
    error, skipped draws per known defect, failures (their repro messages)."""

    family: str
    sequences: int = 0
    calls: int = 0
    refused: int = 0
    rules: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0
    cpu_seconds: float = 0.0

    def line(self) -> str:
        skipped = ", ".join(f"{k}: {v}" for k, v in sorted(self.skipped.items())) or "none"
        return (
            f"{self.family:22s} sequences {self.sequences:5d}  calls {self.calls:6d}  refused {self.refused:4d}  "
            f"failures {len(self.failures)}  {self.seconds:6.1f} s ({self.cpu_seconds:.1f} s CPU)  "
            f"skipped draws: {skipped}"
        )


STATS: dict[str, FuzzStats] = {}


def _stats(family: str) -> FuzzStats:
    return STATS.setdefault(family, FuzzStats(family))


# --------------------------------------------------------------------------------------------------------------
# The session: one family, the live cached batch, the rules
# --------------------------------------------------------------------------------------------------------------

Batch = list[list[int | None]]  # rows of equal width; None is a pad column


@dataclass
class _Stream:
    """The live cached batch: each row's real tokens so far, the ``[B, W]`` mask of every column fed, the cache,
    tokens generate returned but that were not fed yet (``pending``), and layout flags."""

    history: list[list[int]]
    mask: Tensor
    cache: Any
    pending: list[int] | None = None
    right: bool = False
    padded: bool = False


def _layout(batch: Batch) -> tuple[Tensor, Tensor, dict[str, bool]]:
    """(``[B, W]`` ids with pads = PAD_ID, ``[B, W]`` 0/1 mask, flags right / left / holes) of a drawn batch."""
    ids = torch.tensor([[PAD_ID if t is None else t for t in row] for row in batch], dtype=torch.long)
    mask = torch.tensor([[0 if t is None else 1 for t in row] for row in batch], dtype=torch.long)
    flags = {"right": False, "left": False, "holes": False}
    for row in mask.tolist():
        real = [i for i, m in enumerate(row) if m]
        if not real:
            continue
        lo, hi = real[0], real[-1]
        flags["left"] |= lo > 0
        flags["right"] |= hi < len(row) - 1
        flags["holes"] |= hi - lo + 1 != len(real)
    return ids, mask, flags


def _positions(mask: Tensor, start: Tensor | None = None) -> Tensor:
    """generate-style ``[B, W]`` position ids: each real token's index among its row's real tokens (from ``start``
    ``[B]``), pads set to 1."""
    pos = mask.cumsum(-1) - 1
    if start is not None:
        pos = pos + start[:, None]
    return pos.masked_fill(mask == 0, 1)


class Session:
    """One family's wrapped model, its stock twin, and the calls a user makes; each call checks its outputs.

    Args:
        family: a tiny family (:func:`safepad.testing.tiny.family_names`).
        dtype: the models' dtype (float32; float64 where rounding would hide a defect).
        tol: relative tolerance; default :func:`safepad.testing.scenarios.default_tol` of ``dtype``.
        wrap: wrap the subject (False: fuzz the stock twin itself, a check that the oracle catches its defects).
        skip_known: skip draws that :data:`KNOWN_DEFECTS` names (False: run them, as a regression test does).
    """

    def __init__(self, family: str, dtype: torch.dtype = torch.float32, tol: float | None = None,
                 wrap: bool = True, skip_known: bool = True) -> None:
        from .scenarios import _banned_tokens, default_tol

        self.family = family
        self.dtype = dtype
        self.skip_known = skip_known
        self.stock, self.model = _models(family, dtype, wrap)
        self.ref, self.io = _io(self.stock), _io(self.model)
        self.vocab = self.ref.vocab
        self.tol = default_tol(dtype) if tol is None else tol
        self.banned = _banned_tokens(self.stock)
        self.stream: _Stream | None = None
        self.saved: _Stream | None = None
        self.lines: list[str] = [
            "import torch",
            "from safepad.testing.fuzz import Session",
            "",
            f"s = Session({family!r}, dtype={dtype}{'' if wrap else ', wrap=False'}, skip_known=False)",
        ]
        self.stats = _stats(family if wrap else f"{family} (stock)")
        self._memo: dict[tuple[int, ...], Tensor] = {}

    # ---- bookkeeping ---------------------------------------------------------------------------------------

    def _record(self, rule: str, kwargs: dict[str, Any]) -> None:
        args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        # calls that neither read nor change the live stream are left out of a repro unless they fail
        stateless = rule in ("forward", "packed") or (rule == "generate" and not kwargs.get("keep"))
        self.lines.append(("# " if stateless else "") + f"s.{rule}({args})")

    def repro(self) -> str:
        """The calls so far as a standalone Python script (the last call, and every call the live cache depends
        on; earlier stateless calls are dropped)."""
        at = max((i for i, ln in enumerate(self.lines) if ln.startswith(("s.", "# s."))), default=len(self.lines))
        lines = [ln for ln in self.lines[:at] if not ln.startswith("# s.")]
        last = [ln[2:] if ln.startswith("# s.") else ln for ln in self.lines[at : at + 1]]
        return "\n".join([*lines, *last, *self.lines[at + 1 :]])

    def _fail(self, what: str) -> None:
        msg = (
            f"{self.family}: {what}\n--- repro (each call re-checks its outputs; the last one fails) ---\n"
            f"{self.repro()}\n---"
        )
        raise FuzzFailure(msg)

    def _skip(self, rule: str, call: dict[str, Any]) -> bool:
        if not self.skip_known:
            return False
        info = {**call, "stream": None}
        if self.stream is not None:
            info["stream"] = {"right": self.stream.right, "padded": self.stream.padded}
        for d in KNOWN_DEFECTS:
            if d.applies(self.family, rule, info):
                self.stats.skipped[d.item] = self.stats.skipped.get(d.item, 0) + 1
                self.lines.append(f"# skipped (known defect {d.item}): s.{rule}(...)")
                return True
        return False

    def _run(self, rule: str, fn: Callable[[], Any], stock_fn: Callable[[], Any] | None = None) -> tuple[bool, Any]:
        """Run a user call: (True, result), or (False, None) when safepad refused it with its own error, or when
        the stock model refuses the very same call with the same exception type (``stock_fn``: transformers does
        not offer it, e.g. ``labels`` with ``logits_to_keep``)."""
        self.stats.calls += 1
        self.stats.rules[rule] = self.stats.rules.get(rule, 0) + 1
        try:
            return True, fn()
        except FuzzFailure:
            raise
        except Exception as exc:  # noqa: BLE001 -- the oracle decides
            if _is_safepad_error(exc):
                self.stats.refused += 1
                self.lines.append(f"# refused by safepad: {type(exc).__name__}: {str(exc)[:200]!r}")
                return False, None
            if stock_fn is not None:
                try:
                    stock_fn()
                except Exception as stock_exc:  # noqa: BLE001
                    if type(stock_exc) is type(exc):
                        self.stats.refused += 1
                        self.lines.append(f"# stock refuses it too: {type(exc).__name__}: {str(exc)[:200]!r}")
                        return False, None
            tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-6:])
            self._fail(f"{rule} raised an error that is not safepad's (the stock model takes the same call):\n{tb}")
        return False, None  # unreachable

    def _check(self, what: str, got: Tensor, ref: Tensor) -> None:
        err = _rel(got, ref)
        if not err <= self.tol:
            shape = f"got {tuple(got.shape)} vs ref {tuple(ref.shape)}" if got.shape != ref.shape else ""
            self._fail(f"{what}: max |Δ| / max(1, |ref|) = {err:.3g} > tol {self.tol:g} {shape}")

    # ---- references: each row alone through the stock model, no padding, no cache ---------------------------

    def _alone_out(self, tokens: list[int], hidden: bool = False, attentions: bool = False) -> Any:
        ids = torch.tensor([tokens], dtype=torch.long)
        kwargs: dict[str, Any] = {"input_ids": ids, "use_cache": False}
        if self.ref.takes_positions:
            kwargs["position_ids"] = torch.arange(len(tokens))[None]
        if hidden:
            kwargs["output_hidden_states"] = True
        if attentions:
            kwargs["output_attentions"] = True
        with torch.no_grad():
            return self.stock(**kwargs)

    def _alone(self, tokens: list[int]) -> Tensor:
        """``[L, V]`` float logits of ``tokens`` alone (memoised)."""
        key = tuple(tokens)
        if key not in self._memo:
            if len(self._memo) > 512:
                self._memo.clear()
            self._memo[key] = self._alone_out(tokens).logits[0].float()
        return self._memo[key]

    def _greedy_ref(self, prompt: list[int], n_new: int) -> tuple[list[int], list[Tensor]]:
        """The stock greedy continuation of ``prompt`` alone (a full forward per step, eos banned as
        ``min_new_tokens`` does): (tokens, the ``[V]`` logits each was chosen from)."""
        from .scenarios import _greedy

        seq, toks, logits = list(prompt), [], []
        for _ in range(n_new):
            step = self._alone(seq)[-1]
            logits.append(step)
            toks.append(_greedy(step, self.banned))
            seq.append(toks[-1])
        return toks, logits

    def _check_tokens(self, what: str, got: list[int], ref: list[int], ref_logits: list[Tensor]) -> int:
        """Compare generated tokens; a difference is allowed only at a near-tie of the reference's top two logits.
        Returns how many leading tokens agree (the rest is not comparable after a tie)."""
        for k, (a, b) in enumerate(zip(got, ref)):
            if a != b:
                lg = ref_logits[k].double().clone()
                lg[self.banned] = -math.inf
                top = lg.topk(2).values
                gap = (lg[b] - lg[a]).item() if a < lg.numel() else math.inf
                if gap <= self.tol * max(1.0, top[0].abs().item()) * 10:
                    return k
                self._fail(f"{what}: token {k} is {a}, the row alone gives {b} (logit gap {gap:.3g})")
        return min(len(got), len(ref))

    # ---- outputs ------------------------------------------------------------------------------------------

    def _unpack(self, out: Any, return_dict: bool, names: list[str]) -> dict[str, Any]:
        """The output as a dict: ``return_dict=False`` tuples are mapped back through the field names the
        return_dict call of the same options gives (``names``)."""
        if return_dict:
            return {k: v for k, v in out.items() if v is not None}
        if not isinstance(out, tuple):
            self._fail(f"return_dict=False returned a {type(out).__name__}, not a tuple")
        if len(out) != len(names):
            self._fail(f"return_dict=False returned {len(out)} fields, return_dict=True {len(names)}: {names}")
        return dict(zip(names, out))

    def _compare_rows(
        self,
        what: str,
        outs: dict[str, Any],
        mask: Tensor,
        history: list[list[int]],
        cols: Tensor | None = None,
        logits_to_keep: int = 0,
        hidden: bool = False,
        attentions: bool = False,
    ) -> None:
        """Compare a call's logits / hidden states / attentions of each row with the row alone.

        ``mask`` ``[B, W]``: the columns of this call; ``history[b]``: the row's real tokens up to and including
        this call; ``cols`` ``[B, P + W]``: the full mask of the keys (past + this call) for attentions.
        """
        logits = outs.get("logits")
        if logits is None:
            self._fail(f"{what}: no logits returned")
        W = mask.shape[1]
        keep = W if not logits_to_keep else min(logits_to_keep, W)
        if logits.shape[1] != keep:
            self._fail(f"{what}: logits have {logits.shape[1]} columns, expected {keep}")
        for b, toks in enumerate(history):
            m = mask[b].bool()
            n_new = int(m.sum())
            if n_new == 0:
                continue
            ref = self._alone(toks)[-n_new:]  # [n_new, V]
            sel = m[W - keep :]
            got = logits[b][sel]
            self._check(f"{what}: logits of row {b}", got, ref[len(ref) - int(sel.sum()) :])
            if hidden or attentions:
                alone = self._alone_out(toks, hidden=hidden, attentions=attentions)
            if hidden:
                hs = outs.get("hidden_states")
                if hs is None:
                    self._fail(f"{what}: output_hidden_states=True returned no hidden_states")
                ref_hs = getattr(alone, "hidden_states", None)
                if ref_hs is None:
                    self._fail(f"{what}: the stock model alone returns no hidden_states")
                if len(hs) != len(ref_hs):
                    self._fail(f"{what}: {len(hs)} hidden states, the stock model returns {len(ref_hs)}")
                for i, (h, r) in enumerate(zip(hs, ref_hs)):
                    self._check(f"{what}: hidden_states[{i}] of row {b}", h[b][m], r[0][-n_new:])
            if attentions:
                att = outs.get("attentions")
                ref_att = getattr(alone, "attentions", None)
                if att is None or ref_att is None:
                    if att is None and ref_att is None:
                        continue
                    self._fail(f"{what}: attentions returned {att is not None}, stock alone {ref_att is not None}")
                full = cols[b].bool() if cols is not None else m
                for i, (a, r) in enumerate(zip(att, ref_att)):
                    if a is None or r is None:
                        if (a is None) != (r is None):
                            self._fail(f"{what}: attentions[{i}] is None on one side only")
                        continue
                    if a.shape[-1] != full.numel():  # sliding / windowed layouts: compare what both hold
                        continue
                    self._check(f"{what}: attentions[{i}] of row {b}", a[b][:, m][:, :, full], r[0][:, -n_new:])

    # ---- rules --------------------------------------------------------------------------------------------

    def forward(
        self,
        batch: Batch,
        position_ids: bool = True,
        labels: bool = False,
        backward: bool = False,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
        logits_to_keep: int = 0,
        return_dict: bool = True,
        output_router_logits: bool = False,
    ) -> None:
        """An uncached forward of a padded / holed batch; labels on pairs of adjacent real tokens, then backward:
        loss and every parameter's gradient vs the per-row stock sum. ``output_router_logits`` (MoE families):
        each real token's router logits vs the row alone (the loss then holds the aux loss and is not compared;
        the backward still runs)."""
        kw = dict(batch=batch, position_ids=position_ids, labels=labels, backward=backward,
                  output_hidden_states=output_hidden_states, output_attentions=output_attentions,
                  logits_to_keep=logits_to_keep, return_dict=return_dict)
        if output_router_logits:
            kw["output_router_logits"] = True
        ids, mask, flags = _layout(batch)
        if self._skip("forward", {**kw, **flags, "cached": False}):
            return
        self._record("forward", kw)
        history = [[t for t in row if t is not None] for row in batch]
        kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": mask, "use_cache": False}
        if position_ids and self.io.takes_positions:
            kwargs["position_ids"] = _positions(mask)
        lab = None
        if labels:
            lab = ids.masked_fill(mask == 0, -100)
            prev = torch.cat([torch.zeros_like(mask[:, :1]), mask[:, :-1]], dim=1)
            lab = lab.masked_fill(prev == 0, -100)  # a label only where its predecessor is real (same row, no hole)
            if int((lab != -100).sum()) == 0:
                lab = None
            else:
                kwargs["labels"] = lab
        opts = self._opts(output_hidden_states, output_attentions, logits_to_keep, return_dict)
        kwargs.update(opts)
        if output_router_logits:
            kwargs["output_router_logits"] = True
        self.model.zero_grad(set_to_none=True)
        grad = backward and lab is not None
        ok, out = self._run("forward", lambda: self._call(kwargs, grad=grad), lambda: self._stock_call(kwargs))
        if not ok:
            return
        names = self._names(kwargs)
        outs = self._unpack(out, return_dict, names)
        self._compare_rows("forward", outs, mask, history, logits_to_keep=logits_to_keep,
                           hidden=output_hidden_states, attentions=output_attentions)
        if output_router_logits:
            self._check_router("forward", outs, mask, history)
        if lab is not None and not output_router_logits:
            self._check_loss("forward", outs, ids, lab, history, mask, grad)
        self.model.zero_grad(set_to_none=True)

    def packed(self, seqs: list[list[int]], via: str = "position_ids", labels: bool = False,
               backward: bool = False, output_router_logits: bool = False) -> None:
        """One ``[1, T]`` row of sequences back to back: ``via`` ``"position_ids"`` (restarting at 0),
        ``"seq_idx"`` or ``"cu_seq_lens"`` (each with the restarting positions as well)."""
        kw = dict(seqs=seqs, via=via, labels=labels, backward=backward)
        if output_router_logits:
            kw["output_router_logits"] = True
        if self._skip("packed", {**kw, "cached": False}):
            return
        self._record("packed", kw)
        lengths = [len(s) for s in seqs]
        ids = torch.tensor([[t for s in seqs for t in s]], dtype=torch.long)
        kwargs: dict[str, Any] = {"input_ids": ids, "use_cache": False}
        if self.io.takes_positions:
            kwargs["position_ids"] = torch.cat([torch.arange(n) for n in lengths])[None]
        elif via == "position_ids":
            via = "seq_idx"
        if via == "seq_idx":
            kwargs["seq_idx"] = torch.cat(
                [torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)]
            )[None]
        elif via == "cu_seq_lens":
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
            kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths))
        lab = None
        if labels:
            lab = ids.clone()
            starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()[:-1]])
            lab[0, starts] = -100
            if int((lab != -100).sum()):
                kwargs["labels"] = lab
            else:
                lab = None
        if output_router_logits:
            kwargs["output_router_logits"] = True
        self.model.zero_grad(set_to_none=True)
        grad = backward and lab is not None
        ok, out = self._run("packed", lambda: self._call(kwargs, grad=grad), lambda: self._stock_call(kwargs))
        if not ok:
            return
        logits = out.logits[0]
        at = 0
        for i, s in enumerate(seqs):
            self._check(f"packed via {via}: logits of sequence {i}", logits[at : at + len(s)], self._alone(s))
            at += len(s)
        if output_router_logits:
            got = out.get("router_logits") if hasattr(out, "get") else None
            at = 0
            for i, sq in enumerate(seqs):
                self._check_router(f"packed via {via} (sequence {i})",
                                   {"router_logits": None if got is None else
                                    tuple(g.reshape(ids.shape[1], -1)[at : at + len(sq)] for g in got)},
                                   torch.ones(1, len(sq), dtype=torch.long), [sq])
                at += len(sq)
        elif lab is not None:
            self._check_loss(f"packed via {via}", dict(out.items()), ids, lab, seqs, None, grad)
        self.model.zero_grad(set_to_none=True)

    def prefill(self, batch: Batch, position_ids: bool = True, output_hidden_states: bool = False,
                output_attentions: bool = False, return_dict: bool = True) -> None:
        """A cached prefill (``use_cache=True``) of a padded batch: starts the live stream."""
        kw = dict(batch=batch, position_ids=position_ids, output_hidden_states=output_hidden_states,
                  output_attentions=output_attentions, return_dict=return_dict)
        ids, mask, flags = _layout(batch)
        if self._skip("prefill", {**kw, **flags, "cached": True, "stream": None}):
            return
        self._record("prefill", kw)
        self.stream = None
        history = [[t for t in row if t is not None] for row in batch]
        kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": mask, "use_cache": True}
        if position_ids and self.io.takes_positions:
            kwargs["position_ids"] = _positions(mask)
        fresh = self.io.fresh_cache()
        if fresh is None and self.io.cache_kw is not None and not _output_carries_cache(self.stock):
            # a model whose output carries no cache (RecurrentGemma): hand in the one every later call continues,
            # as docs/inference.md says
            from transformers import DynamicCache

            fresh = DynamicCache(config=self.model.config)
        if fresh is not None:
            kwargs[self.io.cache_kw] = fresh
        kwargs.update(self._opts(output_hidden_states, output_attentions, 0, return_dict))
        ok, out = self._run("prefill", lambda: self._call(kwargs), lambda: self._stock_call(kwargs))
        if not ok:
            return
        outs = self._unpack(out, return_dict, self._names(kwargs))
        self._compare_rows("prefill", outs, mask, history, cols=mask, hidden=output_hidden_states,
                           attentions=output_attentions)
        cache = self._cache_of(outs, kwargs)
        if cache is None:
            self._fail("prefill: use_cache=True returned no cache")
        self.stream = _Stream(history, mask, cache, right=flags["right"],
                              padded=flags["right"] or flags["left"] or flags["holes"])

    def chunk(self, batch: Batch, position_ids: bool = True, output_hidden_states: bool = False,
              output_attentions: bool = False, return_dict: bool = True) -> None:
        """The next chunk (or decode step, width 1) of every row of the live stream, through its cache; the mask
        spans past + current columns as ``generate`` builds it. Pending generated tokens go first."""
        st = self.stream
        if st is None:
            return
        kw = dict(batch=batch, position_ids=position_ids, output_hidden_states=output_hidden_states,
                  output_attentions=output_attentions, return_dict=return_dict)
        if st.pending is not None:
            batch = [[p, *row] for p, row in zip(st.pending, batch)]
        if not batch or not batch[0]:
            return
        ids, mask, flags = _layout(batch)
        if self._skip("chunk", {**kw, **flags, "cached": True}):
            return
        self._record("chunk", kw)
        full = torch.cat([st.mask, mask], dim=1)
        history = [h + [t for t in row if t is not None] for h, row in zip(st.history, batch)]
        kwargs: dict[str, Any] = {"input_ids": ids, "use_cache": True, self.io.cache_kw: st.cache}
        # a one-token step without pads goes without a mask where generate() drops it (models without
        # position_ids); a step with a pad column keeps it, as a user has to
        call_mask = full if ids.shape[1] > 1 or bool((mask == 0).any()) else self.io.decode_mask(full)
        if call_mask is not None:
            kwargs["attention_mask"] = call_mask
        if position_ids and self.io.takes_positions:
            kwargs["position_ids"] = _positions(mask, start=st.mask.sum(-1))
        kwargs.update(self._opts(output_hidden_states, output_attentions, 0, return_dict))
        self.stream = None  # a refused or failing call leaves no stream to continue
        ok, out = self._run("chunk", lambda: self._call(kwargs))
        if not ok:
            return
        outs = self._unpack(out, return_dict, self._names(kwargs))
        self._compare_rows("chunk", outs, mask, history, cols=full, hidden=output_hidden_states,
                           attentions=output_attentions)
        cache = self._cache_of(outs, kwargs)
        self.stream = _Stream(history, full, cache if cache is not None else st.cache,
                              right=st.right or flags["right"],
                              padded=st.padded or flags["right"] or flags["left"] or flags["holes"])

    def decode(self, steps: list[list[int]], position_ids: bool = True) -> None:
        """A hand-written decode loop: one token per row per step through the live cache."""
        for toks in steps:
            if self.stream is None:
                return
            n = len(self.stream.history)
            self.chunk([[toks[i % len(toks)]] for i in range(n)], position_ids=position_ids)

    def generate(self, batch: Batch, max_new_tokens: int = 3, use_cache: bool = True, mode: str = "greedy",
                 num_return_sequences: int = 1, keep: bool = False, static: bool = False) -> None:
        """``generate`` on a padded batch: ``mode`` greedy (tokens vs the greedy continuation alone), sample
        (seeded; the logits of every step vs the sampled sequence alone) or beam (2 beams, vs the stock
        cache-free beam search on the prompt alone). ``keep``: the returned cache becomes the live stream.
        ``static``: ``cache_implementation="static"`` (where the stock model refuses it, it is not drawn)."""
        kw = dict(batch=batch, max_new_tokens=max_new_tokens, use_cache=use_cache, mode=mode,
                  num_return_sequences=num_return_sequences, keep=keep)
        if static and use_cache:
            kw["static"], keep = True, False
            kw["keep"] = False
        ids, mask, flags = _layout(batch)
        if self._skip("generate", {**kw, **flags, "cached": use_cache}):
            return
        self._record("generate", kw)
        prompts = [[t for t in row if t is not None] for row in batch]
        if any(not p for p in prompts):
            return
        if mode == "lookup":  # assisted generation serves one row: the first prompt, unpadded
            prompts = prompts[:1]
            ids, mask = torch.tensor(prompts, dtype=torch.long), torch.ones(1, len(prompts[0]), dtype=torch.long)
        nrs = num_return_sequences if mode in ("sample", "beam") else 1
        gkw: dict[str, Any] = dict(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
            pad_token_id=PAD_ID, use_cache=use_cache, return_dict_in_generate=True, output_logits=True,
            num_return_sequences=nrs,
        )
        if static and use_cache:
            gkw["cache_implementation"] = "static"
        if mode == "sample":
            gkw.update(do_sample=True, top_k=0, top_p=1.0, temperature=1.0)
        elif mode == "beam":
            gkw.update(do_sample=False, num_beams=max(2, nrs), early_stopping=True, length_penalty=1.0)
        elif mode == "lookup":
            gkw.update(do_sample=False, prompt_lookup_num_tokens=2)
        else:
            gkw.update(do_sample=False)
        if mode == "sample":
            torch.manual_seed(0)
        if keep:
            self.stream = None
        ok, out = self._run("generate", lambda: self._generate(self.model, gkw),
                            lambda: self._generate(self.stock, gkw))
        if not ok:
            if mode == "lookup":  # where stock serves assisted generation, a wrapped model must serve it
                try:
                    self._generate(self.stock, gkw)
                except Exception:  # noqa: BLE001 -- stock refuses it too
                    return
                self._fail("generate lookup: safepad refuses assisted (prompt lookup) generation, the stock model "
                           "serves it")
            return
        W = ids.shape[1]
        seqs = out.sequences[:, W:].tolist()  # [B * nrs, new]
        rows = [p for p in prompts for _ in range(nrs)]
        if mode == "beam":
            for b, p in enumerate(prompts):
                ref = self._generate(self.stock, dict(
                    input_ids=torch.tensor([p]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                    pad_token_id=PAD_ID, use_cache=False, return_dict_in_generate=True, do_sample=False,
                    num_beams=max(2, nrs), num_return_sequences=nrs, early_stopping=True, length_penalty=1.0,
                ))
                want = ref.sequences[:, len(p):].tolist()
                got = seqs[b * nrs : (b + 1) * nrs]
                if got != want:
                    self._fail(f"generate beam: row {b} returned {got}, the prompt alone (stock, no cache) {want}")
            return
        logits = torch.stack(out.logits, dim=1).float()  # [B * nrs, new, V]
        for r, (p, new) in enumerate(zip(rows, seqs)):
            if mode in ("greedy", "lookup"):
                ref_toks, ref_logits = self._greedy_ref(p, max_new_tokens)
                upto = self._check_tokens(f"generate greedy: row {r}", new, ref_toks, ref_logits)
                n = min(upto + 1, len(new))
                self._check(f"generate greedy: logits of row {r}", logits[r, :n], torch.stack(ref_logits[:n]))
            else:
                ref = self._alone(p + new[:-1])[len(p) - 1 :]  # [new, V]: each step's logits given the sampled prefix
                self._check(f"generate sample: logits of row {r}", logits[r], ref)
        if keep and use_cache and not static:  # a static cache is full at max_length: not continued
            from ..cache import output_cache

            cache = output_cache(out)
            if cache is None:
                self._fail("generate: use_cache=True, return_dict_in_generate=True returned no cache")
            full = torch.cat([mask.repeat_interleave(nrs, 0), torch.ones(len(rows), max_new_tokens - 1,
                                                                         dtype=mask.dtype)], dim=1)
            hist = [p + new[:-1] for p, new in zip(rows, seqs)]
            self.stream = _Stream(hist, full, cache, pending=[new[-1] for new in seqs], right=flags["right"],
                                  padded=flags["right"] or flags["left"] or flags["holes"])

    def generate_more(self, tokens: list[int], max_new_tokens: int = 2) -> None:
        """``generate`` continuing the live stream's cache: ``input_ids`` every column fed so far plus one more
        token per row (a pending generated token, or ``tokens``), the cache under the model's cache argument;
        tokens vs the greedy continuation of each row alone."""
        st = self.stream
        if st is None or self.io.cache_kw is None:
            return
        B = len(st.history)
        nxt = st.pending if st.pending is not None else [tokens[i % len(tokens)] for i in range(B)]
        kw = dict(tokens=tokens, max_new_tokens=max_new_tokens)
        if self._skip("generate_more", {**kw, "cached": True, "use_cache": True}):
            return
        self._record("generate_more", kw)
        W = st.mask.shape[1]
        ids = torch.full((B, W + 1), PAD_ID, dtype=torch.long)
        for b, h in enumerate(st.history):
            ids[b, :W][st.mask[b].bool()] = torch.tensor(h, dtype=torch.long)
        ids[:, W] = torch.tensor(nxt, dtype=torch.long)
        mask = torch.cat([st.mask, torch.ones(B, 1, dtype=st.mask.dtype)], dim=1)
        gkw: dict[str, Any] = dict(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
            pad_token_id=PAD_ID, use_cache=True, return_dict_in_generate=True, output_logits=True, do_sample=False,
        )
        gkw[self.io.cache_kw] = st.cache
        self.stream = None
        ok, out = self._run("generate_more", lambda: self._generate(self.model, gkw))
        if not ok:
            return
        seqs = out.sequences[:, W + 1 :].tolist()
        logits = torch.stack(out.logits, dim=1).float()
        for b, (h, new) in enumerate(zip(st.history, seqs)):
            p = h + [nxt[b]]
            ref_toks, ref_logits = self._greedy_ref(p, max_new_tokens)
            upto = self._check_tokens(f"generate_more: row {b}", new, ref_toks, ref_logits)
            n = min(upto + 1, len(new))
            self._check(f"generate_more: logits of row {b}", logits[b, :n], torch.stack(ref_logits[:n]))

    def fork(self) -> None:
        """``copy.deepcopy`` of the live stream's cache, kept aside."""
        if self.stream is None:
            return
        self._record("fork", {})
        st = self.stream
        ok, cache = self._run("fork", lambda: copy.deepcopy(st.cache))
        if ok:
            self.saved = _Stream([list(h) for h in st.history], st.mask.clone(), cache,
                                 None if st.pending is None else list(st.pending), st.right, st.padded)

    def restore(self, copy: bool = True) -> None:
        """Continue from the forked cache again: a deep copy of it (``copy``), or the object itself (reusing a
        cache a second time)."""
        if self.saved is None:
            return
        if self._skip("restore", {"copy": copy, "cached": True}):
            return
        self._record("restore", {"copy": copy})
        sv = self.saved
        import copy as _copy

        cache = _copy.deepcopy(sv.cache) if copy else sv.cache
        self.stream = _Stream([list(h) for h in sv.history], sv.mask.clone(), cache,
                              None if sv.pending is None else list(sv.pending), sv.right, sv.padded)

    def reorder(self, order: list[int]) -> None:
        """``cache.reorder_cache(beam_idx)`` (or ``batch_select_indices``) where the cache offers it: rows permuted
        or repeated; the histories follow."""
        st = self.stream
        if st is None:
            return
        B = len(st.history)
        idx = [i % B for i in order][:B] or [0]
        fn = getattr(st.cache, "reorder_cache", None)
        if not callable(fn):
            return
        self._record("reorder", {"order": order})
        self.stream = None
        ok, _ = self._run("reorder", lambda: fn(torch.tensor(idx)))
        if not ok:
            return
        self.stream = _Stream([list(st.history[i]) for i in idx], st.mask[idx], st.cache,
                              None if st.pending is None else [st.pending[i] for i in idx], st.right, st.padded)

    # ---- helpers ------------------------------------------------------------------------------------------

    def _opts(self, hidden: bool, attentions: bool, logits_to_keep: int, return_dict: bool) -> dict[str, Any]:
        o: dict[str, Any] = {}
        if hidden:
            o["output_hidden_states"] = True
        if attentions:
            o["output_attentions"] = True
        if logits_to_keep:
            o["logits_to_keep"] = logits_to_keep
        if not return_dict:
            o["return_dict"] = False
        return o

    def _names(self, kwargs: dict[str, Any]) -> list[str]:
        """Field names of the output a return_dict=True call with the same options gives: (loss), logits, cache,
        hidden_states, attentions (the output class' order, None fields dropped)."""
        cls = self._output_cls()
        want = {"loss": "labels" in kwargs, "logits": True,
                "hidden_states": bool(kwargs.get("output_hidden_states")),
                "attentions": bool(kwargs.get("output_attentions"))}
        names = []
        for f in getattr(cls, "__dataclass_fields__", {}):
            if f in want:
                if want[f]:
                    names.append(f)
            elif f in ("past_key_values", "cache_params", "cache") and kwargs.get("use_cache"):
                names.append(f)
        return names

    @functools.cached_property
    def _output_cls_cached(self) -> type:
        with torch.no_grad():
            out = self.stock(input_ids=torch.tensor([[FIRST_TOKEN]]), use_cache=False)
        return type(out)

    def _output_cls(self) -> type:
        return self._output_cls_cached

    def _cache_of(self, outs: dict[str, Any], kwargs: dict[str, Any]) -> Any:
        for name in ("past_key_values", "cache_params", "cache"):
            if outs.get(name) is not None:
                return outs[name]
        if self.io.stateful:
            return kwargs.get(self.io.cache_kw)
        return kwargs.get(self.io.cache_kw)

    def _call(self, kwargs: dict[str, Any], grad: bool = False) -> Any:
        if grad:
            out = self.model(**kwargs)
            loss = out["loss"] if isinstance(out, dict) or hasattr(out, "keys") else out[0]
            loss.backward()
            return out
        with torch.no_grad():
            return self.model(**kwargs)

    def _stock_call(self, kwargs: dict[str, Any]) -> Any:
        """The same call on the stock twin (a cache argument replaced by a fresh cache of the stock model's)."""
        kwargs = {k: v for k, v in kwargs.items() if k != self.io.cache_kw}
        fresh = self.ref.fresh_cache()
        if fresh is not None and kwargs.get("use_cache"):
            kwargs[self.ref.cache_kw] = fresh
        with torch.no_grad():
            return self.stock(**kwargs)

    @staticmethod
    def _generate(model: nn.Module, gkw: dict[str, Any]) -> Any:
        with torch.no_grad():
            return model.generate(**gkw)

    def _check_loss(self, what: str, outs: dict[str, Any], ids: Tensor, lab: Tensor, history: list[list[int]],
                    mask: Tensor | None, grad: bool) -> None:
        """Loss (mean CE over the labelled tokens) and every parameter gradient vs the stock rows alone."""
        loss = outs.get("loss")
        if loss is None:
            self._fail(f"{what}: labels given, no loss returned")
        # each labelled token: (row, index among the row's sequence tokens) -> CE of the alone logits
        self.stock.zero_grad(set_to_none=True)
        terms: list[Tensor] = []
        if mask is None:  # packed: history = the sequences of row 0
            at = 0
            for s in history:
                if len(s) > 1:
                    lg = self._alone_grad(s)
                    terms.append(torch.nn.functional.cross_entropy(lg[:-1].float(), torch.tensor(s[1:]),
                                                                   reduction="sum"))
                at += len(s)
        else:
            for b, toks in enumerate(history):
                real = mask[b].nonzero().flatten().tolist()
                pick = [i for i, c in enumerate(real) if i > 0 and lab[b, c] != -100]
                if not pick:
                    continue
                lg = self._alone_grad(toks)
                tgt = torch.tensor([toks[i] for i in pick])
                terms.append(torch.nn.functional.cross_entropy(lg[[i - 1 for i in pick]].float(), tgt,
                                                               reduction="sum"))
        n = int((lab != -100).sum())
        ref_loss = torch.stack(terms).sum() / n
        self._check(f"{what}: loss", loss.detach().reshape(()), ref_loss.detach())
        if not grad:
            self.stock.zero_grad(set_to_none=True)
            return
        ref_loss.backward()
        ref_grads = {k: p.grad for k, p in self.stock.named_parameters() if p.grad is not None}
        got_grads = {k: p.grad for k, p in self.model.named_parameters() if p.grad is not None}
        scale = max((g.abs().max().item() for g in ref_grads.values()), default=0.0)
        for k, g in ref_grads.items():
            got = got_grads.get(k)
            if got is None:
                if g.abs().max().item() > self.tol * scale:
                    self._fail(f"{what}: parameter {k} has no gradient, the rows alone give one")
                continue
            err = (got.double() - g.double()).abs().max().item() / max(scale, 1e-12)
            if not err <= self.tol * 10:
                self._fail(f"{what}: gradient of {k}: max |Δ| / max |ref grad| = {err:.3g}")
        self.stock.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)

    def _check_router(self, what: str, outs: dict[str, Any], mask: Tensor, history: list[list[int]]) -> None:
        """Each real token's router logits (per MoE layer) vs the row alone."""
        got = outs.get("router_logits")
        B, W = mask.shape
        for b, toks in enumerate(history):
            if not toks:
                continue
            ids = torch.tensor([toks], dtype=torch.long)
            kwargs: dict[str, Any] = {"input_ids": ids, "use_cache": False, "output_router_logits": True}
            if self.ref.takes_positions:
                kwargs["position_ids"] = torch.arange(len(toks))[None]
            with torch.no_grad():
                ref = getattr(self.stock(**kwargs), "router_logits", None)
            if ref is None and got is None:  # the option does nothing on this model, stock or wrapped
                return
            if got is None or ref is None:
                self._fail(f"{what}: router_logits returned {got is not None}, by the stock model alone "
                           f"{ref is not None}")
            if len(ref) != len(got):
                self._fail(f"{what}: {len(got)} router logits, the stock model alone returns {len(ref)}")
            for i, (g, r) in enumerate(zip(got, ref)):
                if g is None or r is None or not isinstance(g, Tensor):
                    continue
                g = g.reshape(B, W, -1)[b][mask[b].bool()]
                self._check(f"{what}: router_logits[{i}] of row {b}", g, r.reshape(len(toks), -1))

    def _alone_grad(self, tokens: list[int]) -> Tensor:
        ids = torch.tensor([tokens], dtype=torch.long)
        kwargs: dict[str, Any] = {"input_ids": ids, "use_cache": False}
        if self.ref.takes_positions:
            kwargs["position_ids"] = torch.arange(len(tokens))[None]
        return self.stock(**kwargs).logits[0]


# --------------------------------------------------------------------------------------------------------------
# hypothesis: the state machine
# --------------------------------------------------------------------------------------------------------------


def _strategies(vocab: int):
    from hypothesis import strategies as st

    token = st.integers(FIRST_TOKEN, vocab - 1)

    @st.composite
    def batch(draw, min_rows: int = 1, max_rows: int = 3, max_len: int = 12, pads: bool = True,
              holes: bool = True, min_len: int = 1) -> Batch:
        n_rows = draw(st.integers(min_rows, max_rows))
        lens = [draw(st.integers(min_len, max_len)) for _ in range(n_rows)]
        width = max(lens) + (draw(st.integers(0, 2)) if pads else 0)
        side = draw(st.sampled_from(["right", "left"])) if pads else "right"
        rows: Batch = []
        for n in lens:
            toks: list[int | None] = [draw(token) for _ in range(n)]
            if holes and n > 1 and width > n and draw(st.booleans()):
                at = draw(st.integers(1, n - 1))
                toks = toks[:at] + [None] * (width - n) + toks[at:]
            elif side == "right" or not pads:
                toks = toks + [None] * (width - n)
            else:
                toks = [None] * (width - n) + toks
            rows.append(toks)
        return rows

    return st, token, batch


def machine_for(family: str, dtype: torch.dtype = torch.float32, wrap: bool = True) -> type:
    """A hypothesis ``RuleBasedStateMachine`` subclass fuzzing ``family`` (its rules draw :class:`Session` calls;
    ``wrap=False`` fuzzes the stock model, which must fail)."""
    from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

    stock, _ = _models(family, dtype, wrap)
    vocab = _io(stock).vocab
    st, token, batch = _strategies(vocab)
    moe = hasattr(_io(stock).text_config, "output_router_logits")

    class FuzzMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.s = Session(family, dtype, wrap=wrap)

        @initialize()
        def start(self) -> None:
            self.s.stats.sequences += 1

        @rule(b=batch(), pos=st.booleans(), labels=st.booleans(), backward=st.booleans(),
              hidden=st.booleans(), attn=st.booleans(), keep=st.sampled_from([0, 0, 0, 1, 2]),
              rd=st.sampled_from([True, True, False]), router=st.booleans())
        def forward(self, b, pos, labels, backward, hidden, attn, keep, rd, router) -> None:
            # labels with logits_to_keep is a transformers usage error (stock raises the same): not drawn
            self.s.forward(b, position_ids=pos, labels=labels, backward=backward, output_hidden_states=hidden,
                           output_attentions=attn, logits_to_keep=0 if labels else keep,
                           return_dict=rd or (router and moe), output_router_logits=router and moe)

        @rule(seqs=st.lists(st.lists(token, min_size=1, max_size=10), min_size=1, max_size=4),
              via=st.sampled_from(["position_ids", "seq_idx", "cu_seq_lens"]), labels=st.booleans(),
              backward=st.booleans(), router=st.booleans())
        def packed(self, seqs, via, labels, backward, router) -> None:
            self.s.packed(seqs, via=via, labels=labels, backward=backward, output_router_logits=router and moe)

        @rule(b=batch(holes=False, max_len=20), pos=st.booleans(), hidden=st.booleans(), attn=st.booleans(),
              rd=st.sampled_from([True, True, False]))
        def prefill(self, b, pos, hidden, attn, rd) -> None:
            self.s.prefill(b, position_ids=pos, output_hidden_states=hidden, output_attentions=attn,
                           return_dict=rd)

        @precondition(lambda self: self.s.stream is not None)
        @rule(data=st.data(), pos=st.booleans(), hidden=st.booleans(), attn=st.booleans(),
              rd=st.sampled_from([True, True, False]))
        def chunk(self, data, pos, hidden, attn, rd) -> None:
            n = len(self.s.stream.history)
            b = data.draw(batch(min_rows=n, max_rows=n, max_len=8, min_len=0, holes=False))
            b = [row if any(t is not None for t in row) or not row else row for row in b]
            self.s.chunk(b, position_ids=pos, output_hidden_states=hidden, output_attentions=attn, return_dict=rd)

        @precondition(lambda self: self.s.stream is not None)
        @rule(steps=st.lists(st.lists(token, min_size=4, max_size=4), min_size=1, max_size=3),
              pos=st.booleans())
        def decode(self, steps, pos) -> None:
            self.s.decode(steps, position_ids=pos)

        @rule(b=batch(holes=False, max_len=8), n=st.integers(1, 4), use_cache=st.booleans(),
              mode=st.sampled_from(["greedy", "greedy", "sample", "beam", "lookup"]), nrs=st.integers(1, 2),
              keep=st.booleans(), static=st.sampled_from([False, False, False, True]))
        def generate(self, b, n, use_cache, mode, nrs, keep, static) -> None:
            self.s.generate(b, max_new_tokens=n, use_cache=use_cache, mode=mode, num_return_sequences=nrs,
                            keep=keep, static=static)

        @precondition(lambda self: self.s.stream is not None)
        @rule(tokens=st.lists(token, min_size=1, max_size=3), n=st.integers(1, 3))
        def generate_more(self, tokens, n) -> None:
            self.s.generate_more(tokens, max_new_tokens=n)

        @precondition(lambda self: self.s.stream is not None)
        @rule()
        def fork(self) -> None:
            self.s.fork()

        @precondition(lambda self: self.s.saved is not None)
        @rule(copy=st.booleans())
        def restore(self, copy) -> None:
            self.s.restore(copy=copy)

        @precondition(lambda self: self.s.stream is not None)
        @rule(order=st.lists(st.integers(0, 3), min_size=1, max_size=4))
        def reorder(self, order) -> None:
            self.s.reorder(order)

    FuzzMachine.__name__ = FuzzMachine.__qualname__ = f"Fuzz_{family}"
    return FuzzMachine


def run_family(family: str, examples: int, steps: int = 6, seed: int | None = 0,
               dtype: torch.dtype = torch.float32, wrap: bool = True) -> FuzzStats:
    """Fuzz ``family``: ``examples`` call sequences of up to ``steps`` calls; ``seed`` fixes the draws (None:
    random). Raises :class:`FuzzFailure` (the shrunk repro) on the first failure. ``wrap=False`` fuzzes the
    stock model (a check of the oracle: it must fail)."""
    from hypothesis import HealthCheck, settings
    from hypothesis.stateful import run_state_machine_as_test

    machine = machine_for(family, dtype, wrap)
    stats = _stats(family if wrap else f"{family} (stock)")
    t0, c0 = time.perf_counter(), time.process_time()
    cfg = settings(
        max_examples=examples, stateful_step_count=steps, deadline=None, database=None,
        derandomize=seed is not None, print_blob=True, report_multiple_bugs=False,
        suppress_health_check=list(HealthCheck),
    )
    log = logging.getLogger("transformers")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        run_state_machine_as_test(machine, settings=cfg)
    finally:
        log.setLevel(level)
        stats.seconds += time.perf_counter() - t0
        stats.cpu_seconds += time.process_time() - c0
    return stats


def fuzz_families() -> list[str]:
    """Every supported tiny family the installed transformers has."""
    from .tiny import family_available, family_names

    return [f for f in family_names() if family_available(f)[0]]


def main(argv: list[str] | None = None) -> int:
    """``python -m safepad.testing.fuzz``: fuzz every family round-robin until ``--minutes`` pass; print the
    per-family counts, skipped draws and each failure's repro. Exit status 1 iff something failed."""
    p = argparse.ArgumentParser(prog="python -m safepad.testing.fuzz", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=float(os.environ.get("FUZZ_MINUTES", "10")))
    p.add_argument("--families", default=os.environ.get("FUZZ_FAMILIES", ""),
                   help="comma-separated families (default: every supported one)")
    p.add_argument("--examples", type=int, default=10, help="call sequences per family per round")
    p.add_argument("--steps", type=int, default=int(os.environ.get("FUZZ_STEPS", "8")))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    families = [f for f in args.families.split(",") if f] or fuzz_families()
    deadline = time.monotonic() + args.minutes * 60
    failed: dict[str, str] = {}
    rounds = 0
    while time.monotonic() < deadline:
        rounds += 1
        for fam in families:
            if fam in failed or time.monotonic() >= deadline:
                continue
            try:
                run_family(fam, args.examples, args.steps, seed=None)
            except Exception as exc:  # noqa: BLE001 -- collect, report, go on with the others
                failed[fam] = f"{type(exc).__name__}: {exc}"
                _stats(fam).failures.append(failed[fam])
        if len(failed) == len(families):
            break
    print(f"== safepad fuzz: {args.minutes:g} min, {rounds} rounds, {len(families)} families")
    for fam in families:
        print(_stats(fam).line())
    tot = [_stats(f) for f in families]
    print(f"total: sequences {sum(s.sequences for s in tot)}, calls {sum(s.calls for s in tot)}, "
          f"failures {len(failed)}")
    print("known defects (skipped draws): " + "; ".join(f"{d.item}: {d.reason}" for d in KNOWN_DEFECTS))
    for fam, msg in failed.items():
        print(f"\n==== FAILURE {fam} ====\n{msg}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
