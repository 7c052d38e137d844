"""The session's rule for the Trainer callbacks: :class:`~safepad.trainer_ext.PaddingGuardCallback` and
:class:`~safepad.trainer_ext.ShadowCheckCallback` (mode ``"error"``) in one optimizer step of a real
``transformers.Trainer`` on packed rows, on a correct run (the wrapped model, the safepad collator: no alarm) and
on a leaking one (the stock model fed packed rows whose boundaries are restarting ``position_ids`` only: an alarm
from the guard callback; from the shadow check exactly when the packed forward is off the sequences alone)."""

from __future__ import annotations

import tempfile
import warnings
from typing import Any

import torch

from .core import _build

__all__: list[str] = []

#: the boundary columns the leaking run's collator drops (restarting position_ids stay, as TRL's padding_free)
_BOUNDARY_KEYS = ("seq_idx", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


class _TrainerRules:
    """Rules of :class:`~safepad.testing.fuzz.Session` that drive a ``transformers.Trainer`` (a mixin)."""

    def callbacks(self, seqs: list[list[int]], wrapped: bool = True, which: str = "guard") -> None:
        """One optimizer step (learning rate 0) of a ``Trainer`` on a deep copy of the stock model (wrapped, or
        not), the sequences ``seqs`` packed by :class:`safepad.DataCollatorForPackedSSM` into one row, with
        ``which`` (``"guard"``: ``PaddingGuardCallback``; ``"shadow"``: ``ShadowCheckCallback(every_n_steps=1)``)
        in mode ``"error"``. The stock run's collator keeps restarting ``position_ids`` only."""
        from transformers import PrinterCallback, Trainer, TrainingArguments

        import safepad
        from ...errors import PaddingError

        if which == "shadow":  # copies of one sequence: the Trainer's shuffling leaves the packed row the same
            seqs = [seqs[0]] * len(seqs)
        seqs = [s for s in seqs if len(s) >= 2]
        if len(seqs) < 2:
            return
        kw = dict(seqs=seqs, wrapped=wrapped, which=which)
        if self._skip("callbacks", {**kw, "cached": False}):
            return
        self._record("callbacks", kw)
        self._surface(f"callbacks:{which}_{'wrapped' if wrapped else 'stock'}")
        # a fresh build of the same weights (seeded): the shared stock twin may hold module states of earlier calls
        # that a deep copy refuses (RecurrentGemma's, with a grad_fn after an oracle backward)
        model = _build(self.family, self.dtype)
        model.train()
        if wrapped:
            model = safepad.wrap(model)
        inner = safepad.DataCollatorForPackedSSM()

        def collate(features: list[dict[str, Any]]) -> dict[str, Any]:
            out = inner(features)
            return out if wrapped else {k: v for k, v in out.items() if k not in _BOUNDARY_KEYS}

        cb = (safepad.PaddingGuardCallback(mode="error") if which == "guard"
              else safepad.ShadowCheckCallback(every_n_steps=1, mode="error"))
        alarm: BaseException | None = None
        with tempfile.TemporaryDirectory() as tmp:
            args = TrainingArguments(
                output_dir=tmp, per_device_train_batch_size=len(seqs), max_steps=1, learning_rate=0.0,
                report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
                logging_steps=1,
            )
            trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": s} for s in seqs],
                              data_collator=collate, callbacks=[cb])
            trainer.remove_callback(PrinterCallback)  # the step's logs would print on every draw
            self.stats.calls += 1
            self.stats.rules["callbacks"] = self.stats.rules.get("callbacks", 0) + 1
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    trainer.train()
                except PaddingError as exc:
                    alarm = exc
                except Exception as exc:  # noqa: BLE001 -- the oracle decides
                    from .core import _is_safepad_error

                    if not _is_safepad_error(exc):
                        self._fail(f"callbacks ({which}): the Trainer step raised {type(exc).__name__}: {exc}")
                    self.stats.refused += 1
                    self.lines.append(f"# refused by safepad: {type(exc).__name__}: {str(exc)[:200]!r}")
                    return
        if wrapped and alarm is not None:
            self._fail(f"callbacks ({which}): an alarm on a correct run (wrapped, safepad's collator): {alarm}")
        if wrapped:
            return
        if which == "guard":
            if alarm is None:
                self._fail("callbacks (guard): no alarm on the stock model fed packed rows (position_ids only)")
            return
        from ...trainer_ext import SHADOW_TOLERANCES

        tol = SHADOW_TOLERANCES[self.dtype]
        err = self._packed_error(seqs)
        if err > 2 * tol and alarm is None:
            self._fail(f"callbacks (shadow): no alarm, the stock packed forward is {err:.3g} off the sequence alone")
        if err < tol / 2 and alarm is not None:
            self._fail(f"callbacks (shadow): an alarm, the stock packed forward is {err:.3g} off: {alarm}")
        # between tol / 2 and 2 tol the two verdicts may differ by rounding: such a draw says nothing

    def _packed_error(self, seqs: list[list[int]]) -> float:
        """``max |Δ logits| / max |logits alone|`` of the stock model's forward of ``seqs`` packed in one row
        (restarting ``position_ids`` only) at ``seqs[1]`` (the sequence the shadow check takes first) vs it alone:
        the independent reference of the shadow check's verdict (the Trainer shuffles the rows: the rule draws
        copies of one sequence, so the order does not matter)."""
        ids = torch.tensor([[t for s in seqs for t in s]], dtype=torch.long)
        kwargs: dict[str, Any] = {"input_ids": ids, "use_cache": False}
        if self.ref.takes_positions:
            kwargs["position_ids"] = torch.cat([torch.arange(len(s)) for s in seqs])[None]
        with torch.no_grad():
            logits = self.stock(**kwargs).logits[0].float()
        at = len(seqs[0])
        ref = self._alone(seqs[1])
        return ((logits[at : at + len(seqs[1])] - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
