"""``RolloutGapCallback``: log the gap between the rollout's log-probs and the training forward's, in TRL.

GRPO / RLOO sample completions with ``generate`` (cached, token-by-token) and then score the same tokens with one
training forward over ``[prompt | completion]``. The policy ratio assumes both give each sampled token the same
log-probability. On a stock hybrid / SSM model with padded batches they do not (docs/rl.md). This callback measures
it on every training batch of TRL 1.16's ``GRPOTrainer`` and ``RLOOTrainer`` and logs, at every logging step::

    safepad/rollout_gap_max     max  |rollout log p - training log p| over the completion tokens since the last log
    safepad/rollout_gap_mean    mean of the same
    safepad/rollout_gap_tokens  how many completion tokens were compared

Usage::

    trainer = GRPOTrainer(model, reward_funcs=..., args=GRPOConfig(...), train_dataset=ds,
                          callbacks=[safepad.RolloutGapCallback()])

How. TRL's transformers-``generate`` rollout keeps no log-probs. At train begin the callback makes the policy's
``generate`` also return its raw logits (``output_logits``). For each sampled token it keeps
``log_softmax(logits / temperature)``, the transform TRL's training forward applies. The rows are keyed by their
prompt and completion tokens, because TRL shuffles the rows between generation and training. The trainer's
``_get_per_token_logps_and_entropies`` is wrapped on the instance, so :class:`safepad.PackedGRPOMixin` composes.
Its calls with gradients (the loss forward of ``_compute_loss``) are compared with the rollout rows they score.
Both are restored at train end.

What it measures: the two forwards' disagreement on the same weights. That holds for every training forward of a
generation batch when ``num_iterations == 1`` and ``steps_per_generation`` equals ``gradient_accumulation_steps``
(TRL's default). Otherwise later forwards also include the policy's own updates since the rollout. The values are
the local process's rows. Generation processors other than the temperature (top-k, top-p, repetition penalty)
change what is sampled, not what is compared: both sides are ``log_softmax(logits / temperature)``.

Settings it refuses, naming the fix: ``use_vllm=True`` (vLLM returns its own log-probs, and TRL already logs
this gap as ``sampling/sampling_logp_difference/{mean,max}`` with ``vllm_importance_sampling_correction=True``),
``use_transformers_continuous_batching=True`` (``generate_batch`` returns no logits) and a ``rollout_func`` (its
log-probs are the user's).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor
from transformers import TrainerCallback

from .callback import _calling_trainer
from .grpo import GRPO_METHOD
from .logs import add_to_logs

logger = logging.getLogger(__name__)

__all__ = ["ROLLOUT_GAP_KEYS", "RolloutGapCallback"]

#: the metrics added to the Trainer's logs
ROLLOUT_GAP_KEYS = ("safepad/rollout_gap_max", "safepad/rollout_gap_mean", "safepad/rollout_gap_tokens")

_Key = tuple[tuple[int, ...], tuple[int, ...]]


class RolloutGapCallback(TrainerCallback):
    """Log max / mean |rollout log-prob - training log-prob| of the completion tokens of TRL's GRPO / RLOO.

    Add it to a ``trl.GRPOTrainer`` or ``trl.RLOOTrainer`` (subclasses included, e.g. with
    :class:`safepad.PackedGRPOMixin`). Other trainers raise ``TypeError`` at train begin, and unsupported rollout
    settings raise ``ValueError`` naming the setting. ``max_mismatch_warnings``: a training row whose tokens no
    rollout produced (e.g. a ``rollout_func`` or tool calls edited it) is skipped, with a warning this many times.
    """

    def __init__(self, max_mismatch_warnings: int = 3) -> None:
        self.max_mismatch_warnings = max_mismatch_warnings
        self._trainer: Any = None
        self._policy: Any = None
        self._saved_generate: tuple[bool, Any] | None = None
        self._rollouts: dict[_Key, list[Tensor]] = {}
        self._reset()
        self._mismatches = 0

    def _reset(self) -> None:
        self._max, self._sum, self._count = 0.0, 0.0, 0

    # ---------------------------------------------------------------------------------------------------------
    # installation
    # ---------------------------------------------------------------------------------------------------------

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        trainer = _calling_trainer()
        _check_trainer(trainer)
        self._trainer, self._policy = trainer, trainer.accelerator.unwrap_model(trainer.model_wrapped)
        self._install_generate()
        self._install_logps()
        self._rollouts.clear()
        self._reset()

    def on_train_end(self, args, state, control, **kwargs):
        self._uninstall()

    def _install_generate(self) -> None:
        policy = self._policy
        had = "generate" in vars(policy)
        self._saved_generate = (had, vars(policy).get("generate"))
        original = policy.generate  # the bound method (or an instance override, e.g. a test's or safepad's)
        callback = self

        def generate(*args: Any, **kwargs: Any) -> Any:
            if not policy.training or kwargs.get("return_dict_in_generate"):
                return original(*args, **kwargs)  # evaluation rollouts are not trained on
            out = original(*args, **{**kwargs, "output_logits": True, "return_dict_in_generate": True})
            callback._record_rollout(kwargs.get("input_ids", args[0] if args else None), kwargs, out)
            return out.sequences

        policy.generate = generate

    def _install_logps(self) -> None:
        trainer = self._trainer
        original = getattr(trainer, GRPO_METHOD)  # bound: a mixin's override stays in the chain
        callback = self

        def get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
            out = original(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
            if torch.is_grad_enabled():  # the loss forward (the old-policy / reference forwards run without grad)
                callback._compare(input_ids, attention_mask, logits_to_keep, out[0])
            return out

        setattr(trainer, GRPO_METHOD, get_per_token_logps_and_entropies)

    def _uninstall(self) -> None:
        if self._trainer is not None:
            vars(self._trainer).pop(GRPO_METHOD, None)
        if self._policy is not None and self._saved_generate is not None:
            had, previous = self._saved_generate
            if had:
                self._policy.generate = previous
            else:
                vars(self._policy).pop("generate", None)
        self._trainer = self._policy = self._saved_generate = None
        self._rollouts.clear()

    # ---------------------------------------------------------------------------------------------------------
    # measurement
    # ---------------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def _record_rollout(self, input_ids: Tensor | None, kwargs: dict[str, Any], out: Any) -> None:
        """Keep each rollout row's sampled-token log-probs ``[C]`` under (prompt tokens, completion tokens)."""
        if input_ids is None or getattr(out, "logits", None) is None:
            raise RuntimeError(
                "safepad.RolloutGapCallback: generate returned no logits for output_logits=True; the rollout "
                "log-probs cannot be measured with this generation setup"
            )
        self._rollouts.clear()  # a new generation batch: the previous one's rows are not trained on again
        mask = kwargs.get("attention_mask")
        mask = torch.ones_like(input_ids) if mask is None else mask
        P = input_ids.shape[1]
        new = out.sequences[:, P:]  # [B, C]
        logps = torch.stack(out.logits, dim=1).float() / self._trainer.temperature  # [B, C, V]
        logps = logps.log_softmax(-1).gather(-1, new[..., None].to(logps.device)).squeeze(-1)  # [B, C]
        eos = torch.tensor(list(self._trainer.eos_token_ids), device=new.device)
        for b in range(new.shape[0]):
            is_eos = torch.isin(new[b], eos)
            n = int(is_eos.int().argmax()) + 1 if bool(is_eos.any()) else new.shape[1]  # TRL keeps up to the eos
            prompt = input_ids[b][mask[b].bool()].tolist()
            key = (tuple(prompt), tuple(new[b, :n].tolist()))
            self._rollouts.setdefault(key, []).append(logps[b, :n].cpu())

    @torch.no_grad()
    def _compare(self, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int, logps: Tensor) -> None:
        """Compare the training forward's ``[B, K]`` log-probs with the rollout rows they score."""
        T = input_ids.shape[1]
        P = T - logits_to_keep
        for b in range(input_ids.shape[0]):
            prompt = input_ids[b, :P][attention_mask[b, :P].bool()].tolist()
            real = attention_mask[b, P:].bool()
            completion = input_ids[b, P:][real].tolist()
            rollouts = self._rollouts.get((tuple(prompt), tuple(completion)))
            if not rollouts:
                self._mismatch(b)
                continue
            train = logps[b, real].detach().float().cpu()  # [n]
            gaps = (rollouts[0] - train).abs()
            if gaps.numel():
                self._max = max(self._max, gaps.max().item())
                self._sum += gaps.sum().item()
                self._count += gaps.numel()

    def _mismatch(self, row: int) -> None:
        self._mismatches += 1
        if self._mismatches <= self.max_mismatch_warnings:
            logger.warning(
                "safepad.RolloutGapCallback: training row %d matches no rollout of this generation batch "
                "(prompt and completion tokens); it is skipped",
                row,
            )

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or any(k.startswith("eval_") for k in logs) or not self._count:
            return
        stats = dict(zip(ROLLOUT_GAP_KEYS, (self._max, self._sum / self._count, float(self._count))))
        add_to_logs(state, logs, stats)
        self._reset()


