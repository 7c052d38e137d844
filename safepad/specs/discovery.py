"""Find every model type of the installed transformers whose modules keep conv or recurrent cache state.

Two independent signals, neither a hand-kept list:

* **cache layer types**: the default config's (text config's) layer types, as transformers' own
  ``get_layer_types_and_kwargs`` resolves them, map to a ``LinearAttentionCacheLayerMixin`` cache layer
  (``"linear_attention"``, ``"conv"``, ``"hybrid"``, ...);
* **stateful modules**: a module class of the model type's modeling package reads or writes conv /
  recurrent state: its source calls the cache's ``update_conv_state`` / ``update_recurrent_state`` /
  ``get_conv_state`` / ``get_linear_cache`` ... or it keeps such state as its own attribute
  (``self.conv1d_state = ...``, ``self.recurrent_states = ...``). These classes count for the model types
  of the package that generate text (causal-LM / image-text-to-text / ... auto mappings) or whose config
  declares recurrent cache layers, and for every wrapper whose text config is such a model type.

:func:`coverage` then says whether safepad supports a family (every stateful class is claimed by a spec),
lists it as unsupported (:mod:`safepad.specs.unsupported`), or neither (``"missing"``: a new recurrent
family safepad has not looked at). Test / tooling code: it instantiates every default config and imports a
few modeling modules.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import logging
import os
import re
import warnings
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from .registry import _COVERED
from .unsupported import UNSUPPORTED_FAMILIES

logger = logging.getLogger(__name__)

__all__ = [
    "RecurrentFamily",
    "class_keeps_state",
    "coverage",
    "discover_recurrent_families",
    "recurrent_cache_layer_types",
    "stateful_classes",
]

#: a class keeps recurrent state when its source calls one of these cache methods or assigns such an attribute
_STATE_CALL = re.compile(r"\.(?:update|get|set)_(?:conv|recurrent|linear)_(?:state|states|cache)\s*\(")
_STATE_ATTR = re.compile(r"self\.\w*(?:conv\w*_state|recurrent_states?|ssm_states?)\s*=")
_CLASS_VERDICT: "weakref.WeakKeyDictionary[type, bool]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class RecurrentFamily:
    """One discovered model type.

    Attributes:
        model_type: ``config.model_type``.
        cache_layer_types: its (text config's) layer types that map to a recurrent cache layer, sorted.
        stateful_classes: class names of the modules that keep conv / recurrent state, sorted.
        text_model_type: the model type of its text config when it differs (VLM wrappers), else ``None``.
    """

    model_type: str
    cache_layer_types: tuple[str, ...]
    stateful_classes: tuple[str, ...]
    text_model_type: str | None = None


@functools.lru_cache(maxsize=None)
def _file_stateful_classes(path: str) -> frozenset[str]:
    """Names of the classes defined in the Python file ``path`` whose body matches the state patterns."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError:
        return frozenset()
    if not (_STATE_CALL.search(text) or _STATE_ATTR.search(text)):
        return frozenset()
    lines = text.splitlines()
    tree = ast.parse(text)

    def body(node: ast.AST) -> str:
        return "\n".join(lines[node.lineno - 1 : node.end_lineno])

    # module-level functions that touch the state, directly or through another such function (transformers 5.25
    # moved the cache calls out of the mixers into functions such as ``causal_conv1d_forward`` / ``mamba2_chunk_scan``)
    functions = {n.name: body(n) for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    stateful = {name for name, b in functions.items() if _STATE_CALL.search(b) or _STATE_ATTR.search(b)}
    while True:
        calls = _calls_any(stateful)
        grown = {name for name, b in functions.items() if name not in stateful and calls and calls.search(b)}
        if not grown:
            break
        stateful |= grown
    calls = _calls_any(stateful)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            b = body(node)
            if _STATE_CALL.search(b) or _STATE_ATTR.search(b) or (calls is not None and calls.search(b)):
                names.add(node.name)
    return frozenset(names)


def _calls_any(names: set[str]) -> re.Pattern | None:
    """A pattern matching a call of any of ``names`` as a plain name (not an attribute: ``x.name(`` is not it)."""
    if not names:
        return None
    return re.compile(r"(?<![\w.])(?:" + "|".join(map(re.escape, sorted(names))) + r")\s*\(")


def class_keeps_state(cls: type) -> bool:
    """Whether ``cls``'s source reads or writes conv / recurrent cache state (parsed once per file, memoised)."""
    if cls not in _CLASS_VERDICT:
        try:
            path = inspect.getsourcefile(cls)
        except TypeError:  # built-in / C classes
            path = None
        _CLASS_VERDICT[cls] = bool(path) and cls.__name__ in _file_stateful_classes(path)
    return _CLASS_VERDICT[cls]


def stateful_classes(model: nn.Module) -> tuple[str, ...]:
    """Sorted class names of the modules of ``model`` that keep conv / recurrent state (original classes
    of safepad-patched mixers)."""
    names = set()
    for module in model.modules():
        cls = getattr(type(module), "_safepad_original_class", None) or type(module)
        if cls.__module__.startswith("torch.") or cls.__module__ == "builtins":
            continue
        if class_keeps_state(cls):
            names.add(cls.__name__)
    return tuple(sorted(names))


def recurrent_cache_layer_types(config) -> tuple[str, ...]:
    """Sorted layer types of ``config`` (its decoder text config) that transformers caches in a recurrent
    (``LinearAttentionCacheLayerMixin``) layer; ``()`` when none or when transformers has no such layers."""
    from transformers import cache_utils

    mixin = getattr(cache_utils, "LinearAttentionCacheLayerMixin", None)
    mapping = getattr(cache_utils, "DYNAMIC_LAYER_TYPE_MAPPING", None)
    resolve = getattr(cache_utils, "get_layer_types_and_kwargs", None)
    if mixin is None or mapping is None or resolve is None:
        return ()
    try:
        text = config.get_text_config(decoder=True)
    except (TypeError, ValueError, AttributeError):
        text = config
    try:
        layer_types, _ = resolve(text)
    except Exception:  # noqa: BLE001 - a config without layers (vision, audio, ...) has no recurrent cache
        return ()
    found = set()
    for t in layer_types:
        layer_cls = mapping.get(t)
        if isinstance(layer_cls, type) and issubclass(layer_cls, mixin):
            found.add(t)
    return tuple(sorted(found))


def _package_dir(config_cls: type) -> str | None:
    mod = importlib.import_module(config_cls.__module__)
    path = getattr(mod, "__file__", None)
    return os.path.dirname(path) if path else None


def _modeling_files(config_cls: type) -> list[str]:
    pkg = _package_dir(config_cls)
    if pkg is None or not config_cls.__module__.startswith("transformers.models."):
        return []
    return sorted(os.path.join(pkg, f) for f in os.listdir(pkg) if f.startswith("modeling_") and f.endswith(".py"))


def _package_classes(config_cls: type) -> tuple[str, ...]:
    """Stateful classes defined in the modeling modules of ``config_cls``'s package (read, not imported)."""
    names: set[str] = set()
    for path in _modeling_files(config_cls):
        names |= _file_stateful_classes(path)
    return tuple(sorted(names))


#: auto-model mappings whose model types generate text: their package's stateful classes count as theirs
_GENERATIVE_MAPPINGS = (
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
    "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES",
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    "MODEL_FOR_VISION_2_SEQ_MAPPING_NAMES",
)


def _generative_model_types() -> set[str]:
    from transformers.models.auto import modeling_auto

    out: set[str] = set()
    for name in _GENERATIVE_MAPPINGS:
        out.update(getattr(modeling_auto, name, {}) or {})
    return out


def discover_recurrent_families(model_types: Iterable[str] | None = None) -> dict[str, RecurrentFamily]:
    """``{model_type: RecurrentFamily}`` for every model type (default: all of ``CONFIG_MAPPING``) whose
    modules keep conv / recurrent cache state. Model types registered at run time (``AutoConfig.register``)
    are included."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    tf_logger = logging.getLogger("transformers")
    level = tf_logger.level
    tf_logger.setLevel(logging.ERROR)
    generative = _generative_model_types()
    out: dict[str, RecurrentFamily] = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            types = sorted(CONFIG_MAPPING.keys()) if model_types is None else list(model_types)
            memo: dict[str, tuple] = {}
            for mt in types:
                fam = _discover_one(CONFIG_MAPPING, mt, generative, memo)
                if fam is not None:
                    out[mt] = fam
    finally:
        tf_logger.setLevel(level)
    return out


def _probe(config_mapping, model_type: str, generative: set[str], memo: dict) -> tuple:
    """(config or None, recurrent cache layer types, own stateful classes, text model type or None), memoised."""
    if model_type in memo:
        return memo[model_type]
    memo[model_type] = (None, (), (), None)  # cycle guard
    try:
        config_cls = config_mapping[model_type]
    except Exception:  # noqa: BLE001 - a model type whose config module does not import
        return memo[model_type]
    try:
        config = config_cls()
    except Exception:  # noqa: BLE001 - configs that need arguments (none of them is a language model)
        config = None
    cache_types = recurrent_cache_layer_types(config) if config is not None else ()
    classes: tuple[str, ...] = ()
    if model_type in generative or cache_types:
        classes = _package_classes(config_cls)
    text_mt = None
    if config is not None:
        try:
            text_mt = config.get_text_config(decoder=True).model_type
        except (TypeError, ValueError, AttributeError):
            text_mt = None
    memo[model_type] = (config, cache_types, classes, text_mt if text_mt != model_type else None)
    return memo[model_type]


def _discover_one(config_mapping, model_type: str, generative: set[str], memo: dict) -> RecurrentFamily | None:
    _, cache_types, classes, text_mt = _probe(config_mapping, model_type, generative, memo)
    if text_mt is not None:
        # a wrapper (VLM, speech LM): its language model's stateful classes are its own too
        _, text_cache, text_classes, _ = _probe(config_mapping, text_mt, generative | {text_mt}, memo)
        cache_types = tuple(sorted(set(cache_types) | set(text_cache)))
        classes = tuple(sorted(set(classes) | set(text_classes)))
    if not cache_types and not classes:
        return None
    return RecurrentFamily(model_type, cache_types, classes, text_mt)


def coverage(family: RecurrentFamily) -> tuple[str, str]:
    """``("supported", specs)``, ``("unsupported", reason)`` or ``("missing", what is uncovered)``.

    Supported: at least one stateful class, and every one is claimed by a registered spec (``safepad.wrap``
    patches exactly those classes). A family listed in :data:`~safepad.specs.unsupported.UNSUPPORTED_FAMILIES`
    that is in fact fully supported is reported ``"missing"`` too (a stale entry).
    """
    claimed = {c: _COVERED[c].model_type for c in family.stateful_classes if c in _COVERED}
    unclaimed = [c for c in family.stateful_classes if c not in _COVERED]
    fully = bool(family.stateful_classes) and not unclaimed
    reason = UNSUPPORTED_FAMILIES.get(family.model_type)
    if reason is not None:
        if fully:
            return "missing", f"listed as unsupported, but every stateful class is claimed by a spec: {claimed}"
        return "unsupported", reason
    if fully:
        return "supported", ", ".join(f"{c} ({s})" for c, s in sorted(claimed.items()))
    if not family.stateful_classes:
        return "missing", (
            f"cache layer types {list(family.cache_layer_types)} are recurrent but no module class was found "
            "that keeps the state; add a spec or list it in safepad/specs/unsupported.py"
        )
    return "missing", (
        f"stateful classes without a spec: {', '.join(unclaimed)}; add a spec or list the model type in "
        "safepad/specs/unsupported.py with a one-line reason"
    )
