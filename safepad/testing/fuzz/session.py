"""The session: one family's wrapped model, its stock twin, the live cached batch, and the calls a user makes
(each public method is one rule); each call checks its outputs against the oracle."""

from __future__ import annotations

import copy
import functools
import logging
import re
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from .core import (
    FIRST_TOKEN,
    PAD_ID,
    Batch,
    FuzzFailure,
    _io,
    _is_safepad_error,
    _layout,
    _models,
    _positions,
    _stats,
    _Stream,
)
from .entry import _EntryRules
from .forms import as_positional
from .trainer import _TrainerRules
from .known import KNOWN_DEFECTS, _output_carries_cache
from .oracle import _Oracle

__all__ = ["Session"]

logger = logging.getLogger(__name__)

_NO_FORWARD = object()
#: models whose ``forward`` a session compiled: id -> (model, the instance attribute it replaced)
_PATCHED: dict[int, tuple[nn.Module, Any]] = {}


def _unpatch(model: nn.Module) -> None:
    """Undo ``model.forward = torch.compile(model.forward)`` made by :meth:`Session.compile`."""
    entry = _PATCHED.pop(id(model), None)
    if entry is None:
        return
    if entry[1] is _NO_FORWARD:
        model.__dict__.pop("forward", None)
    else:
        model.forward = entry[1]


#: the wording of a shape mismatch in torch's errors (eager kernels and fake tensors)
_SHAPE_ERROR = re.compile(r"size of tensor .* must match|broadcast")


def _same_error_compiled(exc: BaseException, stock_exc: BaseException) -> bool:
    """A compiled call's error is the stock model's eager one: dynamo raises a ``RuntimeError`` from its fake-tensor
    run as ``TorchRuntimeError`` (``RuntimeError when making fake tensor call``), quoting it with symbolic sizes
    (``b (s70: hint = 2)`` for ``b (2)``): the stock message up to its first size appears in it. torch 2.15's fake
    tensors word a broadcast error their own way (``Attempting to broadcast a dimension ...``): a shape error of the
    fake-tensor run against a shape error of the stock model's eager run is the same error too."""
    from torch._dynamo.exc import TorchRuntimeError

    if not (isinstance(exc, TorchRuntimeError) and isinstance(stock_exc, RuntimeError)):
        return False
    head = re.split(r"[(\d]", str(stock_exc), maxsplit=1)[0]
    if len(head) >= 16 and head in str(exc):
        return True
    return "fake tensor" in str(exc) and all(_SHAPE_ERROR.search(str(e)) for e in (exc, stock_exc))


