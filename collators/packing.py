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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .flatten import PER_TOKEN_KEYS, _python_ints_beyond_int64

__all__ = ["PackingStats", "bfd_assign", "pack_dataset", "packing_stats"]

logger = logging.getLogger(__name__)

Strategy = Literal["bfd", "wrapped"]
Overflow = Literal["split", "truncate", "error"]

# Columns pack_dataset writes itself. An input ``position_ids`` must count 0..n-1 in every example (it is then
# regenerated); an input ``seq_lengths`` means the dataset is packed already and raises.
_GENERATED = ("seq_lengths", "position_ids")
# Names that are per-token whatever their content: a length that differs from input_ids raises.
_PER_TOKEN_NAMES = frozenset(PER_TOKEN_KEYS - {"attention_mask", "position_ids"})
_INT64_MAX = np.iinfo(np.int64).max


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
        # [T] flat input index of every output token (int32 when it fits: half the memory to fill)
        src = _ranges(out_start, out_len, np.int32 if lengths.sum() < 2**31 else np.int64)
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


def _seq_examples(plan: _Plan, lengths: np.ndarray) -> np.ndarray:
    """``[S]`` index of the example (of ``lengths`` ``[n]``) that every output sequence of ``plan`` comes from."""
    if plan.seq_lengths.shape[0] == 0:
        return np.zeros(0, dtype=np.int64)
    first = plan.src[_exclusive_cumsum(plan.seq_lengths)]  # [S] flat index of every sequence's first token
    # side="right": among examples starting at the same offset (empty ones), the last is the non-empty one
    return np.searchsorted(_exclusive_cumsum(lengths), first, side="right") - 1


def _list_array(offsets: np.ndarray, values: pa.Array, large: bool = False) -> pa.Array:
    cls = pa.LargeListArray if large else pa.ListArray
    return cls.from_arrays(pa.array(offsets, type=pa.int64() if large else pa.int32()), values)


def _build_table(
    plan: _Plan,
    columns: Mapping[str, pa.Array],
    large: Mapping[str, bool],
    emit_position_ids: bool,
    example_columns: Mapping[str, pa.Array] | None = None,
    lengths: np.ndarray | None = None,
) -> pa.Table:
    """Gather every packed column from its flat values; add ``seq_lengths`` (and ``position_ids``).

    ``example_columns`` (list arrays ``[n]``, one entry per example of ``lengths`` ``[n]``) are carried per
    row: a row's value is the concatenation along dim 0 of its sequences' values, in the row's order.
    """
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
    if example_columns:
        seq_ex = _seq_examples(plan, lengths)  # [S]
        for name, col in example_columns.items():
            out[name] = _concat_per_row(col, seq_ex, seq_off)
    return pa.table(out)


def _concat_per_row(col: pa.Array, seq_ex: np.ndarray, seq_off: np.ndarray) -> pa.Array:
    """Row r = concatenation (dim 0) of ``col[seq_ex[j]]`` for the sequences j of row r (``seq_off`` ``[R + 1]``)."""
    col = _as_list_array(col)
    n_el = pc.fill_null(pc.list_value_length(col), 0).to_numpy(zero_copy_only=False).astype(np.int64)  # [n]
    offs = np.asarray(col.offsets, dtype=np.int64)  # [n + 1], absolute in the child of a sliced array
    el_len, el_start = n_el[seq_ex], offs[:-1][seq_ex] - offs[0]  # [S]
    keep = el_len > 0
    child = _ranges(el_start[keep], el_len[keep]) if keep.any() else np.zeros(0, dtype=np.int64)  # [E]
    row_off = np.concatenate([[0], np.cumsum(el_len)])[seq_off]  # [R + 1] element offsets of every row
    return _list_array(row_off, pc.take(col.flatten(), pa.array(child)), pa.types.is_large_list(col.type))


