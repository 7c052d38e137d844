"""safepad: padding- and packing-correct Mamba-family and hybrid SSMs in HuggingFace transformers.

One import is enough::

    import safepad
    model = safepad.wrap(model)                      # packed / padded / chunked / decode: all correct
    collator = safepad.DataCollatorForPackedSSM()    # pack instead of pad
    trainer.add_callback(safepad.PaddingGuardCallback(mode="error"))

Layers: ``safepad.layout`` (boundaries, masks) -> ``safepad.ops`` (torch core + CUDA kernel dispatch) ->
``safepad.specs`` / ``safepad.mixers`` (one generic mixer per kind, a small spec per family) ->
``safepad.wrap`` / ``safepad.guard`` -> ``safepad.cli`` (``safepad audit``). The collators and the Trainer
callback live in ``safepad.collators`` and ``safepad.trainer_ext`` (the repository folders ``collators/`` and
``trainer_ext/``) and are re-exported here.
Public names are imported lazily, so ``import safepad`` stays cheap.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from ._compat import check_torch_version, check_transformers_version
from .errors import PaddingError, PaddingWarning, UnsupportedModelError, UntestedVersionError

logging.getLogger(__name__).addHandler(logging.NullHandler())

try:  # the installed distribution's version (pyproject.toml is the one source)
    from importlib.metadata import PackageNotFoundError, version as _dist_version

    __version__ = _dist_version("safepad")
except PackageNotFoundError:  # a checkout on sys.path that was never installed
    __version__ = "0+unknown"

check_transformers_version()
check_torch_version()

# ``wrap`` and ``guard`` are both submodules and functions: bind the functions eagerly, here, so that the
# package attribute is the function whatever imports the submodule later.
from .guard import GuardHandle, SSMInfo, find_ssm_layers, get_guard, guard  # noqa: E402
from .wrap import is_wrapped, supported_model_types, unwrap, wrap  # noqa: E402

# The collators and the Trainer callback pull in datasets / the Trainer: import them on first use.
_LAZY = {
    "DataCollatorForPackedSSM": "safepad.collators",
    "pack_dataset": "safepad.collators",
    "packing_stats": "safepad.collators",
    "PackingStats": "safepad.collators",
    "PaddingGuardCallback": "safepad.trainer_ext",
    "ShadowCheckCallback": "safepad.trainer_ext",
    "RolloutGapCallback": "safepad.trainer_ext",
    "PackedGRPOMixin": "safepad.trainer_ext",
    "packed_logprobs": "safepad.rl",
    "packed_logprobs_and_entropy": "safepad.rl",
}

__all__ = [
    "__version__",
    "GuardHandle",
    "SSMInfo",
    "find_ssm_layers",
    "get_guard",
    "guard",
    "PaddingError",
    "PaddingWarning",
    "UnsupportedModelError",
    "UntestedVersionError",
    "is_wrapped",
    "supported_model_types",
    "unwrap",
    "wrap",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name])
        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'safepad' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
