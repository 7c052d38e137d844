"""The aten ops of one RG-LRU decode step (issue 38): no more than the stock ``RecurrentGemmaRglru``'s same step.

Each op a decode step dispatches is a CUDA launch (``safepad.testing.launches``); the stock step is the reference:
its two ``baddbmm`` gates, the recurrence and its reset bookkeeping, on a module whose ``recurrent_states`` hold
the rows' states.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from safepad.ops.prepared import keep_prepared
from safepad.ops.rg_lru import rg_lru_step
from safepad.testing.launches import count_ops

B = 4


def _stock(dtype: torch.dtype):
    from transformers import AutoConfig
    from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRglru

    cfg = AutoConfig.for_model("recurrent_gemma", hidden_size=64, lru_width=64, num_attention_heads=4)
    mod = RecurrentGemmaRglru(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return mod.to(dtype)


@pytest.mark.parametrize("masked", [pytest.param(False, id="generate-step"), pytest.param(True, id="pad-rows")])
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="float32"), pytest.param(torch.bfloat16, id="bf16")])
def test_a_step_dispatches_no_more_ops_than_the_stock_step(dtype, masked):
    """``generate-step``: every row brings a real token (a step inside ``generate``, whose scope keeps the prepared
    gate parameters: ``safepad.ops.prepared``), some rows not started; ``pad-rows``: a row of pads too (a
    hand-written step after a padded prefill, outside any scope: the step builds them)."""
    mod = _stock(dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, 64, generator=g).to(dtype)
    state = torch.randn(B, 64, generator=g)  # float32, as the stock module keeps it
    params = (mod.input_gate_weight, mod.input_gate_bias, mod.recurrent_gate_weight, mod.recurrent_gate_bias,
              mod.recurrent_param)
    kw = {"started": torch.tensor([True, False, True, True])}
    if masked:
        kw["token_mask"] = torch.tensor([True, True, False, True])
    with torch.no_grad(), (keep_prepared() if not masked else contextlib.nullcontext()):
        rg_lru_step(x, state, *params, **kw)  # a decode step follows a prefill that read the same parameters
        ours = count_ops(lambda: rg_lru_step(x, state, *params, **kw))
        mod.recurrent_states = state.clone()
        stock = count_ops(lambda: mod(x[:, None], torch.full((B, 1), 5)))
    assert ours.count <= stock.count, (ours.count, stock.count, ours.ops - stock.ops)
