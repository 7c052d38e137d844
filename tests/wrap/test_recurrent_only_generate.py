"""Right-padded ``generate`` on models whose cache has no attention layer (a Nemotron-H of Mamba layers only).

Such a cache is compileable, so ``generate`` hands the model per-layer-type masks it built instead of the 2-D padding
mask; the wrapped model used to refuse the prompt with a message about static caches that did not apply. No attention
layer reads those masks: the wrapped ``generate`` hands the recurrent layers' 2-D mask on, and every row continues as
its prompt alone (reference: the stock model on the prompt alone, no padding, no cache, one forward per step).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import safepad
from safepad.testing.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("quiet_transformers")

N_NEW = 3
VARIANTS = {
    "nemotron_h": {"layers_block_type": ["mamba", "mlp", "mamba"]},
}


@functools.cache
def _models(family: str):
    stock = tiny_model(family, **VARIANTS[family])
    return stock, safepad.wrap(copy.deepcopy(stock), backend="torch")


@torch.no_grad()
@pytest.mark.parametrize("family", [pytest.param(f, id=f) for f in VARIANTS])
def test_right_padded_generate_equals_each_prompt_alone(family):
    stock, wrapped = _models(family)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 250, (n,), generator=g) for n in (7, 4)]
    ids = torch.zeros(2, 7, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, : len(p)], mask[r, : len(p)] = p, 1
    out = wrapped.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False, pad_token_id=0,
        return_dict_in_generate=True, output_logits=True,
    )
    for r, p in enumerate(prompts):
        new = out.sequences[r, 7:]
        ref = stock(input_ids=torch.cat([p, new])[None], use_cache=False).logits[0, len(p) - 1 : -1]  # [N_NEW, V]
        got = torch.stack([step[r] for step in out.logits])
        assert (got - ref).abs().max() < 1e-4, r
        assert torch.equal(new, ref.argmax(-1)), r
