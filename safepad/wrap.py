"""``safepad.wrap(model)``: make every supported recurrent mixer in a model padding- and packing-correct.

One generic patcher. It walks the module tree, finds each module whose class a family spec lists
(``safepad.specs``), and swaps that module's class for a generated subclass whose ``forward`` is the
spec's generic implementation. Parameters, buffers, ``state_dict`` keys and the config are untouched,
``print(model)`` shows ``Safepad<Mixer>(safepad=..., ...)`` for each patched module, and
:func:`unwrap` restores the original classes exactly.

A forward pre-hook on the model (and on every ``PreTrainedModel`` inside it that holds patched mixers)
normalises packed boundaries once per call (``seq_idx``, ``cu_seq_lens_q/k``, or ``position_ids`` that
restart at 0) and hands them to the mixers through a context variable, because several families drop
``**kwargs`` before their mixers. On packed calls it also:

* raises when a cache was explicitly requested (``use_cache=True`` or a cache passed): the cache holds
  one state per row, and a packed row holds several sequences;
* turns off the cache that would come only from the config default (so a Trainer step works);
* synthesises ``position_ids`` that restart at each boundary for hybrids, so their attention layers see
  the boundaries too (transformers detects packing from ``position_ids``);
* builds the block-diagonal attention mask for hybrids whose mask construction ignores ``position_ids``.

Gradient checkpointing: on every training call the hook makes sure each checkpointed layer's
``_gradient_checkpointing_func`` (set by transformers' ``gradient_checkpointing_enable``, before or after
``wrap``) is a :class:`_CheckpointWithContext`, which captures the call context at the layer's forward and
re-enters it when autograd recomputes the layer, so a recompute never sees another call's boundaries.
"""

from __future__ import annotations

import contextvars
import importlib
import inspect
import logging
import sys

import torch
from torch import nn

from . import specs as _specs  # noqa: F401 - registers the family specs
from ._tracing import device_check, tracing
from .cache import (
    CACHE_NAMES,
    CachePreHook,
    SafepadGenerate,
    cache_argument,
    cache_post_hook,
    fresh_cache_is_recurrent_only,
)
from .context import (
    CallContext,
    boundaries_from_kwargs,
    current_context,
    enter_call,
    exit_call,
    multi_sequence,
    no_call_context,
    position_ids_from_seq_idx,
    reset_context,
    set_context,
)
from .errors import UnsupportedModelError
from .layout.masks import is_right_padded
from .layout.slots import SlotJustifiedCall
from .mixers.common import probe_gated_norm
from .specs.registry import MixerSpec, all_specs, spec_for_module, supported_model_types
from .specs.unsupported import unsupported_reason

logger = logging.getLogger(__name__)

__all__ = ["wrap", "unwrap", "is_wrapped", "supported_model_types", "wrapped_modules"]

_BACKENDS = ("auto", "torch", "kernels")
_CLASS_CACHE: dict[tuple[type, str], type] = {}

try:
    from transformers.integrations.accelerate import force_accelerate_hooks as _force_accelerate_hooks
except Exception:  # noqa: BLE001 - older transformers: no offload hooks to fire
    _force_accelerate_hooks = None


def _patched_class(orig: type, spec: MixerSpec) -> type:
    """``Safepad<Orig>``: a subclass of the mixer's class whose forward is the spec's generic forward."""
    key = (orig, spec.model_type)
    if key in _CLASS_CACHE:
        return _CLASS_CACHE[key]

    generic = spec.forward_for(orig.__name__)  # chosen once per class, not on every call

    def forward(self, *args, **kwargs):
        return generic(self, *args, **kwargs)

    children = spec.options.get("accelerate_children", ("conv1d",))
    children = spec.options.get("accelerate_children_by_class", {}).get(orig.__name__, children)
    if _force_accelerate_hooks is not None and children:
        forward = _force_accelerate_hooks(list(children))(forward)

    def extra_repr(self) -> str:
        base = orig.extra_repr(self)
        tag = f"safepad={spec.kind}:{spec.model_type}, backend={self._safepad_backend}"
        return f"{tag}, {base}" if base else tag

    name = f"Safepad{orig.__name__}"
    cls = type(
        name,
        (orig,),
        {
            "forward": forward,
            "extra_repr": extra_repr,
            "_safepad_original_class": orig,
            "_safepad_spec": spec,
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": f"{orig.__name__} patched by safepad ({spec.kind} generic mixer). Undo with safepad.unwrap.",
        },
    )
    _CLASS_CACHE[key] = cls
    setattr(sys.modules[__name__], name, cls)  # so pickle / torch.save of a wrapped model finds the class
    return cls


def _rebuild_patched_class(orig_name: str) -> type | None:
    """``Safepad<orig_name>`` built again from the registry (the spec naming ``orig_name``, its transformers class)."""
    spec = next((s for s in all_specs() if orig_name in s.mixer_classes), None)
    if spec is None:
        return None
    orig = None
    try:
        module = importlib.import_module(f"transformers.models.{spec.model_type}.modeling_{spec.model_type}")
        orig = getattr(module, orig_name, None)
    except ImportError:
        pass
    if orig is None:  # a family whose mixer lives in another model's module: look through the loaded ones
        orig = next(
            (getattr(m, orig_name) for n, m in list(sys.modules.items())
             if n.startswith("transformers.models.") and isinstance(getattr(m, orig_name, None), type)),
            None,
        )
    return None if orig is None else _patched_class(orig, spec)