def _pack_arrow_batch(
    batch: pa.Table,
    *,
    max_length: int,
    strategy: str,
    overflow: str,
    token_columns: tuple[str, ...],
    emit_position_ids: bool,
    example_columns: tuple[str, ...] = (),
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
    per_example = {name: _storage(batch.column(name).combine_chunks()) for name in example_columns}
    return _build_table(plan, cols, large, emit_position_ids, per_example, lengths)


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


def _storage(arr: Any) -> Any:
    """The storage array of an extension array (datasets' ``Array2D`` ...); other arrays as they are."""
    return arr.storage if isinstance(arr.type, pa.ExtensionType) else arr


def _storage_type(t: pa.DataType) -> pa.DataType:
    return t.storage_type if isinstance(t, pa.ExtensionType) else t


def _as_list_array(arr: pa.Array) -> pa.Array:
    if pa.types.is_fixed_size_list(arr.type):
        return arr.cast(pa.list_(arr.type.value_type))
    return arr


def _is_array_type(t: pa.DataType) -> bool:
    """A (nested) list of numbers: an array-valued per-example column such as ``pixel_values``."""
    t = _storage_type(t)
    if not (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)):
        return False
    while pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        t = _storage_type(t.value_type)
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def _first_row_with_null_value(col: pa.Array) -> int | None:
    """Row of the first null element inside the lists of ``col`` (None when there is none)."""
    flat = col.flatten()
    if flat.null_count == 0:
        return None
    parents = pc.list_parent_indices(col).to_numpy(zero_copy_only=False)  # [E] row of every element
    return int(parents[np.flatnonzero(~flat.is_valid().to_numpy(zero_copy_only=False))[0]])


def _check_token_values(name: str, col: pa.Array) -> None:
    """Raise on a ``None`` token and on unsigned ids that do not fit int64 (the collator emits int64)."""
    row = _first_row_with_null_value(col)
    if row is not None:
        raise ValueError(
            f"column {name!r}: row {row} holds a None token; every token must be a number (fix or filter that row)"
        )
    if pa.types.is_uint64(col.type.value_type) and len(col.flatten()):
        too_big = pc.greater(col.flatten(), pa.scalar(_INT64_MAX, pa.uint64())).to_numpy(zero_copy_only=False)
        if too_big.any():
            parents = pc.list_parent_indices(col).to_numpy(zero_copy_only=False)
            raise ValueError(
                f"column {name!r}: row {int(parents[np.flatnonzero(too_big)[0]])} holds a uint64 value >= 2**63, "
                "which int64 ids (what the collator and every embedding take) cannot hold"
            )


def _not_packable(name: str, what: str) -> ValueError:
    return ValueError(
        f"pack_dataset cannot keep column {name!r} ({what}): a packed row holds several examples, and only "
        "per-token columns (one number per token of input_ids) and array-valued per-example columns (such as "
        f"pixel_values, image_grid_hw) can be packed. Remove it first: dataset.remove_columns([{name!r}]) "
        "(or name it in per_token_columns= / per_example_columns=)"
    )