class Session(_EntryRules, _TrainerRules, _Oracle):
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
        from ..scenarios import _banned_tokens, default_tol

        self.family = family
        self.dtype = dtype
        self.skip_known = skip_known
        self.stock, self.model = _models(family, dtype, wrap)
        _unpatch(self.model)  # a compiled forward left by an earlier session that was not closed
        self.ref, self.io = _io(self.stock), _io(self.model)
        self.runner: nn.Module = self.model  # what calls go through: the model, or its torch.compile'd object
        self.compiled = "eager"
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
        # every call, stateless ones (a forward without a cache, a packed call) included: a compiled model carries
        # dynamo's caches and recompile counts from one call to the next, and eager code can keep module state, so
        # a repro without them may pass (recurrent_gemma and glm5_next compiled failures reproduced only after an
        # earlier packed call)
        args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        self.lines.append(f"s.{rule}({args})")

    def repro(self) -> str:
        """The calls so far, every one of them, as a standalone Python script."""
        return "\n".join(self.lines)

    def _fail(self, what: str) -> None:
        msg = (
            f"{self.family}: {what}\n--- repro (each call re-checks its outputs; the last one fails) ---\n"
            f"{self.repro()}\n---"
        )
        if self.stats.first_unshrunk is None:  # shrinking can take minutes: say what failed the moment it does
            self.stats.first_unshrunk = msg
            logger.warning("fuzz failure (as drawn, before shrinking):\n%s", msg)
        raise FuzzFailure(msg)

    def _skip(self, rule: str, call: dict[str, Any]) -> bool:
        if not self.skip_known:
            return False
        info = {**call, "stream": None, "compiled": self.compiled, "dtype": self.dtype}
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
                    if type(stock_exc) is type(exc) or _same_error_compiled(exc, stock_exc):
                        self.stats.refused += 1
                        self.lines.append(f"# stock refuses it too: {type(exc).__name__}: {str(exc)[:200]!r}")
                        return False, None
            tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-6:])
            self._fail(f"{rule} raised an error that is not safepad's (the stock model takes the same call):\n{tb}")
        return False, None  # unreachable

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

    def compile(self, mode: str = "model", backend: str = "eager") -> None:
        """Compile the subject as users do; every later call of this session goes through it (the oracle stays the
        stock eager model). ``mode``: ``"model"`` (``model = torch.compile(model)``, the object; ``generate`` is
        then the module's own, reached through the compiled object) or ``"forward"``
        (``model.forward = torch.compile(model.forward)``, undone by :meth:`close`). ``backend``: ``"eager"``
        (dynamo traces safepad's hooks with the forward and runs the captured graphs eagerly: the traced path,
        at a fraction of inductor's compile time) or ``"aot_eager"`` (AOTAutograd as well: functionalized forward
        and backward graphs)."""
        if mode not in ("model", "forward"):
            raise ValueError(f"compile mode {mode!r}: 'model' or 'forward'")
        self._record("compile", {"mode": mode, "backend": backend})
        self.close()
        torch._dynamo.reset()  # each compiled session traces afresh (no guards or recompile counts carried over)
        if mode == "model":
            self.runner = torch.compile(self.model, backend=backend)
        else:
            _PATCHED[id(self.model)] = (self.model, self.model.__dict__.get("forward", _NO_FORWARD))
            self.model.forward = torch.compile(self.model.forward, backend=backend)
        self.compiled = f"{mode}:{backend}"

    def close(self) -> None:
        """Back to eager: undo :meth:`compile` (the model objects are shared by every session of the process)."""
        _unpatch(self.model)
        self.runner, self.compiled = self.model, "eager"

    def prefill(self, batch: Batch, position_ids: bool = True, output_hidden_states: bool = False,
                output_attentions: bool = False, return_dict: bool = True, reset: bool = False) -> None:
        """A cached prefill (``use_cache=True``) of a padded batch: starts the live stream. ``reset``: into the
        live stream's cache after ``cache.reset()`` (a cache reused for a new batch: must equal a fresh cache)."""
        kw = dict(batch=batch, position_ids=position_ids, output_hidden_states=output_hidden_states,
                  output_attentions=output_attentions, return_dict=return_dict)
        old = self.stream.cache if reset and self.stream is not None else None
        if old is not None:
            if not callable(getattr(old, "reset", None)):
                return
            kw["reset"] = True
        ids, mask, flags = _layout(batch)
        rows = {"rows": len(batch), "stream_rows": len(self.stream.history) if self.stream is not None else 0}
        if self._skip("prefill", {**kw, **flags, "cached": True, "stream": None, **rows}):
            return
        self._record("prefill", kw)
        self.stream = None
        if old is not None:
            ok, _ = self._run("reset", old.reset)
            if not ok:
                return
        history = [[t for t in row if t is not None] for row in batch]
        kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": mask, "use_cache": True}
        if position_ids and self.io.takes_positions:
            kwargs["position_ids"] = _positions(mask)
        fresh = self.io.fresh_cache() if old is None else old
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
        if mode == "lookup":  # assisted generation serves one row: the first prompt, padded as drawn
            prompts = prompts[:1]
            ids, mask = ids[:1], mask[:1]
            side = "right" if not bool(mask[0, -1]) else "left" if not bool(mask[0, 0]) else "unpadded"
            self._surface(f"assisted:lookup_{side}{'_static' if static and use_cache else ''}")
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
        ok, out = self._run("generate", lambda: self._generate(self.runner, gkw),
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
            from ...cache import output_cache

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
        ok, out = self._run("generate_more", lambda: self._generate(self.runner, gkw))
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

    def select(self, indices: list[int]) -> None:
        """``cache.batch_select_indices(indices)`` (as contrastive search and assisted generation call it): keep
        those rows of the live stream, in that order; the histories follow."""
        if self.stream is not None:
            B = len(self.stream.history)
            idx = [i % B for i in indices] or [0]
            self._row_op("select", {"indices": indices}, "batch_select_indices", lambda: (torch.tensor(idx),), idx)

    def repeat(self, repeats: int) -> None:
        """``cache.batch_repeat_interleave(repeats)`` (as ``generate`` expands a cache for ``num_return_sequences``):
        each row of the live stream ``repeats`` times in a row; the histories follow."""
        if self.stream is not None:
            idx = [i for i in range(len(self.stream.history)) for _ in range(repeats)]
            self._row_op("repeat", {"repeats": repeats}, "batch_repeat_interleave", lambda: (repeats,), idx)

    def _row_op(self, rule: str, call: dict[str, Any], method: str, args: Callable[[], tuple], idx: list[int]) -> None:
        """Run the live cache's row operation ``method(*args())`` (stock's own cache refusing the same call counts
        as refused); on success the stream keeps rows ``idx`` of its histories, mask and pending tokens."""
        st = self.stream
        fn = getattr(st.cache, method, None)
        if not callable(fn) or self._skip(rule, {**call, "cached": True}):
            return
        self._record(rule, call)
        self.stream = None
        stock = lambda: getattr(self._stock_cache(len(st.history)), method)(*args())  # noqa: E731
        ok, _ = self._run(rule, lambda: fn(*args()), stock)
        if ok:
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
        """The call on the wrapped model; every other call hands its leading arguments positionally
        (``model(ids, mask, positions, ...)``, :func:`~safepad.testing.fuzz.forms.as_positional`), as users write it."""
        self._calls_made = getattr(self, "_calls_made", 0) + 1
        args: tuple = ()
        if self._calls_made % 2 == 0:
            args, kwargs = as_positional(self.model.forward, kwargs)
        self._surface("args:positional" if args else "args:keywords")
        if grad:
            out = self.runner(*args, **kwargs)
            loss = out["loss"] if isinstance(out, dict) or hasattr(out, "keys") else out[0]
            loss.backward()
            return out
        with torch.no_grad():
            return self.runner(*args, **kwargs)

    def _stock_call(self, kwargs: dict[str, Any]) -> Any:
        """The same call on the stock twin (a cache argument replaced by a fresh cache of the stock model's)."""
        kwargs = {k: v for k, v in kwargs.items() if k != self.io.cache_kw}
        fresh = self.ref.fresh_cache()
        if fresh is not None and kwargs.get("use_cache"):
            kwargs[self.ref.cache_kw] = fresh
        with torch.no_grad():
            return self.stock(**kwargs)

    def _stock_cache(self, rows: int) -> Any:
        """A cache the stock model filled with a ``rows``-row, 2-token prefill (to try a cache operation on)."""
        kwargs: dict[str, Any] = {"input_ids": torch.full((rows, 2), FIRST_TOKEN), "use_cache": True}
        fresh = self.ref.fresh_cache()
        if fresh is None and self.ref.cache_kw is not None and not _output_carries_cache(self.stock):
            from transformers import DynamicCache  # RecurrentGemma: the cache handed in is the one it fills

            fresh = DynamicCache(config=self.stock.config)
        if fresh is not None:
            kwargs[self.ref.cache_kw] = fresh
        with torch.no_grad():
            out = self.stock(**kwargs)
        cache = self._cache_of(dict(out.items()), kwargs)
        if cache is None:
            raise RuntimeError("the stock model returned no cache")
        return cache

    @staticmethod
    def _generate(model: nn.Module, gkw: dict[str, Any]) -> Any:
        with torch.no_grad():
            return model.generate(**gkw)
