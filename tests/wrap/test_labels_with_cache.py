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


def _right_padded_batch(vocab: int):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, vocab, (3, 8), generator=g)
    mask = torch.tensor([[1] * 5 + [0] * 3, [1] * 8, [1] * 3 + [0] * 5])
    return ids, mask, ids.masked_fill(mask == 0, -100)


@pytest.mark.parametrize("keep", [
    pytest.param(1, id="keep-last"),
    pytest.param(3, id="keep-3"),
    pytest.param(torch.tensor([5, 6, 7]), id="keep-index-tensor"),
])
@pytest.mark.parametrize("family, overrides", FAMILIES[::2])
def test_labels_with_logits_to_keep_short_of_the_labels_raises_naming_the_fix(family, overrides, keep):
    """Labels with ``logits_to_keep`` keeping fewer positions than the labels hold, on a re-laid cached call: stock
    fails inside its loss (a batch-size mismatch that names neither argument); the wrapped model refuses the call
    before the forward, naming both and the fix."""
    ok, why = family_available(family)
    if not ok:
        pytest.skip(why)
    stock = tiny_model(family, **overrides)
    model = safepad.wrap(tiny_model(family, **overrides))
    ids, mask, labels = _right_padded_batch(stock.config.vocab_size)
    with torch.no_grad(), pytest.raises(ValueError, match="batch_size"):
        stock(input_ids=ids, attention_mask=mask, labels=labels, use_cache=True, logits_to_keep=keep)
    with torch.no_grad(), pytest.raises(ValueError, match=r"labels together with logits_to_keep.*logits_to_keep=0"):
        model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=True, logits_to_keep=keep)


@pytest.mark.parametrize("keep", [pytest.param(8, id="keep-every"), pytest.param(20, id="keep-more")])
def test_labels_with_logits_to_keep_of_every_position_scores_each_row_alone(keep):
    """``logits_to_keep`` covering every position (stock serves it) on a re-laid cached loss call: the loss and the
    logits of real tokens equal each row alone through stock."""
    stock = tiny_model("nemotron_h")
    model = safepad.wrap(tiny_model("nemotron_h"))
    ids, mask, labels = _right_padded_batch(stock.config.vocab_size)
    real = mask.bool()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=True, logits_to_keep=keep)
        alone = [stock(input_ids=ids[b][real[b]][None]).logits[0] for b in range(3)]
    logits = torch.cat([a[:-1] for a in alone])  # each row's next-token logits
    targets = torch.cat([ids[b][real[b]][1:] for b in range(3)])
    ref = torch.nn.functional.cross_entropy(logits.float(), targets)
    assert torch.allclose(out.loss, ref, atol=1e-5, rtol=1e-5), (out.loss.item(), ref.item())
    for b in range(3):
        assert (out.logits[b][real[b]] - alone[b]).abs().max().item() < 1e-4
