"""The session's rules for the input forms and the entry points beyond a plain forward: attention-mask forms and
``position_ids`` conventions, degenerate sizes, :func:`safepad.packed_logprobs` (and its entropy),
:func:`safepad.guard` on leaking and correct runs, and the audit's verdict (:func:`safepad.testing.scenarios.audit`)
on a correct and on a defective wrapped model. Each rule counts its surface (:attr:`FuzzStats.surfaces`)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor, nn

from .core import Batch, _build, _layout, _models, _Stream
from .forms import mask_in_form, positions_in_form, stacked
from .known import _output_carries_cache

__all__: list[str] = []

#: the parameters an injected audit defect perturbs (+0.1), the first one a model has, in this order
_DEFECT_PARAMS: tuple[str, ...] = ("dt_bias", "A_log", "recurrent_param", "conv1d.weight", "conv_1d.weight", "conv.weight",
                                   "conv_qk_depthwise.weight", "conv_qk_grouped.weight", "v_proj_delayed.weight")


@functools.lru_cache(maxsize=None)
def _defective(family: str, dtype: torch.dtype) -> str | None:
    """The name of the parameter the injected audit defect perturbs in ``family`` (the first of
    :data:`_DEFECT_PARAMS` whose + 0.1 moves the logits of a probe by more than 1e-2 relative, measured here), or
    None when none does."""
    import copy

    stock, _ = _models(family, dtype)
    probe = torch.arange(3, 15)[None] % (int(stock.config.get_text_config().vocab_size) - 3) + 3
    with torch.no_grad():
        ref = stock(input_ids=probe, use_cache=False).logits.double()
    names = [n for n, _ in stock.named_parameters()]
    for suffix in _DEFECT_PARAMS:
        for name in (n for n in names if n.endswith(suffix)):
            moved = copy.deepcopy(stock)
            with torch.no_grad():
                dict(moved.named_parameters())[name].add_(0.1)
                got = moved(input_ids=probe, use_cache=False).logits.double()
            if ((got - ref).abs().max() / ref.abs().max().clamp_min(1.0)).item() > 1e-2:
                return name
    return None


def _perturbed_wrap(param: str):
    """A ``wrap_fn`` for :func:`safepad.testing.scenarios.audit` that wraps and then adds 0.1 to ``param``: a
    wrapped model that is wrong everywhere (the audit must say FAIL)."""
    import safepad

    def wrap_fn(model: nn.Module) -> nn.Module:
        wrapped = safepad.wrap(model)
        with torch.no_grad():
            dict(wrapped.named_parameters())[param].add_(0.1)
        return wrapped

    return wrap_fn


class _EntryRules:
    """Rules of :class:`~safepad.testing.fuzz.Session` for input forms and entry points (a mixin: it uses the
    session's models, oracle and bookkeeping)."""

    def _surface(self, name: str) -> None:
        self.stats.surfaces[name] = self.stats.surfaces.get(name, 0) + 1

    # ---- reference: a row alone with given positions --------------------------------------------------------

    def _alone_at(self, tokens: list[int], positions: list[int] | None) -> Tensor:
        """``[L, V]`` float logits of ``tokens`` alone through stock, at ``positions`` (None: the default), with an
        explicit all-ones 2-D mask (transformers reads no packing next to a mask)."""
        if positions is None or not self.ref.takes_positions:
            return self._alone(tokens)
        ids = torch.tensor([tokens], dtype=torch.long)
        with torch.no_grad():
            out = self.stock(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False,
                             position_ids=torch.tensor([positions], dtype=torch.long))
        return out.logits[0].float()

    def _alone_segments(self, tokens: list[int], positions: list[int] | None) -> Tensor:
        """``[L, V]`` logits of ``tokens`` read as safepad documents ``position_ids`` (docs/limits.md, "position_ids
        layouts read as packing"): a new sequence at each 0 after the row's first real token; each sequence alone
        through stock at its positions."""
        if positions is None:
            return self._alone(tokens)
        starts = [0] + [i for i in range(1, len(positions)) if positions[i] == 0] + [len(tokens)]
        return torch.cat([self._alone_at(tokens[a:z], positions[a:z]) for a, z in zip(starts, starts[1:])])

    # ---- masks and positions ------------------------------------------------------------------------------

    def _start_stream_cache(self, kwargs: dict[str, Any]) -> None:
        """A cached call that starts the live stream: drop the old one and hand the call a fresh cache (a
        ``DynamicCache`` where the model's own output carries none)."""
        self.stream = None
        fresh = self.io.fresh_cache()
        if fresh is None and self.io.cache_kw is not None and not _output_carries_cache(self.stock):
            from transformers import DynamicCache

            fresh = DynamicCache(config=self.model.config)
        if fresh is not None:
            kwargs[self.io.cache_kw] = fresh

    def forms(self, batch: Batch, mask_form: str = "int", positions: str = "arange", offset: int = 0,
              cached: bool = False, blank: bool = False) -> None:
        """A forward of a padded batch with its attention mask in ``mask_form`` (:data:`forms.MASK_FORMS`) and
        ``position_ids`` in ``positions`` (:data:`forms.POSITION_FORMS`; ``offset`` for ``"offset"``). Uncached, or
        a cached prefill that starts the live stream (``cached``; positions ``none`` / ``arange`` only there, the
        convention every later call continues). ``blank``: the last row is all pads (of a batch of several; in
        the first call of a cached session, its first real token comes in a later call). Each row equals the row
        alone at its positions, or safepad raises (a 4-D mask hiding pads: the recurrent layers cannot read it)."""
        if cached and positions not in ("none", "arange"):
            positions = "arange"
        if blank and len(batch) > 1:
            batch = [*batch[:-1], [None] * len(batch[-1])]
        kw = dict(batch=batch, mask_form=mask_form, positions=positions, offset=offset, cached=cached)
        ids, mask, flags = _layout(batch)
        if self._skip("forms", {**kw, **flags, "cached": cached}):
            return
        self._record("forms", kw)
        self._surface(f"mask:{mask_form}")
        self._surface(f"positions:{positions}")
        if any(all(t is None for t in row) for row in batch):
            self._surface("sizes:pad_row_first_call" if cached else "sizes:pad_row")
        history = [[t for t in row if t is not None] for row in batch]
        kwargs: dict[str, Any] = {"input_ids": ids, "use_cache": cached,
                                  "attention_mask": mask_in_form(mask, mask_form, ids.shape[1], self.dtype)}
        pos = positions_in_form(mask, positions, offset=offset) if self.io.takes_positions else None
        if pos is not None:
            kwargs["position_ids"] = stacked(pos, positions)
        if cached:
            self._start_stream_cache(kwargs)
        ok, out = self._run("forms", lambda: self._call(kwargs), lambda: self._stock_call(kwargs))
        if not ok:
            return
        for b, toks in enumerate(history):
            m = mask[b].bool()
            if not toks:
                continue
            at = None if pos is None else pos[b][m].tolist()
            self._check(f"forms ({mask_form}, positions {positions}): logits of row {b}", out.logits[b][m],
                        self._alone_segments(toks, at))
        if cached:
            cache = self._cache_of(dict(out.items()), kwargs)
            if cache is None:
                self._fail("forms: use_cache=True returned no cache")
            self.stream = _Stream(history, mask, cache, right=flags["right"],
                                  padded=flags["right"] or flags["left"] or flags["holes"])

    def chunk_form(self, batch: Batch, mask_form: str = "int", position_ids: bool = True) -> None:
        """The next chunk of the live stream with its full-length mask in ``mask_form`` (the form may change from
        one call of the cached session to the next); rows vs the rows alone, or a safepad raise."""
        st = self.stream
        if st is None or not batch or not batch[0] or st.pending is not None:
            return
        kw = dict(batch=batch, mask_form=mask_form, position_ids=position_ids)
        ids, mask, flags = _layout(batch)
        if self._skip("chunk_form", {**kw, **flags, "cached": True}):
            return
        self._record("chunk_form", kw)
        self._surface(f"mask:{mask_form}")
        self._surface("mask:changes" if mask_form != "int" else "mask:int")
        full = torch.cat([st.mask, mask], dim=1)
        history = [h + [t for t in row if t is not None] for h, row in zip(st.history, batch)]
        kwargs: dict[str, Any] = {"input_ids": ids, "use_cache": True, self.io.cache_kw: st.cache,
                                  "attention_mask": mask_in_form(full, mask_form, ids.shape[1], self.dtype)}
        if position_ids and self.io.takes_positions:
            kwargs["position_ids"] = positions_in_form(mask, "arange", start=st.mask.sum(-1))
        self.stream = None
        ok, out = self._run("chunk_form", lambda: self._call(kwargs))
        if not ok:
            return
        self._compare_rows(f"chunk_form ({mask_form})", dict(out.items()), mask, history)
        cache = self._cache_of(dict(out.items()), kwargs)
        self.stream = _Stream(history, full, cache if cache is not None else st.cache,
                              right=st.right or flags["right"],
                              padded=st.padded or flags["right"] or flags["left"] or flags["holes"])

    def restarts(self, rows: list[list[list[int]]]) -> None:
        """Rows of packed sequences with ``position_ids`` restarting at 0 and no mask and no cache: transformers'
        packing detection (``find_packed_sequence_indices``) reads each row's sequences; rows of equal width
        (each row's sequences back to back, the rows' boundaries at different columns). Each sequence equals it
        alone, or safepad raises."""
        if not self.ref.takes_positions:
            return
        width = min(sum(len(s) for s in r) for r in rows)
        rows = [self._cut(r, width) for r in rows]
        if width == 0:
            return
        kw = dict(rows=rows)
        if self._skip("restarts", {**kw, "cached": False}):
            return
        self._record("restarts", kw)
        self._surface("positions:restarts")
        ids = torch.tensor([[t for s in r for t in s] for r in rows], dtype=torch.long)
        pos = torch.tensor([[i for s in r for i in range(len(s))] for r in rows], dtype=torch.long)
        kwargs = {"input_ids": ids, "position_ids": pos, "use_cache": False}
        ok, out = self._run("restarts", lambda: self._call(kwargs), lambda: self._stock_call(kwargs))
        if not ok:
            return
        for b, r in enumerate(rows):
            at = 0
            for i, s in enumerate(r):
                self._check(f"restarts: logits of row {b} sequence {i}", out.logits[b, at : at + len(s)],
                            self._alone(s))
                at += len(s)

    @staticmethod
    def _cut(seqs: list[list[int]], width: int) -> list[list[int]]:
        out, n = [], 0
        for s in seqs:
            if n >= width:
                break
            out.append(s[: width - n])
            n += len(out[-1])
        return out

    # ---- degenerate sizes ---------------------------------------------------------------------------------

    def sizes(self, kind: str, rows: int = 2, cached: bool = False, token: int = 5) -> None:
        """Degenerate sizes: ``"batch0"`` (``[0, 3]``), ``"len0"`` (``[rows, 0]``), ``"single"`` (one token a row),
        ``"single_pad"`` (one token, the last row a pad). Uncached, or cached (a one-token prefill starts the live
        stream). Outputs equal the rows alone (empty ones: stock's shape), or safepad raises (or stock refuses the
        same call with the same error)."""
        kw = dict(kind=kind, rows=rows, cached=cached, token=token)
        if self._skip("sizes", {**kw, "cached": cached}):
            return
        self._record("sizes", kw)
        self._surface(f"sizes:{kind}")
        if kind == "batch0":
            batch: Batch = []
            ids, mask = torch.zeros(0, 3, dtype=torch.long), torch.zeros(0, 3, dtype=torch.long)
        elif kind == "len0":
            batch = [[] for _ in range(rows)]
            ids, mask = torch.zeros(rows, 0, dtype=torch.long), torch.zeros(rows, 0, dtype=torch.long)
        else:
            batch = [[token + b] for b in range(rows)]
            if kind == "single_pad" and rows > 1:
                batch[-1] = [None]
            ids, mask, _ = _layout(batch)
        kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": mask, "use_cache": cached}
        if cached:
            self._start_stream_cache(kwargs)
        ok, out = self._run("sizes", lambda: self._call(kwargs), lambda: self._stock_as_compiled(kwargs))
        if not ok:
            return
        if ids.numel() == 0:
            try:
                want = self._stock_call(kwargs).logits.shape
            except Exception:  # noqa: BLE001 -- stock refuses it; the wrapped model's answer is checked for shape only
                want = torch.Size([ids.shape[0], ids.shape[1], out.logits.shape[-1]])
            if tuple(out.logits.shape) != tuple(want):
                self._fail(f"sizes {kind}: logits {tuple(out.logits.shape)}, stock gives {tuple(want)}")
            return
        history = [[t for t in row if t is not None] for row in batch]
        self._compare_rows(f"sizes {kind}", dict(out.items()), mask, history)
        if cached:
            cache = self._cache_of(dict(out.items()), kwargs)
            if cache is not None:
                self.stream = _Stream(history, mask, cache, padded=kind == "single_pad")

    def _stock_as_compiled(self, kwargs: dict[str, Any]) -> Any:
        """The same call on the stock twin, compiled as the session's subject is (``torch.compile`` of its forward
        with the session's backend; eager sessions: eager): dynamo refuses some calls stock eager takes (an empty
        ``[0, T]`` / ``[B, 0]`` batch: a ``view(..., -1)`` of 0 elements in transformers' attention)."""
        if self.compiled == "eager":
            return self._stock_call(kwargs)
        backend = self.compiled.split(":")[1]
        kwargs = {k: v for k, v in kwargs.items() if k != self.io.cache_kw}
        with torch.no_grad():
            return torch.compile(self.stock.forward, backend=backend)(**kwargs)

    # ---- RL: packed log-probs -----------------------------------------------------------------------------

    def logprobs(self, batch: Batch, completion: list[bool], temperature: float = 1.0, entropy: bool = False,
                 backward: bool = False) -> None:
        """:func:`safepad.packed_logprobs` (``entropy``: :func:`safepad.packed_logprobs_and_entropy`) of a padded
        batch (one contiguous sequence a row; ``completion[j % len]`` marks column ``j`` scored) vs each row alone
        through stock: ``log_softmax(logits / temperature)`` of each scored token given its predecessors;
        ``backward``: the gradients of the summed log-probs as well."""
        import safepad

        kw = dict(batch=batch, completion=completion, temperature=temperature, entropy=entropy, backward=backward)
        ids, mask, flags = _layout(batch)
        if self._skip("logprobs", {**kw, **flags, "cached": False}):
            return
        self._record("logprobs", kw)
        self._surface("rl:logprobs_entropy" if entropy else "rl:logprobs")
        W = ids.shape[1]
        comp = torch.tensor([[int(completion[j % len(completion)]) for j in range(W)] for _ in batch],
                            dtype=torch.long) * mask
        fn = safepad.packed_logprobs_and_entropy if entropy else safepad.packed_logprobs
        self.model.zero_grad(set_to_none=True)

        def call():
            if backward:
                out = fn(self.model, ids, mask, completion_mask=comp, temperature=temperature)
                lp = out[0] if entropy else out
                lp.sum().backward()
                return out
            with torch.no_grad():
                return fn(self.model, ids, mask, completion_mask=comp, temperature=temperature)

        ok, out = self._run("logprobs", call)
        if not ok:
            return
        lp, ent = (out[0], out[1]) if entropy else (out, None)
        if tuple(lp.shape) != tuple(ids.shape):
            self._fail(f"logprobs: shape {tuple(lp.shape)}, input_ids {tuple(ids.shape)}")
        ref_lp = torch.zeros(ids.shape, dtype=torch.float64)
        ref_ent = torch.zeros(ids.shape, dtype=torch.float64)
        self.stock.zero_grad(set_to_none=True)
        total = None
        for b, row in enumerate(batch):
            cols = [j for j, t in enumerate(row) if t is not None]
            if len(cols) < 2:
                continue
            toks = [row[j] for j in cols]
            pick = [i for i in range(1, len(cols)) if comp[b, cols[i]]]
            if not pick:
                continue
            lg = self._alone_grad(toks) if backward else self._alone(toks)
            logp = torch.log_softmax(lg.float() / temperature, dim=-1)
            for i in pick:
                ref_lp[b, cols[i]] = logp[i - 1, toks[i]].double().detach()
                ref_ent[b, cols[i]] = -(logp[i - 1].exp() * logp[i - 1]).sum().double().detach()
            if backward:
                term = torch.stack([logp[i - 1, toks[i]] for i in pick]).sum()
                total = term if total is None else total + term
        self._check("logprobs: log-probs", lp, ref_lp)
        if ent is not None:
            self._check("logprobs: entropy", ent, ref_ent)
        if backward and total is not None:
            total.backward()
            self._check_grads("logprobs")
        elif backward:  # nothing scored: the backward ran, and moved nothing
            for k, p in self.model.named_parameters():
                if p.grad is not None and bool(p.grad.any()):
                    self._fail(f"logprobs: nothing scored, yet parameter {k} has a nonzero gradient")
        self.stock.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)

    def grpo(self, batch: Batch, keep: int = 2, batch_size: int = 0, entropy: bool = False,
             temperature: float = 1.0) -> None:
        """:class:`safepad.PackedGRPOMixin`'s ``_get_per_token_logps_and_entropies`` (TRL's contract: the last
        ``keep`` columns of ``[prompt | completion]`` rows, micro-batches of ``batch_size`` rows, 0: all) on a
        minimal trainer object (``temperature``, an accelerator whose autocast does nothing) vs each row alone
        through stock."""
        import contextlib

        from ...trainer_ext import PackedGRPOMixin

        kw = dict(batch=batch, keep=keep, batch_size=batch_size, entropy=entropy, temperature=temperature)
        ids, mask, flags = _layout(batch)
        W = ids.shape[1]
        keep = max(1, min(keep, W))
        if self._skip("grpo", {**kw, **flags, "cached": False}):
            return
        self._record("grpo", kw)
        self._surface("rl:grpo_mixin")

        class _Accelerator:
            autocast = staticmethod(contextlib.nullcontext)

        class _Trainer(PackedGRPOMixin):
            pass

        trainer = _Trainer()
        trainer.temperature, trainer.accelerator = temperature, _Accelerator()
        ok, out = self._run("grpo", lambda: trainer._get_per_token_logps_and_entropies(
            self.model, ids, mask, keep, batch_size or None, compute_entropy=entropy))
        if not ok:
            return
        lp, ent, _ = out
        ref_lp = torch.zeros(len(batch), keep, dtype=torch.float64)
        ref_ent = torch.zeros(len(batch), keep, dtype=torch.float64)
        for b, row in enumerate(batch):
            cols = [j for j, t in enumerate(row) if t is not None]
            toks = [row[j] for j in cols]
            if len(toks) < 2:
                continue
            logp = torch.log_softmax(self._alone(toks).float() / temperature, dim=-1)
            for i in range(1, len(cols)):
                if cols[i] >= W - keep:
                    ref_lp[b, cols[i] - (W - keep)] = logp[i - 1, toks[i]].double()
                    ref_ent[b, cols[i] - (W - keep)] = -(logp[i - 1].exp() * logp[i - 1]).sum().double()
        self._check("grpo: log-probs", lp, ref_lp)
        if entropy:
            if ent is None:
                self._fail("grpo: compute_entropy=True returned no entropies")
            self._check("grpo: entropies", ent, ref_ent)

    def _check_grads(self, what: str) -> None:
        """Every parameter gradient of the subject vs the stock one (relative to the largest stock gradient)."""
        ref = {k: p.grad for k, p in self.stock.named_parameters() if p.grad is not None}
        got = {k: p.grad for k, p in self.model.named_parameters() if p.grad is not None}
        scale = max((g.abs().max().item() for g in ref.values()), default=0.0)
        for k, g in ref.items():
            o = got.get(k)
            err = g.abs().max().item() if o is None else (o.double() - g.double()).abs().max().item()
            if not err <= self.tol * 10 * max(scale, 1e-12):
                self._fail(f"{what}: gradient of {k}: max |Δ| / max |ref grad| = {err / max(scale, 1e-12):.3g}")

    # ---- guard -------------------------------------------------------------------------------------------

    def guard(self, batch: Batch, wrapped: bool = True, packed: bool = False) -> None:
        """:func:`safepad.guard` (mode ``"error"``) on the wrapped model (never an alarm) or on the stock twin
        (``wrapped=False``): an alarm (``PaddingError``) exactly when the call leaks, i.e. a row with padding after
        real tokens in a cached call, or a packed row (``packed``: the batch's rows back to back with restarting
        ``position_ids``, or ``seq_idx`` where the forward takes no positions)."""
        import safepad
        from ...errors import PaddingError

        kw = dict(batch=batch, wrapped=wrapped, packed=packed)
        ids, mask, flags = _layout(batch)
        seqs = [[t for t in row if t is not None] for row in batch]
        if packed and (len(seqs) < 2 or any(not s for s in seqs)):
            return
        if self._skip("guard", {**kw, **flags, "cached": not packed}):
            return
        self._record("guard", kw)
        self._surface("guard:wrapped" if wrapped else "guard:stock")
        model = self.model if wrapped else self.stock
        io = self.io if wrapped else self.ref
        if packed:
            pids = torch.tensor([[t for s in seqs for t in s]], dtype=torch.long)
            kwargs: dict[str, Any] = {"input_ids": pids, "use_cache": False}
            if io.takes_positions:
                kwargs["position_ids"] = torch.cat([torch.arange(len(s)) for s in seqs])[None]
            else:
                kwargs["seq_idx"] = torch.cat([torch.full((len(s),), i, dtype=torch.int32)
                                               for i, s in enumerate(seqs)])[None]
            leaks = True
        else:
            kwargs = {"input_ids": ids, "attention_mask": mask, "use_cache": True}
            fresh = io.fresh_cache()
            if fresh is None and io.cache_kw is not None and not _output_carries_cache(self.stock):
                from transformers import DynamicCache

                fresh = DynamicCache(config=model.config)
            if fresh is not None:
                kwargs[io.cache_kw] = fresh
            leaks = flags["right"] or flags["holes"]
        handle = safepad.guard(model, mode="error")
        alarm: BaseException | None = None
        try:
            with torch.no_grad():
                model(**kwargs)
        except PaddingError as exc:
            alarm = exc
        except Exception as exc:  # noqa: BLE001 -- a refusal of the call itself (safepad's or stock's) tells nothing
            self.lines.append(f"# the guarded call raised {type(exc).__name__}: {str(exc)[:160]!r}")
            return
        finally:
            handle.remove()
        if wrapped and alarm is not None:
            self._fail(f"guard: an alarm on the wrapped model, which cannot leak: {alarm}")
        if not wrapped and leaks and alarm is None:
            self._fail("guard: no alarm on the stock model fed " + ("a packed row" if packed else
                       "rows with padding after real tokens into a cache"))
        if not wrapped and not packed and not bool((mask == 0).any()) and alarm is not None:
            self._fail(f"guard: an alarm on the stock model fed rows without any padding: {alarm}")

    # ---- the audit's verdict ------------------------------------------------------------------------------

    def audit(self, scenario: str, defect: bool = False) -> None:
        """:func:`safepad.testing.scenarios.audit` of one scenario: through ``wrap_fn=safepad.wrap`` the verdict is
        PASS; through a ``wrap_fn`` that wraps and adds 0.1 to a recurrent parameter (``defect``) it is FAIL
        (where the scenario applies)."""
        import safepad
        from ..scenarios import audit

        kw = dict(scenario=scenario, defect=defect)
        if self._skip("audit", {**kw, "cached": True}):
            return
        param = _defective(self.family, self.dtype) if defect else None
        if defect and param is None:
            return
        self._record("audit", kw)
        self._surface("audit:defect" if defect else "audit:correct")
        wrap_fn = _perturbed_wrap(param) if defect else safepad.wrap
        # a fresh tiny model (the factory form): the shared stock twin may hold module states of earlier calls
        factory = functools.partial(_build, self.family, self.dtype)
        # half precision judges a defect by the whole audit: one scenario's error may sit within 3x the dtype's
        # rounding (a clamped dt, a short decode) while the audit as a whole fails it (docs/audit.md)
        whole = defect and self.dtype in (torch.bfloat16, torch.float16)
        ok, report = self._run("audit", lambda: audit(factory, wrap_fn, None if whole else [scenario]))
        if not ok:
            return
        if whole:
            applicable = [r for r in report.wrapped if r.applicable]
            if applicable and all(r.passed for r in applicable):
                worst = max(applicable, key=lambda r: r.rms_logits or 0.0)
                self._fail(f"audit ({self.dtype}, every scenario): PASS on a wrapped model with {param} + 0.1 "
                           f"(largest rms |Δ logits| {worst.rms_logits} in {worst.name})")
            return
        (res,) = report.wrapped
        if not res.applicable:
            return
        if defect and res.passed:
            self._fail(f"audit {scenario}: PASS on a wrapped model with {param} + 0.1 (max |Δ logits| "
                       f"{res.max_abs_logits})")
        if not defect and not res.passed:
            self._fail(f"audit {scenario}: FAIL on the correctly wrapped model: {res.to_dict()}")

