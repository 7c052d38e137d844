"""The typed schema of :attr:`MixerSpec.options <safepad.specs.registry.MixerSpec.options>`.

Every option a spec may set is declared here once, with its type and what reads it: the keys the wrap layer reads
for every kind (:data:`MODEL_OPTIONS`) and the keys each generic forward reads (:data:`KIND_OPTIONS`, by
``MixerSpec.kind``; a kind ``"a+b"`` takes the keys of both). :func:`validate_options` runs when a spec is
declared (``MixerSpec.__post_init__``, so at import), so a misspelled or mistyped option raises there, naming the
key and the valid ones, instead of being silently ignored by the ``options.get(key, default)`` that reads it.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

__all__ = ["KIND_OPTIONS", "MODEL_OPTIONS", "Option", "known_kind", "validate_options"]


@dataclass(frozen=True)
class Option:
    """One spec option: the types its value may have, the values it may take (``choices``; None: any), and what
    it means."""

    types: tuple[type, ...]
    doc: str
    choices: tuple[Any, ...] | None = None


_STR = (str,)
_OPT_STR = (str, type(None))
_NAMES = (tuple,)  # a tuple of attribute names
_BOOL = (bool,)


#: options the wrap layer reads, valid for every kind
MODEL_OPTIONS: Mapping[str, Option] = MappingProxyType(
    {
        "accelerate_children": Option(_NAMES, "children whose weights the forward reads directly (accelerate hooks)"),
        "accelerate_children_by_class": Option((Mapping,), "accelerate_children per mixer class name"),
        "layer_idx_from_name": Option(_BOOL, "the stock module keeps no layer index: take it from its module name"),
        "gated_norm": Option(
            (*_OPT_STR, tuple), "transformers class (or the names it has had) of the gated norm the blocked op may replace"
        ),
        "slot_check": Option((Callable,), "check(module, layout [B, N] bool) refusing slot layouts it cannot serve"),
        "slot_distances": Option(_BOOL, "attention reads slot distances: re-lay uncached calls with holes"),
        "text_position_rows": Option(_NAMES, "position_ids row counts whose text row restarts on packed calls"),
        "router_loss_mask": Option(_BOOL, "the MoE router loss reads attention_mask: give it the real-token mask"),
        "module_states": Option((Mapping,), "where the stock module keeps its states (safepad.testing)"),
    }
)

#: options each generic forward reads, by ``MixerSpec.kind``
KIND_OPTIONS: Mapping[str, Mapping[str, Option]] = MappingProxyType(
    {
        "mamba2": MappingProxyType(
            {
                "in_multiplier": Option(_STR, "attribute scaling the hidden states before in_proj"),
                "proj_multiplier": Option(_STR, "attribute scaling in_proj's output"),
                "optional_norm_attr": Option(_STR, "boolean attribute: apply the gated norm only when set"),
            }
        ),
        "mamba1": MappingProxyType(
            {
                "dt_norm": Option(_OPT_STR, "norm applied to the low-rank dt"),
                "b_norm": Option(_OPT_STR, "norm applied to B"),
                "c_norm": Option(_OPT_STR, "norm applied to C"),
                "heads": Option(_BOOL, "multi-head layout (x and z interleaved in in_proj's output)"),
            }
        ),
        "gated_delta": MappingProxyType(
            {
                "qkv": Option((str, tuple), "'qkvz_ba' or the projections whose outputs make [q | k | v]"),
                "beta": Option(_OPT_STR, "beta-logit projection (None: the fused ba projection)"),
                "beta_scale_flag": Option(_OPT_STR, "boolean attribute that doubles beta"),
                "decay": Option(_STR, "how the log-decay is computed", ("mamba", "module")),
                "decay_proj": Option(_OPT_STR, "decay-logit projection (None: the fused ba projection)"),
                "decay_module": Option(_STR, "per-key-channel decay module (decay='module')"),
                "gate": Option((tuple, type(None)), "output-gate projection chain (None: Qwen3-Next's z)"),
                "norm": Option(_STR, "gated RMS norm attribute"),
                "out": Option(_STR, "output projection attribute"),
                "key_dim": Option(_STR, "attribute holding H_k * Dk"),
                "key_head_dim": Option(_STR, "attribute holding Dk"),
                "value_head_dim": Option(_STR, "attribute holding Dv"),
                "chunk_size": Option((int,), "chunk length of the chunked delta rule"),
            }
        ),
        "short_conv": MappingProxyType(
            {
                "in_proj": Option(_STR, "input projection attribute"),
                "conv": Option(_STR, "depthwise conv attribute"),
                "out_proj": Option(_STR, "output projection attribute"),
                "activation": Option(_OPT_STR, "activation after the conv (None: none)"),
            }
        ),
        "rg_lru": MappingProxyType({"c": Option((float, int), "RG-LRU gate constant")}),
        "attn_conv": MappingProxyType(
            {"residual_scale": Option((float, int, str), "residual scale: a number or 'sqrt_k1' (1 / sqrt(K + 1))")}
        ),
        "cca": MappingProxyType({}),
        "dsa_indexer": MappingProxyType({}),
    }
)


def known_kind(kind: str) -> bool:
    """Whether every part of ``kind`` (``"gated_delta+dsa_indexer"``: two) has a schema."""
    return all(part in KIND_OPTIONS for part in kind.split("+"))


def _schema(kind: str) -> dict[str, Option]:
    schema = dict(MODEL_OPTIONS)
    for part in kind.split("+"):
        schema.update(KIND_OPTIONS[part])
    return schema


def validate_options(model_type: str, kind: str, options: Mapping[str, Any]) -> Mapping[str, Any]:
    """``options`` checked against ``kind``'s schema, as a read-only mapping.

    Raises ``ValueError`` naming the spec, the key and the valid keys for an unknown key, and the expected types for
    a value of the wrong type. A kind without a schema is left to :func:`safepad.specs.registry.register`.
    """
    if not known_kind(kind):
        return MappingProxyType(dict(options))
    schema = _schema(kind)
    for key, value in options.items():
        option = schema.get(key)
        if option is None:
            near = difflib.get_close_matches(str(key), schema, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ValueError(
                f"spec {model_type!r} (kind {kind!r}): unknown option {key!r}{hint}; valid options: {sorted(schema)}"
            )
        bad_type = not isinstance(value, option.types) or (isinstance(value, bool) and bool not in option.types)
        if bad_type or (option.choices is not None and value not in option.choices):
            want = " | ".join(t.__name__ for t in option.types)
            if option.choices is not None:
                want = f"one of {list(option.choices)}"
            raise ValueError(f"spec {model_type!r}: option {key!r} must be {want} ({option.doc}), got {value!r}")
    return MappingProxyType(dict(options))