def __getattr__(name: str):
    """Patched classes are generated at wrap time; in a fresh process (``pickle.load`` / ``torch.load`` of a
    wrapped model) ``safepad.wrap.Safepad<Mixer>`` is rebuilt on first access from the family registry."""
    if name.startswith("Safepad") and not name.startswith("Safepad_"):
        cls = _rebuild_patched_class(name[len("Safepad") :])
        if cls is not None:
            return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def wrapped_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every patched mixer in ``model``."""
    return [(n, m) for n, m in model.named_modules() if getattr(m, "_safepad_spec", None) is not None]


def is_wrapped(model: nn.Module) -> bool:
    """True when ``model`` holds at least one safepad-patched mixer."""
    return any(getattr(m, "_safepad_spec", None) is not None for m in model.modules())


def _model_type(model: nn.Module) -> str:
    cfg = getattr(model, "config", None)
    return getattr(cfg, "model_type", type(model).__name__)


def _unsupported_reason(model: nn.Module) -> str:
    """``": <reason>"`` when the model (or its text model) is a listed unsupported recurrent family, else ``""``."""
    cfg = getattr(model, "config", None)
    types = [getattr(cfg, "model_type", None)]
    get_text = getattr(cfg, "get_text_config", None)
    if callable(get_text):
        try:
            types.append(getattr(get_text(decoder=True), "model_type", None))
        except (TypeError, ValueError):
            pass
    for mt in types:
        reason = unsupported_reason(mt) if isinstance(mt, str) else None
        if reason is not None:
            return f": {mt} is a recurrent family safepad does not support yet ({reason})"
    return ""


def wrap(model: nn.Module, backend: str = "auto") -> nn.Module:
    """Patch every supported recurrent mixer in ``model`` in place and return ``model``.

    Args:
        model: any ``nn.Module``; mixers are found anywhere in the tree (a VLM whose language model is
            Nemotron-H is covered).
        backend: ``"auto"`` (CUDA kernels when the tensors are on CUDA and mamba-ssm / causal-conv1d import,
            else the torch core), ``"torch"`` (always the torch core) or ``"kernels"`` (require the kernels).

    Idempotent: wrapping again only updates ``backend``. Raises :class:`safepad.UnsupportedModelError`
    (a ``ValueError``) when the model holds no supported mixer.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if not isinstance(model, nn.Module):
        raise ValueError(f"safepad.wrap expects a torch.nn.Module, got {type(model).__name__}")
    patched: list[str] = []
    owners: set[int] = set()
    for name, module in model.named_modules():
        spec = spec_for_module(module)
        if spec is None:
            continue
        if getattr(type(module), "_safepad_spec", None) is None:
            module.__class__ = _patched_class(type(module), spec)
            patched.append(name)
        module._safepad_backend = backend
        if spec.options.get("layer_idx_from_name") and getattr(module, "layer_idx", None) is None:
            module._safepad_layer_idx = _layer_index(name)
        probe_gated_norm(module, spec.options.get("gated_norm"))
        owners.add(id(module))
    if not owners:
        reason = _unsupported_reason(model)
        raise UnsupportedModelError(
            f"safepad.wrap found no supported recurrent mixer in this {type(model).__name__} "
            f"(model_type={_model_type(model)!r}){reason}. Supported model types: {', '.join(supported_model_types())}."
        )
    _install_model_hooks(model)
    if patched:
        logger.info("safepad: wrapped %d mixer(s) of %s (backend=%s)", len(patched), _model_type(model), backend)
    return model


def _layer_index(name: str) -> int | None:
    """The decoder-layer index of a module named ``...layers.<i>.<child>`` (its last integer component)."""
    ints = [int(part) for part in name.split(".") if part.isdigit()]
    return ints[-1] if ints else None


def unwrap(model: nn.Module) -> nn.Module:
    """Undo :func:`wrap`: restore every mixer's original class and remove the model hooks. Returns ``model``."""
    for module in model.modules():
        orig = getattr(type(module), "_safepad_original_class", None)
        if orig is not None:
            module.__class__ = orig
        for attr in ("_safepad_backend", "_safepad_saw_packed", "_safepad_layer_idx"):
            module.__dict__.pop(attr, None)
        fn = module.__dict__.get("_gradient_checkpointing_func")
        if isinstance(fn, _CheckpointWithContext):
            module._gradient_checkpointing_func = fn.inner
        for handle in module.__dict__.pop("_safepad_hook_handles", []):
            handle.remove()
        module.__dict__.pop("_safepad_tokens", None)
        module.__dict__.pop("_safepad_slot_calls", None)
        module.__dict__.pop("_safepad_cache_calls", None)
        if isinstance(module.__dict__.get("generate"), SafepadGenerate):
            del module.__dict__["generate"]
    return model


# ----------------------------------------------------------------------------------------------------------
# model-level hooks: boundaries -> context, cache policy for packed calls, attention boundaries for hybrids
# ----------------------------------------------------------------------------------------------------------


