"""safepad.packed_logprobs: per-token log-probs on packed rows equal each sequence alone through the stock model.

Reference: every sequence (its real tokens only) run alone through the stock, unwrapped model without a cache;
log softmax(logits / temperature) gathered at the next token. Awkward lengths throughout: 1-token completions,
a prompt with no completion, a 1-token sequence, an all-pad row, and sequences longer than half a packed row.
"""

from __future__ import annotations

import copy
import importlib
import logging

import pytest
import torch

import safepad
from safepad.errors import PaddingError
from safepad.testing.tiny import tiny_model


def grpo_batch(spans: list[tuple[int, int]], prompt_width: int, width: int, seed: int = 0):
    """``(input_ids, attention_mask, completion_mask)`` ``[B, width]``: row ``b`` holds ``spans[b] = (p, c)``,
    a prompt of ``p`` tokens left-padded to ``prompt_width`` and a completion of ``c`` tokens right-padded."""
    g = torch.Generator().manual_seed(seed)
    B = len(spans)
    ids = torch.zeros(B, width, dtype=torch.long)
    mask = torch.zeros(B, width, dtype=torch.long)
    completion = torch.zeros(B, width, dtype=torch.long)
    for b, (p, c) in enumerate(spans):
        ids[b, prompt_width - p : prompt_width + c] = torch.randint(3, 250, (p + c,), generator=g)
        mask[b, prompt_width - p : prompt_width + c] = 1
        completion[b, prompt_width : prompt_width + c] = 1
    return ids, mask, completion


def alone_logprobs(stock, input_ids, attention_mask, scored, temperature: float = 1.0) -> torch.Tensor:
    """``[B, T]``: log softmax(logits / temperature) of each token given its own sequence's earlier tokens, each
    sequence run alone through ``stock``; 0 where ``scored`` is 0 and at each sequence's first token."""
    out = torch.zeros(input_ids.shape, dtype=torch.float32)
    rows = []
    for b in range(input_ids.shape[0]):
        idx = attention_mask[b].nonzero().flatten()
        if idx.numel() < 2:
            rows.append(out[b])
            continue
        seq = input_ids[b, idx]
        logits = stock(seq[None], use_cache=False).logits[0].float() / temperature  # [n, V]
        lp = logits.log_softmax(-1)[:-1].gather(-1, seq[1:, None]).squeeze(-1)  # [n - 1]
        row = torch.zeros(input_ids.shape[1]).index_put((idx[1:],), lp * scored[b, idx[1:]].float())
        rows.append(row)
    return torch.stack(rows)


# (prompt, completion) per row; prompts left-padded to 8, completions right-padded: width 8 + 16
SPANS = [(3, 10), (1, 1), (5, 0), (2, 15), (8, 12), (0, 0), (1, 0), (6, 1)]
WIDTH, PROMPT = 24, 8


@pytest.fixture(scope="module", autouse=True)
def _quiet():
    log = logging.getLogger("transformers")
    level = log.level
    log.setLevel(logging.ERROR)
    yield
    log.setLevel(level)


def _models(family: str, **config):
    stock = tiny_model(family, **config)
    return stock, safepad.wrap(copy.deepcopy(stock))


@pytest.mark.parametrize(
    "family, config",
    [
        pytest.param("nemotron_h", {}, id="nemotron_h-hybrid-mamba2"),
        pytest.param("bamba", {}, id="bamba"),
        pytest.param("falcon_h1", {"lm_head_multiplier": 2.5}, id="falcon_h1-lm_head_multiplier"),
        pytest.param("granitemoehybrid", {"logits_scaling": 4.0}, id="granitemoehybrid-logits_scaling"),
        pytest.param("qwen3_next", {}, id="qwen3_next-gated_delta"),
        pytest.param("lfm2", {}, id="lfm2-short_conv"),
        pytest.param("mamba", {}, id="mamba-mamba1"),
        pytest.param("recurrent_gemma", {"logits_soft_cap": 3.0}, id="recurrent_gemma-logits_soft_cap"),
    ],
)
def test_equals_each_sequence_alone(family, config):
    stock, wrapped = _models(family, **config)
    ids, mask, completion = grpo_batch(SPANS, PROMPT, WIDTH)
    seen = []
    hook = wrapped.register_forward_pre_hook(lambda m, a, k: seen.append(k["input_ids"].shape), with_kwargs=True)
    with torch.no_grad():
        out = safepad.packed_logprobs(
            wrapped, ids, mask, completion_mask=completion, temperature=0.7, max_tokens_per_row=26, chunk_size=7
        )
        ref = alone_logprobs(stock, ids, mask, completion, temperature=0.7)
    hook.remove()
    assert seen[0][1] == 26 and seen[0][0] < len(SPANS), seen  # packed: fewer rows than the batch
    assert torch.isfinite(out).all()
    assert out.shape == ids.shape and out.dtype == torch.float32
    assert (out[completion == 0] == 0).all()
    assert (out - ref).abs().max().item() < 1e-5


