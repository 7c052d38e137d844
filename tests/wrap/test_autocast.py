"""bf16 autocast training on wrapped models (TRL's SFTConfig defaults to bf16 autocast on CPU).

The ops compute in fp32 inside an autocast region; the packed loss under autocast stays close to the fp32
packed loss, and gradients exist and are finite.
"""

from __future__ import annotations

import pytest
import torch

import safepad
from safepad.testing.tiny import tiny_model


@pytest.mark.parametrize("family", ["nemotron_h", "mamba", "qwen3_next", "lfm2"])
def test_bf16_autocast_packed_training_step(family):
    model = safepad.wrap(tiny_model(family)).train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (1, 40), generator=g)
    pos = torch.cat([torch.arange(15), torch.arange(25)])[None]  # two packed sequences
    labels = ids.clone()
    labels[0, 15] = -100
    fp32 = model(input_ids=ids, position_ids=pos, labels=labels).loss.item()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, position_ids=pos, labels=labels).loss
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(gr).all() for gr in grads)
    assert abs(loss.item() - fp32) < 0.05 * abs(fp32)