def _install_model_hooks(model: nn.Module) -> None:
    try:
        from transformers import PreTrainedModel
    except Exception:  # noqa: BLE001
        PreTrainedModel = ()  # type: ignore[assignment]
    targets = [model] + [m for m in model.modules() if m is not model and isinstance(m, PreTrainedModel)]
    for target in targets:
        if "_safepad_hook_handles" in target.__dict__:
            continue
        specs = [m._safepad_spec for m in target.modules() if getattr(m, "_safepad_spec", None) is not None]
        if not specs:
            continue
        params = inspect.signature(target.forward).parameters
        info = {
            "accepts_position_ids": "position_ids" in params,
            "var_kwargs": any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()),
            "params": tuple(params),
            "hybrid": any(s.hybrid for s in specs),
            "packed_attention_mask": tuple(sorted({k for s in specs for k in s.packed_attention_mask})),
            # attention that measures positions in cache slots (Inkling): cached calls keep each row's real
            # tokens contiguous at the end of the cache (safepad.layout.slots)
            "slot_positions": any(s.options.get("slot_positions", False) for s in specs),
            "slot_log_scaling": any(s.options.get("slot_log_scaling", False) for s in specs),
            # modules that transformers may give a checkpoint function (GradientCheckpointingLayer, base models)
            "checkpointed": [m for m in target.modules() if hasattr(m, "gradient_checkpointing")],
        }
        target._safepad_tokens = []
        target._safepad_slot_calls = []
        pre = target.register_forward_pre_hook(_ModelPreHook(info), with_kwargs=True)
        post = target.register_forward_hook(_post_hook, always_call=True)
        target._safepad_hook_handles = [pre, post]
        # a cache without attention layers cannot tell its length in transformers: safepad counts it
        # (safepad.cache); registered after _ModelPreHook, so it sees the packed-call policy's use_cache
        recurrent = fresh_cache_is_recurrent_only(getattr(target, "config", None))
        if recurrent:
            target._safepad_cache_calls = []
            cache_pre = target.register_forward_pre_hook(
                CachePreHook(cache_argument(target.forward), recurrent), with_kwargs=True
            )
            cache_post = target.register_forward_hook(cache_post_hook, always_call=True)
            target._safepad_hook_handles += [cache_pre, cache_post]
            if callable(getattr(type(target), "generate", None)) and "generate" not in target.__dict__:
                target.generate = SafepadGenerate(target)


def _first_tensor(args, kwargs, names: tuple[str, ...], params: tuple[str, ...]):
    for n in names:
        v = kwargs.get(n)
        if isinstance(v, torch.Tensor):
            return v
    for i, a in enumerate(args):
        if i < len(params) and params[i] in names and isinstance(a, torch.Tensor):
            return a
    return None


