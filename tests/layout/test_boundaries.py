"""safepad.layout.boundaries: round trips between seq_idx / cu_seqlens / position_ids, and errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from safepad.layout import (
    cu_seqlens_from_seq_idx,
    packing_positions,
    position_ids_restart,
    seq_idx_from_cu_seqlens,
    seq_idx_from_position_ids,
    sequence_ids,
    validate_cu_seqlens,
    validate_seq_idx,
)


def test_cu_seqlens_round_trip_single_row():
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    seq = seq_idx_from_cu_seqlens(cu, 9)
    assert seq.tolist() == [[0, 0, 0, 1, 2, 2, 2, 2, 2]] and seq.dtype == torch.int32
    assert torch.equal(cu_seqlens_from_seq_idx(seq), cu)


@settings(max_examples=25, deadline=None)
@given(lens=st.lists(st.integers(1, 6), min_size=1, max_size=8))
def test_cu_seqlens_round_trip_property(lens):
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)
    seq = seq_idx_from_cu_seqlens(cu, sum(lens))
    assert torch.equal(cu_seqlens_from_seq_idx(seq), cu)
    pos = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0)
    assert torch.equal(seq_idx_from_position_ids(pos), seq)


def test_cu_seqlens_from_multi_row_seq_idx_is_row_major():
    seq = torch.tensor([[0, 0, 1, 1], [3, 3, 3, 5]], dtype=torch.int32)
    assert cu_seqlens_from_seq_idx(seq).tolist() == [0, 2, 4, 7, 8]
    assert sequence_ids(seq).tolist() == [[0, 0, 1, 1], [2, 2, 2, 3]]


def test_position_ids_restart_and_continuation():
    pos = torch.tensor([[3, 4, 0, 1, 0, 0, 1]])
    assert seq_idx_from_position_ids(pos).tolist() == [[0, 0, 1, 1, 2, 3, 3]]
    assert position_ids_restart(pos)
    assert not position_ids_restart(torch.arange(5).unsqueeze(0))
    rope = torch.tensor([[0, 0, 0, 3, 4], [0, 0, 1, 3, 4], [0, 1, 0, 3, 4]])[:, None]  # [3, 1, 5]: image, then text
    assert not position_ids_restart(rope)  # only the first token is (0, 0, 0)
    assert position_ids_restart(torch.cat([rope, rope], -1))  # a second sequence starts at (0, 0, 0)


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(lambda p: p, id="T"),
        pytest.param(lambda p: p[None], id="1xT"),
        pytest.param(lambda p: p[None].expand(2, -1), id="BxT"),
        pytest.param(lambda p: torch.stack([p, p + 7, p + 9, p + 11])[:, None].expand(4, 2, -1), id="4xBxT-text_row"),
        pytest.param(lambda p: p[None, None], id="1x1xT"),
        pytest.param(lambda p: p[None, None].expand(3, 2, -1), id="3xBxT-rope_rows"),
    ],
)
def test_packing_positions_reads_the_text_positions_of_every_layout(layout):
    pos = torch.tensor([0, 1, 2, 0, 1, 0])
    out = packing_positions(layout(pos), (2, 6))
    assert out.shape == (2, 6) and torch.equal(out == 0, (pos == 0).expand(2, -1))
    assert packing_positions(layout(pos), (2, 5)) is None  # positions that do not fit the call are not read


def test_packing_positions_reads_nothing_from_unknown_layouts():
    assert packing_positions(torch.zeros(2, 1, 6, dtype=torch.long), (1, 6)) is None  # [2, B, T]: no convention
    assert packing_positions(torch.zeros(1, 1, 1, 6, dtype=torch.long), (1, 6)) is None
    assert packing_positions(None, (1, 6)) is None


def test_validate_seq_idx_returns_int32():
    out = validate_seq_idx(torch.tensor([[0, 0, 2]], dtype=torch.int64), (1, 3))
    assert out.dtype == torch.int32


@pytest.mark.parametrize(
    "value,match",
    [
        pytest.param(torch.tensor([[0, 1, 0]]), "decreases", id="decreasing"),
        pytest.param(torch.tensor([[0.0, 1.0]]), "integer", id="float"),
        pytest.param(torch.tensor([0, 1]), "shape", id="1-d"),
        pytest.param(torch.tensor([[-1, 0]]), "non-negative", id="negative"),
        pytest.param([[0, 1]], "Tensor", id="list"),
    ],
)
def test_validate_seq_idx_errors(value, match):
    with pytest.raises(ValueError, match=match):
        validate_seq_idx(value)


def test_validate_seq_idx_shape_mismatch():
    with pytest.raises(ValueError, match="seq_idx"):
        validate_seq_idx(torch.zeros(2, 3, dtype=torch.int32), (2, 4))


@pytest.mark.parametrize(
    "cu,total,match",
    [
        pytest.param(torch.tensor([1, 3]), None, "start at 0", id="not-zero"),
        pytest.param(torch.tensor([0, 3, 2]), None, "non-decreasing", id="decreasing"),
        pytest.param(torch.tensor([0, 3]), 4, "ends at 3", id="wrong-total"),
        pytest.param(torch.tensor([0]), None, "num_seqs", id="too-short"),
        pytest.param(torch.tensor([0.0, 2.0]), None, "integer", id="float"),
    ],
)
def test_validate_cu_seqlens_errors(cu, total, match):
    with pytest.raises(ValueError, match=match):
        validate_cu_seqlens(cu, total)


def test_seq_idx_from_position_ids_rejects_3d():
    with pytest.raises(ValueError, match="position_ids"):
        seq_idx_from_position_ids(torch.zeros(3, 1, 4, dtype=torch.long))
