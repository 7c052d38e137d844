"""DataCollatorForPackedSSM: conservation, layout agreement, options and input validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import DataCollatorWithFlattening

from safepad.collators import DataCollatorForPackedSSM
from safepad.layout.boundaries import (
    cu_seqlens_from_seq_idx,
    seq_idx_from_cu_seqlens,
    seq_idx_from_position_ids,
)


def _random_features(rng: np.random.Generator, n: int, *, labels: bool, packed: bool, start: int):
    """Features whose tokens are unique consecutive ints (token value = global position), so order is checkable."""
    feats, seqs = [], []
    nxt = start
    for _ in range(n):
        k = int(rng.integers(1, 4)) if packed else 1
        lens = rng.integers(1, 40, size=k)
        ids = np.arange(nxt, nxt + lens.sum())
        nxt += int(lens.sum())
        f = {"input_ids": ids.tolist() if rng.random() < 0.5 else torch.from_numpy(ids)}
        if labels:
            lab = ids.copy()
            lab[rng.random(ids.shape[0]) < 0.3] = -100  # completion-only style masks
            f["labels"] = lab.tolist()
        if packed:
            f["seq_lengths"] = lens.tolist()
        feats.append(f)
        off = 0
        for length in lens:
            seqs.append((ids[off : off + length], (lab if labels else ids)[off : off + length]))
            off += length
    return feats, seqs, nxt


def _check_layout(batch, seqs, pad_to_multiple_of, pad_token_id):
    ids = batch["input_ids"]
    T = ids.shape[1]
    assert ids.shape == (1, T) and ids.dtype == torch.int64
    assert batch["labels"].dtype == torch.int64 and batch["position_ids"].dtype == torch.int64
    assert batch["seq_idx"].dtype == torch.int32 and batch["cu_seq_lens_q"].dtype == torch.int32
    assert "attention_mask" not in batch
    cu = batch["cu_seq_lens_q"]
    assert torch.equal(cu, batch["cu_seq_lens_k"])
    lengths = [len(s[0]) for s in seqs]
    real = sum(lengths)
    pad = (-real) % pad_to_multiple_of if pad_to_multiple_of else 0
    assert T == real + pad
    expected_cu = np.cumsum([0, *lengths] + ([pad] if pad else []))
    assert cu.tolist() == expected_cu.tolist()
    assert batch["max_length_q"] == batch["max_length_k"] == max(lengths + ([pad] if pad else []))
    # the three encodings agree (cross-checked with safepad.layout helpers)
    assert torch.equal(batch["seq_idx"], seq_idx_from_cu_seqlens(cu, T))
    assert torch.equal(batch["seq_idx"], seq_idx_from_position_ids(batch["position_ids"]))
    assert torch.equal(cu_seqlens_from_seq_idx(batch["seq_idx"]), cu)
    # every token exactly once, in order within its sequence; labels masked at every start
    exp_labels = [np.concatenate([[-100], y[1:]]) for _, y in seqs]
    assert ids[0, :real].tolist() == np.concatenate([x for x, _ in seqs]).tolist()
    assert batch["labels"][0, :real].tolist() == np.concatenate(exp_labels).tolist()
    assert batch["position_ids"][0, :real].tolist() == np.concatenate([np.arange(n) for n in lengths]).tolist()
    if pad:
        assert ids[0, real:].eq(pad_token_id).all()
        assert batch["labels"][0, real:].eq(-100).all()
        assert batch["position_ids"][0, real:].tolist() == list(range(pad))
        assert batch["seq_idx"][0, real:].eq(len(seqs)).all()  # its own sequence


@pytest.mark.parametrize("seed", range(12))
def test_conservation_property(seed):
    """>= 10k random examples over the 12 seeds: tokens conserved, in order, layouts agree."""
    rng = np.random.default_rng(seed)
    nxt = 0
    n_examples = 0
    for step in range(100):
        labels = bool(rng.random() < 0.5)
        packed = bool(rng.random() < 0.5)
        pad_to = [None, 1, 8, 64][step % 4]
        pad_id = int(rng.integers(0, 5))
        feats, seqs, nxt = _random_features(rng, int(rng.integers(1, 24)), labels=labels, packed=packed, start=nxt)
        n_examples += len(feats)
        collator = DataCollatorForPackedSSM(pad_to_multiple_of=pad_to, pad_token_id=pad_id)
        _check_layout(collator(feats), seqs, pad_to, pad_id)
    assert n_examples >= 1000  # 12 seeds x >= 1000 features (~ 2 sequences each when packed)


def test_matches_transformers_flattening_on_plain_features():
    rng = np.random.default_rng(0)
    feats = [{"input_ids": rng.integers(0, 1000, int(n)).tolist()} for n in rng.integers(1, 50, 8)]
    ours = DataCollatorForPackedSSM()(feats)
    ref = DataCollatorWithFlattening(return_seq_idx=True, return_flash_attn_kwargs=True)(feats)
    for k in ("input_ids", "labels", "position_ids", "seq_idx", "cu_seq_lens_q", "cu_seq_lens_k"):
        assert torch.equal(ours[k], ref[k]), k
    assert ours["max_length_q"] == ref["max_length_q"]


def test_numpy_output():
    out = DataCollatorForPackedSSM(return_tensors="np", pad_to_multiple_of=4)([{"input_ids": [5, 6, 7]}])
    assert isinstance(out["input_ids"], np.ndarray) and out["input_ids"].dtype == np.int64
    assert out["seq_idx"].dtype == np.int32 and out["cu_seq_lens_q"].tolist() == [0, 3, 4]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0]]
    assert isinstance(out["max_length_q"], int)


def test_pad_segment_is_its_own_sequence():
    out = DataCollatorForPackedSSM(pad_to_multiple_of=8, pad_token_id=3)([{"input_ids": [9, 9, 9, 9, 9]}])
    assert out["input_ids"].tolist() == [[9, 9, 9, 9, 9, 3, 3, 3]]
    assert out["seq_idx"].tolist() == [[0, 0, 0, 0, 0, 1, 1, 1]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]
    assert out["labels"].tolist() == [[-100, 9, 9, 9, 9, -100, -100, -100]]
    assert out["cu_seq_lens_q"].tolist() == [0, 5, 8]


def test_no_pad_when_already_a_multiple():
    out = DataCollatorForPackedSSM(pad_to_multiple_of=4)([{"input_ids": [1, 2]}, {"input_ids": [3, 4]}])
    assert out["cu_seq_lens_q"].tolist() == [0, 2, 4]


def test_max_tokens_guard():
    collator = DataCollatorForPackedSSM(max_tokens=10, pad_to_multiple_of=8)
    collator([{"input_ids": [1] * 8}])
    with pytest.raises(ValueError, match=r"16 tokens.*max_tokens=10"):
        collator([{"input_ids": [1] * 9}])


def test_extra_fields_per_token_and_per_example():
    feats = [
        {
            "input_ids": [1, 2, 3],
            "token_type_ids": [0, 1, 1],
            "pixel_values": torch.ones(2, 3, 4, 4),
            "image_sizes": torch.tensor([[4, 4], [4, 4]]),
            "mystery": [7, 7, 7],
        },
        {
            "input_ids": [4, 5],
            "token_type_ids": [1, 0],
            "pixel_values": torch.zeros(1, 3, 4, 4),
            "image_sizes": torch.tensor([[2, 2]]),
            "mystery": [8, 8],
        },
    ]
    out = DataCollatorForPackedSSM(pad_to_multiple_of=8)(feats)
    assert out["token_type_ids"].tolist() == [[0, 1, 1, 1, 0, 0, 0, 0]]
    assert out["mystery"].tolist() == [[7, 7, 7, 8, 8, 0, 0, 0]]  # inferred per-token
    assert out["pixel_values"].shape == (3, 3, 4, 4)
    assert out["pixel_values"][:2].eq(1).all() and out["pixel_values"][2].eq(0).all()  # packing order
    assert out["image_sizes"].tolist() == [[4, 4], [4, 4], [2, 2]]
    forced = DataCollatorForPackedSSM(per_example_keys=["mystery"])(feats)
    assert forced["mystery"].shape == (5,)


def test_all_ones_attention_mask_is_dropped():
    out = DataCollatorForPackedSSM()([{"input_ids": [1, 2], "attention_mask": [1, 1]}])
    assert "attention_mask" not in out


def test_rows_with_position_ids_only_keep_their_boundaries():
    """What a packed row looks like after Trainer's remove_unused_columns dropped seq_lengths."""
    out = DataCollatorForPackedSSM()([{"input_ids": [1, 2, 3, 4, 5], "position_ids": [0, 1, 0, 0, 1]}])
    assert out["cu_seq_lens_q"].tolist() == [0, 2, 3, 5]
    assert out["labels"].tolist() == [[-100, 2, -100, -100, 5]]


