"""safepad.trainer_ext.segments: the union of every boundary a batch (and its collator's features) declares."""

from __future__ import annotations

import pytest
import torch

from safepad.collators import DataCollatorForPackedSSM
from safepad.trainer_ext.segments import Segment, feature_starts, segments, sequence_starts

LENGTHS = (3, 4, 2)  # one [1, 9] row


def _spans(starts, mask=None):
    return [(s.row, s.start, s.end, s.index) for s in segments(starts, mask)]


EXPECTED = [(0, 0, 3, 0), (0, 3, 7, 1), (0, 7, 9, 2)]


@pytest.mark.parametrize(
    "key",
    [
        pytest.param("seq_idx", id="seq_idx"),
        pytest.param("cu_seq_lens_q", id="cu_seq_lens_q"),
        pytest.param("position_ids", id="position_ids"),
    ],
)
def test_each_encoding_alone_gives_the_sequences(key):
    batch = DataCollatorForPackedSSM()([{"input_ids": list(range(3, 3 + n))} for n in LENGTHS])
    only = {"input_ids": batch["input_ids"], key: batch[key]}
    assert _spans(sequence_starts(only, (1, 9))) == EXPECTED


def test_union_keeps_a_boundary_only_one_encoding_declares():
    seq_idx = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]])  # misses the third sequence
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 1]])
    assert _spans(sequence_starts({"seq_idx": seq_idx, "position_ids": pos}, (1, 9))) == EXPECTED


def test_positions_with_a_padding_mask_are_not_packing():
    pos = torch.tensor([[1, 1, 0, 1, 2]])  # generate()-style positions of a left-padded row
    mask = torch.tensor([[0, 0, 1, 1, 1]])
    starts = sequence_starts({"position_ids": pos, "attention_mask": mask}, (1, 5))
    assert _spans(starts, mask) == [(0, 2, 5, 0)]  # one sequence: its real tokens


def test_features_given_to_the_collator_are_placed_in_its_output():
    features = [{"input_ids": list(range(3, 10)), "seq_lengths": [3, 4]}, {"input_ids": [5, 6]}]
    out = {k: v for k, v in DataCollatorForPackedSSM()(features).items() if k == "input_ids"}  # boundaries lost
    starts = feature_starts(features, out)
    assert _spans(sequence_starts(out, (1, 9), starts)) == EXPECTED


def test_describe():
    assert Segment(1, 4, 9, 2).describe() == "sequence 2 of row 1 (tokens 4..8, length 5)"
