"""Boundaries given two ways must agree: ``seq_idx`` / ``cu_seq_lens`` with position_ids that do not restart raise.

On main, position_ids ``0..T-1`` next to packed ``seq_idx`` were accepted; the recurrent layers honoured the
boundaries while the attention layers of hybrids, reading the position_ids, attended across sequences
(logits 3e-3 to 1e-2 off the sequences alone). Restarting-but-different position_ids already raised.
"""

from __future__ import annotations

import copy

import pytest
import torch

import safepad
from safepad.testing.tiny import tiny_model

from .helpers import packed_batch

HYBRIDS = ["nemotron_h", "bamba", "jamba", "qwen3_next", "granitemoehybrid", "lfm2"]
_CACHE: dict = {}


def _wrapped(family):
    if family not in _CACHE:
        stock = tiny_model(family)
        _CACHE[family] = (stock, safepad.wrap(copy.deepcopy(stock)))
    return _CACHE[family]


@pytest.mark.parametrize("source", ["seq_idx", "cu_seq_lens"])
@pytest.mark.parametrize("family", HYBRIDS + ["mamba2"])
def test_packed_boundaries_with_non_restarting_position_ids_raise(family, source):
    _, wrapped = _wrapped(family)
    _, ids, seq_idx, cu, _ = packed_batch([5, 9, 3])
    kw = {"seq_idx": seq_idx} if source == "seq_idx" else {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu}
    pos = torch.arange(ids.shape[1])[None]  # [1, T]: one sequence per row
    with pytest.raises(ValueError, match="position_ids disagree"):
        wrapped(input_ids=ids, position_ids=pos, use_cache=False, **kw)


def test_broadcast_position_ids_row_is_checked_too():
    """A ``[1, T]`` position row broadcast over a batch of 2 packed rows."""
    _, wrapped = _wrapped("nemotron_h")
    _, ids, seq_idx, _, _ = packed_batch([5, 9, 3])
    ids2 = torch.cat([ids, ids.flip(1)])
    seq2 = torch.cat([seq_idx, seq_idx])
    with pytest.raises(ValueError, match="position_ids disagree"):
        wrapped(input_ids=ids2, seq_idx=seq2, position_ids=torch.arange(ids.shape[1])[None], use_cache=False)


@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_next"])
def test_agreeing_position_ids_are_accepted_and_right(family):
    stock, wrapped = _wrapped(family)
    seqs, ids, seq_idx, _, pos = packed_batch([5, 9, 3])
    with torch.no_grad():
        out = wrapped(input_ids=ids, seq_idx=seq_idx, position_ids=pos, use_cache=False).logits
        s = 0
        for q in seqs:
            ref = stock(input_ids=q[None], use_cache=False).logits
            torch.testing.assert_close(out[:, s : s + len(q)], ref, rtol=1e-4, atol=1e-4)
            s += len(q)