def test_stats_and_skip_empty():
    collator = DataCollatorForPackedSSM(on_empty="skip", pad_to_multiple_of=4)
    out = collator([{"input_ids": [1, 2, 3]}, {"input_ids": []}, {"input_ids": [4]}])
    assert out["input_ids"].tolist() == [[1, 2, 3, 4]]
    assert collator.stats.examples_skipped == 1 and collator.stats.last_skipped == [1]
    assert collator.stats.sequences == 2 and collator.stats.real_tokens == 4 and collator.stats.fill_ratio == 1.0


@pytest.mark.parametrize(
    "features, match",
    [
        pytest.param([{"input_ids": [1]}, {"input_ids": []}], r"feature 1: input_ids is empty", id="empty"),
        pytest.param(
            [{"input_ids": [1, 2], "labels": [1, 2]}, {"input_ids": [1, 2], "labels": [1]}],
            r"feature 1: labels has 1 entries",
            id="labels-length",
        ),
        pytest.param(
            [{"input_ids": [1]}, {"input_ids": [1.5, 2.0]}],
            r"feature 1: 'input_ids' must hold integers",
            id="float-ids",
        ),
        pytest.param(
            [{"input_ids": torch.tensor([1.0])}], r"feature 0: 'input_ids' must hold integer ids", id="float-tensor"
        ),
        pytest.param(
            [{"input_ids": [1]}, {"input_ids": ["a"]}], r"feature 1: 'input_ids' must hold integers", id="string-ids"
        ),
        pytest.param([{"input_ids": [True, False]}], r"feature 0: 'input_ids' must hold integers", id="bool-ids"),
        pytest.param(
            [{"input_ids": [1, 2, 3], "seq_lengths": [1, 1]}, {"input_ids": [1, 2], "seq_lengths": [1, 2]}],
            r"feature 0: seq_lengths add up to 2 but input_ids has 3",
            id="seq-lengths-sum",
        ),
        pytest.param(
            [{"input_ids": [1], "labels": [1]}, {"input_ids": [1]}], r"feature 1 lacks labels", id="mixed-labels"
        ),
        pytest.param(
            [{"input_ids": [1]}, {"input_ids": [2], "labels": [2]}], r"feature 1 has labels", id="mixed-labels-2"
        ),
        pytest.param(
            [{"input_ids": [1, 2, 3], "seq_lengths": [2, 1], "position_ids": [0, 1, 2]}],
            r"feature 0: seq_lengths \[2, 1\] disagree",
            id="seq-lengths-vs-positions",
        ),
        pytest.param(
            [{"input_ids": [1, 2], "position_ids": [1, 2]}],
            r"feature 0: position_ids must start at 0",
            id="positions-not-from-0",
        ),
        pytest.param(
            [{"input_ids": [1, 2], "attention_mask": [1, 0]}],
            r"feature 0: attention_mask contains zeros",
            id="padded-feature",
        ),
        pytest.param(
            [{"input_ids": [1, 2], "token_type_ids": [0]}],
            r"feature 0: per-token field 'token_type_ids'",
            id="per-token-length",
        ),
        pytest.param([{"input_ids": [[1, 2]]}], r"feature 0: 'input_ids' must be 1-D", id="2d-ids"),
        pytest.param([{"input_ids": [1], "seq_idx": [0]}], r"feature 0 already carries \['seq_idx'\]", id="layout-key"),
        pytest.param([], r"non-empty list", id="no-features"),
    ],
)
def test_bad_input_raises_naming_the_feature(features, match):
    with pytest.raises(ValueError, match=match):
        DataCollatorForPackedSSM()(features)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        pytest.param({"pad_to_multiple_of": 0}, "pad_to_multiple_of", id="pad-multiple"),
        pytest.param({"max_tokens": -1}, "max_tokens", id="max-tokens"),
        pytest.param({"on_empty": "drop"}, "on_empty", id="on-empty"),
        pytest.param({"return_tensors": "tf"}, "return_tensors", id="return-tensors"),
        pytest.param({"per_token_keys": ["x"], "per_example_keys": ["x"]}, "both", id="key-overlap"),
    ],
)
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DataCollatorForPackedSSM(**kwargs)
