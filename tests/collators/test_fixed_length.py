"""DataCollatorForPackedSSM(pad_to_length=...): every emitted tensor has a shape fixed by its bucket."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from safepad.collators import DataCollatorForPackedSSM
from safepad.layout.boundaries import seq_idx_from_cu_seqlens


def _features(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(3, 100, n).tolist()} for n in lengths]


def _shapes(batch):
    return {k: tuple(v.shape) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


@pytest.mark.parametrize(
    "lengths",
    [pytest.param([5, 9, 1], id="3-seqs"), pytest.param([20], id="1-seq"), pytest.param([4] * 8, id="8-seqs"),
     pytest.param([16, 16], id="exactly-full")],
)  # fmt: skip
def test_fixed_length_layout(lengths):
    L = 32
    out = DataCollatorForPackedSSM(pad_to_length=L, pad_token_id=7)(_features(lengths))
    assert _shapes(out) == {
        "input_ids": (1, L), "labels": (1, L), "position_ids": (1, L), "seq_idx": (1, L),
        "cu_seq_lens_q": (L + 1,), "cu_seq_lens_k": (L + 1,), "max_length_q": L, "max_length_k": L,
        "real_token_mask": (1, L),
    }  # fmt: skip
    real = sum(lengths)
    pad = L - real
    seqs = lengths + ([pad] if pad else [])
    cu = out["cu_seq_lens_q"]
    expect = np.concatenate([[0], np.cumsum(seqs)])
    assert cu[: len(expect)].tolist() == expect.tolist()
    assert (cu[len(expect) :] == L).all()  # zero-length sequences fill the rest
    assert torch.equal(seq_idx_from_cu_seqlens(cu, L), out["seq_idx"])  # padded cu_seq_lens agree with seq_idx
    assert out["seq_idx"][0].tolist() == np.repeat(np.arange(len(seqs)), seqs).tolist()
    assert out["position_ids"][0].tolist() == [p for n in seqs for p in range(n)]
    assert (out["labels"][0, real:] == -100).all() and (out["input_ids"][0, real:] == 7).all()
    assert out["real_token_mask"][0].tolist() == [1] * real + [0] * pad  # the pad tail, for the router loss
    starts = expect[:-1]
    assert (out["labels"][0, starts] == -100).all()


def test_buckets_pick_the_smallest_that_fits():
    collator = DataCollatorForPackedSSM(pad_to_length=(64, 16, 32))
    assert collator(_features([10]))["input_ids"].shape == (1, 16)
    assert collator(_features([10, 7]))["input_ids"].shape == (1, 32)
    out = collator(_features([33]))
    assert out["input_ids"].shape == (1, 64) and out["cu_seq_lens_q"].shape == (65,) and out["max_length_q"] == 64


def test_max_sequences_sizes_cu_seq_lens():
    out = DataCollatorForPackedSSM(pad_to_length=32, max_sequences=4)(_features([3, 4]))
    assert out["cu_seq_lens_q"].tolist() == [0, 3, 7, 32, 32]
    with pytest.raises(ValueError, match="max_sequences=4"):
        DataCollatorForPackedSSM(pad_to_length=32, max_sequences=4)(_features([3, 4, 5, 6]))  # 4 + the pad tail


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"pad_to_length": 0}, "pad_to_length", id="zero"),
        pytest.param({"pad_to_length": []}, "pad_to_length", id="empty"),
        pytest.param({"pad_to_length": "64"}, "pad_to_length", id="string"),
        pytest.param({"pad_to_length": 64, "pad_to_multiple_of": 8}, "not both", id="with-multiple"),
        pytest.param({"pad_to_length": 64, "max_tokens": 32}, "max_tokens", id="over-max-tokens"),
        pytest.param({"max_sequences": 4}, "only applies with pad_to_length", id="max-sequences-alone"),
        pytest.param({"pad_to_length": 8, "max_sequences": 0}, "max_sequences", id="max-sequences-zero"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DataCollatorForPackedSSM(**kwargs)


def test_batch_longer_than_the_largest_bucket_raises_with_the_fix():
    with pytest.raises(ValueError, match=r"40 real tokens, more than pad_to_length=32.*pack_dataset\(max_length=32\)"):
        DataCollatorForPackedSSM(pad_to_length=(16, 32))(_features([20, 20]))


def test_numpy_output_and_stats():
    collator = DataCollatorForPackedSSM(pad_to_length=16, return_tensors="np")
    out = collator(_features([5, 3]))
    assert out["cu_seq_lens_q"].dtype == np.int32 and out["cu_seq_lens_q"].shape == (17,)
    assert collator.stats.real_tokens == 8 and collator.stats.pad_tokens == 8 and collator.stats.sequences == 2
