"""A forward pre-hook that catches batch layouts an unwrapped state-space model gets silently wrong.

``safepad.guard(model, mode)`` installs one ``register_forward_pre_hook(..., with_kwargs=True)`` on the
top-level model. On every forward call into a model that has SSM / linear-attention layers and is not
wrapped by :func:`safepad.wrap`, it looks at the few inputs that describe the batch layout and detects:

* ``right_padding_with_cache`` — a 2-D ``attention_mask`` ``[B, T_mask]`` whose row ends in padding while a
  cache is built for later use or read (``use_cache=True``, a cache passed in as ``cache`` / ``cache_params`` /
  ``past_key_values``, or the config default ``use_cache`` in eval mode). The cached conv / SSM state of that
  row is then taken after the pads, so everything decoded from it is wrong. In training mode a cache that exists only
  because of the config default is thrown away by the Trainer: it is counted, not reported.
* ``packed`` — several sequences in one row: ``seq_idx`` ``[B, T]`` with a boundary, ``cu_seq_lens_q/k``
  ``[S + 1]`` with ``S > 1``, or ``position_ids`` that restart at 0 inside a row (``[B, T]``, ``[1, T]``, ``[T]``,
  the text row of ``[4, B, T]`` / ``[1, B, T]``, all-zero ``[3, B, T]`` RoPE rows; with a
  padding mask, only at real tokens after the row's first one: ``generate()`` sets the position of a pad to 1
  and of the first real token to 0, which is not packing; packed sequences followed by pads are).
  The recurrent state leaks from one sequence into the next.
* ``mask_holes`` — zeros between ones in a row of a 2-D ``attention_mask``: the state decays and the conv
  window reads zeros across the hole.

Modes: ``"warn"`` emits one :class:`~safepad.errors.PaddingWarning` per kind (and logs every detection),
``"error"`` raises :class:`~safepad.errors.PaddingError`, ``"fix"`` calls ``safepad.wrap(model)`` before
the forward proceeds and logs that it did so.

Cost per forward: a handful of element-wise ops and reductions over the ``[B, T]`` mask / ids, stacked into
one small int64 vector and read back with a single ``.tolist()`` (the only device sync). A wrapped or
non-SSM model needs no decision, so its statistics stay on the device until they are read.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import re
import warnings
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from .cache import CACHE_NAMES
from .errors import PaddingError, PaddingWarning, UnsupportedModelError
from .layout.boundaries import packing_positions
from .layout.masks import ends_in_padding, has_holes, hole_positions
from .layout.normalize import change_points, restarts_at_real_tokens

logger = logging.getLogger(__name__)

__all__ = [
    "GUARD_MODES",
    "KIND_HOLES",
    "KIND_PACKED",
    "KIND_RIGHT_PADDING",
    "GuardHandle",
    "GuardMode",
    "SSMInfo",
    "find_ssm_layers",
    "get_guard",
    "guard",
]

GuardMode = Literal["warn", "error", "fix"]
GUARD_MODES: tuple[str, ...] = ("warn", "error", "fix")

KIND_RIGHT_PADDING = "right_padding_with_cache"
KIND_PACKED = "packed"
KIND_HOLES = "mask_holes"

# Mixer classes: a name match only counts when the module owns a Conv1d (directly or through a
# short-convolution child), so that e.g. ``MambaBlock`` / ``MambaRMSNorm`` are not counted as mixers.
_MIXER_NAME = re.compile(r"Mamba|GatedDeltaNet|DeltaNet|DeltaAttention|ShortConv|Mixer|RecurrentBlock")
# Linear-attention mixers that carry a recurrent state but no short convolution.
_LINEAR_ATTENTION_NAME = re.compile(r"LinearAttention|LightningAttention")
# ``config.layer_types`` entries that denote a recurrent layer.
_SSM_LAYER_TYPES = frozenset({"mamba", "mamba2", "mamba1", "linear_attention", "conv", "ssm", "recurrent", "hybrid"})
# Model types that are SSM or hybrid by construction (used when the module scan finds no mixer class).
_SSM_MODEL_TYPES = frozenset(
    {
        "mamba", "mamba2", "falcon_mamba", "jamba", "bamba", "falcon_h1", "granitemoehybrid", "zamba", "zamba2",
        "nemotron_h", "qwen3_next", "qwen3_5", "qwen3_5_moe", "lfm2", "lfm2_moe", "olmo_hybrid", "kimi_linear",
        "minimax", "recurrent_gemma", "rwkv", "plamo2",
    }
)  # fmt: skip

# Index of each entry of the per-forward summary vector (int64, read back with one .tolist()).
_TOKENS, _TRAILING_ROWS, _HOLE_ROWS, _REAL_ROWS, _RESTARTS, _SEQ_CHANGES = range(6)
_SUMMARY_LEN = 6


def _config_of(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    get_text_config = getattr(config, "get_text_config", None)
    if callable(get_text_config):
        try:
            return get_text_config()
        except (TypeError, ValueError):
            return config
    return config


def _owns_conv1d(module: nn.Module) -> bool:
    for child in module.children():
        if isinstance(child, nn.Conv1d):
            return True
        if "Conv" in type(child).__name__ and any(isinstance(g, nn.Conv1d) for g in child.children()):
            return True
    return False


def _is_mixer(module: nn.Module) -> bool:
    name = type(module).__name__
    if getattr(type(module), "_safepad_original_class", None) is not None:  # a class patched by safepad.wrap
        name = type(module)._safepad_original_class.__name__
    return bool((_MIXER_NAME.search(name) and _owns_conv1d(module)) or _LINEAR_ATTENTION_NAME.search(name))


def _registry_mixer(module: nn.Module) -> bool:
    """Whether safepad's spec registry patches ``module``'s class (a patched module counts by its original class)."""
    from .specs.registry import spec_for_module

    return getattr(module, "_safepad_spec", None) is not None or spec_for_module(module) is not None


def _mixer_modules(model: nn.Module) -> list[nn.Module]:
    """The recurrent mixer modules of ``model`` (see :func:`find_ssm_layers`).

    A model of a family safepad supports: exactly the modules whose class the spec registry patches (what
    :func:`safepad.wrap` patches), so that an attention class whose name happens to match the name patterns (e.g.
    Kimi-Linear's full-attention ``KimiLinearAttention``) is not taken for an unwrapped mixer. A model none of
    whose modules the registry knows: the class-name patterns below.
    """
    modules = list(model.modules())
    claimed = [m for m in modules if _registry_mixer(m)]
    return claimed if claimed else [m for m in modules if _is_mixer(m)]


@dataclass(frozen=True)
class SSMInfo:
    """What :func:`find_ssm_layers` found: the family name and the recurrent mixer classes."""

    family: str
    mixer_classes: tuple[str, ...]
    num_layers: int

    def describe(self) -> str:
        """Human-readable family, e.g. ``"nemotron_h (2 NemotronHMamba2Mixer layers)"``."""
        if not self.mixer_classes:
            return f"{self.family} (recurrent layers per config.layer_types)"
        classes = "/".join(self.mixer_classes)
        return f"{self.family} ({self.num_layers} {classes} layer{'s' if self.num_layers != 1 else ''})"


def find_ssm_layers(model: nn.Module) -> SSMInfo | None:
    """Detect SSM / linear-attention layers by module class, ``config.layer_types`` and ``config.model_type``.

    Works for families safepad does not support: any module whose class name contains
    Mamba / GatedDeltaNet / ShortConv / Mixer / ... and which owns a ``Conv1d``, or any linear-attention
    class, counts; failing that, any module whose class reads or writes conv / recurrent cache state (or keeps
    it as an attribute), then any layer type transformers caches in a recurrent cache layer
    (:mod:`safepad.specs.discovery`). Returns ``None`` for a model without recurrent layers.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")  # noqa: TRY004
    config = _config_of(model)
    model_type = str(getattr(config, "model_type", None) or type(model).__name__)
    classes: dict[str, int] = {}
    for module in _mixer_modules(model):
        cls = getattr(type(module), "_safepad_original_class", None) or type(module)
        classes[cls.__name__] = classes.get(cls.__name__, 0) + 1
    if not classes:
        # any other module whose class keeps conv / recurrent state (the discovery's class rule)
        from .specs.discovery import class_keeps_state

        for module in model.modules():
            cls = getattr(type(module), "_safepad_original_class", None) or type(module)
            if not cls.__module__.startswith("torch.") and class_keeps_state(cls):
                classes[cls.__name__] = classes.get(cls.__name__, 0) + 1
    if classes:
        return SSMInfo(model_type, tuple(sorted(classes)), sum(classes.values()))
    if config is not None:
        # layer types that transformers itself caches in a recurrent (conv / linear-attention) cache layer
        from .specs.discovery import recurrent_cache_layer_types

        recurrent_types = recurrent_cache_layer_types(config)
        if recurrent_types:
            n = sum(1 for t in getattr(config, "layer_types", None) or () if t in recurrent_types)
            return SSMInfo(model_type, (), n)
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, (list, tuple)):
        n = sum(1 for t in layer_types if isinstance(t, str) and t.lower() in _SSM_LAYER_TYPES)
        if n:
            return SSMInfo(model_type, (), n)
    if model_type in _SSM_MODEL_TYPES:
        return SSMInfo(model_type, (), 0)
    return None


