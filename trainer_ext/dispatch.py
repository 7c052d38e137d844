"""accelerate's batch dispatcher and the packing collator's per-batch tensors.

For an ``IterableDataset`` accelerate's ``prepare`` (and so ``transformers.Trainer``) defaults to
``dispatch_batches=True``: a ``DataLoaderDispatcher`` fetches the batches on process 0, broadcasts them and
cuts EVERY tensor to ``[i * b, (i + 1) * b)`` along dim 0, with ``b`` the batch size it finds in the first
tensor (``input_ids`` ``[B, T]``). That is right for ``[B, ...]`` tensors, but a packed row's
``cu_seq_lens_q`` / ``cu_seq_lens_k`` ``[N + 1]`` (one entry per packed sequence, from
:class:`~collators.DataCollatorForPackedSSM` or TRL's padding-free collators) is cut to its first ``b``
entries, which a wrapped model then refuses (``cu_seq_lens_q must have shape [num_seqs + 1] ... got (1,)``).

* One process: the dispatcher's slice keeps every ``[B, ...]`` tensor whole (``b = B``), so taking the batch
  as it is gives exactly the batch the collator built, the per-sequence tensors included.
  :func:`adapt_dispatcher` installs that identity slice (``PaddingGuardCallback`` does it at train begin).
* Several processes: the dispatcher concatenates one batch per process and cuts the result, and the
  concatenated ``cu_seq_lens`` of several rows cannot be cut back per process. Nothing is re-derived from
  ``seq_idx`` / ``position_ids`` (that would hide a corrupted batch): :func:`adapt_dispatcher` raises, naming
  the fix ``TrainingArguments(accelerator_config={"dispatch_batches": False})``.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["DISPATCH_FIX", "adapt_dispatcher"]

logger = logging.getLogger(__name__)

#: the fix named in every refusal
DISPATCH_FIX = "TrainingArguments(accelerator_config={'dispatch_batches': False})"


def _whole_batch(data: Any, tensor_slice: slice, process_index: int | None = None, num_processes: int | None = None):
    """The dispatcher's ``slice_fn`` on one process: the batch unchanged (its slice would only cut the
    per-sequence tensors, whose first dimension is not the batch)."""
    return data


def _collator(loader: Any) -> Any:
    fn = getattr(loader, "collate_fn", None)
    return getattr(fn, "data_collator", fn)  # transformers' RemoveColumnsCollator keeps the user's collator here


def adapt_dispatcher(loader: Any, what: str = "train dataloader") -> bool:
    """Make an accelerate ``DataLoaderDispatcher`` hand packed batches over whole; returns whether it changed it.

    Any other loader is left alone (returns False). On one process the dispatcher's slice becomes the identity
    (exact: see the module doc). On several processes with :class:`~collators.DataCollatorForPackedSSM`, raises
    ``ValueError`` naming :data:`DISPATCH_FIX`.
    """
    try:
        from accelerate.data_loader import DataLoaderDispatcher
    except ImportError:  # pragma: no cover - accelerate is a transformers.Trainer dependency
        return False
    if not isinstance(loader, DataLoaderDispatcher):
        return False
    processes = int(getattr(loader.state, "num_processes", 1))
    if processes == 1:
        if loader.slice_fn is not _whole_batch:
            loader.slice_fn = _whole_batch
            logger.info("safepad: the %s dispatches batches on one process; they are passed on whole", what)
        return True
    from safepad.collators import DataCollatorForPackedSSM

    if isinstance(_collator(loader), DataCollatorForPackedSSM):
        raise ValueError(
            f"the {what} is accelerate's batch dispatcher over {processes} processes (the default for an "
            "IterableDataset): it concatenates one packed batch per process and cuts every tensor, which breaks "
            f"the per-sequence cu_seq_lens_q / cu_seq_lens_k of DataCollatorForPackedSSM. Set {DISPATCH_FIX}: each "
            "process then reads its own share of the stream"
        )
    return False
