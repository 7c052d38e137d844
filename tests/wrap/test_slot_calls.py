"""Hand-written decode steps after a right-padded prefill (a re-laid cache), with step tokens that are pads and no
``position_ids``: the wrapped model picks each step's position (the row's cached real tokens) and re-lays each
attention layer's cache on the device; every real token's logits equal its sequence run alone through the stock
model (:mod:`safepad.wrap.slot_calls`, :class:`safepad.layout.slots.SlotJustifiedCall`)."""

from __future__ import annotations

import copy

import pytest
import torch

import safepad
from safepad.testing.scenarios import _ModelIO
from safepad.testing.tiny import tiny_model

from .helpers import family_param, strengthen_attention

pytestmark = pytest.mark.usefixtures("quiet_transformers")

#: one family per kind of attention cache a step re-lays: plain keys (conv / Mamba2 / delta-rule hybrids), DSA
#: indexer keys
FAMILIES = ("lfm2", "nemotron_h", "qwen3_next", "glm5_next")
#: float32 against float32: the batched and the alone runs differ by reduction order only (measured <= 2.5e-6)
TOL = 1e-4


@torch.no_grad()
@pytest.mark.parametrize("mask_dtype", [pytest.param(torch.long, id="long"), pytest.param(torch.bool, id="bool")])
@pytest.mark.parametrize("family", [family_param(f) for f in FAMILIES])
def test_pad_steps_without_positions_equal_each_row_alone(family, mask_dtype):
    stock = strengthen_attention(tiny_model(family)).eval()
    wrapped = safepad.wrap(copy.deepcopy(stock)).eval()
    io = _ModelIO(wrapped)
    g = torch.Generator().manual_seed(5)
    lengths = (6, 3, 5)
    ids = torch.zeros(3, 6, dtype=torch.long)
    mask = torch.zeros(3, 6, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.randint(3, io.vocab, (n,), generator=g)
        mask[b, :n] = 1  # right-padded
    steps = torch.randint(3, io.vocab, (3, 3), generator=g)  # [B, steps]
    step_real = torch.tensor([[1, 1, 1], [0, 1, 0], [1, 0, 1]])  # row 1's first and last steps are pads
    _, cache = io(ids, attention_mask=mask.to(mask_dtype), cache=io.fresh_cache(), use_cache=True)
    full, seqs = mask, [ids[b, :n] for b, n in enumerate(lengths)]
    for k in range(steps.shape[1]):
        full = torch.cat([full, step_real[:, k : k + 1]], 1)  # [B, L + k + 1]
        logits, cache = io(steps[:, k : k + 1], attention_mask=io.decode_mask(full.to(mask_dtype)), cache=cache,
                           use_cache=True)
        for b in range(3):
            if not step_real[b, k]:
                continue
            seqs[b] = torch.cat([seqs[b], steps[b, k : k + 1]])
            alone = stock(input_ids=seqs[b][None], use_cache=False).logits[0, -1]  # [V]
            err = (logits[b, -1] - alone).abs().max().item()
            assert err < TOL, (family, b, k, err)
