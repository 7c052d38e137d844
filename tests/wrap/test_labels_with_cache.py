"""A loss call with an explicit cache on right-padded rows (a Trainer batch with ``use_cache=True``): the wrapped
model re-lays the rows for the cache and still scores the caller's rows. The loss and logits equal the stock model's
uncached forward (right for right-padded rows: the pads come after every real token), and the returned cache
continues each row as that row alone through stock."""

from __future__ import annotations

import pytest
import torch

import safepad
from safepad.cache import cache_argument, output_cache
from safepad.testing.tiny import family_available, tiny_model

FAMILIES = [
    pytest.param("nemotron_h", {}, id="nemotron_h"),
    pytest.param("qwen3_next", {}, id="qwen3_next"),
    pytest.param("lfm3", {"sliding_window": 6}, id="lfm3-window6"),
]


@pytest.mark.parametrize("family, overrides", FAMILIES)
def test_loss_with_cache_on_right_padded_rows_scores_the_callers_rows(family, overrides):
    ok, why = family_available(family)
    if not ok:
        pytest.skip(why)
    stock = tiny_model(family, **overrides)
    model = safepad.wrap(tiny_model(family, **overrides))
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, stock.config.vocab_size, (3, 8), generator=g)
    mask = torch.tensor([[1] * 5 + [0] * 3, [1] * 8, [1] * 3 + [0] * 5])
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        ref = stock(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
        out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=True)
    assert torch.allclose(out.loss, ref.loss, atol=1e-5, rtol=1e-5), (out.loss.item(), ref.loss.item())
    real = mask.bool()
    assert (out.logits[real] - ref.logits[real]).abs().max().item() < 1e-4
    # the cache continues every row as that row alone
    nxt = torch.randint(3, stock.config.vocab_size, (3, 1), generator=g)
    name = cache_argument(model.forward)
    with torch.no_grad():
        step = model(input_ids=nxt, attention_mask=torch.cat([mask, torch.ones_like(nxt)], 1),
                     **{name: output_cache(out)}, use_cache=True)
        for b in range(3):
            row = torch.cat([ids[b][real[b]], nxt[b]])[None]
            alone = stock(input_ids=row).logits[0, -1]
            err = (step.logits[b, -1] - alone).abs().max().item()
            assert err < 1e-4, f"row {b}: the step after the loss call is off by {err:.3g}"