class _ModelPreHook:
    """Forward pre-hook of a wrapped model: boundaries -> context, cache policy, attention boundaries.

    A class (not a closure) so that a wrapped model can be pickled.
    """

    def __init__(self, info: dict):
        self.info = info

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        info = self.info
        params = info["params"]
        module._safepad_slot_calls.append(None)
        ids = _first_tensor(args, kwargs, ("input_ids", "inputs_embeds"), params)
        outer = current_context()
        if outer is not None:
            # nested model call (PEFT -> model, VLM -> language model): the outer call decided the boundaries;
            # this level only applies the packed-call policy to its own kwargs
            if outer.seq_idx is not None and ids is not None and tuple(ids.shape[:2]) == outer.shape:
                kwargs.pop("seq_idx", None)
                self._packed_policy(module, kwargs, outer.seq_idx, ids, outer.source, nested=True)
                module._safepad_tokens.append(None)
                return args, kwargs
            module._safepad_tokens.append(None)
            return None
        if module.training:
            _hook_checkpoint_functions(info["checkpointed"])
        if ids is None or ids.dim() < 2:
            module._safepad_tokens.append(None)
            return None
        B, T = ids.shape[0], ids.shape[1]
        if tracing():
            return self._traced_call(module, args, kwargs, B, T, ids)
        given = _two_d_mask(kwargs.get("attention_mask"))  # the caller's (a slot-justified call replaces it below)
        if (
            isinstance(given, torch.Tensor) and given.dim() == 2 and T > 1
            and bool((given[:, -1] == 0).any()) and _inside_generate()
        ):
            row = int((given[:, -1] == 0).nonzero()[0])
            raise ValueError(
                f"generate() with a right-padded batch (row {row} of attention_mask ends in padding): generate picks "
                "each row's next token from the logits of its LAST column, which is a pad there, so that row's "
                "continuation would be wrong (the recurrent cache itself is right). Pad on the left "
                "(tokenizer.padding_side = 'left') for generate()."
            )
        token_mask = None
        if info["slot_positions"]:
            args, kwargs = _slot_justify(module, info, args, kwargs, B, T)
            record = module._safepad_slot_calls[-1]
            token_mask = record.call.token_mask if record is not None and record.call is not None else None
        mask = _two_d_mask(kwargs.get("attention_mask")) if token_mask is None else token_mask
        padding = isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.all())
        position_ids = kwargs.get("position_ids")
        seq_idx, source = boundaries_from_kwargs(
            (B, T),
            seq_idx=kwargs.get("seq_idx"),
            cu_seq_lens_q=kwargs.get("cu_seq_lens_q"),
            cu_seq_lens_k=kwargs.get("cu_seq_lens_k"),
            position_ids=position_ids if isinstance(position_ids, torch.Tensor) else None,
            padding_mask=mask if padding else None,
        )
        if source == "none":
            seq_idx, source = _boundaries_of_enclosing_call(module, (B, T), position_ids, mask if padding else None)
        kwargs.pop("seq_idx", None)
        if not info["var_kwargs"]:
            for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
                if k not in params:
                    kwargs.pop(k, None)
        if seq_idx is not None:
            if padding:
                seq_idx = _trailing_pads_as_segment(seq_idx, mask[:, -T:].to(torch.bool), source)
            self._packed_policy(module, kwargs, seq_idx, ids, source, nested=False)
        decode_mask = None
        if T == 1 and isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask[:, -1].all()):
            decode_mask = mask[:, -1:].to(torch.bool)  # [B, 1]: this step's token is padding in some rows
        padding_mask = mask if padding and seq_idx is None else None
        token = enter_call(
            CallContext(
                seq_idx=seq_idx, shape=(B, T), source=source, decode_mask=decode_mask, padding_mask=padding_mask,
                token_mask=token_mask,
            )
        )
        module._safepad_tokens.append(token)
        return args, kwargs

    def _traced_call(self, module: nn.Module, args: tuple, kwargs: dict, B: int, T: int, ids: torch.Tensor):
        """The pre-hook while dynamo traces the call: every decision from what is static, checks on the device.

        * given boundaries (``seq_idx`` / ``cu_seq_lens_*``, or 2-D ``position_ids`` without a 2-D mask) run the
          varlen path, whether or not a row really holds several sequences (same result). A 2-D mask next to
          ``seq_idx`` / ``cu_seq_lens`` must be right-padded (checked); its pads become a segment of their own and
          it is dropped, as eager does for packed rows;
        * an explicitly requested cache keeps the unpacked path and checks on the device that no row holds
          several sequences (the eager error); without one the call runs with ``use_cache=False``;
        * ``position_ids`` next to a 2-D mask are not read as packing; the device checks that they do not
          restart at 0 after a row's first real token (eager would read them as packed rows);
        * a 2-D mask on a one-token step always travels to the mixers (rows marked real are unaffected).
        """
        info = self.info
        params = info["params"]
        if not any(isinstance(kwargs.get(k), torch.Tensor) for k in _BOUNDARY_INPUTS):
            _check_enclosing_call_at_trace()  # run by dynamo at trace time, on the real Python stack
        mask = kwargs.get("attention_mask")
        mask2d = isinstance(mask, torch.Tensor) and mask.dim() == 2
        position_ids = kwargs.get("position_ids")
        position_ids = position_ids if isinstance(position_ids, torch.Tensor) else None
        explicit = any(isinstance(kwargs.get(k), torch.Tensor) for k in ("seq_idx", "cu_seq_lens_q", "cu_seq_lens_k"))
        seq_idx, source = boundaries_from_kwargs(
            (B, T),
            seq_idx=kwargs.get("seq_idx"),
            cu_seq_lens_q=kwargs.get("cu_seq_lens_q"),
            cu_seq_lens_k=kwargs.get("cu_seq_lens_k"),
            position_ids=position_ids if (explicit or not mask2d) else None,
            padding_mask=mask if (explicit and mask2d) else None,
        )
        kwargs.pop("seq_idx", None)
        if not info["var_kwargs"]:
            for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
                if k not in params:
                    kwargs.pop(k, None)
        cache_requested = kwargs.get("use_cache") is True or any(
            kwargs.get(k) is not None for k in ("past_key_values", "cache_params", "cache")
        )
        if seq_idx is not None and cache_requested:
            device_check(
                ~multi_sequence(seq_idx),
                f"packed rows (several sequences per row, from {source}) cannot be used with a cache: the cache "
                "keeps one recurrent state per row, so there is no right state to store. Call with "
                "use_cache=False, or pad the sequences (left or right) instead of packing them.",
            )
            seq_idx = None  # every row holds one sequence (checked): the unpacked path, as eager
        elif seq_idx is not None:
            if mask2d:
                m = mask[:, -T:].to(torch.bool)  # [B, T]
                device_check(
                    ~(m[:, 1:] & ~m[:, :-1]).any() if T > 1 else m.new_ones(()),
                    f"packed boundaries ({source}) came together with an attention_mask that has padding before "
                    "or between real tokens; packed rows may only end in padding (under torch.compile this holds "
                    f"for rows of one sequence with {source} too). Put the pads at the end of each row, or pad "
                    "without packing boundaries.",
                )
                seq_idx = torch.where(m, seq_idx, seq_idx.amax(dim=1, keepdim=True) + 1).to(torch.int32)  # [B, T]
            self._packed_policy(module, kwargs, seq_idx, ids, source, nested=False)
        elif mask2d and position_ids is not None and position_ids.dim() == 2 and T > 1:
            if position_ids.shape[-1] == T and position_ids.shape[0] in (1, B):
                m = mask[:, -T:].to(device=position_ids.device, dtype=torch.bool)  # [B, T]
                device_check(
                    ~((position_ids == 0) & m & (m.cumsum(1) > 1)).any(),
                    "position_ids restart at 0 inside a row (packed sequences) while an attention_mask is given: "
                    "under torch.compile packed rows must describe their boundaries with seq_idx / cu_seq_lens_q "
                    "when they come with an attention_mask (or come without one)",
                )
        decode_mask = mask[:, -1:].to(torch.bool) if T == 1 and mask2d else None  # [B, 1]
        padding_mask = mask if mask2d and seq_idx is None else None
        token = enter_call(
            CallContext(seq_idx=seq_idx, shape=(B, T), source=source, decode_mask=decode_mask, padding_mask=padding_mask)
        )
        module._safepad_tokens.append(token)
        return args, kwargs

    def _packed_policy(self, module: nn.Module, kwargs: dict, seq_idx: torch.Tensor, ids: torch.Tensor, source: str,
                       nested: bool) -> None:
        """Cache off (or raise if one was asked for), restarting position_ids and packed masks for hybrids."""
        info = self.info
        explicit = kwargs.get("use_cache") is True or any(kwargs.get(k) is not None for k in CACHE_NAMES)
        if explicit and not nested:
            raise ValueError(
                f"packed rows (several sequences per row, from {source}) cannot be used with a cache: the cache "
                "keeps one recurrent state per row, so there is no right state to store. Call with "
                "use_cache=False, or pad the sequences (left or right) instead of packing them."
            )
        if "use_cache" in info["params"] or info["var_kwargs"]:
            kwargs["use_cache"] = False  # the config default would build a cache nobody can use
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            # an all-ones mask carries no padding, but transformers detects packing from position_ids only
            # when no 2-D mask is given: drop it so that attention layers see the boundaries
            kwargs["attention_mask"] = None
        if info["hybrid"] and kwargs.get("position_ids") is None and info["accepts_position_ids"]:
            kwargs["position_ids"] = position_ids_from_seq_idx(seq_idx).to(ids.device)
        if info["packed_attention_mask"] and "attention_mask" in info["params"]:
            if kwargs.get("attention_mask") is None:
                kwargs["attention_mask"] = _packed_mask_mapping(module, seq_idx, info["packed_attention_mask"])