def _check_trainer(trainer: Any) -> None:
    """TypeError / ValueError naming the fix when ``trainer`` cannot be measured."""
    if trainer is None or not callable(getattr(trainer, GRPO_METHOD, None)) or not hasattr(trainer, "temperature"):
        name = type(trainer).__name__ if trainer is not None else "no Trainer"
        raise TypeError(
            f"safepad.RolloutGapCallback measures TRL's GRPOTrainer / RLOOTrainer (trl 1.16), got {name}: add it to "
            "one of those (or a subclass)"
        )
    if getattr(trainer, "use_vllm", False):
        raise ValueError(
            "safepad.RolloutGapCallback measures transformers generation; with use_vllm=True TRL logs this gap "
            "itself as sampling/sampling_logp_difference/{mean,max} when "
            "GRPOConfig(vllm_importance_sampling_correction=True): drop the callback, or set use_vllm=False"
        )
    if getattr(trainer, "use_transformers_continuous_batching", False):
        raise ValueError(
            "safepad.RolloutGapCallback needs the rollout's logits, which generate_batch does not return: set "
            "use_transformers_continuous_batching=False (use_transformers_paged=False)"
        )
    if getattr(trainer, "rollout_func", None) is not None:
        raise ValueError(
            "safepad.RolloutGapCallback measures TRL's own generate rollout; with a rollout_func the log-probs are "
            "the function's: compare its 'logprobs' with the training forward yourself, or drop rollout_func"
        )
