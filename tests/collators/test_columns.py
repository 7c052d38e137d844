"""No column is lost silently: pack_dataset packs it or raises naming the column and the first bad row; clear errors
for bad values (None tokens, uint64 >= 2**63, ragged lists) in pack_dataset and the collator."""

from __future__ import annotations

import datasets
import numpy as np
import pyarrow as pa
import pytest
import torch

from safepad.collators import DataCollatorForPackedSSM, pack_dataset

D = datasets.Dataset.from_dict


def _pack(ds, *args, **kw):
    out = pack_dataset(ds, *args, **kw)
    return out if isinstance(out, datasets.Dataset) else list(out)  # a stream packs when it is read


def _param_both(cases):
    """Each dataset as a Dataset and as a stream (pack_dataset has one path for each)."""
    return [
        pytest.param(ds if not stream else ds.to_iterable_dataset(), match, id=f"{cid}-{'stream' if stream else 'ds'}")
        for cid, ds, match in cases
        for stream in (False, True)
    ]


BAD_COLUMNS = [
    ("labels-length", D({"input_ids": [[1, 2, 3], [4, 5, 6, 7]], "labels": [[-100, -100, 3], [-100, -100, 6]]}),
     r"'labels'.* (row|example) 1 .*3|example 1: per-token column 'labels' has shape \(3,\) but input_ids has 4"),
    ("labels-of-empty-example", D({"input_ids": [[1, 2], [], [3]], "labels": [[1, 2], [7], [3]]}),
     r"'labels'.*1|example 1.*'labels'"),
    ("string-column", D({"input_ids": [[1, 2], [3]], "text": ["a", "b"]}),
     r"cannot keep column 'text'.*remove_columns\(\['text'\]\)"),
    ("scalar-column", D({"input_ids": [[1, 2], [3]], "score": [0.5, 0.25]}), r"cannot keep column 'score'"),
    ("already-packed", D({"input_ids": [[1, 2, 3]], "seq_lengths": [[2, 1]]}), "looks packed already"),
    ("position_ids-restarting", D({"input_ids": [[1, 2, 3]], "position_ids": [[0, 1, 0]]}),
     r"position_ids'? does not count 0, 1, \.\.\., n-1"),
    ("none-token", D({"input_ids": [[1, 2], [3, None, 4]]}), r"(row|example) 1.*None token|None token.*row 1"),
    ("none-label", D({"input_ids": [[1, 2], [3, 5, 4]], "labels": [[1, 2], [3, None, 4]]}),
     r"'labels'.*(row 1 holds a None token|None token)|example 1: column 'labels'.*None token"),
]  # fmt: skip


@pytest.mark.parametrize("ds, match", _param_both(BAD_COLUMNS))
def test_a_column_that_cannot_be_packed_raises(ds, match):
    with pytest.raises(ValueError, match=match):
        _pack(ds, 8)


def test_ambiguous_numeric_column_raises_and_can_be_named():
    ds = D({"input_ids": [[1, 2, 3], [4, 5, 6, 7]], "w": [[1.0, 2.0, 3.0], [4.0, 5.0]]})
    with pytest.raises(ValueError, match=r"column 'w' has the length of input_ids in some rows but not in row 1"):
        pack_dataset(ds, 8)
    with pytest.raises(ValueError, match=r"per-token column 'w': row 1 has 2 entries but input_ids has 4"):
        pack_dataset(ds, 8, per_token_columns=["w"])
    packed = pack_dataset(ds, 8, per_example_columns=["w"])
    assert packed["w"] == [[4.0, 5.0, 1.0, 2.0, 3.0]]  # in the row's sequence order (BFD: longest first)
    assert packed["seq_lengths"] == [[4, 3]]


