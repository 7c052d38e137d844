"""Shared helpers for the wrap tests."""

from __future__ import annotations

import pytest
import torch

from safepad.testing.tiny import family_available

def packed_batch(lens: list[int], seed: int = 0, vocab: int = 250):
    """Sequences of the given lengths, their concatenation [1, T] and the three boundary encodings."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(3, vocab, (L,), generator=g) for L in lens]
    ids = torch.cat(seqs)[None]  # [1, T]
    seq_idx = torch.cat([torch.full((L,), i, dtype=torch.int32) for i, L in enumerate(lens)])[None]  # [1, T]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)  # [N + 1]
    pos = torch.cat([torch.arange(L) for L in lens])[None]  # [1, T]
    return seqs, ids, seq_idx, cu, pos


def family_param(family: str):
    """``pytest.param(family)``, skipped (with the reason) where the installed transformers lacks the family."""
    ok, why = family_available(family)
    return pytest.param(family, id=family, marks=() if ok else pytest.mark.skip(reason=why))


def strengthen_attention(model):
    """Attention query / key projections at std 0.3: positions (and so position errors) matter."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model