def _check_column_lists(per_token: Any, per_example: Any) -> tuple[frozenset[str], frozenset[str]]:
    out = []
    for label, names in (("per_token_columns", per_token), ("per_example_columns", per_example)):
        if isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"{label} must be a list of column names, got {names!r}")
        out.append(frozenset(names))
    both = out[0] & out[1]
    reserved = (out[0] | out[1]) & {"input_ids", "attention_mask", *_GENERATED}
    if both:
        raise ValueError(f"columns {sorted(both)} are listed both in per_token_columns and per_example_columns")
    if reserved:
        raise ValueError(f"columns {sorted(reserved)} are handled by pack_dataset itself; do not list them")
    if out[1] & _PER_TOKEN_NAMES:
        raise ValueError(f"columns {sorted(out[1] & _PER_TOKEN_NAMES)} are always per-token")
    return out[0], out[1]


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
    per_token_columns: Sequence[str] = (),
    per_example_columns: Sequence[str] = (),
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

        per_token_columns: columns to pack as per-token even if their name is not a known one; each row
            must then have the length of ``input_ids``.
        per_example_columns: list-of-number columns to carry per example even when some rows happen to
            have the length of ``input_ids`` (name them in the collator's ``per_example_keys`` too, so that a
            packed value that happens to have the row's length is not taken for a per-token field).

    Columns (none is dropped silently):

    * per-token: ``input_ids``, the known per-token names (``labels``, ``token_type_ids``,
      ``completion_mask``, ...; see ``collators.PER_TOKEN_KEYS``), ``per_token_columns`` and any list column of
      numbers with the length of ``input_ids`` in every row. They are concatenated like ``input_ids``. A
      known per-token column whose length differs in one row raises, naming the column and the row.
    * per-example: array-valued columns (a list of numbers per example, nested or not, e.g. ``pixel_values``
      ``[patches_i, C*p*p]``, ``image_grid_hw`` ``[n_i, 2]``) and ``per_example_columns``. A packed row holds
      their concatenation along dim 0 in the row's sequence order, which is what the collator and a VLM
      expect (``None`` / ``[]`` = no value). An example that holds a value is never cut: a longer one
      than ``max_length``, or ``strategy="wrapped"``, raises.
    * ``attention_mask`` must be all ones (packing padded examples would pack the pads) and ``position_ids``
      must count 0..n-1; both are then dropped (``position_ids`` is regenerated). A ``seq_lengths`` column
      (an already packed dataset) raises.
    * anything else (strings, scalars) raises, naming the column: remove it first
      (``dataset.remove_columns([...])``).

    ``None`` tokens and uint64 ids >= 2**63 raise, naming the column and the row.

    Returns:
        The packed dataset (same type as ``dataset``), with columns ``input_ids``, the per-token
        columns, the per-example columns, ``seq_lengths`` and (by default) ``position_ids``. An empty
        dataset gives an empty one with these columns.
    """
    _check_args(max_length, strategy, overflow, on_empty)
    max_length = int(max_length)
    per_token_columns, per_example_columns = _check_column_lists(per_token_columns, per_example_columns)
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
                per_token_columns=per_token_columns,
                per_example_columns=per_example_columns,
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
            per_token_columns=per_token_columns,
            per_example_columns=per_example_columns,
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
    if not (pa.types.is_list(ids_type) or pa.types.is_large_list(ids_type)) or not (
        pa.types.is_integer(ids_type.value_type) or pa.types.is_null(ids_type.value_type)  # null: every list empty
    ):
        raise ValueError(f"column 'input_ids' must be a list of integers, got arrow type {ids_type}")
    table = arrow[:]  # zero-copy for a plain Dataset; applies the indices mapping of a shuffled/selected one
    ids = table.column("input_ids")
    lengths = pc.fill_null(pc.list_value_length(ids), 0).to_numpy(zero_copy_only=False).astype(np.int64)  # [n]
    stats = PackingStats(max_length=max_length)
    _length_checks(lengths, max_length, overflow, on_empty, stats)

    token_columns, example_columns = _classify_columns(
        dataset, table, lengths, max_length, strategy, overflow, per_token_columns, per_example_columns
    )
    if stats.tokens_dropped:
        logger.warning(
            "pack_dataset: %d examples longer than max_length=%d were truncated; %d tokens dropped",
            stats.examples_truncated,
            max_length,
            stats.tokens_dropped,
        )

    if len(table) == 0:  # Dataset.map never calls the function: build the (empty) packed table directly
        empty = _pack_arrow_batch(
            table,
            max_length=max_length,
            strategy=strategy,
            overflow=overflow,
            token_columns=tuple(token_columns),
            emit_position_ids=emit_position_ids,
            example_columns=tuple(example_columns),
        )
        packed = datasets.Dataset(empty)
        fmt = dataset.format
        packed = packed.with_format(fmt["type"], **(fmt.get("format_kwargs") or {}))
        return (packed, stats) if return_stats else packed

    fn_kwargs = {
        "max_length": max_length,
        "strategy": strategy,
        "overflow": overflow,
        "token_columns": tuple(token_columns),
        "emit_position_ids": emit_position_ids,
        "example_columns": tuple(example_columns),
    }
    if not dataset.cache_files and num_proc is None and not map_kwargs:
        # An in-memory dataset: Dataset.map would pack the same batches and keep the result in memory too, but
        # only after writing every packed batch into an in-memory Arrow stream and reading it back (most of the
        # time on a large dataset). Build that table directly.
        batches = [_pack_arrow_batch(table.slice(i, batch_size), **fn_kwargs) for i in range(0, len(table), batch_size)]
        from datasets.fingerprint import Hasher  # a fingerprint like map's: hashing the packed table takes longer

        fingerprint = Hasher.hash(["safepad.pack_dataset", dataset._fingerprint, batch_size, fn_kwargs])
        packed = datasets.Dataset(pa.concat_tables(batches), split=dataset.split, fingerprint=fingerprint)
    else:
        packed = _map_pack(arrow, dataset, batch_size, num_proc, map_kwargs, fn_kwargs, strategy, max_length)
    fmt = dataset.format
    packed = packed.with_format(fmt["type"], **(fmt.get("format_kwargs") or {}))
    out_stats = packing_stats(packed, max_length)
    stats.rows, stats.sequences, stats.tokens = out_stats.rows, out_stats.sequences, out_stats.tokens
    return (packed, stats) if return_stats else packed


def _map_pack(
    arrow: Any,
    dataset: Any,
    batch_size: int,
    num_proc: int | None,
    map_kwargs: dict[str, Any] | None,
    fn_kwargs: dict[str, Any],
    strategy: str,
    max_length: int,
) -> Any:
    """``Dataset.map`` over :func:`_pack_arrow_batch` (a dataset on disk, ``num_proc`` or ``map_kwargs``)."""
    kwargs = dict(map_kwargs or {})
    kwargs.setdefault("desc", f"Packing ({strategy}, max_length={max_length})")
    return arrow.map(
        _pack_arrow_batch,
        batched=True,
        batch_size=batch_size,
        num_proc=num_proc,
        remove_columns=dataset.column_names,
        fn_kwargs=fn_kwargs,
        **kwargs,
    )


def _classify_columns(
    dataset: Any,
    table: pa.Table,
    lengths: np.ndarray,
    max_length: int,
    strategy: str,
    overflow: str,
    per_token_columns: frozenset[str],
    per_example_columns: frozenset[str],
) -> tuple[list[str], list[str]]:
    """Sort the columns of ``dataset`` into per-token and per-example ones; raise on anything else.

    No column is dropped silently: ``attention_mask`` (all ones) and ``position_ids`` (0..n-1) are dropped
    because they hold nothing a packed row does not regenerate; every other column is packed or raises.
    """
    _check_token_values("input_ids", table.column("input_ids").combine_chunks())
    token_columns, example_columns = ["input_ids"], []
    real = lengths > 0  # [n] empty examples are skipped: their other columns do not matter
    for name in dataset.column_names:
        if name == "input_ids":
            continue
        if name == "seq_lengths":
            raise ValueError(
                "dataset already has a 'seq_lengths' column: it looks packed already, and packing it again would "
                "merge its sequences; pack the unpacked examples, or remove the column"
            )
        t = _storage_type(dataset.features.arrow_schema.field(name).type)
        col = _storage(table.column(name).combine_chunks())
        n_el = (
            pc.fill_null(pc.list_value_length(col), 0).to_numpy(zero_copy_only=False).astype(np.int64)
            if pa.types.is_list(t) or pa.types.is_large_list(t)
            else None
        )  # [n] list lengths

        def first_mismatch() -> int:
            return int(np.flatnonzero(n_el != lengths)[0])

        is_tok = _is_token_list_type(t)
        matches = is_tok and bool(np.array_equal(n_el, lengths))  # every row, empty examples too
        if name in ("attention_mask", "position_ids"):
            if not matches:
                i = first_mismatch() if is_tok else 0
                raise ValueError(
                    f"column {name!r} must hold one number per token of input_ids; row {i} does not "
                    f"(input_ids has {int(lengths[i]) if len(lengths) else 0} tokens)"
                )
            _check_token_values(name, col)
            flat = pc.list_flatten(pc.filter(col, pa.array(real)))
            if name == "attention_mask":
                if not bool(pc.all(pc.cast(flat, pa.bool_())).as_py() in (True, None)):
                    raise ValueError(
                        "column 'attention_mask' contains zeros: the examples are padded; tokenize without padding "
                        "before packing"
                    )
            elif not np.array_equal(
                flat.to_numpy(zero_copy_only=False), _ranges(np.zeros_like(lengths[real]), lengths[real])
            ):
                raise ValueError(
                    "column 'position_ids' does not count 0, 1, ..., n-1 in every example (are the examples packed "
                    "already?); pack_dataset writes its own position_ids: remove the column, or pack unpacked examples"
                )
            continue
        if name in per_example_columns:
            if not _is_array_type(t):
                raise _not_packable(name, f"per_example_columns needs a list of numbers per example, got {t}")
            example_columns.append(name)
        elif name in per_token_columns or name in _PER_TOKEN_NAMES:
            if not is_tok:
                raise ValueError(f"per-token column {name!r} must be a list of numbers per example, got arrow type {t}")
            if not matches:
                i = first_mismatch()
                raise ValueError(
                    f"per-token column {name!r}: row {i} has {int(n_el[i])} entries but input_ids has "
                    f"{int(lengths[i])} tokens; every per-token column must have the length of input_ids in every "
                    "row (fix that row; packing without it would lose the column)"
                )
            _check_token_values(name, col)
            token_columns.append(name)
        elif matches:
            _check_token_values(name, col)
            token_columns.append(name)
        elif is_tok and bool((n_el[real] == lengths[real]).any()):
            i = first_mismatch()
            raise ValueError(
                f"column {name!r} has the length of input_ids in some rows but not in row {i} ({int(n_el[i])} "
                f"entries, {int(lengths[i])} tokens): per-token or per-example? Name it in per_token_columns= "
                "(then every row must match) or per_example_columns="
            )
        elif _is_array_type(t):
            example_columns.append(name)
        else:
            raise _not_packable(name, f"arrow type {t}")
    if example_columns:
        _check_uncut(table, lengths, max_length, strategy, overflow, example_columns)
    return token_columns, example_columns


def _check_uncut(
    table: Any, lengths: np.ndarray, max_length: int, strategy: str, overflow: str, example_columns: list[str]
) -> None:
    """A per-example value must stay with its whole example: raise when an example holding one would be cut."""
    for name in example_columns:
        col = _as_list_array(_storage(table.column(name).combine_chunks()))
        has = (pc.fill_null(pc.list_value_length(col), 0).to_numpy(zero_copy_only=False) > 0) & (lengths > 0)  # [n]
        if strategy == "wrapped" and has.any():
            raise ValueError(
                f"strategy='wrapped' cuts examples at every row end, which would separate per-example column "
                f"{name!r} (example {int(np.flatnonzero(has)[0])}) from its tokens; use strategy='bfd'"
            )
        cut = has & (lengths > max_length)
        if cut.any():
            i = int(np.flatnonzero(cut)[0])
            raise ValueError(
                f"example {i} has {int(lengths[i])} tokens > max_length={max_length} and a value in per-example "
                f"column {name!r}: overflow={overflow!r} would cut it and separate that value from its tokens; raise "
                "max_length or filter the long examples out"
            )


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
    per_token_columns: frozenset[str] = frozenset(),
    per_example_columns: frozenset[str] = frozenset(),
) -> Any:
    import datasets

    if not isinstance(buffer_size, int) or buffer_size < 1:
        raise ValueError(f"buffer_size must be a positive int, got {buffer_size!r}")
    stats = PackingStats(max_length=max_length)
    packer = _StreamPacker(
        dataset,
        max_length,
        strategy,
        overflow,
        on_empty,
        emit_position_ids,
        buffer_size,
        stats,
        per_token_columns,
        per_example_columns,
    )
    packed = datasets.IterableDataset.from_generator(packer.rows)
    return (packed, stats) if return_stats else packed


def _stream_array(value: Any, key: str, index: int) -> np.ndarray:
    """``value`` of example ``index`` as numpy, with errors that name the column (ragged lists)."""
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu().numpy()
    try:
        return np.asarray(value)
    except ValueError as e:
        raise ValueError(f"example {index}: column {key!r} is a ragged nested list, not an array: {e}") from e


def _check_stream_tokens(arr: np.ndarray, key: str, index: int, n: int, integer: bool) -> None:
    if arr.shape != (n,):
        raise ValueError(
            f"example {index}: per-token column {key!r} has shape {arr.shape} but input_ids has {n} tokens; every "
            "per-token column must have the length of input_ids (fix that example; packing without it would lose it)"
        )
    if n and arr.dtype.kind not in ("iu" if integer else "iufb"):
        what = "a None token" if arr.dtype == object and any(v is None for v in arr.tolist()) else f"dtype {arr.dtype}"
        kind = "integers" if integer else "numbers"
        raise ValueError(f"example {index}: column {key!r} must hold {kind}, got {what}")
    if arr.dtype.kind == "u" and n and arr.max() > _INT64_MAX:
        raise ValueError(f"example {index}: column {key!r} holds a uint64 value >= 2**63, which int64 cannot hold")


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
        per_token_columns: frozenset[str] = frozenset(),
        per_example_columns: frozenset[str] = frozenset(),
    ) -> None:
        self.source = source
        self.max_length = max_length
        self.strategy = strategy
        self.overflow = overflow
        self.on_empty = on_empty
        self.emit_position_ids = emit_position_ids
        self.buffer_size = buffer_size
        self.stats = stats
        self.per_token_columns = per_token_columns
        self.per_example_columns = per_example_columns

    def _columns(self, example: Mapping[str, Any]) -> tuple[list[str], list[str]]:
        """Per-token and per-example columns, decided on example 0 (later examples are checked against it)."""
        if "input_ids" not in example:
            raise ValueError(f"example 0 has no 'input_ids' (keys: {sorted(example)}); tokenize the stream first")
        n = len(example["input_ids"])
        tokens, per_example = ["input_ids"], []
        for k, v in example.items():
            if k in ("input_ids", "attention_mask", "position_ids"):
                continue  # the last two are checked in every example, then regenerated / dropped
            if k == "seq_lengths":
                raise ValueError(
                    "the stream already has a 'seq_lengths' column: it looks packed already, and packing it again "
                    "would merge its sequences; pack the unpacked examples, or remove the column"
                )
            if k in self.per_example_columns:
                per_example.append(k)
            elif k in self.per_token_columns or k in _PER_TOKEN_NAMES:
                tokens.append(k)
            elif v is None:
                per_example.append(k)  # e.g. pixel_values of a text-only first example
            else:
                arr = _stream_array(v, k, 0)
                if arr.ndim == 1 and arr.shape[0] == n and arr.dtype.kind in "iufb":
                    tokens.append(k)
                elif arr.ndim >= 1 and (arr.dtype.kind in "iufb" or arr.size == 0):
                    per_example.append(k)
                else:
                    raise _not_packable(k, f"{type(v).__name__} of dtype {arr.dtype}")
        return tokens, per_example

    def _example_value(self, value: Any, key: str, index: int, n: int) -> list | None:
        """A per-example value as a Python list (dim 0 = its entries), or None when the example has none."""
        if value is None:
            return None
        arr = _stream_array(value, key, index)
        if arr.ndim == 0 or (arr.size and arr.dtype.kind not in "iufb"):
            raise _not_packable(key, f"example {index} holds {type(value).__name__} of dtype {arr.dtype}")
        if arr.shape[0] == 0:
            return None
        if self.strategy == "wrapped":
            raise ValueError(
                f"strategy='wrapped' cuts examples at every row end, which would separate per-example column "
                f"{key!r} (example {index}) from its tokens; use strategy='bfd'"
            )
        if n > self.max_length:
            raise ValueError(
                f"example {index} has {n} tokens > max_length={self.max_length} and a value in per-example column "
                f"{key!r}: overflow={self.overflow!r} would cut it and separate that value from its tokens; raise "
                "max_length or filter the long examples out"
            )
        return value.tolist() if hasattr(value, "tolist") else list(value)

    def rows(self) -> Iterator[dict[str, Any]]:
        cols: list[str] | None = None
        ex_cols: list[str] = []
        buf: dict[str, list[Any]] = {}
        n_seen = 0
        warned = False
        for i, ex in enumerate(self.source):
            if cols is None:
                cols, ex_cols = self._columns(ex)
                buf = {c: [] for c in (*cols, *ex_cols)}
            ids = _stream_array(ex["input_ids"], "input_ids", i)
            if _python_ints_beyond_int64(ex["input_ids"], ids):
                raise ValueError(
                    f"example {i}: column 'input_ids' holds a uint64 value >= 2**63, which int64 cannot hold"
                )
            if ids.ndim != 1:
                raise ValueError(f"example {i}: input_ids must be a 1-D list of integers, got shape {ids.shape}")
            n = ids.shape[0]
            _check_stream_tokens(ids, "input_ids", i, n, integer=True)  # None tokens, floats, uint64 overflow
            mask = ex.get("attention_mask")
            if mask is not None:
                m = _stream_array(mask, "attention_mask", i)
                _check_stream_tokens(m, "attention_mask", i, n, integer=False)
                if not np.all(m):
                    raise ValueError(f"example {i}: attention_mask contains zeros; tokenize without padding")
            pos = ex.get("position_ids")
            if pos is not None:
                p = _stream_array(pos, "position_ids", i)
                _check_stream_tokens(p, "position_ids", i, n, integer=True)
                if not np.array_equal(p, np.arange(n)):
                    raise ValueError(
                        f"example {i}: position_ids does not count 0, 1, ..., n-1 (is the stream packed already?); "
                        "pack_dataset writes its own position_ids: remove the column"
                    )
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
            if set(ex).difference(("attention_mask", "position_ids")) != {*cols, *ex_cols}:
                raise ValueError(
                    f"example {i} has columns {sorted(ex)} but example 0 has {sorted({*cols, *ex_cols})}: every "
                    "example must carry the same columns"
                )
            values = {c: self._example_value(ex[c], c, i, n) for c in ex_cols}
            token_values = {}
            for c in cols:
                v = ids if c == "input_ids" else _stream_array(ex[c], c, i)
                _check_stream_tokens(v, c, i, n, integer=c == "input_ids")
                token_values[c] = v
            if n == 0:
                continue
            for c in cols:
                buf[c].append(token_values[c])
            for c in ex_cols:
                buf[c].append(values[c])
            n_seen += 1
            if n_seen >= self.buffer_size:
                yield from self._flush(buf, cols, ex_cols, final=False)
                n_seen = len(buf["input_ids"])
        if cols is not None and buf["input_ids"]:
            yield from self._flush(buf, cols, ex_cols, final=True)
        if self.stats.tokens_dropped:
            logger.warning(
                "pack_dataset (streaming): %d examples truncated, %d tokens dropped",
                self.stats.examples_truncated,
                self.stats.tokens_dropped,
            )

    def _flush(
        self, buf: dict[str, list[Any]], cols: list[str], ex_cols: list[str], final: bool
    ) -> Iterator[dict[str, Any]]:
        lengths = np.fromiter((a.shape[0] for a in buf["input_ids"]), dtype=np.int64, count=len(buf["input_ids"]))
        flat = {c: np.concatenate(buf[c]) for c in cols}  # [sum n]
        ex_vals = {c: buf[c] for c in ex_cols}  # [entries] per-example values (list or None)
        plan = _plan(lengths, self.max_length, self.strategy, self.overflow)
        seq_ex = _seq_examples(plan, lengths)  # [S] buffer entry of every output sequence
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
            seqs = range(int(seq_off[r]), int(seq_off[r + 1]))
            lens = plan.seq_lengths[seq_off[r] : seq_off[r + 1]]
            if r == hold:
                for j in seqs:
                    s, length = int(seq_start[j]), int(plan.seq_lengths[j])
                    piece = plan.src[s : s + length]
                    for c in cols:
                        buf[c].append(flat[c][piece])
                    for c in ex_cols:  # an example with a value is never cut, so it is this whole piece
                        buf[c].append(ex_vals[c][seq_ex[j]])
                continue
            row = {c: flat[c][src].tolist() for c in flat}
            for c in ex_cols:
                row[c] = [x for j in seqs if ex_vals[c][seq_ex[j]] for x in ex_vals[c][seq_ex[j]]]
            row["seq_lengths"] = lens.tolist()
            if self.emit_position_ids:
                row["position_ids"] = (
                    np.arange(hi - lo) - np.repeat(seq_start[seq_off[r] : seq_off[r + 1]] - lo, lens)
                ).tolist()
            self.stats.rows += 1
            self.stats.sequences += int(lens.shape[0])
            self.stats.tokens += hi - lo
            yield row