def test_every_real_token_by_default():
    """No completion_mask: every real token but each sequence's first is scored; the default row length is the
    longest sequence (20 here: two sequences longer than half a row share no row)."""
    stock, wrapped = _models("nemotron_h")
    ids, mask, _ = grpo_batch(SPANS, PROMPT, WIDTH, seed=1)
    with torch.no_grad():
        out = safepad.packed_logprobs(wrapped, ids, mask)
        ref = alone_logprobs(stock, ids, mask, mask)
    assert (out != 0).sum() == (mask.sum(1).clamp(min=1) - 1).sum()
    assert (out - ref).abs().max().item() < 1e-5


def test_the_stock_model_on_the_same_packed_rows_is_wrong(monkeypatch):
    """What the wrap check prevents: stock Mamba runs the state from one packed sequence into the next, stock
    Nemotron-H's torch fallback refuses ``seq_idx``."""
    monkeypatch.setattr(importlib.import_module("safepad.rl"), "is_wrapped", lambda m: True)
    ids, mask, completion = grpo_batch(SPANS, PROMPT, WIDTH)
    stock, _ = _models("mamba")
    with torch.no_grad():
        out = safepad.packed_logprobs(stock, ids, mask, completion_mask=completion, max_tokens_per_row=26)
        assert (out - alone_logprobs(stock, ids, mask, completion)).abs().max().item() > 0.5
        with pytest.raises(ValueError, match="packed sequences"):
            safepad.packed_logprobs(_models("nemotron_h")[0], ids, mask, max_tokens_per_row=26)


def test_gradients_equal_the_per_sequence_ones():
    stock, wrapped = _models("nemotron_h")
    stock.train()
    wrapped.train()
    ids, mask, completion = grpo_batch(SPANS, PROMPT, WIDTH, seed=2)
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(0))
    (safepad.packed_logprobs(wrapped, ids, mask, completion_mask=completion, chunk_size=5) * weights).sum().backward()
    (alone_logprobs(stock, ids, mask, completion) * weights).sum().backward()
    worst = 0.0
    for (name, p), q in zip(stock.named_parameters(), wrapped.parameters()):
        if p.grad is None:
            assert q.grad is None or not q.grad.any(), name
            continue
        worst = max(worst, ((q.grad - p.grad).abs().max() / p.grad.abs().max().clamp(min=1e-12)).item())
        assert torch.isfinite(q.grad).all(), name
    assert worst < 1e-4


def test_refusals():
    stock, wrapped = _models("nemotron_h")
    ids, mask, completion = grpo_batch(SPANS, PROMPT, WIDTH)
    with pytest.raises(PaddingError, match="safepad.wrap"):
        safepad.packed_logprobs(stock, ids, mask)
    holes = mask.clone()
    holes[0, PROMPT] = 0
    with pytest.raises(PaddingError, match="row 0 .* pads between real tokens"):
        safepad.packed_logprobs(wrapped, ids, holes)
    with pytest.raises(ValueError, match="never cuts a sequence; raise max_tokens_per_row to at least 20"):
        safepad.packed_logprobs(wrapped, ids, mask, max_tokens_per_row=12)
    with pytest.raises(ValueError, match="temperature must be positive"):
        safepad.packed_logprobs(wrapped, ids, mask, temperature=0.0)
    with pytest.raises(ValueError, match="only 0 and 1"):
        safepad.packed_logprobs(wrapped, ids, mask * 2)


def test_entropy_is_that_of_the_tempered_distribution():
    stock, wrapped = _models("lfm2")
    ids, mask, completion = grpo_batch(SPANS[:4], PROMPT, WIDTH)
    with torch.no_grad():
        _, ent = safepad.packed_logprobs_and_entropy(wrapped, ids, mask, completion_mask=completion, temperature=0.5)
        b, t = 3, PROMPT + 4  # a completion token of row 3
        idx = mask[b].nonzero().flatten()
        logits = stock(ids[b, idx][None]).logits[0, t - int(idx[0]) - 1].float() / 0.5
    expected = -(logits.softmax(-1) * logits.log_softmax(-1)).sum()
    assert abs(ent[b, t].item() - expected.item()) < 1e-5
    assert (ent[completion == 0] == 0).all()