class _CheckpointWithContext:
    """A layer's checkpoint function whose recompute runs under the context of the original forward.

    transformers' ``GradientCheckpointingLayer`` calls ``self._gradient_checkpointing_func(fn, *args)``
    during the forward; torch re-runs ``fn`` in backward (reentrant: ``CheckpointFunction.backward``;
    non-reentrant: on unpacking a saved tensor), when the context variables hold whatever call is current
    then (another forward's, or none). The context variables (safepad's call context, and any other, such as
    the sequence-parallel one) are snapshot here, at the forward, and the recompute runs inside the snapshot.
    """

    __slots__ = ("inner",)

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, function, *args, **kwargs):
        if tracing():  # dynamo traces the checkpoint into the graph: the recompute is part of the compiled backward
            return self.inner(function, *args, **kwargs)
        return self.inner(_InContext(function, contextvars.copy_context()), *args, **kwargs)


class _InContext:
    """``function`` bound to the context snapshot of its forward (see :class:`_CheckpointWithContext`): the first
    call is the forward itself (already in that context), every later one a recompute run inside the snapshot."""

    __slots__ = ("calls", "context", "function")

    def __init__(self, function, context: contextvars.Context):
        self.function = function
        self.context = context
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == 1:
            return self.function(*args, **kwargs)
        return self.context.run(_recompute, self.function, args, kwargs)


def _recompute(function, args: tuple, kwargs: dict):
    """Inside a forward's context snapshot: a forward that was no safepad model call recomputes as one (no
    boundaries, and no 'recompute without context' error)."""
    if current_context() is None:
        set_context(no_call_context())  # changes only the snapshot
    return function(*args, **kwargs)


def _hook_checkpoint_functions(modules: list[nn.Module]) -> None:
    """Wrap each module's ``_gradient_checkpointing_func`` (if any, and not already wrapped)."""
    for m in modules:
        fn = m.__dict__.get("_gradient_checkpointing_func")
        if fn is not None and type(fn) is not _CheckpointWithContext:
            m._gradient_checkpointing_func = _CheckpointWithContext(fn)


#: code objects of ``nn.Module.__call__``'s frames: their ``args`` / ``kwargs`` locals are a module call's inputs
_CALL_CODES = frozenset(
    f.__code__ for f in (getattr(nn.Module, n, None) for n in ("_call_impl", "_wrapped_call_impl")) if f is not None
)
_BOUNDARY_INPUTS = ("seq_idx", "cu_seq_lens_q", "cu_seq_lens_k", "position_ids")
_MAX_FRAMES = 16


