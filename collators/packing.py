"""``pack_dataset``: bin-pack tokenized examples into rows of at most ``max_length`` tokens.

Every output row holds ``input_ids``, the packed per-token columns, ``seq_lengths`` (the lengths of
the sequences in the row, in order) and ``position_ids`` (restarting at 0 per sequence). Feed the
rows to :class:`~collators.DataCollatorForPackedSSM`, which turns them into ``seq_idx`` /
``cu_seq_lens`` / ``position_ids`` without ever letting one sequence see another.

Best-fit-decreasing (BFD) runs as one Python loop over the sorted lengths whose per-item work is a
C-level ``bisect`` (O(log k)) plus, when a new free-space value appears, a C-level ``insort``
(a memmove of at most k pointers) over the sorted distinct free spaces of the open bins, where
k <= max_length. TRL's segment tree does O(log max_length) *Python* steps per item instead. The sort
is O(n log n); everything else (splitting, truncating, gathering tokens, building the Arrow columns)
is vectorised numpy / pyarrow.
"""

from __future__ import annotations

import logging
from bisect import bisect_left, insort
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["PackingStats", "bfd_assign", "pack_dataset", "packing_stats"]

logger = logging.getLogger(__name__)

Strategy = Literal["bfd", "wrapped"]
Overflow = Literal["split", "truncate", "error"]

# Columns pack_dataset writes itself; an input column of the same name is replaced.
_GENERATED = ("seq_lengths", "position_ids")


@dataclass
class PackingStats:
    """What packing did. For a streamed dataset the counters grow as the stream is consumed.

    Attributes:
        max_length: capacity of one row in tokens.
        examples: examples read.
        examples_skipped: examples with empty ``input_ids`` (dropped).
        examples_truncated: examples longer than ``max_length`` cut with ``overflow="truncate"``.
        tokens_dropped: tokens lost to truncation (0 unless ``overflow="truncate"``).
        sequences: sequences written (a split example counts once per piece).
        rows: packed rows written.
        tokens: real tokens written.
    """

    max_length: int
    examples: int = 0
    examples_skipped: int = 0
    examples_truncated: int = 0
    tokens_dropped: int = 0
    sequences: int = 0
    rows: int = 0
    tokens: int = 0

    @property
    def fill_ratio(self) -> float:
        """Real tokens / capacity (``rows * max_length``)."""
        return self.tokens / (self.rows * self.max_length) if self.rows else 0.0

    @property
    def sequences_per_row(self) -> float:
        return self.sequences / self.rows if self.rows else 0.0

    def __str__(self) -> str:
        return (
            f"PackingStats(rows={self.rows}, fill_ratio={self.fill_ratio:.4f}, "
            f"sequences_per_row={self.sequences_per_row:.2f}, tokens={self.tokens}, "
            f"tokens_dropped={self.tokens_dropped}, examples={self.examples}, "
            f"examples_skipped={self.examples_skipped}, examples_truncated={self.examples_truncated})"
        )