def test_per_token_and_per_example_columns_are_packed_in_order():
    ds = D({
        "input_ids": [[1, 2, 3], [4, 5, 6, 7], [8]],
        "labels": [[-100, 2, 3], [-100, -100, 6, 7], [8]],  # completion-only masks survive
        "weights": [[0.5, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0], [1.0]],
        "emb": [[[1.0, 1.0]], [[2.0, 2.0], [3.0, 3.0]], None],  # array-valued per-example column
    })  # fmt: skip
    packed = pack_dataset(ds, 8)
    assert packed["seq_lengths"] == [[4, 3, 1]]
    assert packed["labels"] == [[-100, -100, 6, 7, -100, 2, 3, 8]]
    assert packed["weights"] == [[0.0, 0.0, 1.0, 1.0, 0.5, 1.0, 1.0, 1.0]]
    assert packed["emb"] == [[[2.0, 2.0], [3.0, 3.0], [1.0, 1.0]]]
    stream = list(pack_dataset(ds.to_iterable_dataset(), 8))
    assert [r["seq_lengths"] for r in stream] == packed["seq_lengths"]
    for c in ("labels", "weights", "emb"):
        assert [r[c] for r in stream] == packed[c], c
    batch = DataCollatorForPackedSSM()(list(packed))
    assert batch["labels"][0].tolist() == [-100, -100, 6, 7, -100, 2, 3, -100]  # + -100 at each start
    assert batch["weights"].dtype == torch.float32 and batch["emb"].shape == (3, 2)


def test_empty_typed_dataset_gives_an_empty_result():
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int64")),
                                  "labels": datasets.Sequence(datasets.Value("int64"))})  # fmt: skip
    ds = datasets.Dataset.from_dict({"input_ids": [], "labels": []}, features=features)
    packed, stats = pack_dataset(ds, 8, return_stats=True)
    assert len(packed) == 0 and set(packed.column_names) == {"input_ids", "labels", "seq_lengths", "position_ids"}
    assert (stats.rows, stats.tokens, stats.examples) == (0, 0, 0)
    assert len(pack_dataset(D({"input_ids": [[], []]}), 8)) == 0  # only empty examples (skipped, counted)


def test_uint64_ids_beyond_int64_raise():
    big = 2**63 + 5
    ds = datasets.Dataset(pa.table({"input_ids": pa.array([[1, 2], [big, 3]], type=pa.list_(pa.uint64()))}))
    with pytest.raises(ValueError, match=r"'input_ids': row 1 holds a uint64 value >= 2\*\*63"):
        pack_dataset(ds, 8)
    with pytest.raises(ValueError, match=r"example 1: column 'input_ids' holds a uint64 value >= 2\*\*63"):
        list(pack_dataset(ds.to_iterable_dataset(), 8))
    collator = DataCollatorForPackedSSM()
    for ids in (np.array([big, 3], dtype=np.uint64), torch.from_numpy(np.array([big, 3], dtype=np.uint64)), [big, 3]):
        with pytest.raises(ValueError, match=r"feature 0: 'input_ids' holds the unsigned value \d+ >= 2\*\*63"):
            collator([{"input_ids": ids}])
    ok = collator([{"input_ids": np.array([2**63 - 1, 3], dtype=np.uint64)}])  # the largest int64 fits
    assert ok["input_ids"][0, 0].item() == 2**63 - 1


