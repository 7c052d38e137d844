"""Class patching: each supported mixer's class is swapped for a generated ``Safepad<Mixer>`` subclass.

The subclass's ``forward`` is the family spec's generic forward (chosen once per class); parameters, buffers,
``state_dict`` keys and the config are untouched, ``print(model)`` shows ``Safepad<Mixer>(safepad=..., ...)``
and :func:`unwrap` restores the original classes exactly.

The other modules of a wrapped model whose class the ``kernels`` package's ``use_kernelized_func`` decorates
(transformers 5.25: e.g. ``NemotronHAttention``, for its rotary function) get a ``Safepad<Class>`` subclass too
(``safepad=kernel-routing-skipped``): its forward calls the class's own forward directly, unless the module's
kernel functions were replaced by ``kernels.kernelize``. The decorator's forward sets a module-level context
variable around every call, which torch.compile cannot trace inside a checkpointed layer (a graph break per
layer); without ``kernelize`` the routing changes nothing (every function runs its torch code either way). The generated classes live in ``safepad.wrap`` (their
``__module__``), so a pickled wrapped model finds them again (``safepad.wrap.__getattr__`` rebuilds them in a
fresh process).
"""

from __future__ import annotations

import importlib
import logging
import sys

from torch import nn

from .. import specs as _specs  # noqa: F401 - registers the family specs
from .._state import module_state
from ..errors import UnsupportedModelError
from ..mixers.common import probe_gated_norm
from ..serving.manager import SafepadContinuousBatching, SafepadContinuousBatchingManager
from ..serving.mixer_call import serving_mixer_call, serving_step
from ..specs.registry import MixerSpec, all_specs, spec_for_module, supported_model_types
from ..specs.unsupported import unsupported_reason
from .attention import restore_sdpa, use_upcast_sdpa
from .checkpoint import _CheckpointWithContext
from .generate import SafepadCompiledCall, SafepadGenerate, SafepadPrepareInputs
from .hooks import install_model_hooks

logger = logging.getLogger(__name__)

__all__ = ["is_wrapped", "rebuild_patched_class", "supported_model_types", "unwrap", "wrap", "wrapped_modules"]

#: the module that holds the generated classes (``Safepad<Mixer>.__module__``)
_PUBLIC_MODULE = "safepad.wrap"
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
        step = serving_step()
        if step is not None:  # a continuous-batching step: the packed requests as rows, states from their slots
            return serving_mixer_call(self, generic, step, args, kwargs)
        return generic(self, *args, **kwargs)

    children = spec.options.get("accelerate_children", ("conv1d",))
    children = spec.options.get("accelerate_children_by_class", {}).get(orig.__name__, children)
    if _force_accelerate_hooks is not None and children:
        forward = _force_accelerate_hooks(list(children))(forward)

    def extra_repr(self) -> str:
        base = orig.extra_repr(self)
        tag = f"safepad={spec.kind}:{spec.model_type}, backend={self._safepad.backend}"
        return f"{tag}, {base}" if base else tag

    doc = f"{orig.__name__} patched by safepad ({spec.kind} generic mixer). Undo with safepad.unwrap."
    return _generated_class(orig, key, forward, extra_repr, doc, _safepad_spec=spec)


def _generated_class(orig: type, key: tuple, forward, extra_repr, doc: str, **attrs) -> type:
    """``Safepad<Orig>``: a subclass of ``orig`` with ``forward`` / ``extra_repr``, cached under ``key`` and set on
    the public module (so pickle / torch.save of a wrapped model finds the class); ``unwrap`` restores ``orig``."""
    name = f"Safepad{orig.__name__}"
    cls = type(
        name,
        (orig,),
        {
            "forward": forward,
            "extra_repr": extra_repr,
            "_safepad_original_class": orig,
            **attrs,
            "__module__": _PUBLIC_MODULE,
            "__qualname__": name,
            "__doc__": doc,
        },
    )
    _CLASS_CACHE[key] = cls
    setattr(sys.modules[_PUBLIC_MODULE], name, cls)
    return cls


def _kernel_routing_forward(cls: type):
    """The forward ``cls`` had before the ``kernels`` package's ``use_kernelized_func`` wrapped it (which routes
    the module's kernel functions through a context variable around each call), or ``None`` when ``cls``'s
    forward is no such wrapper."""
    forward = getattr(cls, "forward", None)
    inner = getattr(forward, "__wrapped__", None)
    code = getattr(forward, "__code__", None)
    if inner is None or code is None or code.co_name != "new_forward":
        return None
    layer = sys.modules.get("kernels._internals.layer.layer")
    if layer is None or getattr(layer, "_ACTIVE_KERNEL_FUNCS", None) is None:
        return None
    if code.co_filename != getattr(layer, "__file__", None):
        return None
    return inner


def _kernelized(module: nn.Module) -> bool:
    """Whether ``kernels.kernelize`` replaced one of ``module``'s kernel functions (it sets their ``forward``)."""
    funcs = getattr(module, "_kernel_funcs", None)
    if funcs is None or len(funcs) == 0:  # (not bool(dict): dynamo of torch 2.11 cannot trace it)
        return False
    return any("forward" in f.__dict__ for f in funcs.values())


