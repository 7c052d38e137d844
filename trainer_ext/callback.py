"""``PaddingGuardCallback``: the safepad guard for ``transformers.Trainer`` (and TRL's trainers).

It installs :func:`safepad.guard` on the model at train begin and removes it at train end, warns at train
begin when the tokenizer pads on the right for an unwrapped SSM model, and adds the guard's batch
statistics to the Trainer's logs at every logging step::

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[PaddingGuardCallback(mode="error")])
"""

from __future__ import annotations

import inspect
import logging
import warnings
from typing import Any

from transformers import TrainerCallback

from safepad.errors import PaddingError, PaddingWarning
from safepad.guard import GUARD_MODES, GuardHandle, get_guard, guard

from .dispatch import adapt_dispatcher
from .logs import add_to_logs

logger = logging.getLogger(__name__)

__all__ = ["KIND_DROPPED_BOUNDARIES", "KIND_TOKENIZER", "PaddingGuardCallback"]

KIND_TOKENIZER = "right_padding_tokenizer"
KIND_DROPPED_BOUNDARIES = "dropped_boundary_columns"
_BOUNDARY_COLUMNS = frozenset({"seq_lengths", "position_ids"})


def _calling_trainer() -> Any:
    """The ``transformers.Trainer`` whose callback event is running (a few frames up), or None."""
    from transformers import Trainer

    frame = inspect.currentframe()
    try:
        for _ in range(16):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, Trainer):
                return candidate
        return None
    finally:
        del frame


def _padding_side(processing_class: Any) -> str | None:
    """``padding_side`` of a tokenizer, or of the tokenizer inside a processor; ``None`` when there is none."""
    if processing_class is None:
        return None
    side = getattr(processing_class, "padding_side", None)
    if side is None:
        side = getattr(getattr(processing_class, "tokenizer", None), "padding_side", None)
    return side if isinstance(side, str) else None