# --------------------------------------------------------------------------- core algorithm
def bfd_assign(lengths: np.ndarray, max_length: int) -> tuple[np.ndarray, np.ndarray]:
    """Best-fit-decreasing bin packing of integer ``lengths`` ``[n]`` (each in ``[1, max_length]``).

    Items are taken longest first; each goes into the open bin with the *smallest* free space that
    still fits it, or opens a new bin.

    Returns:
        order: ``[n]`` int64 item indices grouped by bin (bins in creation order, items in
            placement order).
        counts: ``[R]`` int64 number of items in each bin.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    n = lengths.shape[0]
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    if lengths.min() < 1 or lengths.max() > max_length:
        raise ValueError(f"lengths must lie in [1, max_length={max_length}], got [{lengths.min()}, {lengths.max()}]")
    by_len = np.argsort(-lengths, kind="stable")  # [n] longest first, ties in input order
    sorted_lengths = lengths[by_len].tolist()
    bin_of = [0] * n
    spaces: list[int] = []  # sorted distinct free spaces (> 0) of open bins
    bins_at: dict[int, list[int]] = {}  # free space -> open bins with exactly that space
    n_bins = 0
    for j, length in enumerate(sorted_lengths):
        k = bisect_left(spaces, length)
        if k == len(spaces):  # nothing fits: open a bin
            b = n_bins
            n_bins += 1
            free = max_length - length
        else:
            space = spaces[k]
            group = bins_at[space]
            b = group.pop()
            if not group:
                del spaces[k]
                del bins_at[space]
            free = space - length
        bin_of[j] = b
        if free:
            group = bins_at.get(free)
            if group is None:
                bins_at[free] = [b]
                insort(spaces, free)
            else:
                group.append(b)
    bins = np.asarray(bin_of, dtype=np.int64)  # [n] bin of the j-th longest item
    regroup = np.argsort(bins, kind="stable")  # [n] group by bin, keep placement order
    return by_len[regroup], np.bincount(bins, minlength=n_bins)


def _exclusive_cumsum(x: np.ndarray) -> np.ndarray:
    out = np.zeros(x.shape[0], dtype=np.int64)
    if x.shape[0] > 1:
        np.cumsum(x[:-1], out=out[1:])
    return out


def _ranges(starts: np.ndarray, lengths: np.ndarray, dtype: type = np.int64) -> np.ndarray:
    """Concatenated ``arange(starts[s], starts[s] + lengths[s])`` for positive ``lengths`` ``[S]``.

    One cumsum over the output ``[sum(lengths)]``: step +1 inside a range, a jump at every range start.
    """
    out = np.ones(int(lengths.sum()), dtype=dtype)  # [T]
    if out.shape[0]:
        ends = starts[:-1] + lengths[:-1] - 1  # [S - 1] last value of every range but the last
        out[_exclusive_cumsum(lengths)[1:]] = starts[1:] - ends  # [S - 1] jump to the next range's start
        out[0] = starts[0]
        np.cumsum(out, out=out)
    return out


@dataclass
class _Plan:
    """Where every output token comes from: ``src[T]`` indexes the flat input tokens."""

    src: np.ndarray  # [T] flat input token index of every output token
    seq_lengths: np.ndarray  # [S] output sequence lengths, row-major
    row_nseq: np.ndarray  # [R] sequences per row
    row_ntok: np.ndarray  # [R] tokens per row


def _plan(lengths: np.ndarray, max_length: int, strategy: str, overflow: str) -> _Plan:
    """Pieces from ``lengths`` ``[n]`` (already checked for overflow="error"), then bin them."""
    starts = _exclusive_cumsum(lengths)  # [n] offset of every example in the flat tokens
    if overflow == "split":
        n_frag = -(-lengths // max_length)  # [n] ceil; 0 for empty examples
        item = np.repeat(np.arange(lengths.shape[0]), n_frag)  # [F]
        k = np.arange(item.shape[0]) - np.repeat(_exclusive_cumsum(n_frag), n_frag)  # [F] piece index
        frag_start = starts[item] + k * max_length  # [F]
        frag_len = np.minimum(max_length, lengths[item] - k * max_length)  # [F]
    else:  # truncate (error was checked before)
        keep = lengths > 0
        frag_start = starts[keep]  # [F]
        frag_len = np.minimum(lengths[keep], max_length)  # [F]

    if strategy == "bfd":
        order, row_nseq = bfd_assign(frag_len, max_length)
        out_start, out_len = frag_start[order], frag_len[order]  # [S]
        src = _ranges(out_start, out_len)  # [T] flat input index of every output token
        row_ntok = np.add.reduceat(out_len, _exclusive_cumsum(row_nseq)) if row_nseq.size else row_nseq
        return _Plan(src, out_len, row_nseq, row_ntok)

    # wrapped: pieces back to back, cut every max_length tokens (a cut also ends a sequence)
    total = int(frag_len.sum())
    src = _ranges(frag_start, frag_len)  # [T]
    cuts = np.union1d(_exclusive_cumsum(frag_len), np.arange(0, total, max_length))  # [S] sequence starts
    cuts = cuts[cuts < total]
    seq_lengths = np.diff(np.append(cuts, total))  # [S]
    row_of_seq = cuts // max_length  # [S]
    n_rows = -(-total // max_length)
    row_nseq = np.bincount(row_of_seq, minlength=n_rows)
    row_ntok = np.bincount(row_of_seq, weights=seq_lengths, minlength=n_rows).astype(np.int64)
    return _Plan(src, seq_lengths, row_nseq, row_ntok)


def _list_array(offsets: np.ndarray, values: pa.Array, large: bool = False) -> pa.Array:
    cls = pa.LargeListArray if large else pa.ListArray
    return cls.from_arrays(pa.array(offsets, type=pa.int64() if large else pa.int32()), values)


def _build_table(
    plan: _Plan, columns: Mapping[str, pa.Array], large: Mapping[str, bool], emit_position_ids: bool
) -> pa.Table:
    """Gather every packed column from its flat values; add ``seq_lengths`` (and ``position_ids``)."""
    tok_off = np.zeros(plan.row_ntok.shape[0] + 1, dtype=np.int64)  # [R + 1]
    np.cumsum(plan.row_ntok, out=tok_off[1:])
    seq_off = np.zeros(plan.row_nseq.shape[0] + 1, dtype=np.int64)  # [R + 1]
    np.cumsum(plan.row_nseq, out=seq_off[1:])
    src = pa.array(plan.src)
    out: dict[str, pa.Array] = {}
    for name, flat in columns.items():
        out[name] = _list_array(tok_off, pc.take(flat, src), large.get(name, False))
    out["seq_lengths"] = _list_array(seq_off, pa.array(plan.seq_lengths.astype(np.int32)))
    if emit_position_ids:
        pos = _ranges(np.zeros_like(plan.seq_lengths), plan.seq_lengths, np.int32)  # [T] restarting at 0
        out["position_ids"] = _list_array(tok_off, pa.array(pos))
    return pa.table(out)


def _pack_arrow_batch(
    batch: pa.Table,
    *,
    max_length: int,
    strategy: str,
    overflow: str,
    token_columns: tuple[str, ...],
    emit_position_ids: bool,
) -> pa.Table:
    """``datasets.map(batched=True)`` worker: one Arrow batch in, its packed rows out."""
    ids = batch.column("input_ids").combine_chunks()
    lengths = pc.fill_null(pc.list_value_length(ids), 0).to_numpy(zero_copy_only=False).astype(np.int64)  # [n]
    plan = _plan(lengths, max_length, strategy, overflow)
    cols: dict[str, pa.Array] = {}
    large: dict[str, bool] = {}
    for name in token_columns:
        col = batch.column(name).combine_chunks()
        cols[name] = col.flatten()  # respects the slice offset of this batch
        large[name] = pa.types.is_large_list(col.type)
    return _build_table(plan, cols, large, emit_position_ids)


# --------------------------------------------------------------------------- validation helpers
def _check_args(max_length: int, strategy: str, overflow: str, on_empty: str) -> None:
    if not isinstance(max_length, (int, np.integer)) or isinstance(max_length, bool) or max_length < 1:
        raise ValueError(f"max_length must be a positive int, got {max_length!r}")
    if strategy not in ("bfd", "wrapped"):
        raise ValueError(f"strategy must be 'bfd' or 'wrapped', got {strategy!r}")
    if overflow not in ("split", "truncate", "error"):
        raise ValueError(f"overflow must be 'split', 'truncate' or 'error', got {overflow!r}")
    if on_empty not in ("skip", "error"):
        raise ValueError(f"on_empty must be 'skip' or 'error', got {on_empty!r}")


def _is_token_list_type(t: pa.DataType) -> bool:
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)):
        return False
    v = t.value_type
    return pa.types.is_integer(v) or pa.types.is_floating(v) or pa.types.is_boolean(v)


def _length_checks(
    lengths: np.ndarray, max_length: int, overflow: str, on_empty: str, stats: PackingStats, offset: int = 0
) -> None:
    """Apply on_empty / overflow policies to a block of example lengths ``[n]``; update ``stats``."""
    empty = lengths == 0
    if on_empty == "error" and empty.any():
        i = int(np.flatnonzero(empty)[0]) + offset
        raise ValueError(f"example {i} has empty input_ids; filter it out or pass on_empty='skip'")
    long = lengths > max_length
    if overflow == "error" and long.any():
        i = int(np.flatnonzero(long)[0])
        raise ValueError(
            f"example {i + offset} has {int(lengths[i])} tokens > max_length={max_length}; "
            "pass overflow='split' (keep every token) or overflow='truncate' (drop the tail)"
        )
    stats.examples += int(lengths.shape[0])
    stats.examples_skipped += int(empty.sum())
    if overflow == "truncate":
        stats.examples_truncated += int(long.sum())
        stats.tokens_dropped += int((lengths[long] - max_length).sum())


# --------------------------------------------------------------------------- public API
def packing_stats(packed: Any, max_length: int) -> PackingStats:
    """Row statistics of an already packed ``datasets.Dataset`` (reads only its ``seq_lengths``).

    ``examples*`` and ``tokens_dropped`` are not recoverable from the output and stay 0; use
    ``pack_dataset(..., return_stats=True)`` for them.
    """
    if "seq_lengths" not in getattr(packed, "column_names", ()):
        raise ValueError("packed must be a datasets.Dataset with a 'seq_lengths' column (made by pack_dataset)")
    col = packed.with_format("arrow", columns=["seq_lengths"])[:].column("seq_lengths").combine_chunks()
    stats = PackingStats(max_length=max_length)
    stats.rows = len(col)
    stats.sequences = int(pc.sum(pc.list_value_length(col)).as_py() or 0)
    stats.tokens = int(pc.sum(col.flatten()).as_py() or 0)
    return stats


def pack_dataset(
    dataset: Any,
    max_length: int,
    *,
    strategy: Strategy = "bfd",
    overflow: Overflow = "split",
    on_empty: Literal["skip", "error"] = "skip",
    emit_position_ids: bool = True,
    batch_size: int = 10_000,
    num_proc: int | None = None,
    buffer_size: int = 10_000,
    return_stats: bool = False,
    map_kwargs: dict[str, Any] | None = None,
) -> Any:
    """Pack tokenized examples into rows of at most ``max_length`` tokens, keeping every boundary.

    Args:
        dataset: a ``datasets.Dataset`` (packed with a batched ``map``, ``batch_size`` examples per
            batch, optionally ``num_proc`` processes), a ``datasets.DatasetDict`` (each split), or a
            ``datasets.IterableDataset`` (online packing over a bounded buffer of ``buffer_size``
            examples). Needs an ``input_ids`` column.
        max_length: row capacity in tokens.
        strategy: ``"bfd"`` — best-fit-decreasing bins (sequences are never cut to fill a row);
            ``"wrapped"`` — examples back to back, cut every ``max_length`` tokens (each cut also
            ends a sequence, so no state crosses it; fill is 100% except the last row).
        overflow: for an example longer than ``max_length``: ``"split"`` makes it several
            sequences (nothing lost); ``"truncate"`` drops the tail (counted in the stats and
            warned about with the number of tokens lost); ``"error"`` raises ``ValueError``
            naming the example's index and length.
        on_empty: ``"skip"`` drops examples with empty ``input_ids`` (counted); ``"error"`` raises.
        emit_position_ids: also write a ``position_ids`` column (restarting at 0 per sequence). It
            keeps the boundaries alive through ``transformers.Trainer``'s ``remove_unused_columns``,
            which drops ``seq_lengths`` but keeps ``position_ids`` for every model whose forward
            takes it; the collator reads boundaries from either.
        batch_size: examples per ``map`` batch (BFD packs within a batch; larger fills better).
        num_proc: processes for ``map``.
        buffer_size: examples per online packing round for an ``IterableDataset``; the least
            filled row of a round is carried into the next one.
        return_stats: return ``(packed, PackingStats)`` (a dict of them for a ``DatasetDict``). For an
            ``IterableDataset`` the stats fill in as the stream is consumed in this process (a
            DataLoader worker updates its own copy).
        map_kwargs: extra keyword arguments for ``Dataset.map``.

    Columns: ``input_ids`` and every per-token column (a list column of numbers with the length of
    ``input_ids`` in every row, e.g. ``labels``, ``token_type_ids``) are packed together. An
    ``attention_mask`` column must be all ones (packing padded examples would pack the pads) and is
    dropped. Any other column is dropped, with a logged note naming it.

    Returns:
        The packed dataset (same type as ``dataset``), with columns ``input_ids``, the per-token
        columns, ``seq_lengths`` and (by default) ``position_ids``.
    """
    _check_args(max_length, strategy, overflow, on_empty)
    max_length = int(max_length)
    import datasets

    if isinstance(dataset, datasets.DatasetDict):
        packed, stats = {}, {}
        for split, ds in dataset.items():
            packed[split], stats[split] = pack_dataset(
                ds,
                max_length,
                strategy=strategy,
                overflow=overflow,
                on_empty=on_empty,
                emit_position_ids=emit_position_ids,
                batch_size=batch_size,
                num_proc=num_proc,
                buffer_size=buffer_size,
                return_stats=True,
                map_kwargs=map_kwargs,
            )
        out = datasets.DatasetDict(packed)
        return (out, stats) if return_stats else out
    if isinstance(dataset, datasets.IterableDataset):
        return _pack_iterable(
            dataset,
            max_length,
            strategy=strategy,
            overflow=overflow,
            on_empty=on_empty,
            emit_position_ids=emit_position_ids,
            buffer_size=buffer_size,
            return_stats=return_stats,
        )
    if not isinstance(dataset, datasets.Dataset):
        raise ValueError(
            f"dataset must be a datasets.Dataset, DatasetDict or IterableDataset, got {type(dataset).__name__}"
        )
    if "input_ids" not in dataset.column_names:
        raise ValueError(f"dataset has no 'input_ids' column (columns: {dataset.column_names}); tokenize it first")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")

    arrow = dataset.with_format("arrow")
    ids_type = dataset.features.arrow_schema.field("input_ids").type
    if not _is_token_list_type(ids_type) or not pa.types.is_integer(ids_type.value_type):
        raise ValueError(f"column 'input_ids' must be a list of integers, got arrow type {ids_type}")
    table = arrow[:]  # zero-copy for a plain Dataset; applies the indices mapping of a shuffled/selected one
    ids = table.column("input_ids")
    lengths = pc.fill_null(pc.list_value_length(ids), 0).to_numpy(zero_copy_only=False).astype(np.int64)  # [n]
    stats = PackingStats(max_length=max_length)
    _length_checks(lengths, max_length, overflow, on_empty, stats)

    token_columns, dropped = ["input_ids"], []
    for name in dataset.column_names:
        if name == "input_ids" or name in _GENERATED:
            continue
        t = dataset.features.arrow_schema.field(name).type
        col = table.column(name)
        same = _is_token_list_type(t) and bool(
            np.array_equal(pc.fill_null(pc.list_value_length(col), 0).to_numpy(zero_copy_only=False), lengths)
        )
        if name == "attention_mask" and same:
            if not bool(pc.all(pc.cast(pc.list_flatten(col), pa.bool_())).as_py() in (True, None)):
                raise ValueError(
                    "column 'attention_mask' contains zeros: the examples are padded; tokenize without padding "
                    "before packing"
                )
            dropped.append(name)
        elif same:
            token_columns.append(name)
        else:
            dropped.append(name)
    if dropped:
        logger.info(
            "pack_dataset: dropping columns %s (not per-token; packed rows keep only per-token columns)", dropped
        )
    if stats.tokens_dropped:
        logger.warning(
            "pack_dataset: %d examples longer than max_length=%d were truncated; %d tokens dropped",
            stats.examples_truncated,
            max_length,
            stats.tokens_dropped,
        )

    kwargs = dict(map_kwargs or {})
    kwargs.setdefault("desc", f"Packing ({strategy}, max_length={max_length})")
    packed = arrow.map(
        _pack_arrow_batch,
        batched=True,
        batch_size=batch_size,
        num_proc=num_proc,
        remove_columns=dataset.column_names,
        fn_kwargs={
            "max_length": max_length,
            "strategy": strategy,
            "overflow": overflow,
            "token_columns": tuple(token_columns),
            "emit_position_ids": emit_position_ids,
        },
        **kwargs,
    )
    fmt = dataset.format
    packed = packed.with_format(fmt["type"], **(fmt.get("format_kwargs") or {}))
    out_stats = packing_stats(packed, max_length)
    stats.rows, stats.sequences, stats.tokens = out_stats.rows, out_stats.sequences, out_stats.tokens
    return (packed, stats) if return_stats else packed


# --------------------------------------------------------------------------- streaming
def _pack_iterable(
    dataset: Any,
    max_length: int,
    *,
    strategy: str,
    overflow: str,
    on_empty: str,
    emit_position_ids: bool,
    buffer_size: int,
    return_stats: bool,
) -> Any:
    import datasets

    if not isinstance(buffer_size, int) or buffer_size < 1:
        raise ValueError(f"buffer_size must be a positive int, got {buffer_size!r}")
    stats = PackingStats(max_length=max_length)
    packer = _StreamPacker(dataset, max_length, strategy, overflow, on_empty, emit_position_ids, buffer_size, stats)
    packed = datasets.IterableDataset.from_generator(packer.rows)
    return (packed, stats) if return_stats else packed


class _StreamPacker:
    """Online packing: BFD over a buffer of examples; the least filled row waits for the next round."""

    def __init__(
        self,
        source: Any,
        max_length: int,
        strategy: str,
        overflow: str,
        on_empty: str,
        emit_position_ids: bool,
        buffer_size: int,
        stats: PackingStats,
    ) -> None:
        self.source = source
        self.max_length = max_length
        self.strategy = strategy
        self.overflow = overflow
        self.on_empty = on_empty
        self.emit_position_ids = emit_position_ids
        self.buffer_size = buffer_size
        self.stats = stats

    def _columns(self, example: Mapping[str, Any]) -> list[str]:
        if "input_ids" not in example:
            raise ValueError(f"example 0 has no 'input_ids' (keys: {sorted(example)}); tokenize the stream first")
        n = len(example["input_ids"])
        cols, dropped = ["input_ids"], []
        for k, v in example.items():
            if k == "input_ids" or k in _GENERATED:
                continue
            if k != "attention_mask" and np.ndim(v) == 1 and len(v) == n and np.asarray(v).dtype.kind in "iufb":
                cols.append(k)
            else:
                dropped.append(k)
        if dropped:
            logger.info("pack_dataset (streaming): dropping columns %s (not per-token)", dropped)
        return cols

    def rows(self) -> Iterator[dict[str, Any]]:
        cols: list[str] | None = None
        buf: dict[str, list[np.ndarray]] = {}
        n_seen = 0
        warned = False
        for i, ex in enumerate(self.source):
            if cols is None:
                cols = self._columns(ex)
                buf = {c: [] for c in cols}
            ids = np.asarray(ex["input_ids"])
            n = ids.shape[0]
            if ids.ndim != 1 or (n and ids.dtype.kind not in "iu"):
                raise ValueError(f"example {i}: input_ids must be a 1-D list of integers, got dtype {ids.dtype}")
            mask = ex.get("attention_mask")
            if mask is not None and not np.all(np.asarray(mask)):
                raise ValueError(f"example {i}: attention_mask contains zeros; tokenize without padding")
            before = self.stats.tokens_dropped
            _length_checks(np.array([n]), self.max_length, self.overflow, self.on_empty, self.stats, offset=i)
            if self.stats.tokens_dropped > before and not warned:
                logger.warning(
                    "pack_dataset (streaming): example %d has %d tokens > max_length=%d; truncating (the total "
                    "is counted in PackingStats.tokens_dropped)",
                    i,
                    n,
                    self.max_length,
                )
                warned = True
            if n == 0:
                continue
            for c in cols:
                if c not in ex:
                    raise ValueError(f"example {i} lacks the per-token column {c!r} that example 0 has")
                v = np.asarray(ex[c])
                if v.shape != (n,):
                    raise ValueError(
                        f"example {i}: per-token column {c!r} has shape {v.shape} but input_ids has {n} tokens"
                    )
                buf[c].append(v)
            n_seen += 1
            if n_seen >= self.buffer_size:
                yield from self._flush(buf, final=False)
                n_seen = len(buf["input_ids"])
        if cols is not None and buf["input_ids"]:
            yield from self._flush(buf, final=True)
        if self.stats.tokens_dropped:
            logger.warning(
                "pack_dataset (streaming): %d examples truncated, %d tokens dropped",
                self.stats.examples_truncated,
                self.stats.tokens_dropped,
            )

    def _flush(self, buf: dict[str, list[np.ndarray]], final: bool) -> Iterator[dict[str, Any]]:
        lengths = np.fromiter((a.shape[0] for a in buf["input_ids"]), dtype=np.int64, count=len(buf["input_ids"]))
        flat = {c: np.concatenate(v) for c, v in buf.items()}  # [sum n]
        plan = _plan(lengths, self.max_length, self.strategy, self.overflow)
        n_rows = plan.row_ntok.shape[0]
        hold = -1
        if not final and n_rows > 1:
            hold = int(np.argmin(plan.row_ntok))  # least filled row: its sequences wait for the next round
        tok_off = np.zeros(n_rows + 1, dtype=np.int64)
        np.cumsum(plan.row_ntok, out=tok_off[1:])
        seq_off = np.zeros(n_rows + 1, dtype=np.int64)
        np.cumsum(plan.row_nseq, out=seq_off[1:])
        seq_start = _exclusive_cumsum(plan.seq_lengths)  # [S] offset of every output sequence
        for c in buf:
            buf[c] = []
        for r in range(n_rows):
            lo, hi = int(tok_off[r]), int(tok_off[r + 1])
            src = plan.src[lo:hi]  # [n_r]
            lens = plan.seq_lengths[seq_off[r] : seq_off[r + 1]]
            if r == hold:
                for s, length in zip(seq_start[seq_off[r] : seq_off[r + 1]], lens):
                    piece = plan.src[s : s + length]
                    for c in buf:
                        buf[c].append(flat[c][piece])
                continue
            row = {c: flat[c][src].tolist() for c in flat}
            row["seq_lengths"] = lens.tolist()
            if self.emit_position_ids:
                row["position_ids"] = (
                    np.arange(hi - lo) - np.repeat(seq_start[seq_off[r] : seq_off[r + 1]] - lo, lens)
                ).tolist()
            self.stats.rows += 1
            self.stats.sequences += int(lens.shape[0])
            self.stats.tokens += hi - lo
            yield row
