"""Sequence-parallel training of wrapped models over a ``torch.distributed`` process group.

::

    import safepad, safepad.distributed as spd
    model = safepad.wrap(model)
    sp = spd.sequence_parallel(model, group)   # every rank of `group` is fed the same full batch
    loss = model(**batch).loss                 # the whole batch's loss; logits are this rank's shard
    loss.backward(); sp.sync_gradients()       # every rank now holds the unsharded gradient

    spd.prepare_trainer(trainer, sp_size=2)    # or: under transformers.Trainer, before trainer.train()

Each rank holds a contiguous shard of every (packed) row. Conv layers get the ``K - 1``-token halo from
the previous rank; recurrent layers get their incoming state from the ranks before them (an affine scan
over ranks of each shard's final state and transition, :mod:`safepad.parallel.ops`); attention layers
all-gather K/V (:mod:`safepad.parallel.attention`). All exchanges are differentiable.

This package is the model and Trainer integration (it sits above ``safepad.wrap``); what the mixers read per
shard (the SP context, the sequence-parallel ops, the attention function) lives below them in
:mod:`safepad.parallel`. Submodules load lazily.
"""

from __future__ import annotations

import importlib

__all__ = [
    "SUPPORTED_KINDS",
    "SPContext",
    "SequenceParallel",
    "UnsupportedSequenceParallelError",
    "current_sp",
    "prepare_trainer",
    "sequence_parallel",
]

_LAZY = {
    "SUPPORTED_KINDS": "model",
    "SequenceParallel": "model",
    "UnsupportedSequenceParallelError": "model",
    "sequence_parallel": "model",
    "SPContext": "context",
    "current_sp": "context",
    "prepare_trainer": "trainer",
}


def __getattr__(name: str):
    if name in _LAZY:
        module = _LAZY[name]
        package = "safepad.parallel" if module == "context" else __name__
        return getattr(importlib.import_module(f".{module}", package), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