def _boundaries_of_enclosing_call(module: nn.Module, shape: tuple[int, int], position_ids, padding_mask):
    """Boundaries that the nearest enclosing module call received but did not hand to this wrapped model.

    ``safepad.wrap(model.backbone)`` hooks only the backbone; ``MambaForCausalLM.forward`` takes ``seq_idx``
    (``**kwargs``) and calls the backbone without it. No hook of the outer model exists to see them, so this
    looks one module call up the Python stack (the ``kwargs`` of its ``nn.Module.__call__`` frame). Found
    boundaries are used when they fit this call's ``[B, T]`` (the outer model passes the same tokens down), and
    raise when they do not: the outer call was packed, and this one cannot know how. Returns
    ``(seq_idx | None, source)``.
    """
    frame = sys._getframe(2)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return None, "none"
        if frame.f_code in _CALL_CODES:
            owner = frame.f_locals.get("self")
            if isinstance(owner, nn.Module) and owner is not module:
                break
        frame = frame.f_back
    else:
        return None, "none"
    outer_kwargs = frame.f_locals.get("kwargs") or {}
    found = {k: outer_kwargs.get(k) for k in _BOUNDARY_INPUTS if isinstance(outer_kwargs.get(k), torch.Tensor)}
    if not found or set(found) == {"position_ids"} and not _restarts(found["position_ids"]):
        return None, "none"
    name = type(owner).__name__
    try:
        seq_idx, source = boundaries_from_kwargs(
            shape,
            seq_idx=found.get("seq_idx"),
            cu_seq_lens_q=found.get("cu_seq_lens_q"),
            cu_seq_lens_k=found.get("cu_seq_lens_k"),
            position_ids=position_ids if isinstance(position_ids, torch.Tensor) else found.get("position_ids"),
            padding_mask=padding_mask,
        )
    except ValueError as err:
        raise ValueError(
            f"{name} was called with packed boundaries ({', '.join(found)}) but called the safepad-wrapped "
            f"{type(module).__name__} without them, and they do not fit its input of [batch, seqlen] = "
            f"{list(shape)} ({err}). Call safepad.wrap on the outermost model ({name}), or pass the boundaries to "
            f"the wrapped {type(module).__name__} yourself."
        ) from err
    if seq_idx is not None:
        logger.debug("safepad: %s dropped %s before the wrapped %s; using them", name, source, type(module).__name__)
        source = f"{source} of the enclosing {name} call"
    return seq_idx, source


def _two_d_mask(mask):
    """The 2-D ``[B, T]`` padding mask of a call's ``attention_mask``: generate() with a compileable cache (e.g. one
    without attention layers) hands in per-layer-type masks, whose recurrent layers' entry is the 2-D one."""
    if isinstance(mask, dict):
        return next((m for m in mask.values() if isinstance(m, torch.Tensor) and m.dim() == 2), None)
    return mask


def _inside_generate() -> bool:
    """Is this model call made by transformers' ``generate()`` (a ``generate`` frame of ``transformers.generation``
    a few frames up the stack)?"""
    frame = sys._getframe(2)
    for _ in range(_MAX_FRAMES * 2):
        if frame is None:
            return False
        if frame.f_code.co_name == "generate" and str(frame.f_globals.get("__name__", "")).startswith(
            "transformers.generation"
        ):
            return True
        frame = frame.f_back
    return False


@torch.compiler.assume_constant_result
def _check_enclosing_call_at_trace() -> bool:
    """While dynamo traces a wrapped model's call that received no boundaries: raise ``ValueError`` (surfacing as
    dynamo's ``InternalTorchDynamoError``, a ``RuntimeError`` carrying the message) when the boundaries of an
    enclosing module call could not reach it.

    Eager calls look one module call up the stack (:func:`_boundaries_of_enclosing_call`); a traced one cannot use
    what it would find there (tensors of the real stack, not graph inputs). Run once per trace (dynamo executes this
    for real and keeps the result), it walks the real Python stack to the nearest module call that is neither
    safepad-wrapped nor a ``torch.compile`` wrapper of a wrapped model:

    * a ``torch.compile`` wrapper of an unwrapped model (``torch.compile(model)`` after ``wrap(model.backbone)``)
      whose call holds boundary tensors: the message (dynamo re-traces when those inputs come or go);
    * a plain (not compiled) module around a compiled wrapped submodule, when its call holds boundary tensors, or
      whatever it holds when it is a transformers model whose forward can take boundaries (its compiled submodule's
      graph is reused for its later calls, which may hold some).

    Returns True otherwise (dynamo keeps the result as a constant).
    """
    from torch._dynamo.eval_frame import OptimizedModule

    frame = sys._getframe(1)
    for _ in range(_MAX_FRAMES * 64):  # dynamo's own frames (~80) sit between the traced call and the real stack
        if frame is None:
            return True
        owner = frame.f_locals.get("self") if frame.f_code in _CALL_CODES else None
        if isinstance(owner, nn.Module):
            inner = owner._orig_mod if isinstance(owner, OptimizedModule) else owner
            if "_safepad_hook_handles" not in inner.__dict__:
                break
        frame = frame.f_back
    else:
        return True
    outer_kwargs = frame.f_locals.get("kwargs") or {}
    found = [k for k in _BOUNDARY_INPUTS if isinstance(outer_kwargs.get(k), torch.Tensor)]
    name = type(inner).__name__
    fix = (
        f"Under torch.compile, call safepad.wrap on the outermost model ({name}) and compile that, or pass the "
        "boundaries to the wrapped model yourself."
    )
    compiled = isinstance(owner, OptimizedModule)
    up = frame.f_back
    for _ in range(_MAX_FRAMES):  # the frame dynamo converts is the module's own call; its compile wrapper is above
        if up is None or compiled:
            break
        parent = up.f_locals.get("self") if up.f_code in _CALL_CODES else None
        if isinstance(parent, nn.Module) and parent is not inner:  # (_wrapped_call_impl and _call_impl: 2 frames)
            compiled = isinstance(parent, OptimizedModule) and parent._orig_mod is inner
            break
        up = up.f_back
    if compiled:
        if found:
            raise ValueError(
                f"{name} was called with packed boundaries ({', '.join(found)}) but calls the safepad-wrapped model "
                f"inside it without them; eager safepad finds them one call up the stack, a compiled call cannot. {fix}"
            )
        return True
    try:
        from transformers import PreTrainedModel
    except Exception:  # noqa: BLE001
        PreTrainedModel = ()  # type: ignore[assignment]
    params = inspect.signature(inner.forward).parameters
    takes = isinstance(inner, PreTrainedModel) and (
        any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()) or any(k in params for k in _BOUNDARY_INPUTS)
    )  # a transformers model may drop them (pass-through wrappers such as DDP hand them on)
    if found or takes:
        raise ValueError(
            f"a compiled safepad-wrapped model is called by the uncompiled {name}, whose forward can take packed "
            f"boundaries ({', '.join(k for k in _BOUNDARY_INPUTS if k in params) or '**kwargs'}) that it may not "
            f"pass down; eager safepad finds them one call up the stack, a compiled call cannot. {fix}"
        )
    return True


