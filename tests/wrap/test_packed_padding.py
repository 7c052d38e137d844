"""Packed rows together with a padding mask: trailing pads are accepted and right, other pads raise.

The layout of issue 17: ids = [A (6), B (9), 3 pads], a mask of 15 ones then 3 zeros, and boundaries given
as restarting ``position_ids`` (pads at 0, or at 1 as ``generate()`` writes them), as ``seq_idx`` or as
``cu_seq_lens``. Reference: each sequence alone through the stock model. On main the ``position_ids`` were
ignored as soon as the mask had a zero, so B came out as a continuation of A.
"""

from __future__ import annotations

import copy

import pytest
import torch

import safepad
from safepad.testing.tiny import tiny_model

FAMILIES = ["mamba2", "nemotron_h", "bamba", "granitemoehybrid", "jamba", "mamba", "qwen3_next", "lfm2"]
_CACHE: dict = {}


def _models(family):
    if family not in _CACHE:
        stock = tiny_model(family)
        _CACHE[family] = (stock, safepad.wrap(copy.deepcopy(stock)))
    return _CACHE[family]


def _layout(pad_pos: int = 0):
    g = torch.Generator().manual_seed(11)
    a, b = torch.randint(3, 250, (6,), generator=g), torch.randint(3, 250, (9,), generator=g)
    ids = torch.cat([a, b, torch.zeros(3, dtype=torch.long)])[None]  # [1, 18]
    pos = torch.cat([torch.arange(6), torch.arange(9), torch.full((3,), pad_pos)])[None]  # [1, 18]
    mask = torch.cat([torch.ones(15, dtype=torch.long), torch.zeros(3, dtype=torch.long)])[None]  # [1, 18]
    return a, b, ids, pos, mask


def _check(stock, out, a, b):
    with torch.no_grad():
        ref_a = stock(input_ids=a[None], use_cache=False).logits
        ref_b = stock(input_ids=b[None], use_cache=False).logits
    torch.testing.assert_close(out[:, :6], ref_a, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[:, 6:15], ref_b, rtol=1e-4, atol=1e-4)


BOUNDARIES = [
    pytest.param("position_ids", id="position_ids-pads-at-0"),
    pytest.param("position_ids_generate", id="position_ids-pads-at-1"),
    pytest.param("seq_idx", id="seq_idx"),
    pytest.param("cu_seq_lens", id="cu_seq_lens"),
]


def _kwargs(how: str, pos, mask):
    if how == "position_ids":
        return {"position_ids": pos}
    if how == "position_ids_generate":
        return {"position_ids": torch.where(mask.bool(), pos, torch.ones_like(pos))}
    if how == "seq_idx":
        return {"seq_idx": torch.tensor([[0] * 6 + [1] * 9 + [1] * 3], dtype=torch.int32)}
    return {"cu_seq_lens_q": torch.tensor([0, 6, 15, 18], dtype=torch.int32)}


@pytest.mark.parametrize("how", BOUNDARIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_then_trailing_pads_equals_each_sequence_alone(family, how):
    stock, wrapped = _models(family)
    a, b, ids, pos, mask = _layout()
    with torch.no_grad():
        out = wrapped(input_ids=ids, attention_mask=mask, use_cache=False, **_kwargs(how, pos, mask)).logits
    _check(stock, out, a, b)


def test_batch_of_packed_and_padded_rows():
    """Row 0: A, B, 3 pads (packed); row 1: one sequence of 10 and 8 pads; position_ids carry the packing."""
    stock, wrapped = _models("nemotron_h")
    a, b, ids, pos, mask = _layout()
    c = torch.randint(3, 250, (10,), generator=torch.Generator().manual_seed(5))
    ids2 = torch.cat([c, torch.zeros(8, dtype=torch.long)])[None]
    pos2 = torch.cat([torch.arange(10), torch.zeros(8, dtype=torch.long)])[None]
    mask2 = (torch.arange(18) < 10).long()[None]
    with torch.no_grad():
        out = wrapped(input_ids=torch.cat([ids, ids2]), attention_mask=torch.cat([mask, mask2]),
                      position_ids=torch.cat([pos, pos2]), use_cache=False).logits
        ref_c = stock(input_ids=c[None], use_cache=False).logits
    _check(stock, out[:1], a, b)
    torch.testing.assert_close(out[1:, :10], ref_c, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("how", ["position_ids", "seq_idx"])
@pytest.mark.parametrize("where", [pytest.param("left", id="left-pads"), pytest.param("middle", id="pads-between")])
def test_packed_with_pads_before_or_between_sequences_raises(how, where):
    _, wrapped = _models("mamba2")
    a, b, _, _, _ = _layout()
    pad = torch.zeros(3, dtype=torch.long)
    parts = [pad, a, b] if where == "left" else [a, pad, b]
    ids = torch.cat(parts)[None]
    mask = torch.cat([torch.zeros(3) if p is pad else torch.ones(len(p)) for p in parts]).long()[None]
    pos = torch.cat([torch.zeros(3, dtype=torch.long) if p is pad else torch.arange(len(p)) for p in parts])[None]
    seq = torch.cat([torch.full((len(p),), i, dtype=torch.int32) for i, p in enumerate(parts)])[None]
    kw = {"position_ids": pos} if how == "position_ids" else {"seq_idx": seq}
    with pytest.raises(ValueError, match="packed rows may only end in padding"):
        wrapped(input_ids=ids, attention_mask=mask, use_cache=False, **kw)


def test_left_padded_generate_positions_are_not_packing():
    """generate()'s position ids of a left-padded batch (pads at 1, real tokens from 0) stay a padded batch."""
    stock, wrapped = _models("nemotron_h")
    g = torch.Generator().manual_seed(2)
    s = torch.randint(3, 250, (7,), generator=g)
    ids = torch.cat([torch.zeros(4, dtype=torch.long), s])[None]
    mask = torch.cat([torch.zeros(4), torch.ones(7)]).long()[None]
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        out = wrapped(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        ref = stock(input_ids=s[None], use_cache=False).logits
    torch.testing.assert_close(out[:, 4:], ref, rtol=1e-4, atol=1e-4)
