"""A cached call's attention_mask may not edit the columns its cache has read (safepad.wrap.mask_history).

A column that was 1 at an earlier call and is 0 now (or the reverse) asks the recurrent states to unsee a token
(or to have seen one they skipped): stock answers it silently wrong (nemotron_h 0.54 off both readings). Wrapped,
such a call raises a ValueError naming the row and the column; an unedited hand-written decode loop (any mask
dtype, chunks and one-token steps) equals each row alone through the stock model without a cache.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

import safepad
from safepad.cache import cache_argument
from safepad.testing.tiny import tiny_model

from .helpers import family_param

pytestmark = pytest.mark.usefixtures("quiet_transformers")

FAMILIES = ["nemotron_h", "qwen3_next", "jamba", "recurrent_gemma", "lfm2"]


@pytest.fixture(scope="module", params=[family_param(f) for f in FAMILIES])
def models(request):
    stock = tiny_model(request.param)
    return stock, safepad.wrap(copy.deepcopy(stock))


def _kw(model, cache) -> dict:
    return {cache_argument(model.forward): cache}


def _prefill(wrapped, dtype=torch.long):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (2, 5), generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    cache = DynamicCache(config=wrapped.config)
    with torch.no_grad():
        wrapped(input_ids=ids, attention_mask=mask.to(dtype), **_kw(wrapped, cache), use_cache=True)
    return ids, mask, cache


@torch.no_grad()
@pytest.mark.parametrize("T", [pytest.param(1, id="step"), pytest.param(2, id="chunk")])
@pytest.mark.parametrize("edit", [pytest.param((0, 1), id="1_to_0"), pytest.param((1, 0), id="0_to_1")])
@pytest.mark.parametrize("dtype", [torch.long, torch.bool, torch.float32], ids=str)
def test_an_edit_of_read_columns_raises(models, T, edit, dtype):
    _, wrapped = models
    ids, mask, cache = _prefill(wrapped, dtype)
    full = torch.cat([mask, torch.ones(2, T, dtype=torch.long)], 1)
    row, col = edit
    full[row, col] = 1 - full[row, col]
    new = torch.randint(3, 200, (2, T), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match=rf"attention_mask\[{row}, {col}\] is {int(full[row, col])}.*unchanged"):
        wrapped(input_ids=new, attention_mask=full.to(dtype), **_kw(wrapped, cache), use_cache=True)


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.long, torch.bool, torch.float32], ids=str)
def test_an_unedited_decode_loop_equals_each_row_alone(models, dtype):
    """A chunk of 2, then two one-token steps (the mask extended with ones each time, a new tensor every call,
    and once the same buffer sliced): each row's last logits equal its real tokens alone, cache-free."""
    stock, wrapped = models
    ids, mask, cache = _prefill(wrapped, dtype)
    g = torch.Generator().manual_seed(2)
    rows = [ids[b][mask[b].bool()] for b in range(2)]
    buf = torch.cat([mask, torch.ones(2, 4, dtype=torch.long)], 1).to(dtype)  # [B, 9]
    for T in (2, 1, 1):
        new = torch.randint(3, 200, (2, T), generator=g)
        M = cache.get_seq_length() + T
        out = wrapped(input_ids=new, attention_mask=buf[:, :M], **_kw(wrapped, cache), use_cache=True).logits
        rows = [torch.cat([r, new[b]]) for b, r in enumerate(rows)]
        for b, r in enumerate(rows):
            ref = stock(input_ids=r[None], use_cache=False).logits[0, -1]
            torch.testing.assert_close(out[b, -1], ref, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_the_record_follows_row_selection_and_reset(models):
    """batch_select_indices moves the record with the rows; reset() forgets it."""
    _, wrapped = models
    ids, mask, cache = _prefill(wrapped)
    cache.batch_select_indices(torch.tensor([1]))
    new = torch.tensor([[7]])
    bad = torch.tensor([[1, 0, 1, 1, 1, 1]])  # row 1's column 0 was a pad
    with pytest.raises(ValueError, match=r"attention_mask\[0, 0\] is 1"):
        wrapped(input_ids=new, attention_mask=bad, **_kw(wrapped, cache), use_cache=True)
    wrapped(input_ids=new, attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1]]), **_kw(wrapped, cache), use_cache=True)
    cache.reset()
    wrapped(input_ids=ids[:1], attention_mask=torch.ones(1, 5, dtype=torch.long), **_kw(wrapped, cache),
            use_cache=True)


@torch.no_grad()
def test_a_hand_written_step_after_generate(models):
    """generate's own masks are not checked (it never edits history); a step continuing its cache with the
    extended mask is served, one editing the prompt's columns raises."""
    _, wrapped = models
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (2, 5), generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    cache = DynamicCache(config=wrapped.config)
    out = wrapped.generate(input_ids=ids, attention_mask=mask, **_kw(wrapped, cache), max_new_tokens=3,
                           do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    seq = out.sequences
    full = torch.cat([mask, torch.ones(2, seq.shape[1] - 5, dtype=torch.long)], 1)  # [B, 8]: 7 cached + the last
    M = cache.get_seq_length() + 1
    step = wrapped(input_ids=seq[:, -1:], attention_mask=full[:, :M], **_kw(wrapped, cache), use_cache=True)
    assert step.logits.shape[:2] == (2, 1)
    bad = torch.cat([full[:, :M], torch.ones(2, 1, dtype=torch.long)], 1)
    bad[1, 0] = 1
    with pytest.raises(ValueError, match=r"attention_mask\[1, 0\] is 1"):
        wrapped(input_ids=seq[:, -1:], attention_mask=bad, **_kw(wrapped, cache), use_cache=True)