def _restarts(position_ids: torch.Tensor) -> bool:
    return position_ids.dim() == 2 and position_ids.shape[-1] > 1 and bool((position_ids[:, 1:] == 0).any())


def _trailing_pads_as_segment(seq_idx: torch.Tensor, mask: torch.Tensor, source: str) -> torch.Tensor:
    """Packed rows followed by padding: the pads (``mask`` ``[B, T]`` False) become a segment of their own.

    Trailing pads come after every real token of their row, so in a causal model they can change no real
    token's output; as their own segment they also start from a fresh state. The attention mask is then
    dropped (packed calls carry their boundaries in ``seq_idx`` / ``position_ids``). Pads before or between
    the packed sequences of a row have no such reading: raise.
    """
    if not is_right_padded(mask):
        row = int((mask[:, 1:] & ~mask[:, :-1]).any(1).nonzero()[0])
        raise ValueError(
            f"packed boundaries ({source}) came together with an attention_mask whose row {row} has padding before "
            "or between real tokens; packed rows may only end in padding. Put the pads at the end of each row (the "
            "safepad collator packs without any), or pad one sequence per row without packing boundaries."
        )
    return torch.where(mask, seq_idx, seq_idx.amax(dim=1, keepdim=True) + 1).to(torch.int32)  # [B, T]


def _post_hook(module: nn.Module, args, output):
    tokens = module.__dict__.get("_safepad_tokens")
    if tokens:
        token = tokens.pop()
        if token is not None:
            exit_call(token)
    slot_calls = module.__dict__.get("_safepad_slot_calls")
    if slot_calls:
        record = slot_calls.pop()
        if record is not None:
            return _slot_restore(record, output)
    return None


# ----------------------------------------------------------------------------------------------------------
# slot-justified cached calls (families whose attention counts positions in cache slots: Inkling)
# ----------------------------------------------------------------------------------------------------------

_PACKED_NAMES = ("seq_idx", "cu_seq_lens_q", "cu_seq_lens_k")
#: marks a cache whose rows hold pads (in the justified layout): a later call must pass the full attention mask
_PADDED_FLAG = "_safepad_padded_slots"


class _SlotRecord:
    """What the post-hook needs to undo a slot-justified call (``call`` None: nothing to undo)."""

    __slots__ = ("call", "keep", "padded", "shape")

    def __init__(self, call: SlotJustifiedCall | None, shape: tuple[int, int], keep, padded: bool):
        self.call, self.shape, self.keep, self.padded = call, shape, keep, padded


def _arg(args: tuple, kwargs: dict, params: tuple[str, ...], name: str):
    if name in kwargs:
        return kwargs[name]
    i = params.index(name) if name in params else -1
    return args[i] if 0 <= i < len(args) else None


def _text_config_value(module: nn.Module, name: str, default=None):
    cfg = getattr(module, "config", None)
    get_text = getattr(cfg, "get_text_config", None)
    if callable(get_text):
        try:
            cfg = get_text(decoder=True)
        except (TypeError, ValueError):
            pass
    return getattr(cfg, name, default)


