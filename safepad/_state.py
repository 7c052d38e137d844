"""Everything safepad keeps on a module, in one namespace object: ``module._safepad``.

:func:`safepad.wrap` gives every patched mixer and every hooked model module one :class:`ModuleState`, and
:func:`safepad.unwrap` is its one inverse: restore the class, remove the handles, ``del module._safepad``. No other
per-module attribute exists, so nothing can be left behind.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ModuleState", "hooked", "module_state", "state_of"]


class ModuleState:
    """What safepad keeps on one module.

    Attributes:
        backend: a patched mixer's backend (``"auto"``, ``"torch"``, ``"kernels"``), or None on a model module.
        layer_idx: a patched mixer's layer index taken from its module name, when the stock module keeps none.
        saw_packed: the mixer has run on packed boundaries (a recompute without context then raises).
        last_sp: the sequence-parallel context of the mixer's last sharded call (for its checkpoint recompute).
        hook_handles: the hooks safepad registered on this (model) module.
        tokens / slot_calls / cache_calls: per-call stacks of the model hooks (one entry per call in progress;
            plain lists, made at wrap time, so a traced call mutates no module ``__dict__``).
        counts: the eager call in progress's expected static-cache count (``safepad.cache.expect_count``), settled
            by the model's post-hook (at most one entry).
    """

    def __init__(self) -> None:
        self.backend: str | None = None
        self.layer_idx: int | None = None
        self.saw_packed: bool = False
        self.last_sp: Any = None
        self.hook_handles: list[Any] = []
        self.tokens: list[Any] = []
        self.slot_calls: list[Any] = []
        self.cache_calls: list[Any] = []
        self.counts: list[Any] = []

    def __repr__(self) -> str:
        return (
            f"ModuleState(backend={self.backend!r}, layer_idx={self.layer_idx!r}, saw_packed={self.saw_packed}, "
            f"hooks={len(self.hook_handles)})"
        )


def state_of(module: Any) -> ModuleState | None:
    """``module._safepad``, or None when safepad keeps nothing on ``module``."""
    return module.__dict__.get("_safepad")


def hooked(module: Any) -> bool:
    """Whether safepad's model hooks are installed on ``module``."""
    state = module.__dict__.get("_safepad")
    return state is not None and bool(state.hook_handles)


def module_state(module: Any) -> ModuleState:
    """``module._safepad``, made on first use (at wrap time)."""
    state = module.__dict__.get("_safepad")
    if state is None:
        state = module._safepad = ModuleState()
    return state
