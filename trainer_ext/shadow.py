"""``ShadowCheckCallback``: certify the training run itself, a packed-vs-alone check inside ``Trainer``.

``safepad audit`` certifies a model on the machine where the audit runs. The real run happens elsewhere: other
kernels, another transformers release, another collator, DDP / FSDP. Every ``every_n_steps`` optimizer steps
this callback takes one sequence of the training batch (from its ``seq_idx``, ``cu_seq_lens_q``, restarting
``position_ids``, its mask, and the boundaries the collator was given), runs it ALONE through the same model
(same weights, no grad, eval mode, the training dtype / autocast and device), and compares the logits and the
per-token loss with the packed forward's values for that sequence::

    trainer = Trainer(model, args, train_dataset=packed, data_collator=safepad.DataCollatorForPackedSSM(),
                      callbacks=[safepad.ShadowCheckCallback(every_n_steps=100, mode="error")])

Cost: no second packed forward. A forward hook on the model keeps the packed logits of one chosen sequence
(``[L, V]``, in the logits' dtype) from EVERY training micro-batch of a checked step (under gradient accumulation a
leak may reach only some micro-batches); the alone forwards (``L`` tokens each, one per micro-batch) run at
``on_pre_optimizer_step``, after backward and before the weights change. Memory: one ``[L, V]`` per micro-batch.

A forward that returns no logits (TRL's fused LM head, which ``SFTTrainer``, ``GRPOTrainer`` and ``DPOTrainer``
add to the model and call with ``fused_lm_head=True``) is checked on its backbone's last hidden state instead: a
second forward hook on the backbone (``model.base_model``) keeps the chosen sequence's ``[L, H]`` hidden states,
and both sides, packed and alone, go through the LM head weight (``hidden @ W.T (+ b)`` in float32, before any
family-specific logit scaling, softcapping or temperature, which act the same on both sides).

Which sequence: the sequences after a packed boundary (or every sequence when no row holds several), in row
order, are visited in rotation: check ``k`` of micro-batch ``m`` takes candidate ``(seed + k + m) mod n``. With a
steady batch layout, every sequence slot of the row (the last one included) is checked within ``n`` checks.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import TrainerCallback

from safepad.errors import PaddingError, PaddingWarning

from .callback import _calling_trainer
from .segments import Segment, feature_starts, segments, sequence_starts
from .logs import add_to_logs

logger = logging.getLogger(__name__)

__all__ = ["KIND_SHADOW_MISMATCH", "SHADOW_TOLERANCES", "ShadowCheckCallback", "ShadowResult"]

KIND_SHADOW_MISMATCH = "shadow_mismatch"

#: Tolerated ``max |Δ logits| / max |logits alone|`` per training dtype, several times the largest spread
#: measured on correct runs (200-step Trainer runs of a wrapped tiny Nemotron-H with strengthened mixers, a
#: check at every step: fp32 5.6e-6, bf16 autocast 1.0e-2, bf16 weights 8.7e-3; fp16 weights 1.2e-3 over the
#: 12 finite steps before that AdamW run diverged, so fp16's value is a weak estimate) and far below the leaks
#: it exists to catch (0.2 - 1.5: stock packing, an unwrapped model, a scan that ignores ``seq_idx``).
SHADOW_TOLERANCES: dict[torch.dtype, float] = {
    torch.float32: 1e-4,
    torch.float64: 1e-8,
    torch.bfloat16: 8e-2,
    torch.float16: 1e-2,
}

_MODES = ("warn", "error")
_RANKS = ("all", "main")
_LOG_KEYS = ("safepad/shadow_max_abs_diff", "safepad/shadow_rel_diff", "safepad/shadow_checked_tokens")
_IGNORE = -100
_BOUNDARY_COLUMNS = ("seq_lengths", "position_ids")


@dataclass
class ShadowResult:
    """One check: the sequence, its errors, and whether it was flagged."""

    step: int
    segment: Segment
    max_abs_diff: float  #: max |Δ logits| over the sequence
    rel_diff: float  #: max |Δ logits| / max |logits alone|
    loss_abs_diff: float  #: max |Δ per-token loss| over its scored tokens
    checked_tokens: int
    dtype: torch.dtype
    tol: float
    flagged: bool = False
    remote: bool = False  #: the worst sequence was checked on another rank
    micro_batch: int = 0  #: the training forward of the step it came from (gradient accumulation)
    micro_batches: int = 1  #: training forwards checked at this step (the worst one is reported)

    def describe(self) -> str:
        where = "a sequence checked on another rank" if self.remote else self.segment.describe()
        if not self.remote and self.micro_batches > 1:
            where += f" of micro-batch {self.micro_batch} ({self.micro_batches} checked)"
        return (
            f"step {self.step}, {where}: packed vs alone max |Δ logits| {self.max_abs_diff:.3g} "
            f"(relative {self.rel_diff:.3g}, tolerance {self.tol:g} for {str(self.dtype).removeprefix('torch.')}), "
            f"max |Δ per-token loss| {self.loss_abs_diff:.3g} over {self.checked_tokens} tokens"
        )


@dataclass
class _Capture:
    segment: Segment
    input_ids: Tensor  # [L]
    labels: Tensor | None  # [L] (the row's labels over the sequence) or None
    logits: Tensor  # [L, V] packed forward in the logits' dtype, or [L, H] hidden states (``hidden``)
    autocast: tuple[str, torch.dtype] | None
    dtype: torch.dtype
    n_candidates: int = 0  #: sequences it was drawn from
    micro_batch: int = 0  #: index of the training forward in the step
    hidden: bool = False  #: ``logits`` holds the backbone's last hidden states (a forward without logits)


def _dropout_sources(model: nn.Module) -> list[str]:
    """Modules and config fields that make a training forward random (dropout > 0)."""
    found = [
        f"{n or type(model).__name__} (p={m.p})"
        for n, m in model.named_modules()
        if isinstance(m, nn.Dropout) and m.p > 0
    ]
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "to_dict"):
        for k, v in cfg.to_dict().items():
            if "dropout" in k and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
                found.append(f"config.{k}={v}")
    return found


def _autocast_state(device_type: str) -> tuple[str, torch.dtype] | None:
    if torch.is_autocast_enabled(device_type):
        return device_type, torch.get_autocast_dtype(device_type)
    return None


def _training_dtype(model: nn.Module, autocast: tuple[str, torch.dtype] | None, amp: torch.dtype | None) -> torch.dtype:
    """The dtype the forward computes in: an enclosing autocast's, the Trainer's mixed precision
    (accelerate puts its autocast inside ``model.forward``, so the shadow forward gets it too), or the weights'."""
    if autocast is not None:
        return autocast[1]
    if amp is not None:
        return amp
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _token_loss(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Causal next-token loss of ``[L, V]`` logits under ``[L]`` labels -> (``[L-1]`` loss, ``[L-1]`` scored)."""
    target = labels[1:]
    scored = target != _IGNORE
    loss = F.cross_entropy(logits[:-1].float(), target.clamp_min(0), reduction="none")
    return loss, scored


def _is_fsdp2(model: nn.Module) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


def _core(model: nn.Module) -> nn.Module:
    """The transformers model under a PEFT wrapper (or the model itself)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def _backbone(model: nn.Module) -> nn.Module | None:
    """The backbone whose ``last_hidden_state`` the LM head reads (``model.base_model``), or None."""
    core = _core(model)
    backbone = getattr(core, "base_model", None)
    return backbone if isinstance(backbone, nn.Module) and backbone is not core else None


def _lm_head(model: nn.Module) -> nn.Module | None:
    """The LM head (``get_output_embeddings``) when it holds a ``[V, H]`` weight, else None."""
    get = getattr(_core(model), "get_output_embeddings", None)
    head = get() if callable(get) else None
    weight = getattr(head, "weight", None)
    return head if isinstance(weight, Tensor) and weight.dim() == 2 else None


def _lm_head_weight(model: nn.Module) -> tuple[Tensor, Tensor | None]:
    """The LM head's ``[V, H]`` weight and ``[V]`` bias (or None) in float32, gathered when sharded."""
    head = _lm_head(model)
    if head is None:
        raise ValueError("ShadowCheckCallback: the model has no LM head (get_output_embeddings) with a weight")
    weight, bias = head.weight, getattr(head, "bias", None)
    full = [t.full_tensor() if hasattr(t, "full_tensor") else t for t in (weight, bias) if isinstance(t, Tensor)]
    return full[0].detach().float(), (full[1].detach().float() if len(full) > 1 else None)


def _padding_mask(mask: Any) -> Tensor | None:
    """The ``[B, T]`` padding mask of a forward's ``attention_mask`` as the forward hook sees it: safepad's pre-hook
    may have replaced it by a dict of per-layer masks (a packed call of a model whose attention mask it builds,
    GraniteMoeHybrid: block-diagonal, no padding) or a caller may give a 4-D one; their 2-D entry, or None."""
    if isinstance(mask, Mapping):
        return next((m for m in mask.values() if isinstance(m, Tensor) and m.dim() == 2), None)
    return mask if isinstance(mask, Tensor) and mask.dim() == 2 else None


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


class ShadowCheckCallback(TrainerCallback):
    """Every ``every_n_steps`` optimizer steps, check one packed sequence against the same sequence run alone.

    Args:
        every_n_steps: check at optimizer steps 1, 1 + n, 1 + 2n, ... (the first step is always checked).
        mode: ``"warn"`` (a :class:`~safepad.errors.PaddingWarning` per flagged check) or ``"error"``
            (:class:`~safepad.errors.PaddingError` naming the step, the sequence and the error).
        tol: tolerated ``max |Δ logits| / max |logits alone|``; default by training dtype
            (:data:`SHADOW_TOLERANCES`).
        ranks: ``"all"``: under DDP / FSDP every rank checks a sequence of its own batch and the worst result is
            shared (every rank logs and raises together); ``"main"``: rank 0 checks and shares its result (not
            under FSDP2, whose forward is collective).
        seed: offsets the rotation that picks the checked sequence of each micro-batch (the global RNGs are
            never touched): check ``k`` of micro-batch ``m`` takes candidate ``(seed + k + m) mod n``.

    Logs ``safepad/shadow_max_abs_diff``, ``safepad/shadow_rel_diff`` (max over the checks since the last log)
    and ``safepad/shadow_checked_tokens`` (sum) to the Trainer's logs. The callback moves itself to the front
    of the Trainer's callbacks so that the reporting integrations (W&B, TensorBoard) see these keys.

    Needs: input_ids (no inputs_embeds), full-length logits from the packed forward (``logits_to_keep=0``) or,
    when it returns none (TRL's fused LM head in ``SFTTrainer`` / ``GRPOTrainer`` / ``DPOTrainer``), the
    ``[B, T, H]`` last hidden states of its backbone (``model.base_model``) and an LM head weight, and a
    deterministic training forward (dropout 0); each is checked with a clear error.
    ``safepad.distributed`` sequence parallelism is refused (each rank sees a shard of the sequence).
    """

    def __init__(
        self,
        every_n_steps: int = 100,
        mode: str = "warn",
        tol: float | None = None,
        ranks: str = "all",
        seed: int = 0,
    ) -> None:
        if not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps must be an int >= 1, got {every_n_steps!r}")
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        if tol is not None and not tol > 0:
            raise ValueError(f"tol must be > 0 (a relative logits error), got {tol!r}")
        if ranks not in _RANKS:
            raise ValueError(f"ranks must be one of {_RANKS}, got {ranks!r}")
        self.every_n_steps, self.mode, self.tol, self.ranks, self.seed = every_n_steps, mode, tol, ranks, seed
        #: every check of the run, in order (also flagged ones)
        self.results: list[ShadowResult] = []
        self._model: nn.Module | None = None
        self._hook: Any = None
        self._backbone_hook: Any = None
        self._hidden: Tensor | None = None  #: [B, T, H] last hidden states of the backbone's latest forward
        self._record_hidden = False
        self._armed = False
        self._captures: list[_Capture] = []
        self._forwards = 0  #: training forwards seen in the current checked step
        self._step = 0
        self._features: deque[tuple[Tensor, Tensor]] = deque(maxlen=64)
        self._pending: dict[str, float] = {}
        self._patched_loader: Any = None
        self._orig_collate: Any = None
        self._amp_dtype: torch.dtype | None = None
        self._stash: list[list[dict[str, Any]]] = []
        self._patched_dataset: Any = None

    # ---------------------------------------------------------------------------------------------- set-up

    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        if model is None:
            raise ValueError("ShadowCheckCallback needs the Trainer to pass `model` to on_train_begin")
        trainer = _calling_trainer()
        if trainer is not None and getattr(trainer, "_safepad_sp", None) is not None:
            raise ValueError(
                "ShadowCheckCallback: the Trainer runs safepad.distributed sequence parallelism, where each rank's "
                "forward sees a shard of every row, so there is no packed output of a whole sequence to compare "
                "with. Run the shadow check without SP (same model and data, sp_size=1), or drop the callback."
            )
        module = getattr(model, "_orig_mod", model)  # torch.compile: the shadow runs the eager module
        sources = _dropout_sources(module)
        if sources:
            raise ValueError(
                "ShadowCheckCallback: the model trains with dropout (" + ", ".join(sources[:6]) + "), so its packed "
                "forward is random and cannot be compared with a deterministic run of the same sequence. Set the "
                "dropout to 0 for the checked run, or remove the callback."
            )
        if self.ranks == "main" and _dist() is not None and _is_fsdp2(module):
            raise ValueError(
                "ShadowCheckCallback(ranks='main') under FSDP2: the shadow forward all-gathers the sharded "
                "parameters, so every rank must run it. Use ranks='all' (each rank checks its own batch)."
            )
        self._model, self._captures, self._armed, self._pending = module, [], False, {}
        self._amp_dtype = (
            torch.bfloat16 if getattr(args, "bf16", False) else torch.float16 if getattr(args, "fp16", False) else None
        )
        self._hook = module.register_forward_hook(self._on_forward, with_kwargs=True)
        backbone = _backbone(module)
        if backbone is not None:
            self._backbone_hook = backbone.register_forward_hook(self._on_backbone)
        self._watch_collator(train_dataloader, getattr(trainer, "train_dataset", None))
        if trainer is not None:  # run our on_log before the reporting integrations'
            callbacks = trainer.callback_handler.callbacks
            if self in callbacks:
                callbacks.remove(self)
                callbacks.insert(0, self)

    def _watch_collator(self, loader: Any, source: Any) -> None:
        """Record, for each batch, the sequence starts of the features the collator was given (main process).

        When Trainer's ``remove_unused_columns`` removed boundary columns (``seq_lengths`` / ``position_ids``) from
        a map-style dataset, the features the collator gets have lost them: the same rows of the Trainer's own
        ``train_dataset`` (before the filter) are read for the check, and never handed to the collator.
        """
        loader = getattr(loader, "base_dataloader", loader)  # accelerate's DataLoaderShard iterates its base loader
        collate = getattr(loader, "collate_fn", None)
        if collate is None or getattr(loader, "num_workers", 0):
            if collate is not None:
                logger.info("shadow check: dataloader workers collate out of process; batch boundaries only")
            return
        features, stash = self._features, self._stash
        self._watch_removed_columns(loader, source)

        def recording_collate(batch_features):
            out = collate(batch_features)
            known = batch_features
            if stash:
                originals = stash.pop()
                if len(originals) == len(batch_features):
                    known = [{**f, **o} for f, o in zip(batch_features, originals)]
            try:
                starts = feature_starts(known, out)
            except (TypeError, ValueError) as exc:  # an unusual feature format: the batch's own boundaries remain
                logger.debug("shadow check: cannot read the features' boundaries: %s", exc)
                starts = None
            if starts is not None and isinstance(out.get("input_ids"), Tensor):
                features.append((out["input_ids"].detach().cpu(), starts))
            return out

        self._patched_loader, self._orig_collate = loader, collate
        loader.collate_fn = recording_collate

    def _watch_removed_columns(self, loader: Any, source: Any) -> None:
        dataset = getattr(loader, "dataset", None)
        have, had = getattr(dataset, "column_names", None), getattr(source, "column_names", None)
        if have is None or had is None or dataset is source:
            return
        lost = [c for c in _BOUNDARY_COLUMNS if c in had and c not in have]
        fetch = getattr(dataset, "__getitems__", None)
        if not lost or not callable(fetch) or len(dataset) != len(source):
            return
        stash, known = self._stash, source.select_columns(lost)

        def getitems(indices):
            rows = known[list(indices)]  # {column: [values]}
            stash.clear()
            stash.append([{c: rows[c][i] for c in lost} for i in range(len(indices))])
            return fetch(indices)

        dataset.__getitems__ = getitems
        self._patched_dataset = dataset

    def on_train_end(self, args, state, control, **kwargs):
        self._teardown()

    def _teardown(self) -> None:
        if self._hook is not None:
            self._hook.remove()
        if self._backbone_hook is not None:
            self._backbone_hook.remove()
        self._backbone_hook, self._hidden, self._record_hidden = None, None, False
        if self._patched_loader is not None:
            self._patched_loader.collate_fn = self._orig_collate
        if self._patched_dataset is not None:
            self._patched_dataset.__dict__.pop("__getitems__", None)
        self._patched_dataset = None
        self._stash.clear()
        self._hook, self._patched_loader, self._orig_collate = None, None, None
        self._captures, self._armed = [], False
        self._features.clear()

    # ---------------------------------------------------------------------------------------------- capture

    def on_step_begin(self, args, state, control, **kwargs):
        self._step = state.global_step + 1
        self._armed = (self._step - 1) % self.every_n_steps == 0
        self._captures, self._forwards = [], 0

    @torch._dynamo.disable
    def _on_backbone(self, module: nn.Module, args: tuple, output: Any) -> None:
        """Keep the backbone's ``[B, T, H]`` last hidden states of a checked step's training forward (or of the
        shadow run): a forward without logits (TRL's fused LM head) is checked on them."""
        if not (self._record_hidden or (self._armed and module.training and torch.is_grad_enabled())):
            return
        hidden = getattr(output, "last_hidden_state", None)
        if hidden is None and isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
            hidden = output[0]
        self._hidden = hidden.detach() if isinstance(hidden, Tensor) and hidden.dim() == 3 else None

    @torch._dynamo.disable
    def _on_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not self._armed or not module.training or not torch.is_grad_enabled():
            return
        micro_batch = self._forwards  # every training forward of the step (gradient accumulation) is checked
        self._forwards += 1
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(ids, Tensor) or ids.dim() != 2:
            raise ValueError(
                "ShadowCheckCallback: the training forward got no [B, T] input_ids (inputs_embeds only?); the shadow "
                "check re-runs a sequence from its token ids. Remove the callback for embeddings-only training."
            )
        logits = getattr(output, "logits", None)
        if logits is None and isinstance(output, Mapping):
            logits = output.get("logits")
        hidden, self._hidden = self._hidden, None
        use_hidden = False
        if not isinstance(logits, Tensor) or tuple(logits.shape[:2]) != tuple(ids.shape):
            use_hidden = isinstance(hidden, Tensor) and tuple(hidden.shape[:2]) == tuple(ids.shape)
            if not use_hidden or _lm_head(module) is None:
                got = "no logits" if not isinstance(logits, Tensor) else f"logits of shape {tuple(logits.shape)}"
                raise ValueError(
                    f"ShadowCheckCallback: the packed forward returned {got} for input_ids {tuple(ids.shape)}, and "
                    "no [B, T, H] hidden states of its backbone (model.base_model) with an LM head "
                    "(get_output_embeddings) to compute them from; the shadow check compares every position's "
                    "logits. Keep the full logits (logits_to_keep=0, no fused linear-cross-entropy kernel) or "
                    "remove the callback."
                )
        B, T = ids.shape
        cpu_ids = ids.detach().cpu()
        extra = next(
            (s for i, s in reversed(self._features) if i.shape == cpu_ids.shape and torch.equal(i, cpu_ids)), None
        )
        starts = sequence_starts(kwargs, (B, T), extra)
        labels = kwargs.get("labels")
        segs = segments(starts, _padding_mask(kwargs.get("attention_mask")))
        if isinstance(labels, Tensor) and tuple(labels.shape) == (B, T):
            lab = labels.detach().cpu()
            segs = [s for s in segs if s.length >= 2 and bool((lab[s.row, s.start + 1 : s.end] != _IGNORE).any())]
        else:
            lab = None
            segs = [s for s in segs if s.length >= 2]
        if not segs:
            logger.debug("shadow check, step %d: no sequence of >= 2 scored tokens in the batch", self._step)
            return
        later = [s for s in segs if s.index > 0]  # a leak shows only after a boundary
        pool = later or segs
        seg = pool[self._pick(len(pool), micro_batch)]
        device_type = ids.device.type
        amp = _autocast_state(device_type)
        self._captures.append(
            _Capture(
                segment=seg,
                input_ids=ids[seg.row, seg.start : seg.end].detach().clone(),
                labels=None if lab is None else lab[seg.row, seg.start : seg.end].clone(),
                logits=(hidden if use_hidden else logits)[seg.row, seg.start : seg.end].detach().clone(),
                autocast=amp,
                dtype=_training_dtype(module, amp, self._amp_dtype),
                n_candidates=len(pool),
                micro_batch=micro_batch,
                hidden=use_hidden,
            )
        )

    def _pick(self, n: int, micro_batch: int) -> int:
        """Index of the checked sequence among ``n`` candidates: a rotation over the checks (``k``-th check of
        the run) and the micro-batches, offset by ``seed``, so that a steady layout has every candidate slot,
        the row's last sequence included, checked within ``n`` checks."""
        k = (self._step - 1) // self.every_n_steps
        return (self.seed + k + micro_batch) % n

    # ---------------------------------------------------------------------------------------------- check

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if (self._step - 1) % self.every_n_steps != 0 or self._model is None:
            return
        caps, self._captures, self._armed = self._captures, [], False
        dist = _dist()
        if self.ranks == "main" and dist is not None and dist.get_rank() != 0:
            caps = []  # rank 0 checks; this rank only takes part in sharing the result
        result = self._worst([r for cap in caps if (r := self._shadow(cap)) is not None])
        result = self._share(result)
        if result is None:
            return
        self.results.append(result)
        p = self._pending
        p["safepad/shadow_max_abs_diff"] = max(p.get("safepad/shadow_max_abs_diff", 0.0), result.max_abs_diff)
        p["safepad/shadow_rel_diff"] = max(p.get("safepad/shadow_rel_diff", 0.0), result.rel_diff)
        p["safepad/shadow_checked_tokens"] = p.get("safepad/shadow_checked_tokens", 0) + result.checked_tokens
        if not result.flagged:
            return
        msg = (
            f"safepad shadow check: {result.describe()}. The packed training forward does not equal the sequence run "
            "alone: state or attention leaks across the packed boundary (an unwrapped or partly wrapped model, a "
            "collator or column filter that dropped seq_idx / position_ids / cu_seq_lens, or a kernel route that "
            "ignores them). Run `safepad audit` with this model, dtype and device, and check the collator's output."
        )
        logger.warning("%s", msg)
        if self.mode == "error":
            self._teardown()
            raise PaddingError(msg, (KIND_SHADOW_MISMATCH,))
        warnings.warn(PaddingWarning(msg, KIND_SHADOW_MISMATCH), stacklevel=2)

    @staticmethod
    def _worst(results: list[ShadowResult]) -> ShadowResult | None:
        """One result for the step: the worst micro-batch's, with the tokens of every micro-batch checked."""
        if not results:
            return None
        worst = max(results, key=lambda r: (r.flagged, r.rel_diff if r.rel_diff == r.rel_diff else float("inf")))
        worst.checked_tokens = sum(r.checked_tokens for r in results)
        worst.micro_batches = len(results)
        return worst

    @torch.no_grad()
    def _shadow(self, cap: _Capture) -> ShadowResult | None:
        model = self._model
        flags = [(m, m.training) for m in model.modules()]
        device = cap.input_ids.device
        amp = torch.autocast(cap.autocast[0], dtype=cap.autocast[1]) if cap.autocast else contextlib.nullcontext()
        rng_devices = [device] if device.type == "cuda" else []
        self._hidden, self._record_hidden = None, cap.hidden
        try:
            model.eval()
            with torch.random.fork_rng(devices=rng_devices), amp:
                out = model(input_ids=cap.input_ids[None], use_cache=False)
        finally:
            for m, training in flags:
                m.training = training
            hidden, self._hidden, self._record_hidden = self._hidden, None, False
        if cap.hidden:  # both sides through the LM head weight: [L, H] -> [L, V]
            if not isinstance(hidden, Tensor) or tuple(hidden.shape[:2]) != (1, cap.segment.length):
                raise ValueError(
                    "ShadowCheckCallback: the alone forward of the checked sequence did not run the backbone "
                    f"(model.base_model) on its {cap.segment.length} tokens; cannot compare hidden states"
                )
            weight, bias = _lm_head_weight(model)
            alone, packed = (F.linear(h.float(), weight, bias) for h in (hidden[0], cap.logits))
        else:
            alone = out.logits[0].float()  # [L, V]
            packed = cap.logits.float()  # [L, V]
        if not bool(torch.isfinite(packed).all()):
            logger.warning(
                "shadow check, step %d: the packed forward's logits are not finite (the run diverged?); a packing "
                "leak cannot be told from that, so this step is not checked",
                self._step,
            )
            return None
        diff = (alone - packed).abs()
        max_abs = float(diff.max())
        scale = float(alone.abs().max())
        rel = max_abs / max(scale, 1e-30)
        labels = cap.labels.to(device) if cap.labels is not None else cap.input_ids
        loss_a, scored = _token_loss(alone, labels)
        loss_p, _ = _token_loss(packed, labels)
        loss_diff = float((loss_a - loss_p).abs()[scored].max()) if bool(scored.any()) else 0.0
        tol = self.tol if self.tol is not None else SHADOW_TOLERANCES.get(cap.dtype, SHADOW_TOLERANCES[torch.float32])
        flagged = not (rel <= tol)  # finite packed logits, non-finite alone ones: flagged
        return ShadowResult(
            self._step, cap.segment, max_abs, rel, loss_diff, cap.segment.length, cap.dtype, tol, flagged,
            micro_batch=cap.micro_batch,
        )

    def _share(self, result: ShadowResult | None) -> ShadowResult | None:
        """Under torch.distributed: every rank gets the worst result (``ranks="all"``) or rank 0's (``"main"``)."""
        dist = _dist()
        if dist is None:
            return result
        device = next(self._model.parameters()).device
        mine = result is not None and (self.ranks == "all" or dist.get_rank() == 0)
        vals = [result.rel_diff, result.max_abs_diff, result.loss_abs_diff, 1.0] if mine else [-1.0, 0.0, 0.0, 0.0]
        t = torch.tensor(vals, dtype=torch.float64, device=device)
        t = torch.nan_to_num(t, nan=float("inf"))
        worst = t.clone()
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        tokens = torch.tensor([result.checked_tokens if mine else 0], dtype=torch.float64, device=device)
        dist.all_reduce(tokens, op=dist.ReduceOp.SUM)
        if worst[3] <= 0:
            return None
        if mine and float(t[0]) == float(worst[0]):
            base = result
        else:  # another rank's sequence is the worst one
            base = ShadowResult(self._step, Segment(-1, 0, 0, -1), 0.0, 0.0, 0.0, 0, torch.float32, 0.0, remote=True)
            if result is not None:
                base.dtype, base.tol = result.dtype, result.tol
            else:
                base.tol = self.tol if self.tol is not None else SHADOW_TOLERANCES[torch.float32]
        base.rel_diff, base.max_abs_diff, base.loss_abs_diff = (float(x) for x in worst[:3])
        base.checked_tokens = int(tokens.item())
        base.flagged = not (base.rel_diff <= base.tol)
        return base

    # ---------------------------------------------------------------------------------------------- logs

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or not self._pending or any(str(k).startswith("eval_") for k in logs):
            return
        stats, self._pending = self._pending, {}
        add_to_logs(state, logs, stats)