def _slot_justify(module: nn.Module, info: dict, args: tuple, kwargs: dict, B: int, T: int):
    """Keep the slot-justified cache layout (``safepad.layout.slots``) for this call; returns ``(args, kwargs)``."""
    params = info["params"]
    if any(isinstance(_arg(args, kwargs, params, n), torch.Tensor) for n in _PACKED_NAMES):
        return args, kwargs  # packed rows: the packed policy applies (no cache)
    cache = next((c for n in CACHE_NAMES if (c := _arg(args, kwargs, params, n)) is not None), None)
    use_cache = _arg(args, kwargs, params, "use_cache")
    explicit = cache is not None or use_cache is True
    wanted = explicit or (use_cache is None and bool(_text_config_value(module, "use_cache", False)))
    mask = _arg(args, kwargs, params, "attention_mask")
    past_len = int(cache.get_seq_length()) if cache is not None and hasattr(cache, "get_seq_length") else 0
    flagged = bool(getattr(cache, _PADDED_FLAG, False))
    if not (isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[0] == B):
        if flagged and past_len > 0 and mask is None:
            raise ValueError(
                f"{type(module).__name__}: this cache holds padded rows, but the call came without an attention_mask. "
                "Pass the full-length attention_mask (the cached tokens plus the new ones, as generate() does) so "
                "that the pads stay masked."
            )
        return args, kwargs
    m = mask.to(torch.bool)
    if not wanted:
        if info["slot_log_scaling"]:
            _check_slot_log_scaling(module, m[:, -T:])
        return args, kwargs
    if mask.shape[1] != past_len + T:
        if flagged or not bool(m.all()):
            raise ValueError(
                f"{type(module).__name__}: attention_mask has {mask.shape[1]} columns but the cache holds {past_len} "
                f"tokens and the call brings {T}: with padding, pass the full-length mask (cached tokens plus new "
                f"ones, {past_len + T} columns), as generate() does"
            )
        return args, kwargs
    call = SlotJustifiedCall(m, past_len)
    if info["slot_log_scaling"]:
        _check_slot_log_scaling(module, call.mask)
    record = _SlotRecord(None, (B, T), None, not bool(call.mask.all()))
    module._safepad_slot_calls[-1] = record
    if call.noop:
        return args, kwargs
    named = dict(zip(params, args))  # every argument by name from here on
    named.update(kwargs)
    if named.get("labels") is not None:
        if explicit:
            raise ValueError(
                f"{type(module).__name__}: labels together with a cache on rows with padding after real tokens: "
                "safepad re-lays such rows for the cache, and the loss would be taken over the re-laid row. Compute "
                "the loss without a cache (use_cache=False), or pad on the left."
            )
        if "use_cache" in params or info["var_kwargs"]:
            named["use_cache"] = False  # the cache only the config default would build is of no use to a loss call
        record.padded = False
        return (), named
    for name, value in list(named.items()):
        if name in ("attention_mask", "labels") or not isinstance(value, torch.Tensor) or value.dim() < 2:
            continue
        if value.shape[1] == T and value.shape[0] in (1, B):  # [B, T, ...] current-token inputs
            named[name] = call.reorder(value)
    named["attention_mask"] = call.mask.to(mask.dtype)
    if named.get("position_ids") is None and info["accepts_position_ids"]:
        named["position_ids"] = call.position_ids().to(mask.device)
    keep = named.get("logits_to_keep")
    if call.order is not None and "logits_to_keep" in named and not (isinstance(keep, int) and keep == 0):
        named["logits_to_keep"] = 0  # every position, put back in order, then the kept ones (post-hook)
        record.keep = keep
    call.install(cache)
    record.call = call
    return (), named


def _check_slot_log_scaling(module: nn.Module, layout: torch.Tensor) -> None:
    """Inkling's log scaling takes each query's scale from its slot (``tau(slot + 1)``), not its position.

    ``layout`` ``[B, N]`` bool: the slots the call's queries and keys occupy (True = real). Exact unless a real
    token after a pad sits past the floor (``tau`` is 1 up to it); raise there.
    """
    floor = _text_config_value(module, "log_scaling_n_floor")
    if floor is None or layout.shape[1] <= floor:
        return
    slots = torch.arange(layout.shape[1], device=layout.device)[None]  # [1, N]
    after_pad = (~layout).cumsum(1) > 0  # [B, N]
    bad = layout & after_pad & (slots + 1 > floor)
    if bool(bad.any()):
        row = int(bad.any(1).nonzero()[0])
        raise ValueError(
            f"{type(module).__name__}: log-scaled attention (log_scaling_n_floor={floor}) scales each query by its "
            f"cache slot, and row {row} has real tokens past slot {floor} with pads before them, so its slots run "
            "ahead of its positions there: those queries would be scaled wrong. Keep padded batches shorter than "
            "the floor, or run such rows without padding."
        )


def _slot_restore(record: _SlotRecord, output):
    """Post-hook half of :func:`_slot_justify`: outputs back in the caller's order, the cache marked padded."""
    call = record.call
    if call is not None:
        call.uninstall()
    if output is None:  # the forward raised
        return None
    cache = next((c for n in CACHE_NAMES if (c := getattr(output, n, None)) is not None), None)
    if record.padded and cache is not None:
        setattr(cache, _PADDED_FLAG, True)
    if call is None or call.order is None:
        return None
    B, T = record.shape

    def fix(v, name=""):
        if isinstance(v, torch.Tensor) and v.dim() >= 2 and tuple(v.shape[:2]) == (B, T):
            v = call.restore(v)
            if name == "logits" and record.keep is not None:
                v = v[:, -record.keep :] if isinstance(record.keep, int) else v[:, record.keep]
            return v
        if isinstance(v, tuple) and name in ("hidden_states",):
            return tuple(fix(x) for x in v)
        return v

    if hasattr(output, "keys") and hasattr(output, "__setitem__"):
        for k in list(output.keys()):
            output[k] = fix(output[k], k)
        return output
    if isinstance(output, tuple):
        return tuple(fix(v) for v in output)
    return fix(output)


def _packed_mask_mapping(module: nn.Module, seq_idx: torch.Tensor, keys: tuple[str, ...]) -> dict:
    """Block-diagonal causal masks for hybrids whose own mask construction ignores packing."""
    from transformers.masking_utils import create_causal_mask

    config = module.config
    B, T = seq_idx.shape
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    shape_only = torch.empty(B, T, 0, dtype=dtype, device=seq_idx.device)  # create_causal_mask reads shape/dtype
    positions = position_ids_from_seq_idx(seq_idx)
    cache_kw = cache_argument(create_causal_mask) or "past_key_values"  # 5.23: past_key_values, 5.24: cache
    full = create_causal_mask(
        config=config, inputs_embeds=shape_only, attention_mask=None, position_ids=positions, **{cache_kw: None}
    )
    mapping: dict = {k: full for k in keys}
    mapping.setdefault("linear_attention", None)
    return mapping
