"""The oracle: each row run alone through the stock model (no padding, no cache) and the comparisons of a call's
outputs with it: logits, hidden states, attentions, loss, gradients, router logits, generated tokens. The
tolerance is relative, ``max |Δ| <= tol * max(1, max |ref|)``."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .core import _rel

__all__: list[str] = []


class _Oracle:
    """The reference runs and comparisons of :class:`~safepad.testing.fuzz.Session` (a mixin: it uses the
    session's ``stock``, ``ref``, ``tol``, ``banned``, ``_memo`` and ``_fail``)."""

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
        from ..scenarios import _greedy

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
