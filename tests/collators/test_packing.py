"""pack_dataset / bfd_assign: conservation, best fit, overflow policies, streaming, round trip."""

from __future__ import annotations

import logging
from collections import Counter

import datasets
import numpy as np
import pytest

from safepad.collators import DataCollatorForPackedSSM, PackingStats, bfd_assign, pack_dataset, packing_stats

datasets.disable_progress_bars()


def _reference_bfd_loads(lengths: list[int], max_length: int) -> list[int]:
    """Plain best-fit-decreasing: scan every open bin for the tightest fit. Returns sorted bin loads."""
    loads: list[int] = []
    for length in sorted(lengths, reverse=True):
        best = None
        for b, load in enumerate(loads):
            if load + length <= max_length and (best is None or load > loads[best]):
                best = b
        if best is None:
            loads.append(length)
        else:
            loads[best] += length
    return sorted(loads)


@pytest.mark.parametrize("seed", range(6))
def test_bfd_assign_matches_reference(seed):
    rng = np.random.default_rng(seed)
    max_length = int(rng.integers(8, 200))
    lengths = rng.integers(1, max_length + 1, size=int(rng.integers(1, 300)))
    order, counts = bfd_assign(lengths, max_length)
    assert sorted(order.tolist()) == list(range(lengths.shape[0]))  # every item exactly once
    loads = np.add.reduceat(lengths[order], np.concatenate([[0], np.cumsum(counts)[:-1]]))
    assert loads.max() <= max_length
    assert sorted(loads.tolist()) == _reference_bfd_loads(lengths.tolist(), max_length)


def test_bfd_assign_rejects_out_of_range():
    with pytest.raises(ValueError, match="max_length=4"):
        bfd_assign(np.array([5]), 4)


def _dataset(rng: np.random.Generator, n: int, max_len: int, *, empty: float = 0.05, extra: bool = False):
    lengths = rng.integers(1, max_len, size=n)
    lengths[rng.random(n) < empty] = 0
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    ids = [list(range(s, s + n_)) for s, n_ in zip(starts.tolist(), lengths.tolist())]  # token = global position
    data = {"input_ids": ids, "labels": [[-x for x in row] for row in ids]}
    if extra:
        data["text"] = [str(i) for i in range(n)]
    return datasets.Dataset.from_dict(data), lengths


def _sequences(packed) -> list[tuple[int, ...]]:
    rows = (
        packed[:]
        if isinstance(packed, datasets.Dataset)
        else {k: [r[k] for r in packed] for k in ("input_ids", "labels", "seq_lengths", "position_ids")}
    )
    seqs = []
    for ids, labels, lens, pos in zip(rows["input_ids"], rows["labels"], rows["seq_lengths"], rows["position_ids"]):
        assert sum(lens) == len(ids) == len(labels) == len(pos)
        off = 0
        for length in lens:
            piece = ids[off : off + length]
            assert labels[off : off + length] == [-x for x in piece]  # per-token column packed alongside
            assert pos[off : off + length] == list(range(length))
            assert piece == list(range(piece[0], piece[0] + length))  # in order within its sequence
            seqs.append(tuple(piece))
            off += length
    return seqs


def _expected_pieces(lengths: np.ndarray, max_length: int, overflow: str) -> list[tuple[int, ...]]:
    pieces, start = [], 0
    for n in lengths.tolist():
        if overflow == "split":
            pieces += [tuple(range(start + k, start + min(n, k + max_length))) for k in range(0, n, max_length)]
        elif n:
            pieces.append(tuple(range(start, start + min(n, max_length))))
        start += n
    return pieces


@pytest.mark.parametrize(
    "strategy, overflow, batch_size",
    [
        pytest.param("bfd", "split", 10_000, id="bfd-split"),
        pytest.param("bfd", "split", 37, id="bfd-split-small-batches"),
        pytest.param("bfd", "truncate", 1000, id="bfd-truncate"),
        pytest.param("wrapped", "split", 100, id="wrapped"),
    ],
)
def test_pack_dataset_conserves_tokens(strategy, overflow, batch_size, caplog):
    rng = np.random.default_rng(1)
    ds, lengths = _dataset(rng, 2000, 120)
    max_length = 64
    with caplog.at_level(logging.INFO, logger="safepad.collators.packing"):
        packed, stats = pack_dataset(
            ds, max_length, strategy=strategy, overflow=overflow, batch_size=batch_size, return_stats=True
        )
    assert set(packed.column_names) == {"input_ids", "labels", "seq_lengths", "position_ids"}
    seqs = _sequences(packed)
    if strategy == "wrapped":  # a row cut also cuts a sequence: the concatenation is the whole stream
        assert [t for s in seqs for t in s] == [t for p in _expected_pieces(lengths, max_length, overflow) for t in p]
        short = sum(len(r) < max_length for r in packed["input_ids"])
        assert short <= -(-2000 // batch_size)  # only each map batch's last row may be short
    else:
        assert Counter(seqs) == Counter(_expected_pieces(lengths, max_length, overflow))
    assert max(len(r) for r in packed["input_ids"]) <= max_length
    long = lengths > max_length
    assert stats.examples == 2000 and stats.examples_skipped == int((lengths == 0).sum())
    assert stats.tokens_dropped == (int((lengths[long] - max_length).sum()) if overflow == "truncate" else 0)
    assert stats.rows == len(packed) and stats.sequences == len(seqs)
    assert stats.tokens == sum(map(len, seqs))
    assert stats.fill_ratio == stats.tokens / (len(packed) * max_length)
    if overflow == "truncate":
        assert f"{stats.tokens_dropped} tokens dropped" in caplog.text
    again = packing_stats(packed, max_length)
    assert (again.rows, again.sequences, again.tokens) == (stats.rows, stats.sequences, stats.tokens)


def test_bfd_fills_rows():
    rng = np.random.default_rng(2)
    ds, _ = _dataset(rng, 3000, 200, empty=0.0, extra=False)
    _, stats = pack_dataset(ds, 512, return_stats=True)
    assert stats.fill_ratio > 0.98


def test_shuffled_dataset_uses_its_own_order():
    rng = np.random.default_rng(3)
    ds, lengths = _dataset(rng, 300, 50, extra=False)
    shuffled = ds.shuffle(seed=0).select(range(100))  # an indices mapping over the table
    kept = np.array([len(r) for r in shuffled["input_ids"]])
    packed, stats = pack_dataset(shuffled, 64, return_stats=True)
    assert Counter(map(len, _sequences(packed))) == Counter(kept[kept > 0].tolist())
    assert stats.examples == 100


def test_overflow_error_names_the_example():
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2], [1] * 9, [3]]})
    with pytest.raises(ValueError, match=r"example 1 has 9 tokens > max_length=8"):
        pack_dataset(ds, 8, overflow="error")


