"""A NaN in one packed sequence leaves the other sequences' logits equal to their runs alone (wrapped models).

Reference: each sequence alone through the stock model. The NaN sits in the input embeddings of one token
of the middle sequence; the stock model run on the other sequences alone is finite. (Hybrids are left
out: their attention layers, stock transformers code, multiply the masked-out values of other sequences
by zero softmax weights, so a NaN crosses there whatever the recurrent layers do.)
"""

from __future__ import annotations

import copy

import pytest
import torch

import safepad
from safepad.testing.tiny import tiny_model

LENS = (5, 9, 3)


@pytest.mark.parametrize("where", [pytest.param(2, id="inside"), pytest.param(8, id="last-token")])
@pytest.mark.parametrize("family", ["mamba2", "mamba", "falcon_mamba"])
def test_nan_in_one_packed_sequence_stays_there(family, where):
    stock = tiny_model(family)
    wrapped = safepad.wrap(copy.deepcopy(stock))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 250, (1, sum(LENS)), generator=g)
    emb = stock.get_input_embeddings()(ids).detach().clone()  # [1, T, C]
    bad = LENS[0] + where
    emb[0, bad, :3] = float("nan")
    seq_idx = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(LENS)])[None]
    with torch.no_grad():
        out = wrapped(inputs_embeds=emb, seq_idx=seq_idx, use_cache=False).logits  # [1, T, V]
        s = 0
        for i, n in enumerate(LENS):
            if i != 1:
                alone = stock(inputs_embeds=emb[:, s : s + n], use_cache=False).logits
                assert torch.isfinite(alone).all()
                got = out[:, s : s + n]
                assert torch.isfinite(got).all(), f"{family}: the NaN of sequence 1 reached sequence {i}"
                torch.testing.assert_close(got, alone, rtol=1e-4, atol=1e-4)
            s += n
    assert not torch.isfinite(out[0, bad]).all(), "the NaN sequence must not come out finite"
