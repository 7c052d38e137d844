"""The plan of a wrapped model's hooks: what they need to know about the model, decided once at wrap time.

:class:`ModelPlan` is built by :func:`plan_for` when :func:`safepad.wrap` installs the model hooks
(:mod:`safepad.wrap.hooks`) and read by attribute there and in :mod:`safepad.wrap.slot_calls`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from .._config import text_config_value
from .attention import attention_configs

__all__ = ["ModelPlan", "counts_slots", "plan_for", "positional_names"]

#: mixer kinds whose attention reads cache slots (slot-relative positions, selected key slots)
_SLOT_KINDS = frozenset({"attn_conv", "dsa_indexer", "ple"})


def _pretrained_model_class() -> type | tuple:
    """transformers' ``PreTrainedModel`` (for ``isinstance``), or ``()`` (matching nothing) without transformers."""
    try:
        from transformers import PreTrainedModel
    except Exception:  # noqa: BLE001
        return ()
    return PreTrainedModel


@dataclass(frozen=True, eq=False)
class ModelPlan:
    """What the model hooks of one wrapped model need to know about it, decided once at wrap time (:func:`plan_for`).

    Read by attribute in the pre-hook and in :mod:`safepad.wrap.slot_calls`; frozen, so a call cannot change it.
    """

    #: the names of the model forward's parameters, in order (positional arguments are matched to them)
    params: tuple[str, ...]
    #: the parameters positional arguments bind to, in order (:func:`positional_names`): the pre-hook names them
    #: (:func:`safepad.wrap.entry.name_arguments`), so that every later read sees ``model(ids, mask)`` as
    #: ``attention_mask=mask``
    positional: tuple[str, ...]
    #: the forward takes ``position_ids``
    accepts_position_ids: bool
    #: the forward takes ``**kwargs``
    var_kwargs: bool
    #: some patched mixer sits in a hybrid (attention layers beside the recurrent ones)
    hybrid: bool
    #: the packed attention-mask kinds the specs ask for (:func:`safepad.wrap.attention_masks.packed_mask_mapping`)
    packed_attention_mask: tuple[str, ...]
    #: a spec's refusals of slot layouts its attention cannot serve (Inkling's log scaling)
    slot_checks: tuple[Callable[..., Any], ...]
    #: attention that counts cache slots (sliding windows, slot-relative positions, selected key slots): its
    #: one-token steps always go through slot justification (:mod:`safepad.wrap.slot_calls`)
    slot_sensitive: bool
    #: text models that read row 0 of ``[R, B, T]`` position_ids as their text positions, for these R (Qwen3.5: 4;
    #: Qwen4-Exp: 4 and 1); None: the model reads ``[B, T]`` position_ids only
    text_position_rows: tuple[int, ...] | None
    #: a spec whose attention reads slot distances: calls without a cache on rows with holes are re-laid too
    slot_distances: bool
    #: modules that transformers may give a checkpoint function (GradientCheckpointingLayer, base models)
    checkpointed: tuple[nn.Module, ...]
    #: a top-level forward that gives its attention_mask to the router loss and passes it on to a hooked inner
    #: model (which drops it on packed calls): it gets the real-token mask of a packed call
    router_loss_mask: bool
    #: the configs (and sub-configs) of ``target`` with an attention implementation: the pre-hook points those at
    #: ``"sdpa"`` / ``"safepad_sdpa"`` by the call's dtype and device (:mod:`safepad.wrap.attention`)
    attention_configs: tuple = ()


def plan_for(target: nn.Module, specs: list) -> ModelPlan:
    """The :class:`ModelPlan` of ``target``, a model holding mixers patched after ``specs`` (their ``MixerSpec``)."""
    PreTrainedModel = _pretrained_model_class()
    params = inspect.signature(target.forward).parameters
    rows = next((s.options["text_position_rows"] for s in specs if "text_position_rows" in s.options), None)
    return ModelPlan(
        params=tuple(params),
        positional=positional_names(target.forward),
        accepts_position_ids="position_ids" in params,
        var_kwargs=any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()),
        hybrid=any(s.hybrid for s in specs),
        packed_attention_mask=tuple(sorted({k for s in specs for k in s.packed_attention_mask})),
        slot_checks=tuple(dict.fromkeys(s.options["slot_check"] for s in specs if "slot_check" in s.options)),
        slot_sensitive=counts_slots(target, specs),
        text_position_rows=rows,
        slot_distances=any(s.options.get("slot_distances", False) for s in specs),
        checkpointed=tuple(m for m in target.modules() if hasattr(m, "gradient_checkpointing")),
        router_loss_mask=any(s.options.get("router_loss_mask", False) for s in specs)
        and any(m is not target and isinstance(m, PreTrainedModel) for m in target.modules()),
        attention_configs=attention_configs(target),
    )


def counts_slots(model: nn.Module, specs) -> bool:
    """Does ``model``'s attention count cache slots (a sliding window, or a slot-reading mixer kind)?"""
    if any(s.kind in _SLOT_KINDS or "slot_check" in s.options for s in specs):
        return True
    windows = [text_config_value(model, a, None) for a in ("sliding_window", "attention_window_size", "sliding_window_size")]
    layer_types = text_config_value(model, "layer_types", None) or ()
    return any(w for w in windows) or any("sliding" in str(t) for t in layer_types)


def positional_names(forward: Callable[..., Any]) -> tuple[str, ...]:
    """The parameters of ``forward`` that positional arguments bind to, in order, up to the first that cannot be
    named (``*args``, a positional-only parameter): ``model(ids, mask)`` -> ``("input_ids", "attention_mask")``."""
    names = []
    for p in inspect.signature(forward).parameters.values():
        if p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD:
            break
        names.append(p.name)
    return tuple(names)
