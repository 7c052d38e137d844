"""packed_logprobs applies the model's own output head: every family, bf16 Mamba-family models, empty inputs.

Reference: each sequence alone through the stock, unwrapped model (``alone_logprobs``): the log softmax of the
model's own logits. The RL path once re-implemented each family's logit transform (and missed Inkling's
``logits_mup_width_multiplier`` and ``unpadded_vocab_size``, 5-15 nats off) and fed the float32 hidden states of
a bf16 Mamba / Mamba2 / FalconMamba backbone to the bf16 LM head (a dtype error; the model's forward casts them).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import safepad
from safepad.testing.tiny import family_available, family_names, tiny_model

from .test_packed_logprobs import PROMPT, SPANS, WIDTH, alone_logprobs, grpo_batch

FAMILIES = [f for f in family_names() if family_available(f)[0]]


@pytest.fixture(scope="module", autouse=True)
def _quiet():
    log = logging.getLogger("transformers")
    level = log.level
    log.setLevel(logging.ERROR)
    yield
    log.setLevel(level)


@pytest.mark.parametrize("family", FAMILIES)
def test_equals_the_models_own_logits_on_every_family(family):
    stock = tiny_model(family)
    wrapped = safepad.wrap(copy.deepcopy(stock))
    ids, mask, completion = grpo_batch(SPANS, PROMPT, WIDTH, seed=3)
    with torch.no_grad():
        out, ent = safepad.packed_logprobs_and_entropy(
            wrapped, ids, mask, completion_mask=completion, temperature=0.8, max_tokens_per_row=26, chunk_size=7
        )
        ref = alone_logprobs(stock, ids, mask, completion, temperature=0.8)
    assert out.shape == ids.shape and out.dtype == torch.float32
    assert torch.isfinite(out).all() and torch.isfinite(ent).all()
    assert (out[completion == 0] == 0).all()
    # log-probs of O(5) nats in float32: the packed rows and the rows alone differ only by rounding (~1e-6)
    assert (out - ref).abs().max().item() < 1e-4, family


@pytest.mark.parametrize("family", ["inkling_text", "inkling2_text"])
def test_inkling_logit_transform_comes_from_the_model(family):
    """A μP width multiplier and a padded vocabulary that a re-implemented transform would miss: the model's own
    forward divides the hidden states by the multiplier and cuts the logits to ``unpadded_vocab_size``."""
    stock = tiny_model(family, logits_mup_width_multiplier=4.0, unpadded_vocab_size=200, vocab_size=256)
    wrapped = safepad.wrap(copy.deepcopy(stock))
    ids, mask, completion = grpo_batch(SPANS, PROMPT, WIDTH, seed=4)
    ids = ids.clamp(max=199)
    with torch.no_grad():
        assert stock(ids[:1, PROMPT - 3 :]).logits.shape[-1] == 200
        out = safepad.packed_logprobs(wrapped, ids, mask, completion_mask=completion, chunk_size=5)
        ref = alone_logprobs(stock, ids, mask, completion)
    assert (out - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", ["mamba", "mamba2", "falcon_mamba"])
def test_bf16_mamba_family_without_autocast(family):
    """The backbone hands the head float32 hidden states; the model's forward casts them to the head's dtype.

    Tolerance from the rounding measured here: bf16 log-probs of the stock model vs the same weights in float32,
    each sequence alone; packed bf16 log-probs may be off the float32 ones by a few times that, no more."""
    stock = tiny_model(family, dtype=torch.bfloat16)
    wrapped = safepad.wrap(copy.deepcopy(stock))
    stock32 = copy.deepcopy(stock).float()
    ids, mask, completion = grpo_batch(SPANS, PROMPT, WIDTH, seed=5)
    with torch.no_grad():
        out = safepad.packed_logprobs(wrapped, ids, mask, completion_mask=completion, max_tokens_per_row=26)
        ref = alone_logprobs(stock, ids, mask, completion)  # the model's own bf16 logits, log-softmaxed
        ref32 = alone_logprobs(stock32, ids, mask, completion)
    noise = (ref - ref32).abs().max().item()
    assert 0 < noise < 1.0
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert (out - ref32).abs().max().item() <= 3 * noise
    assert (out - ref).abs().max().item() <= 3 * noise


def test_empty_inputs_give_empty_results():
    """``T = 0`` (and ``B = 0``): nothing to score; the result has the caller's ``[B, T]`` shape, as for all-pad
    rows (zeros), and the model is not called."""
    wrapped = safepad.wrap(tiny_model("nemotron_h"))
    calls = []
    hook = wrapped.register_forward_pre_hook(lambda *a: calls.append(1))
    for B, T in ((3, 0), (0, 5), (0, 0)):
        ids = torch.zeros(B, T, dtype=torch.long)
        for mask in (None, torch.zeros(B, T, dtype=torch.long)):
            out = safepad.packed_logprobs(wrapped, ids, mask, completion_mask=mask)
            lp, ent = safepad.packed_logprobs_and_entropy(wrapped, ids, mask)
            for t in (out, lp, ent):
                assert t.shape == (B, T) and t.dtype == torch.float32
    # all-pad rows: zeros of the caller's shape
    out = safepad.packed_logprobs(wrapped, torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long))
    assert out.shape == (2, 4) and not out.any()
    hook.remove()
    assert not calls