def _routing_skipped_class(orig: type) -> type:
    """``Safepad<Orig>`` for a ``use_kernelized_func``-decorated class safepad does not patch otherwise: its forward
    calls ``orig``'s undecorated forward, or the decorated one when the module was kernelized."""
    key = (orig, "kernel-routing")
    if key in _CLASS_CACHE:
        return _CLASS_CACHE[key]
    inner = _kernel_routing_forward(orig)
    routed = orig.forward

    def forward(self, *args, **kwargs):
        if _kernelized(self):
            return routed(self, *args, **kwargs)
        return inner(self, *args, **kwargs)

    def extra_repr(self) -> str:
        base = orig.extra_repr(self)
        tag = "safepad=kernel-routing-skipped"
        return f"{tag}, {base}" if base else tag

    doc = (
        f"{orig.__name__} calling its forward without the kernels package's routing (safepad, unless kernelized). "
        "Undo with safepad.unwrap."
    )
    return _generated_class(orig, key, forward, extra_repr, doc)


def _loaded_transformers_class(name: str) -> type | None:
    """The class ``name`` of an imported ``transformers.models`` module, if any."""
    return next(
        (getattr(m, name) for n, m in list(sys.modules.items())
         if n.startswith("transformers.models.") and isinstance(getattr(m, name, None), type)),
        None,
    )


def rebuild_patched_class(orig_name: str) -> type | None:
    """``Safepad<orig_name>`` built again from the registry (the spec naming ``orig_name``, its transformers class),
    or for a class whose kernel routing safepad skips."""
    spec = next((s for s in all_specs() if orig_name in s.mixer_classes), None)
    if spec is None:
        orig = _loaded_transformers_class(orig_name)
        if orig is not None and _kernel_routing_forward(orig) is not None:
            return _routing_skipped_class(orig)
        return None
    orig = None
    try:
        module = importlib.import_module(f"transformers.models.{spec.model_type}.modeling_{spec.model_type}")
        orig = getattr(module, orig_name, None)
    except ImportError:
        pass
    if orig is None:  # a family whose mixer lives in another model's module: look through the loaded ones
        orig = _loaded_transformers_class(orig_name)
    return None if orig is None else _patched_class(orig, spec)


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
        state = module_state(module)
        state.backend = backend
        if spec.options.get("layer_idx_from_name") and getattr(module, "layer_idx", None) is None:
            state.layer_idx = layer_index(name)
        probe_gated_norm(module, spec.options.get("gated_norm"))
        owners.add(id(module))
    if owners:
        _skip_kernel_routing(model)
    if not owners:
        reason = _unsupported_reason(model)
        raise UnsupportedModelError(
            f"safepad.wrap found no supported recurrent mixer in this {type(model).__name__} "
            f"(model_type={_model_type(model)!r}){reason}. Supported model types: {', '.join(supported_model_types())}."
        )
    install_model_hooks(model)
    use_upcast_sdpa(model)  # bf16 / fp16 CPU attention: the decode step rounds like the full forward
    if patched:
        logger.info("safepad: wrapped %d mixer(s) of %s (backend=%s)", len(patched), _model_type(model), backend)
    return model


def _skip_kernel_routing(model: nn.Module) -> None:
    """Give each other ``use_kernelized_func``-decorated module its ``Safepad<Class>`` (see the module docstring)."""
    for module in model.modules():
        cls = type(module)
        if getattr(cls, "_safepad_original_class", None) is None and _kernel_routing_forward(cls) is not None:
            module.__class__ = _routing_skipped_class(cls)


def layer_index(name: str) -> int | None:
    """The decoder-layer index of a module named ``...layers.<i>.<child>`` (its last integer component)."""
    ints = [int(part) for part in name.split(".") if part.isdigit()]
    return ints[-1] if ints else None


def unwrap(model: nn.Module) -> nn.Module:
    """Undo :func:`wrap`: restore every mixer's original class and remove the model hooks. Returns ``model``."""
    for module in model.modules():
        orig = getattr(type(module), "_safepad_original_class", None)
        if orig is not None:
            module.__class__ = orig
        fn = module.__dict__.get("_gradient_checkpointing_func")
        if isinstance(fn, _CheckpointWithContext):
            module._gradient_checkpointing_func = fn.inner
        state = module.__dict__.pop("_safepad", None)  # everything safepad kept on the module (safepad._state)
        if state is not None:
            for handle in state.hook_handles:
                handle.remove()
        if isinstance(module.__dict__.get("generate"), SafepadGenerate):
            del module.__dict__["generate"]
        if isinstance(module.__dict__.get("prepare_inputs_for_generation"), SafepadPrepareInputs):
            del module.__dict__["prepare_inputs_for_generation"]
        if isinstance(module.__dict__.get("get_compiled_call"), SafepadCompiledCall):
            del module.__dict__["get_compiled_call"]
        if isinstance(module.__dict__.get("init_continuous_batching"), SafepadContinuousBatching):
            del module.__dict__["init_continuous_batching"]
        if isinstance(module.__dict__.get("_cached_continuous_batching_manager"), SafepadContinuousBatchingManager):
            module.destroy_cached_continuous_batching_manager()  # (persistent_manager=True) it serves wrapped mixers
    restore_sdpa(model)
    return model