def test_on_empty_error_names_the_example():
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2], [], [3]]})
    with pytest.raises(ValueError, match=r"example 1 has empty input_ids"):
        pack_dataset(ds, 8, on_empty="error")


def test_padded_attention_mask_is_refused():
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2, 0]], "attention_mask": [[1, 1, 0]]})
    with pytest.raises(ValueError, match="attention_mask.*zeros"):
        pack_dataset(ds, 8)
    ok = datasets.Dataset.from_dict({"input_ids": [[1, 2]], "attention_mask": [[1, 1]]})
    assert "attention_mask" not in pack_dataset(ok, 8).column_names


@pytest.mark.parametrize(
    "kwargs, match",
    [
        pytest.param({"max_length": 0}, "max_length", id="max-length"),
        pytest.param({"strategy": "first_fit"}, "strategy", id="strategy"),
        pytest.param({"overflow": "drop"}, "overflow", id="overflow"),
        pytest.param({"on_empty": "keep"}, "on_empty", id="on-empty"),
    ],
)
def test_bad_arguments(kwargs, match):
    ds = datasets.Dataset.from_dict({"input_ids": [[1]]})
    with pytest.raises(ValueError, match=match):
        pack_dataset(ds, **{"max_length": 8, **kwargs})


def test_non_dataset_and_missing_column():
    with pytest.raises(ValueError, match="datasets.Dataset"):
        pack_dataset([{"input_ids": [1]}], 8)
    with pytest.raises(ValueError, match="no 'input_ids' column"):
        pack_dataset(datasets.Dataset.from_dict({"text": ["a"]}), 8)


@pytest.mark.parametrize("buffer_size", [pytest.param(7, id="small-buffer"), pytest.param(10_000, id="one-buffer")])
def test_streaming_conserves_tokens(buffer_size):
    rng = np.random.default_rng(4)
    ds, lengths = _dataset(rng, 600, 90)
    max_length = 64
    packed, stats = pack_dataset(
        ds.to_iterable_dataset(num_shards=3), max_length, buffer_size=buffer_size, return_stats=True
    )
    assert isinstance(packed, datasets.IterableDataset)
    rows = list(packed)
    seqs = _sequences(rows)
    assert Counter(seqs) == Counter(_expected_pieces(lengths, max_length, "split"))
    assert all(len(r["input_ids"]) <= max_length for r in rows)
    assert stats.rows == len(rows) and stats.examples == 600
    assert stats.examples_skipped == int((lengths == 0).sum()) and stats.sequences == len(seqs)


def test_streaming_truncate_and_error():
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2], [5] * 10, [3]]}).to_iterable_dataset()
    packed, stats = pack_dataset(ds, 4, overflow="truncate", return_stats=True)
    assert sum(len(r["input_ids"]) for r in packed) == 7 and stats.tokens_dropped == 6
    with pytest.raises(ValueError, match=r"example 1 has 10 tokens > max_length=4"):
        list(pack_dataset(ds, 4, overflow="error"))


def test_datasetdict_packs_every_split():
    rng = np.random.default_rng(5)
    dd = datasets.DatasetDict({"train": _dataset(rng, 50, 20)[0], "test": _dataset(rng, 20, 20)[0]})
    packed, stats = pack_dataset(dd, 32, return_stats=True)
    assert set(packed) == {"train", "test"} and isinstance(stats["test"], PackingStats)


def test_round_trip_through_collator():
    """features -> pack_dataset -> collator gives the same sequences as features -> collator."""
    rng = np.random.default_rng(6)
    ds, _ = _dataset(rng, 200, 40, extra=False)
    collator = DataCollatorForPackedSSM(on_empty="skip")

    def split(batch):
        cu = batch["cu_seq_lens_q"].tolist()
        ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
        return Counter((tuple(ids[a:b]), tuple(labels[a:b])) for a, b in zip(cu[:-1], cu[1:]))

    direct = split(collator(list(ds)))
    packed = pack_dataset(ds, 64)
    via_rows = Counter()
    for start in range(0, len(packed), 5):
        via_rows += split(collator([packed[i] for i in range(start, min(start + 5, len(packed)))]))
    assert via_rows == direct
    # rows without seq_lengths (as Trainer's remove_unused_columns leaves them) keep their boundaries
    no_lengths = packed.remove_columns("seq_lengths")
    assert split(collator(list(no_lengths))) == direct


def test_num_proc_gives_the_same_sequences():
    rng = np.random.default_rng(7)
    ds, lengths = _dataset(rng, 400, 90, extra=False)
    packed = pack_dataset(ds, 64, num_proc=2, batch_size=100)
    assert Counter(_sequences(packed)) == Counter(_expected_pieces(lengths, 64, "split"))
