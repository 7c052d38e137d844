"""``generate(use_cache=False)`` on right-padded prompts: each row generates what its prompt alone generates.

Without a cache generate re-feeds the whole sequence every step and appends each new token after the prompt's
pads (the row then has a hole), reading the next token from the last column, a pad for a right-padded row: stock
generates every new token of a padded row wrong. The wrapped model re-lays such rows pads first inside generate.
Reference: each prompt alone through the stock model without padding and without a cache, step by step on the
tokens the wrapped model generated (every step's logits), and the tokens of the prompt's own greedy search.
"""

from __future__ import annotations

import copy

import pytest
import torch

import safepad
from safepad.testing.tiny import tiny_model
from .helpers import family_param

TOL = 1e-4
NEW = 3

pytestmark = pytest.mark.usefixtures("quiet_transformers")


@pytest.mark.parametrize("family", [family_param(f) for f in ("nemotron_h", "qwen3_next", "bamba", "mamba2")])
@torch.no_grad()
def test_right_padded_generate_without_cache_equals_each_prompt_alone(family: str):
    stock = tiny_model(family).eval()
    stock.generation_config.eos_token_id = None  # every row generates NEW tokens
    wrapped = safepad.wrap(copy.deepcopy(stock), backend="torch").eval()
    ids = torch.randint(3, 250, (3, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    mask[2, 2:] = 0
    ids = ids * mask
    kw = {"max_new_tokens": NEW, "do_sample": False, "use_cache": False, "pad_token_id": 0}
    out = wrapped.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True, output_logits=True, **kw)
    new = out.sequences[:, ids.shape[1]:]  # [B, NEW]
    assert torch.equal(out.sequences[:, : ids.shape[1]], ids)  # the prompts as given
    err = 0.0
    for r in range(ids.shape[0]):
        prompt = ids[r, mask[r].bool()]
        alone = stock(input_ids=torch.cat([prompt, new[r]])[None], use_cache=False).logits[0, prompt.numel() - 1 : -1]
        got = torch.stack([step[r] for step in out.logits])  # [NEW, V]
        err = max(err, (got - alone).abs().max().item())
        greedy = stock.generate(input_ids=prompt[None], **kw)[0, prompt.numel():]
        assert torch.equal(new[r], greedy), (family, r, new[r].tolist(), greedy.tolist())
    assert err < TOL, (family, err)
