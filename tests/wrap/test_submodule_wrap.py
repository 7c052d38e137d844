"""Wrapping only an inner model: the boundaries the outer model drops still reach the mixers, or it raises.

``safepad.wrap(model.backbone)`` of ``MambaForCausalLM`` hooks the backbone only, and the stock outer
forward takes ``seq_idx`` into ``**kwargs`` without passing it on. On main that call was silently computed
as one sequence per row (logits 4.27 off). Reference: each sequence alone through the stock model.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import safepad
from safepad.testing.tiny import tiny_model

from .helpers import packed_batch

INNER = {"mamba": "backbone", "mamba2": "backbone", "falcon_mamba": "backbone", "jamba": "model", "nemotron_h": "model"}


def _check(stock, out, seqs):
    s = 0
    with torch.no_grad():
        for q in seqs:
            ref = stock(input_ids=q[None], use_cache=False).logits
            torch.testing.assert_close(out[:, s : s + len(q)], ref, rtol=1e-4, atol=1e-4)
            s += len(q)


@pytest.mark.parametrize("how", ["seq_idx", "cu_seq_lens", "position_ids"])
@pytest.mark.parametrize("family", list(INNER))
def test_outer_call_with_boundaries_when_only_the_inner_model_is_wrapped(family, how):
    stock = tiny_model(family)
    model = copy.deepcopy(stock)
    safepad.wrap(getattr(model, INNER[family]))
    seqs, ids, seq_idx, cu, pos = packed_batch([5, 9, 3])
    kw = {"seq_idx": seq_idx, "cu_seq_lens": {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu}, "position_ids": pos}[how]
    kw = kw if isinstance(kw, dict) else {how: kw}
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False, **kw).logits
    _check(stock, out, seqs)


class _Splitter(nn.Module):
    """A user's outer module that takes seq_idx for a batch and calls the wrapped model on half of it."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, seq_idx=None):
        return self.lm(input_ids=input_ids[:, :8], use_cache=False)


def test_outer_boundaries_that_do_not_fit_the_inner_call_raise():
    lm = safepad.wrap(tiny_model("mamba"))
    _, ids, seq_idx, _, _ = packed_batch([5, 9, 3])
    with pytest.raises(ValueError, match="without them"):
        _Splitter(lm)(ids, seq_idx=seq_idx)


def test_unpacked_outer_call_is_untouched():
    stock = tiny_model("mamba")
    model = copy.deepcopy(stock)
    safepad.wrap(model.backbone)
    ids = torch.randint(3, 200, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, stock(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