def test_ragged_ids_name_the_feature():
    with pytest.raises(ValueError, match=r"feature 1: 'input_ids' is a ragged nested list"):
        DataCollatorForPackedSSM()([{"input_ids": [1, 2]}, {"input_ids": [[1, 2], [3]]}])
    with pytest.raises(ValueError, match=r"feature 0: 'pixel_values' is a ragged nested list"):
        DataCollatorForPackedSSM()([{"input_ids": [1, 2], "pixel_values": [[0.5, 0.5], [0.5]]}])
    rows = [{"input_ids": [1, 2]}, {"input_ids": [[1], [2, 3]]}]
    stream = datasets.IterableDataset.from_generator(lambda: iter(rows))
    with pytest.raises(ValueError, match=r"example 1: column 'input_ids' is a ragged nested list"):
        list(pack_dataset(stream, 8))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        pytest.param({"pad_to_multiple_of": 10**9}, r"pad_to_multiple_of=1000000000 exceeds", id="huge"),
        pytest.param({"pad_to_multiple_of": 128, "max_tokens": 64}, r"pad_to_multiple_of=128 > max_tokens=64",
                     id="above-max_tokens"),
        pytest.param({"pad_to_multiple_of": True}, "positive int", id="bool"),
    ],
)  # fmt: skip
def test_pad_to_multiple_of_is_bounded(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DataCollatorForPackedSSM(**kwargs)


def test_python_float_fields_become_float32_arrays_keep_their_dtype():
    collator = DataCollatorForPackedSSM()
    out = collator([{"input_ids": [1, 2], "w": [0.5, 0.25], "feat": [[0.5, 1.5]]}])
    assert out["w"].dtype == torch.float32 and out["feat"].dtype == torch.float32
    out = collator([{"input_ids": [1, 2], "feat": np.zeros((1, 2), dtype=np.float64)}])
    assert out["feat"].dtype == torch.float64  # an explicit float64 array is the user's choice (as in transformers)


def test_stream_whose_first_example_has_no_media():
    rows = [
        {"input_ids": [1, 2, 3], "pixel_values": None, "image_grid_hw": []},
        {"input_ids": [4, 5], "pixel_values": [[0.5, 0.25]], "image_grid_hw": [[1, 1]]},
        {"input_ids": [6], "pixel_values": [[1.5, 2.5], [3.5, 4.5]], "image_grid_hw": [[1, 2]]},
    ]
    stream = datasets.IterableDataset.from_generator(lambda: iter(rows))
    packed = list(pack_dataset(stream, 8))
    assert [r["seq_lengths"] for r in packed] == [[3, 2, 1]]
    assert packed[0]["pixel_values"] == [[0.5, 0.25], [1.5, 2.5], [3.5, 4.5]]
    assert packed[0]["image_grid_hw"] == [[1, 1], [1, 2]]
    batch = DataCollatorForPackedSSM()(packed)
    assert batch["pixel_values"].dtype == torch.float32 and batch["image_grid_hw"].tolist() == [[1, 1], [1, 2]]
    bad = rows + [{"input_ids": [7], "pixel_values": "img.png", "image_grid_hw": []}]
    with pytest.raises(ValueError, match=r"cannot keep column 'pixel_values'.*example 3"):
        list(pack_dataset(datasets.IterableDataset.from_generator(lambda: iter(bad)), 8))


def test_string_lists_pass_through_the_collator():
    out = DataCollatorForPackedSSM()([{"input_ids": [1, 2], "tags": ["a", "b"]}, {"input_ids": [3], "tags": ["c"]}])
    assert out["tags"] == [["a", "b"], ["c"]]


def _media_follow_their_sequences(rows, emb) -> None:
    for row in rows:
        off, expected = 0, []
        for n in row["seq_lengths"]:
            expected += emb[row["input_ids"][off] // 100] or []  # token // 100 = example index
            off += n
        assert row["emb"] == expected


@pytest.mark.parametrize("batch_size", [pytest.param(1, id="batch-1"), pytest.param(7, id="batch-7"),
                                        pytest.param(1000, id="one-batch")])  # fmt: skip
def test_per_example_values_follow_their_sequences(batch_size):
    """Shuffled dataset (an indices mapping), map batches that slice the Arrow arrays, None / [] values."""
    rng = np.random.default_rng(0)
    n = 57
    ids = [list(range(100 * i, 100 * i + int(length))) for i, length in enumerate(rng.integers(0, 9, n))]
    emb = [None if rng.random() < 0.3 else [[float(i), float(k)] for k in range(rng.integers(0, 3))] for i in range(n)]
    ds = datasets.Dataset.from_dict({"input_ids": ids, "emb": emb}).shuffle(seed=1)
    _media_follow_their_sequences(pack_dataset(ds, 10, batch_size=batch_size), emb)
    _media_follow_their_sequences(list(pack_dataset(ds.to_iterable_dataset(num_shards=2), 10, buffer_size=5)), emb)


def test_array2d_feature_is_carried():
    """datasets' Array2D (an Arrow extension type), as a processor's map often writes pixel_values."""
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int64")),
                                  "pv": datasets.Array2D(shape=(None, 3), dtype="float32")})  # fmt: skip
    ds = D({"input_ids": [[1, 2], [3]], "pv": [[[1, 2, 3]], [[4, 5, 6], [7, 8, 9]]]}, features=features)
    packed = pack_dataset(ds, 8)
    assert packed["pv"] == [[[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]]
    assert DataCollatorForPackedSSM()(list(packed))["pv"].dtype == torch.float32
