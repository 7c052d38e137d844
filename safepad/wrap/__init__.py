"""``safepad.wrap(model)``: make every supported recurrent mixer in a model padding- and packing-correct.

One generic patcher plus one model-level hook, one concern per file:

* :mod:`.patching`: swaps each supported mixer's class for ``Safepad<Mixer>`` (the spec's generic forward);
  ``wrap`` / ``unwrap`` / ``is_wrapped`` / ``wrapped_modules``;
* :mod:`.hooks`: the model pre-/post-hooks, which decide each call's boundaries, masks and cache policy once;
* :mod:`.checkpoint`: checkpointed layers recompute under their forward's call context;
* :mod:`.frames`: the enclosing-call stack walk and ``generate()`` detection;
* :mod:`.generate`: the wrapped ``generate`` / ``prepare_inputs_for_generation`` (right-padded prompts, continued caches);
* :mod:`.slot_calls`: slot-justified cached calls (every cached row kept ``[pads | real tokens]``, positions);
  :mod:`.traced_slot_calls`: the same re-lay while traced, decided on the device; :mod:`.slot_record`: what such
  a call leaves for the post-hook, which puts its outputs back in the caller's order;
* :mod:`.attention_masks`: block-diagonal masks for packed hybrids whose mask construction ignores packing.
"""

from __future__ import annotations

from .patching import is_wrapped, rebuild_patched_class, supported_model_types, unwrap, wrap, wrapped_modules

__all__ = ["is_wrapped", "supported_model_types", "unwrap", "wrap", "wrapped_modules"]


def __getattr__(name: str):
    """Patched classes are generated at wrap time; in a fresh process (``pickle.load`` / ``torch.load`` of a
    wrapped model) ``safepad.wrap.Safepad<Mixer>`` is rebuilt on first access from the family registry."""
    if name.startswith("Safepad") and not name.startswith("Safepad_"):
        cls = rebuild_patched_class(name[len("Safepad") :])
        if cls is not None:
            return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
