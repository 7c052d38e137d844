"""The registry of family specs, keyed by ``config.model_type`` and by mixer class name.

A :class:`MixerSpec` is a small declarative description of how one family's recurrent mixer differs from
the generic implementation of its kind (``safepad.mixers``). ``safepad.wrap`` walks the module tree,
finds every module whose class name a spec lists, and patches it with the spec's generic forward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .options import KIND_OPTIONS, known_kind, validate_options

logger = logging.getLogger(__name__)

__all__ = ["MixerSpec", "register", "spec_for_module", "specs_for_model_type", "supported_model_types", "all_specs"]


class FrozenOptions(dict):
    """A spec's options: a read-only ``dict``. Not a ``MappingProxyType``: under ``torch.compile`` dynamo breaks the
    graph at every read of a mapping proxy once the traced code has edited a dict it was handed (transformers'
    ``can_return_tuple`` pops ``return_dict`` from the forward's kwargs), so ``fullgraph=True`` would fail."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("a MixerSpec's options are read-only; declare them when the spec is built")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _refuse  # type: ignore[assignment]

    def __reduce__(self):  # pickle / deepcopy rebuild it whole (not item by item)
        return (type(self), (dict(self),))

    def __hash__(self) -> int:  # frozen dataclasses hash their fields
        return hash(tuple(sorted(self, key=repr)))


@dataclass(frozen=True)
class MixerSpec:
    """How to make one family's mixer padding-correct.

    Attributes:
        model_type: ``config.model_type`` of the family (the registry key), e.g. ``"nemotron_h"``.
        kind: which generic implementation serves it: ``"mamba2"``, ``"mamba1"``, ``"gated_delta"``, ``"short_conv"``.
        mixer_classes: class names of the modules to patch (matched anywhere in the tree, so a VLM whose
            language model is of this family is covered).
        forward: the generic forward, called as ``forward(module, *args, **kwargs)``.
        forward_by_class: for a family with several kinds of stateful module (a mixer and an indexer, ...):
            the forward of each mixer class that is not served by ``forward``, keyed by class name.
        options: family differences the generic forward reads (multipliers, gate variant, ...), and the hooks read
            (typed: every key is declared in :mod:`safepad.specs.options`, and an unknown key or a value of the wrong
            type raises when the spec is declared; ``router_loss_mask``: the top-level forward gives its ``attention_mask`` to the MoE router
            load-balancing loss, so a packed call hands it the real-token mask; see ``safepad.wrap.hooks``).
        hybrid: whether the family interleaves attention layers (they need packed ``position_ids``).
        packed_attention_mask: for hybrids whose mask construction ignores ``position_ids`` (GraniteMoeHybrid):
            the mask-mapping keys to fill with a block-diagonal causal mask on packed inputs.
        inner_classes: stateful classes inside a patched mixer whose work the generic forward does itself (they
            are not patched, and never called by the wrapped mixer), e.g. RecurrentGemma's ``RecurrentGemmaRglru``.
    """

    model_type: str
    kind: str
    mixer_classes: tuple[str, ...]
    forward: Callable[..., Any]
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    hybrid: bool = False
    packed_attention_mask: tuple[str, ...] = ()
    description: str = ""
    inner_classes: tuple[str, ...] = ()
    forward_by_class: Mapping[str, Callable[..., Any]] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", FrozenOptions(validate_options(self.model_type, self.kind, self.options)))

    def forward_for(self, class_name: str) -> Callable[..., Any]:
        """The generic forward that serves mixer class ``class_name``."""
        return self.forward_by_class.get(class_name, self.forward)


_BY_MODEL_TYPE: dict[str, MixerSpec] = {}
_BY_CLASS: dict[str, MixerSpec] = {}
#: class name -> spec for every class a spec covers: its mixer classes and its inner classes
_COVERED: dict[str, MixerSpec] = {}


def register(spec: MixerSpec) -> MixerSpec:
    """Add a family spec. Class names must be unique across families."""
    if spec.model_type in _BY_MODEL_TYPE:
        raise ValueError(f"a spec for model_type {spec.model_type!r} is already registered")
    if not known_kind(spec.kind):
        raise ValueError(
            f"spec {spec.model_type!r}: unknown kind {spec.kind!r}; known kinds: {sorted(KIND_OPTIONS)} (declare a new "
            "kind's options in safepad.specs.options)"
        )
    stray = sorted(set(spec.forward_by_class) - set(spec.mixer_classes))
    if stray:
        raise ValueError(f"{spec.model_type}: forward_by_class names classes that are not mixer_classes: {stray}")
    for name in (*spec.mixer_classes, *spec.inner_classes):
        if name in _COVERED:
            raise ValueError(f"mixer class {name!r} is already claimed by {_COVERED[name].model_type!r}")
    _BY_MODEL_TYPE[spec.model_type] = spec
    for name in spec.mixer_classes:
        _BY_CLASS[name] = spec
    for name in (*spec.mixer_classes, *spec.inner_classes):
        _COVERED[name] = spec
    return spec


def spec_for_module(module: Any) -> MixerSpec | None:
    """The spec that patches this module's class, if any (matched on the original class name)."""
    cls = getattr(module, "_safepad_original_class", type(module))
    return _BY_CLASS.get(cls.__name__)


def specs_for_model_type(model_type: str) -> MixerSpec | None:
    return _BY_MODEL_TYPE.get(model_type)


def supported_model_types() -> list[str]:
    """Every ``config.model_type`` safepad can wrap, sorted."""
    return sorted(_BY_MODEL_TYPE)


def all_specs() -> list[MixerSpec]:
    return [_BY_MODEL_TYPE[k] for k in sorted(_BY_MODEL_TYPE)]
