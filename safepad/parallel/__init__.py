"""The sequence-parallel compute floor: what a mixer needs to run one shard of a row.

* :mod:`.context`: :class:`~.context.SPContext`, the per-call description of this rank's shard, set by the
  entry point (:mod:`safepad.distributed.model`) and read by the mixers;
* :mod:`.ops`: the sequence-parallel versions of the varlen ops (conv halo, scan-state hand-off over ranks);
* :mod:`.attention`: the all-gather attention function for hybrids' attention layers;
* :mod:`.collectives`: the differentiable exchanges they are built on.

It sits beside :mod:`safepad.ops`, below the mixers; the model and Trainer integration
(:mod:`safepad.distributed`) sits above ``safepad.wrap``. Nothing here imports ``wrap``.
"""

__all__: list[str] = []