def _checkpointing(model: nn.Module) -> bool:
    """Activation checkpointing turns the config-default cache off in training (``merge_with_config_defaults``)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if isinstance(getattr(type(model), name, None), property):
            return bool(getattr(model, name))
    return any(getattr(m, "gradient_checkpointing", False) for m in model.children())


def _cache_has_recurrent_layers(cache: Any) -> bool:
    """True for a transformers cache holding a recurrent / linear-attention layer (5.x ``LinearAttentionLayer``)."""
    try:
        from transformers import cache_utils
    except ImportError:  # pragma: no cover - transformers is a hard dependency
        return False
    mixin = getattr(cache_utils, "LinearAttentionCacheLayerMixin", None)
    layers = getattr(cache, "layers", None)
    if mixin is None or not isinstance(layers, (list, tuple)):
        return hasattr(cache, "conv_states") or hasattr(cache, "ssm_states")
    return any(isinstance(layer, mixin) for layer in layers)


def _wrap_api(required: bool) -> Any:
    """The ``safepad.wrap`` module, or ``None`` when it does not exist (``required=False``)."""
    name = f"{__package__}.wrap"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name or required:
            raise
        return None


class _Stats:
    """Per-mode accumulators: host sums for forwards already synced, one device vector for the rest."""

    __slots__ = ("default_cache_right_padded", "device", "forwards", "host", "slots")

    def __init__(self) -> None:
        self.forwards = 0
        self.slots = 0
        self.host = [0] * _SUMMARY_LEN
        self.device: Tensor | None = None
        self.default_cache_right_padded = 0

    def result(self) -> dict[str, float]:
        summary = list(self.host)
        if self.device is not None:
            summary = [a + b for a, b in zip(summary, self.device.tolist())]
        if not self.forwards:
            return {}
        tokens, sequences = summary[_TOKENS], summary[_REAL_ROWS]
        return {
            "safepad/pad_fraction": (self.slots - tokens) / max(self.slots, 1),
            "safepad/tokens_per_batch": tokens / self.forwards,
            "safepad/sequences_per_batch": sequences / self.forwards,
            "safepad/right_padded_default_cache": float(self.default_cache_right_padded),
        }


class GuardHandle:
    """The guard installed on one model. ``remove()`` detaches it; also a context manager.

    Attributes:
        model: the guarded top-level module.
        mode: ``"warn"``, ``"error"`` or ``"fix"``.
        info: the :class:`SSMInfo` found at install time (``None`` for a model without recurrent layers).
        detections: how many forwards showed each kind (``KIND_*``), whatever the mode.
        warned: the kinds already warned about (``mode="warn"`` warns once per kind).
    """

    def __init__(self, model: nn.Module, mode: str, info: SSMInfo | None, collect_stats: bool) -> None:
        self.model = model
        self.mode = mode
        self.info = info
        self.collect_stats = collect_stats
        self.installed_by: str | None = None  # e.g. "PaddingGuardCallback"; None for a direct guard() call
        self.detections: dict[str, int] = {}
        self.warned: set[str] = set()
        self._stats = {True: _Stats(), False: _Stats()}
        self._wrap_module: Any = _wrap_api(required=False)
        self._mixers = _mixer_modules(model) if info is not None else []
        self._wrapped_key: tuple[type, ...] | None = None
        self._wrapped = False
        self._positional = [
            p.name
            for p in inspect.signature(model.forward).parameters.values()
            if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        ]
        self._hook = model.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
        model._safepad_guard = self  # type: ignore[assignment]

    # ----------------------------------------------------------------------------------------- public
    @property
    def active(self) -> bool:
        """False once :meth:`remove` has run."""
        return self._hook is not None

    def remove(self) -> None:
        """Detach the hook from the model (idempotent)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
            if getattr(self.model, "_safepad_guard", None) is self:
                del self.model._safepad_guard

    def __enter__(self) -> GuardHandle:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def stats(self, training: bool = True) -> dict[str, float]:
        """Batch statistics over the forwards (in train or eval mode) since the last :meth:`pop_stats`.

        Keys: ``safepad/pad_fraction`` (pad slots / all slots of the inputs), ``safepad/tokens_per_batch``
        (real tokens per forward), ``safepad/sequences_per_batch`` (sequences per forward, counting packed
        ones), ``safepad/right_padded_default_cache`` (forwards that built a cache only from the config
        default over right-padded rows). Empty when no forward ran.
        """
        return self._stats[bool(training)].result()

    def pop_stats(self, training: bool = True) -> dict[str, float]:
        """:meth:`stats`, then reset the accumulators of that mode."""
        out = self.stats(training)
        self._stats[bool(training)] = _Stats()
        return out

    def is_wrapped(self) -> bool:
        """Whether :func:`safepad.wrap` has made the model safe (False while ``safepad.wrap`` does not exist).

        With mixer modules found at install time, every one of them must be wrapped (a model where wrap
        patched only some mixers is still unsafe); the answer is cached on the tuple of their classes, which
        ``wrap`` / ``unwrap`` change. Otherwise ``safepad.wrap.is_wrapped(model)`` decides.
        """
        wrap_module = self._wrap_module
        if wrap_module is None:
            return False
        if not self._mixers:
            return bool(wrap_module.is_wrapped(self.model))
        key = tuple(type(m) for m in self._mixers)
        if key != self._wrapped_key:
            self._wrapped_key = key
            self._wrapped = all(bool(wrap_module.is_wrapped(m)) for m in self._mixers)
        return self._wrapped

    # ----------------------------------------------------------------------------------------- hook
    def _get(self, name: str, args: tuple, kwargs: dict) -> Any:
        value = kwargs.get(name)
        if value is None and args:
            try:
                i = self._positional.index(name)
            except ValueError:
                return None
            if i < len(args):
                value = args[i]
        return value

    def _cache_reason(self, args: tuple, kwargs: dict) -> tuple[str | None, bool]:
        """(why a cache is built or used, whether it counts) — the reason is None when no cache is involved."""
        use_cache = self._get("use_cache", args, kwargs)
        if use_cache:
            return "use_cache=True", True
        for name in CACHE_NAMES:
            if self._get(name, args, kwargs) is not None:
                return f"{name} passed in", True
        if use_cache is not None:
            return None, False
        config = _config_of(self.model)
        if not getattr(config, "use_cache", False):
            return None, False
        if self.model.training:
            if _checkpointing(self.model):
                return None, False
            return "config.use_cache=True in training mode", False
        return "config.use_cache=True in eval mode", True

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        info = self.info
        wrapped = self.is_wrapped()
        if info is None and not wrapped:
            cache = next((c for c in (self._get(n, args, kwargs) for n in CACHE_NAMES) if c is not None), None)
            if cache is not None and _cache_has_recurrent_layers(cache):
                info = SSMInfo(str(getattr(_config_of(module), "model_type", type(module).__name__)), (), 0)
        check = info is not None and not wrapped
        if not check and not self.collect_stats:
            return None

        ids = self._get("input_ids", args, kwargs)
        if ids is None:
            ids = self._get("inputs_embeds", args, kwargs)
        mask = self._get("attention_mask", args, kwargs)
        if not isinstance(mask, Tensor) or mask.dim() != 2:
            mask = None  # dict of per-layer masks (compiled generate) or a 4-D mask: no row layout to read
        if isinstance(ids, Tensor) and ids.dim() >= 2:
            B, T = int(ids.shape[0]), int(ids.shape[1])
        elif mask is not None:
            B, T = int(mask.shape[0]), int(mask.shape[1])
        else:
            return None
        # [B, T] from every layout a model accepts ([T], [1|B, T], [4|1, B, T] text row, [3, B, T] RoPE rows)
        position_ids = packing_positions(self._get("position_ids", args, kwargs), (B, T))
        seq_idx = self._get("seq_idx", args, kwargs)
        if not (isinstance(seq_idx, Tensor) and seq_idx.dim() == 2 and seq_idx.shape[-1] == T):
            seq_idx = None
        cu = None
        for name in ("cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens"):
            value = self._get(name, args, kwargs)
            if isinstance(value, Tensor) and value.dim() == 1:
                cu = (name, value)
                break

        n_cu = cu[1].numel() - 1 if cu is not None else None
        device = ids.device if isinstance(ids, Tensor) else mask.device
        summary = _summarize(mask, position_ids, seq_idx, n_cu, B, T, device)  # [6] int64
        stats = self._stats[bool(module.training)] if self.collect_stats else None
        if stats is not None:
            stats.forwards += 1
            stats.slots += B * T
        if not check:
            if stats is not None:
                stats.device = summary if stats.device is None else stats.device + summary.to(stats.device)
            return None

        values = summary.tolist()  # the one device sync
        if stats is not None:
            stats.host = [a + b for a, b in zip(stats.host, values)]
        found: list[tuple[str, str]] = []
        if values[_TRAILING_ROWS]:
            reason, counts = self._cache_reason(args, kwargs)
            if reason is not None and counts:
                found.append((KIND_RIGHT_PADDING, _right_padding_message(mask, reason, info)))
            elif reason is not None and stats is not None:
                stats.default_cache_right_padded += 1
        packed_by = None
        if cu is not None and cu[1].numel() > 2:
            packed_by = cu[0]
        elif values[_SEQ_CHANGES]:
            packed_by = "seq_idx"
        elif values[_RESTARTS]:
            packed_by = "position_ids"
        if packed_by is not None:
            found.append((KIND_PACKED, _packed_message(packed_by, cu, seq_idx, position_ids, info, mask)))
        if values[_HOLE_ROWS]:
            found.append((KIND_HOLES, _holes_message(mask, info)))
        if found:
            return self._report(found, module, args, kwargs)
        return None

    def _report(
        self, found: list[tuple[str, str]], module: nn.Module, args: tuple, kwargs: dict
    ) -> tuple[tuple, dict] | None:
        for kind, _ in found:
            self.detections[kind] = self.detections.get(kind, 0) + 1
        if self.mode == "error":
            raise PaddingError("\n".join(msg for _, msg in found), kinds=tuple(kind for kind, _ in found))
        if self.mode == "warn":
            for kind, msg in found:
                logger.warning("%s", msg)
                if kind not in self.warned:
                    self.warned.add(kind)
                    warnings.warn(PaddingWarning(msg, kind), stacklevel=4)
            return None
        return self._fix(found, module, args, kwargs)

    def _fix(self, found: list[tuple[str, str]], module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Wrap the model, then run the pre-hooks that wrap added to it on this call's arguments.

        torch snapshots a module's pre-hooks before calling them, so hooks registered by ``wrap`` from inside
        this hook would otherwise miss the current call (while its forward hooks, read after the forward,
        would not). Returns the ``(args, kwargs)`` the forward proceeds with.
        """
        kind_names = tuple(kind for kind, _ in found)
        kinds = ", ".join(kind_names)

        def refused(why: str) -> PaddingError:
            """``why`` the call cannot be fixed, followed by what the guard detected."""
            return PaddingError(why + "\n" + "\n".join(msg for _, msg in found), kinds=kind_names)

        try:
            wrap_module = _wrap_api(required=True)
        except ImportError as exc:
            raise refused(
                f"mode='fix' needs safepad.wrap, which cannot be imported ({exc}); detected: {kinds}."
            ) from exc
        model = self.model
        cls, forward = type(model), model.__dict__.get("forward")
        hooks_before = set(model._forward_pre_hooks)
        try:
            result = wrap_module.wrap(model)
        except UnsupportedModelError as exc:
            raise refused(
                f"mode='fix': safepad.wrap cannot fix this model ({exc}), so this forward would be wrong."
            ) from exc
        if result is not model or type(model) is not cls or model.__dict__.get("forward") is not forward:
            raise PaddingError(
                "mode='fix': safepad.wrap replaced the model or its top-level forward, but this call was already "
                "dispatched to the unwrapped one. Call safepad.wrap(model) before the first forward instead.",
                kinds=kind_names,
            )
        self._wrap_module = wrap_module
        if not self.is_wrapped():
            left = sorted({type(m).__name__ for m in self._mixers if not wrap_module.is_wrapped(m)})
            raise refused(
                f"mode='fix': safepad.wrap left these recurrent mixers unpatched: {', '.join(left)}; they would "
                "still compute this forward wrong."
            )
        for hook_id, hook in list(model._forward_pre_hooks.items()):
            if hook_id in hooks_before:
                continue
            if hook_id in model._forward_pre_hooks_with_kwargs:
                result = hook(module, args, kwargs)
                if result is not None:
                    args, kwargs = result
            else:
                result = hook(module, args)
                if result is not None:
                    args = result if isinstance(result, tuple) else (result,)
        logger.warning(
            "safepad guard (mode='fix'): wrapped %s with safepad.wrap before a forward with %s; continuing.",
            self.info.describe() if self.info is not None else type(model).__name__,
            kinds,
        )
        return args, kwargs


def _summarize(
    mask: Tensor | None,
    position_ids: Tensor | None,
    seq_idx: Tensor | None,
    n_cu: int | None,
    B: int,
    T: int,
    device: torch.device,
) -> Tensor:
    """One ``[6]`` int64 vector on ``device``.

    Entries: real tokens of this call, right-padded rows, rows with holes, sequences (non-empty rows, or
    packed sequences from ``n_cu`` / ``seq_idx`` / ``position_ids``), position restarts (with a mask: at real
    tokens after each row's first real one in this call), ``seq_idx`` changes. Every entry is counted from the
    predicates wrap decides with (:mod:`safepad.layout`), stacked here so the guard reads them in one sync.
    """
    # the classification is wrap's own (safepad.layout predicates, device tensors), so the two cannot disagree
    cur = None
    if mask is not None:
        m = mask != 0  # [B, Tm]; Tm = past + T during decode
        cur = m[:, -T:]  # [B, T]: the columns of this call's tokens
        tokens = cur.sum()
        trailing = ends_in_padding(m).sum()
        holes = has_holes(m).sum()
        real_rows = m.any(1).sum()
    else:
        tokens = torch.full((), B * T, dtype=torch.int64, device=device)  # a fill kernel: no host-to-device copy
        trailing = holes = torch.zeros((), dtype=torch.int64, device=device)
        real_rows = torch.full((), B, dtype=torch.int64, device=device)
    if position_ids is not None and T > 1:
        # only real tokens count, and not a row's first real token of this call: generate() puts pads at 1 and the
        # first real token at 0 (no packing), while packed sequences followed by pads restart at real tokens
        restarts = restarts_at_real_tokens(position_ids, cur).sum()
    else:
        restarts = torch.zeros((), dtype=torch.int64, device=tokens.device)
    if seq_idx is not None and T > 1:
        changes = change_points(seq_idx).sum()
    else:
        changes = torch.zeros((), dtype=torch.int64, device=tokens.device)
    if n_cu is not None:
        real_rows = torch.full((), n_cu, dtype=torch.int64, device=device)
    elif seq_idx is not None:
        real_rows = real_rows + changes.to(real_rows.device)
    elif position_ids is not None:
        real_rows = real_rows + restarts.to(real_rows.device)
    parts = (tokens, trailing, holes, real_rows, restarts, changes)
    return torch.stack([p.to(device=device, dtype=torch.int64) for p in parts])  # [6]


_FIXES = (
    "Fix: pad on the left (tokenizer.padding_side = 'left'), or call safepad.wrap(model), which makes right "
    "padding and packed rows (seq_idx / cu_seq_lens / position_ids) correct."
)


def _family(info: SSMInfo | None) -> str:
    return info.describe() if info is not None else "recurrent"


def _right_padding_message(mask: Tensor, reason: str, info: SSMInfo | None) -> str:
    m = mask != 0  # [B, Tm]
    rows = ends_in_padding(m).nonzero().flatten().tolist()
    row = rows[0]
    last_real = int(m[row].nonzero().max())
    pads = m.shape[1] - 1 - last_real
    return (
        f"safepad guard: row {row} of attention_mask ends in {pads} padding token(s) "
        f"({len(rows)} of {m.shape[0]} rows are right-padded) while a cache is built or used ({reason}) on "
        f"{_family(info)} that safepad has not wrapped. The conv and SSM states cached for such a row are taken "
        f"after its pads, so every token decoded from them is wrong. {_FIXES}"
    )


def _packed_message(
    source: str,
    cu: tuple[str, Tensor] | None,
    seq_idx: Tensor | None,
    position_ids: Tensor | None,
    info: SSMInfo | None,
    mask: Tensor | None = None,
) -> str:
    if source == "seq_idx" and seq_idx is not None:
        change = seq_idx[:, 1:] != seq_idx[:, :-1]  # [B, T-1]
        row = int(change.any(1).nonzero()[0])
        n_seq = int(change[row].sum()) + 1
        first = int(change[row].nonzero()[0]) + 1
        where = f"row {row} holds {n_seq} sequences (seq_idx; the first boundary is at token {first})"
    elif source == "position_ids" and position_ids is not None:
        m = None if mask is None else (mask != 0)[:, -position_ids.shape[1] :]  # [B, T]
        restart = restarts_at_real_tokens(position_ids, m)[:, 1:]  # [B, T-1] (as _summarize counts them)
        row = int(restart.any(1).nonzero()[0])
        n_seq = int(restart[row].sum()) + 1
        first = int(restart[row].nonzero()[0]) + 1
        where = f"row {row} holds {n_seq} sequences (position_ids restart at 0 at token {first})"
    else:
        n_seq = cu[1].numel() - 1 if cu is not None else 0
        where = f"row 0 holds {n_seq} sequences ({source})"
    return (
        f"safepad guard: packed inputs: {where}, but {_family(info)} is not wrapped, so the recurrent state leaks "
        "from one sequence into the next (the mixers ignore the boundaries). Fix: call safepad.wrap(model) "
        "(boundaries are then honoured), or do not pack: one sequence per row, padded on the left."
    )


def _holes_message(mask: Tensor, info: SSMInfo | None) -> str:
    m = mask != 0  # [B, Tm]
    hole = hole_positions(m)  # [B, Tm]
    rows = hole.any(1).nonzero().flatten().tolist()
    row = rows[0]
    first = int(hole[row].nonzero()[0])
    return (
        f"safepad guard: row {row} of attention_mask has {int(hole[row].sum())} masked position(s) between real "
        f"tokens (the first at index {first}; {len(rows)} of {m.shape[0]} rows have holes). {_family(info)} is not "
        "wrapped: its state decays and its conv window reads zeros across the hole. Fix: compact each row and "
        "pad on the left, or call safepad.wrap(model) / pack the pieces as separate sequences."
    )


def get_guard(model: nn.Module) -> GuardHandle | None:
    """The active guard installed on ``model`` by :func:`guard`, or ``None``."""
    handle = getattr(model, "_safepad_guard", None)
    return handle if isinstance(handle, GuardHandle) and handle.active else None


def guard(model: nn.Module, mode: GuardMode = "warn", *, collect_stats: bool = True) -> GuardHandle:
    """Install the padding / packing guard on ``model`` and return its handle.

    Args:
        model: the top-level model (e.g. ``NemotronHForCausalLM``, a ``PeftModel``); the hook sees the
            arguments of its ``forward``.
        mode: ``"warn"`` — one :class:`PaddingWarning` per kind, plus a log line per detection;
            ``"error"`` — raise :class:`PaddingError`; ``"fix"`` — call ``safepad.wrap(model)`` before the
            forward proceeds (raises :class:`PaddingError` when the model cannot be wrapped).
        collect_stats: count pad fraction / tokens / sequences per forward (see :meth:`GuardHandle.stats`).

    Returns:
        A :class:`GuardHandle`; ``handle.remove()`` or leaving ``with guard(model): ...`` detaches it.

    A model without recurrent layers, or one already wrapped by :func:`safepad.wrap`, is never reported.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")  # noqa: TRY004
    if mode not in GUARD_MODES:
        raise ValueError(f"mode must be one of {GUARD_MODES}, got {mode!r}")
    if get_guard(model) is not None:
        raise ValueError(
            "model already has an active safepad guard: call .remove() on its handle (get_guard(model) returns it) "
            "before installing another one"
        )
    info = find_ssm_layers(model)
    if info is None:
        logger.info("safepad guard: %s has no SSM / linear-attention layers; only statistics are collected",
                    type(model).__name__)
    handle = GuardHandle(model, mode, info, collect_stats)
    logger.debug("safepad guard installed on %s (mode=%s, layers: %s)", type(model).__name__, mode, _family(info))
    return handle
