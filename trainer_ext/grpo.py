"""TRL ``GRPOTrainer`` with packed log-prob forwards: :class:`PackedGRPOMixin`.

TRL's ``GRPOTrainer`` scores the ``[prompt | completion]`` batch with one padded forward
(``_get_per_token_logps_and_entropies``). The mixin replaces that method with :func:`safepad.rl.packed_logprobs`
(the sequences packed into rows, the boundaries given as ``seq_idx`` / ``cu_seq_lens``), and returns what TRL's
method returns::

    class PackedGRPOTrainer(safepad.PackedGRPOMixin, GRPOTrainer):
        pass

TRL 1.16's ``RLOOTrainer`` has the same method and takes the same mixin. The mixin relies on the private
method's name and leading parameters (checked when the class is defined: a TRL that changes them raises
``TypeError`` there, not a wrong result later). Text-only: multimodal inputs raise ``ValueError``. The MoE
load-balancing loss (``compute_aux_loss``) is computed over the real tokens of the packed rows for the families
whose router loss safepad masks (Jamba, Qwen3-Next, Qwen3.5-MoE, GraniteMoeHybrid); other MoE families raise
``ValueError`` naming the fix: ``GRPOConfig(router_aux_loss_coef=0.0)``.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

__all__ = ["GRPO_METHOD", "GRPO_METHOD_PARAMS", "PackedGRPOMixin"]

#: the TRL method the mixin overrides
GRPO_METHOD = "_get_per_token_logps_and_entropies"
#: its leading parameters, as the mixin reads them (TRL 1.16); further ones must be optional (multimodal inputs)
GRPO_METHOD_PARAMS = (
    "self",
    "model",
    "input_ids",
    "attention_mask",
    "logits_to_keep",
    "batch_size",
    "compute_entropy",
    "compute_aux_loss",
)


class PackedGRPOMixin:
    """Put first in the bases of a TRL ``GRPOTrainer`` subclass: its log-prob forwards run on packed rows.

    The per-token log-probs (and entropies) equal TRL's padded ones up to float rounding: each sequence is
    scored as if it ran alone. The model must be :func:`safepad.wrap`-ped. ``packed_max_tokens_per_row``
    (class attribute) sets the packed row length (None: the longest sequence of each micro-batch).
    """

    packed_max_tokens_per_row: int | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # the trainer class whose method the mixin replaces (the first one past every mixin subclass)
        base = next((k for k in cls.__mro__ if not issubclass(k, PackedGRPOMixin) and GRPO_METHOD in vars(k)), None)
        if base is None:
            return  # another mixin or an abstract subclass: checked on the class that adds the trainer
        params = inspect.signature(vars(base)[GRPO_METHOD]).parameters
        names = tuple(params)
        rest = [p for n, p in params.items() if n not in GRPO_METHOD_PARAMS]
        if names[: len(GRPO_METHOD_PARAMS)] != GRPO_METHOD_PARAMS or any(
            p.default is inspect.Parameter.empty and p.kind is not inspect.Parameter.VAR_KEYWORD for p in rest
        ):
            raise TypeError(
                f"safepad.PackedGRPOMixin overrides {base.__qualname__}.{GRPO_METHOD}{tuple(names)}, which no longer "
                f"starts with {GRPO_METHOD_PARAMS} (TRL 1.16's): this TRL version is not supported by the mixin; "
                "use TRL's own GRPOTrainer (padded forwards) or pin trl to a supported version"
            )

    def _get_per_token_logps_and_entropies(  # noqa: D401 (TRL's private method, same contract)
        self,
        model: torch.nn.Module,
        input_ids: Tensor,
        attention_mask: Tensor,
        logits_to_keep: int,
        batch_size: int | None = None,
        compute_entropy: bool = False,
        compute_aux_loss: bool = False,
        **inputs: Any,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """TRL's contract: ``(logps [B, K], entropies [B, K] or None, aux_loss [] or None)`` for the last
        ``K = logits_to_keep`` columns of ``input_ids`` ``[B, T]``, 0 where ``attention_mask`` is 0.

        ``compute_aux_loss`` (TRL sets it when the model is an MoE and ``router_aux_loss_coef != 0``): the MoE
        load-balancing loss over the real tokens of each micro-batch, averaged over the micro-batches, as TRL's
        padded forward computes it. Families whose router loss safepad cannot keep to the real tokens of packed
        rows raise ``ValueError`` naming the setting that turns the loss off (``router_aux_loss_coef=0.0``).
        """
        from ..rl import DEFAULT_CHUNK_SIZE, _forward

        given = sorted(k for k, v in inputs.items() if v is not None)
        if given:
            raise ValueError(
                f"safepad.PackedGRPOMixin scores text only, got {given}: use TRL's GRPOTrainer without the mixin"
            )
        B, T = input_ids.shape
        completion = torch.zeros_like(attention_mask, dtype=torch.bool)
        completion[:, T - logits_to_keep :] = True  # TRL scores the last logits_to_keep columns
        step = batch_size or B
        logps, entropies, aux_losses = [], [], []
        for start in range(0, B, step):
            end = min(start + step, B)
            with self.accelerator.autocast():  # type: ignore[attr-defined]
                lp, ent, aux = _forward(
                    model,
                    input_ids[start:end],
                    attention_mask[start:end],
                    completion[start:end],
                    self.temperature,  # type: ignore[attr-defined]
                    self.packed_max_tokens_per_row,
                    DEFAULT_CHUNK_SIZE,
                    compute_aux_loss=compute_aux_loss,
                )
            logps.append(lp[:, T - logits_to_keep :])
            entropies.append(ent[:, T - logits_to_keep :])
            aux_losses.append(aux)
        aux_loss = torch.stack(aux_losses).mean() if compute_aux_loss else None  # as TRL: the micro-batches' mean
        return torch.cat(logps), (torch.cat(entropies) if compute_entropy else None), aux_loss