class PaddingGuardCallback(TrainerCallback):
    """Guard a Trainer's model against padding / packing layouts that an unwrapped SSM gets silently wrong.

    Args:
        mode: passed to :func:`safepad.guard`: ``"warn"``, ``"error"`` or ``"fix"``.
        log_stats: add ``safepad/pad_fraction``, ``safepad/tokens_per_batch``, ``safepad/sequences_per_batch``
            and ``safepad/right_padded_default_cache`` (means over the forwards since the previous log) to the
            Trainer's logs; evaluation logs get the same keys prefixed with ``eval_``.

    The logs dict is mutated in ``on_log`` and the entry that the Trainer has just appended to
    ``state.log_history`` is updated too. Reporting integrations (wandb, tensorboard, ...) run their
    ``on_log`` before user callbacks, so they do not see these keys; ``ProgressCallback`` / ``PrinterCallback``
    and callbacks added after this one do.

    The right-padding tokenizer check only warns, in modes "warn" and "error" (in "fix" mode the guard wraps
    the model before any forward that needs it): training on right-padded rows without a cache is correct; it
    is generation / evaluation with a cache that goes wrong, which the guard catches.

    A guard the user installed with :func:`safepad.guard` is reused (and left in place at train end); one
    left behind by an earlier run of this callback that raised is replaced.
    """

    def __init__(self, mode: str = "warn", log_stats: bool = True) -> None:
        if mode not in GUARD_MODES:
            raise ValueError(f"mode must be one of {GUARD_MODES}, got {mode!r}")
        self.mode = mode
        self.log_stats = bool(log_stats)
        self.handle: GuardHandle | None = None
        self._owns_handle = False
        self._warned: set[str] = set()

    def on_train_begin(self, args, state, control, model=None, processing_class=None, **kwargs):
        if model is None:
            raise ValueError("PaddingGuardCallback needs the Trainer to pass `model` to on_train_begin")
        self._warned = set()
        existing = get_guard(model)
        if existing is not None and existing.installed_by == type(self).__name__:
            # left behind by a run that raised before on_train_end (e.g. mode="error"): replace it
            existing.remove()
            existing = None
        if existing is not None:
            logger.info("PaddingGuardCallback: reusing the safepad guard installed on the model by the user")
            self.handle, self._owns_handle = existing, False
        else:
            self.handle, self._owns_handle = guard(model, self.mode, collect_stats=self.log_stats), True
            self.handle.installed_by = type(self).__name__
        self._check_boundary_columns(args, model, kwargs.get("train_dataloader"))
        adapt_dispatcher(kwargs.get("train_dataloader"))  # packed batches survive accelerate's dispatcher
        if self.handle.info is None or self.handle.mode == "fix" or self.handle.is_wrapped():
            return  # nothing to warn about, or the guard wraps the model before any forward that needs it
        tokenizer = processing_class if processing_class is not None else kwargs.get("tokenizer")
        if _padding_side(tokenizer) == "right":
            msg = (
                f"safepad: the tokenizer pads on the right and {self.handle.info.describe()} is not wrapped. "
                "Training without a cache is unaffected, but generation or evaluation with a cache on right-padded "
                "rows caches the state after the pads. Fix: tokenizer.padding_side = 'left' for generation, or "
                "call safepad.wrap(model)."
            )
            logger.warning("%s", msg)
            if KIND_TOKENIZER not in self.handle.warned:
                self.handle.warned.add(KIND_TOKENIZER)
                warnings.warn(PaddingWarning(msg, KIND_TOKENIZER), stacklevel=2)

    def _check_boundary_columns(self, args, model, dataloader) -> None:
        """Report when Trainer's column filter removes pack_dataset's boundary columns before collation.

        ``remove_unused_columns`` keeps only the columns ``model.forward`` names. Mamba, Mamba2 and FalconMamba
        take no ``position_ids``, so a packed dataset loses both ``seq_lengths`` and ``position_ids`` and the
        packing collator would read every packed row as one sequence. ``mode="warn"`` warns; ``"error"`` raises
        :class:`~safepad.errors.PaddingError`, and so does ``"fix"``: wrapping the model cannot bring back
        columns the Trainer has already removed.

        The columns are read from the Trainer's own ``train_dataset`` (before the filter), so a dataset with one
        example per row and no boundary columns is left alone. A stream's columns are only known batch by batch:
        its column filter (``RemoveColumnsCollator``) is checked on every feature instead.
        """
        if dataloader is None or not getattr(args, "remove_unused_columns", False):
            return
        collate_fn = getattr(dataloader, "collate_fn", None)
        collate = getattr(collate_fn, "data_collator", collate_fn)  # transformers' RemoveColumnsCollator
        from safepad.collators import DataCollatorForPackedSSM

        if not isinstance(collate, DataCollatorForPackedSSM):
            return
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        if "position_ids" in inspect.signature(base.forward).parameters:
            return
        trainer = _calling_trainer()
        source = getattr(trainer, "train_dataset", None)
        columns = getattr(source, "column_names", None)
        if columns is not None:
            if _BOUNDARY_COLUMNS & set(columns):
                self._report_dropped(base, self.handle.mode, certain=True)
            return
        kept = getattr(collate_fn, "signature_columns", None)
        if callable(getattr(collate_fn, "_remove_columns", None)) and kept is not None:
            dropped = _BOUNDARY_COLUMNS - set(kept)
            if dropped == _BOUNDARY_COLUMNS:
                self._watch_stream(collate_fn, base, self.handle.mode)
            return
        left = getattr(getattr(dataloader, "dataset", None), "column_names", None)  # after the filter
        if left is not None and not _BOUNDARY_COLUMNS & set(left):
            self._report_dropped(base, self.handle.mode, certain=False)

    def _watch_stream(self, collate_fn: Any, base: Any, mode: str) -> None:
        """Check every feature that the stream's column filter is about to strip of its boundary columns."""
        strip = collate_fn._remove_columns

        def remove_columns(feature):
            if isinstance(feature, dict) and _BOUNDARY_COLUMNS & feature.keys():
                self._report_dropped(base, mode, certain=True)
            return strip(feature)

        collate_fn._remove_columns = remove_columns

    def _report_dropped(self, base: Any, mode: str, certain: bool) -> None:
        msg = (
            f"safepad: Trainer's remove_unused_columns keeps only the columns {type(base).__name__}.forward names, "
            "and it takes no position_ids: the seq_lengths / position_ids columns of a pack_dataset dataset are "
            "dropped before collation, so DataCollatorForPackedSSM reads each packed row as ONE sequence and state "
            "leaks between the examples packed into it. Fix: TrainingArguments(remove_unused_columns=False)."
        )
        if certain and mode in ("error", "fix"):
            if self._owns_handle and self.handle is not None:
                self.handle.remove()  # nothing will train: leave the model as it was
            self.handle, self._owns_handle = None, False
            raise PaddingError(msg, (KIND_DROPPED_BOUNDARIES,))
        if not certain:  # the Trainer (and so the columns before the filter) was not found
            msg += " (Datasets with one example per row and no such columns are unaffected.)"
        if KIND_DROPPED_BOUNDARIES in self._warned or (
            self.handle is not None and KIND_DROPPED_BOUNDARIES in self.handle.warned
        ):
            return
        self._warned.add(KIND_DROPPED_BOUNDARIES)
        if self.handle is not None:
            self.handle.warned.add(KIND_DROPPED_BOUNDARIES)
        logger.warning("%s", msg)
        warnings.warn(PaddingWarning(msg, KIND_DROPPED_BOUNDARIES), stacklevel=3)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not self.log_stats or self.handle is None or logs is None:
            return
        is_eval = any(str(k).startswith("eval_") for k in logs)
        stats = self.handle.pop_stats(training=not is_eval)
        if not stats:
            return
        if is_eval:
            stats = {f"eval_{k}": v for k, v in stats.items()}
        add_to_logs(state, logs, stats)

    def on_train_end(self, args, state, control, **kwargs):
        if self.handle is not None and self._owns_handle:
            self.handle.remove()
        self.handle, self._owns_handle = None, False
