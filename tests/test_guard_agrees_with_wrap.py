"""The guard and wrap classify every layout the same way: right padding, left padding, holes, position restarts.

The guard (``safepad.guard._summarize``, one host sync per call) and wrap (the mask compaction of the mixers, the
boundary normaliser of the model hook) decide from the same ``safepad.layout`` predicates. Both are checked here,
row by row, against a plain-Python reading of random masks and ``position_ids`` (with and without past columns in
the mask, as in a chunk continuing a cache): a row the guard calls packed is a row wrap packs, and so on.
"""

from __future__ import annotations

import pytest
import torch

from safepad.guard import _HOLE_ROWS, _RESTARTS, _TRAILING_ROWS, _summarize
from safepad.layout.masks import has_holes, is_right_padded
from safepad.layout.normalize import normalize_boundaries


def _reference(mask: list[int] | None, pos: list[int], T: int) -> dict[str, int]:
    """One row, read token by token: ``mask`` (past + this call's columns, 1 = real) and ``pos`` (this call's)."""
    m = [1] * T if mask is None else mask
    real = [i for i, v in enumerate(m) if v]
    cur = m[-T:]
    cur_real = [i for i, v in enumerate(cur) if v]
    return {
        "right": int(bool(real) and not m[-1]),  # ends in a pad after real tokens
        "hole": int(bool(real) and real[-1] - real[0] + 1 != len(real)),  # a pad between two real tokens
        "left_or_hole": int(any(cur[i + 1] and not cur[i] for i in range(T - 1))),  # a real token after a pad
        "restarts": sum(1 for i in cur_real[1:] if pos[i] == 0) if T > 1 else 0,  # a 0 after the first real token
    }


def _random_case(g: torch.Generator, B: int, T: int, past: int, with_mask: bool):
    layouts = torch.randint(0, 5, (B,), generator=g).tolist()
    rows = []
    for kind in layouts:
        n = int(torch.randint(0, past + T + 1, (1,), generator=g))
        if kind == 0:  # right-padded
            row = [1] * n + [0] * (past + T - n)
        elif kind == 1:  # left-padded
            row = [0] * (past + T - n) + [1] * n
        elif kind == 2:  # any pattern: holes, pads on both sides
            row = torch.randint(0, 2, (past + T,), generator=g).tolist()
        elif kind == 3:  # all real
            row = [1] * (past + T)
        else:  # all pads
            row = [0] * (past + T)
        rows.append(row)
    mask = torch.tensor(rows, dtype=torch.long) if with_mask else None  # [B, past + T]
    style = int(torch.randint(0, 3, (1,), generator=g))
    if style == 0 and mask is not None:  # generate(): real tokens count from 0, pads at 1
        cur = mask[:, -T:]
        pos = (cur.cumsum(1) - 1).masked_fill(cur == 0, 1)
    elif style == 1:  # packed: restarts at random tokens
        restart = torch.rand(B, T, generator=g) < 0.3
        restart[:, 0] = True
        start = torch.where(restart, torch.arange(T).expand(B, T), torch.zeros(B, T, dtype=torch.long))
        pos = torch.arange(T).expand(B, T) - torch.cummax(start, dim=1).values
    else:  # anything
        pos = torch.randint(0, 3, (B, T), generator=g)
    return mask, pos.to(torch.long)  # [B, Tm] | None, [B, T]


def _wrap_restarts(mask, pos, T: int) -> list[int]:
    """Per row: the sequence boundaries between real tokens that wrap's normaliser reads from ``position_ids``."""
    B = pos.shape[0]
    seq_idx, _ = normalize_boundaries((B, T), position_ids=pos, padding_mask=mask)
    if seq_idx is None:
        return [0] * B
    real = torch.ones(B, T, dtype=torch.bool) if mask is None else mask[:, -T:].bool()
    out = []
    for b in range(B):
        ids = seq_idx[b][real[b]]
        out.append(int(ids.max() - ids.min()) if ids.numel() else 0)
    return out


@pytest.mark.parametrize(
    ("T", "past", "with_mask"),
    [
        pytest.param(6, 0, True, id="prefill"),
        pytest.param(5, 3, True, id="chunk_after_past_columns"),
        pytest.param(6, 0, False, id="no_mask"),
        pytest.param(1, 4, True, id="decode_step"),
    ],
)
def test_guard_and_wrap_classify_rows_alike(T: int, past: int, with_mask: bool) -> None:
    g = torch.Generator().manual_seed(1000 * T + past)
    cpu = torch.device("cpu")
    for _ in range(40):
        B = int(torch.randint(1, 5, (1,), generator=g))
        mask, pos = _random_case(g, B, T, past, with_mask)
        refs = [_reference(None if mask is None else mask[b].tolist(), pos[b].tolist(), T) for b in range(B)]
        # the guard, row by row and for the whole batch (what it reads in its one sync)
        for b, ref in enumerate(refs):
            row = _summarize(None if mask is None else mask[b : b + 1], pos[b : b + 1], None, None, 1, T, cpu)
            got = {"right": int(row[_TRAILING_ROWS]), "hole": int(row[_HOLE_ROWS]), "restarts": int(row[_RESTARTS])}
            assert got == {k: ref[k] for k in got}, (mask, pos, b)
        batch = _summarize(mask, pos, None, None, B, T, cpu)
        assert int(batch[_TRAILING_ROWS]) == sum(r["right"] for r in refs)
        assert int(batch[_HOLE_ROWS]) == sum(r["hole"] for r in refs)
        assert int(batch[_RESTARTS]) == sum(r["restarts"] for r in refs)
        # wrap: the boundaries its normaliser packs, the rows its mixers compact, the holes its hook re-lays
        assert _wrap_restarts(mask, pos, T) == [r["restarts"] for r in refs], (mask, pos)
        if mask is not None:
            cur = mask[:, -T:].bool()
            for b, ref in enumerate(refs):
                assert (not is_right_padded(cur[b : b + 1])) == bool(ref["left_or_hole"]), (mask, b)
            assert has_holes(mask.bool()).long().tolist() == [r["hole"] for r in refs], mask
