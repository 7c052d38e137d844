"""Mamba2 family × every behaviour: wrapped == each sequence alone through the stock model; stock fails.

Families: Nemotron-H, Mamba2, Bamba, Falcon-H1, GraniteMoeHybrid, Zamba2 (tiny strengthened models, fp32 CPU,
max |Δ logits| <= 1e-4). The scenario engine (``safepad.testing.scenarios``) is the reference: every sequence
run alone, without padding and without a cache, through the unwrapped model.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import safepad
from safepad.cache import cache_argument, output_cache
from safepad.testing.scenarios import SCENARIOS, packed_loss_grad_errors, run_scenario
from safepad.testing.tiny import MAMBA2_FAMILIES, tiny_model

from .helpers import packed_batch

#: Scenarios the stock transformers 5.23 model already gets right (cross-checks, not fixes). Everything else
#: must FAIL on the stock model — this is what shows each test can fail.
#: nemotron_h / zamba2 hard-code time_step_limit = (time_step_min, inf) and stock decode skips that clamp, so
#: every scenario that decodes (left padding, generate) is wrong for them against the full-forward reference.
#: From transformers 5.25 on, Nemotron-H's default time_step_limit has no floor (tests/testing/test_scenarios.py),
#: so its stock decode agrees with its full forward there.
_TF525 = tuple(int(p) for p in transformers.__version__.split(".")[:2]) >= (5, 25)
_DECODE_CLAMP_OK = {"mamba2", "bamba", "falcon_h1", "granitemoehybrid"} | ({"nemotron_h"} if _TF525 else set())
STOCK_OK = {
    "left_pad_decode": _DECODE_CLAMP_OK,
    "chunked_prefill": set(MAMBA2_FAMILIES),
    "decode_default": _DECODE_CLAMP_OK,
    "generate": _DECODE_CLAMP_OK,
}

_MODELS: dict[str, tuple] = {}


def _models(family: str):
    """(stock, wrapped, reference) with identical weights, built once per family."""
    if family not in _MODELS:
        stock = tiny_model(family)
        _MODELS[family] = (stock, safepad.wrap(copy.deepcopy(stock)), copy.deepcopy(stock))
    return _MODELS[family]


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("family", MAMBA2_FAMILIES)
def test_behaviour(family, scenario):
    stock, wrapped, ref = _models(family)
    res = run_scenario(wrapped, ref, scenario)
    assert res.passed, (res.status, res.max_abs_logits, res.state_errors, res.error, res.mismatched_tokens)
    stock_res = run_scenario(stock, ref, scenario)
    if family in STOCK_OK.get(scenario, ()):
        assert stock_res.passed, f"stock {family} was expected to get {scenario} right: {stock_res}"
    else:
        assert not stock_res.passed, f"stock {family} unexpectedly passes {scenario}: the test proves nothing"


@pytest.mark.parametrize("boundaries", ["position_ids", "seq_idx", "cu_seq_lens"])
@pytest.mark.parametrize("family", MAMBA2_FAMILIES)
def test_packed_loss_and_gradients(family, boundaries):
    stock, wrapped, ref = _models(family)
    errs = packed_loss_grad_errors(wrapped, ref, boundaries)
    assert errs["loss_rel"] < 1e-5 and errs["grad_rel"] < 1e-4, errs
    if boundaries == "position_ids":  # stock: silently wrong (seq_idx raises, cu_seq_lens is dropped)
        bad = packed_loss_grad_errors(stock, ref, boundaries)
        assert bad["grad_rel"] > 1e-2, bad


@pytest.mark.parametrize("family", [f for f in MAMBA2_FAMILIES if f != "mamba2"])
def test_hybrid_attention_sees_seq_idx_boundaries_without_position_ids(family):
    """Only seq_idx is given: safepad must derive restarting positions so the attention layers split too."""
    stock, wrapped, ref = _models(family)
    seqs, ids, seq_idx, cu, _ = packed_batch([4, 19, 10])
    with torch.no_grad():
        alone = torch.cat([ref(input_ids=s[None], use_cache=False).logits[0] for s in seqs])
        for kw in (dict(seq_idx=seq_idx), dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu)):
            got = wrapped(input_ids=ids, **kw).logits[0]
            assert (got - alone).abs().max() < 1e-4


def test_packed_training_with_config_default_use_cache_builds_no_cache():
    stock, wrapped, ref = _models("nemotron_h")
    assert wrapped.config.use_cache  # the default that a Trainer step leaves in place
    _, ids, seq_idx, _, pos = packed_batch([6, 9])
    out = wrapped(input_ids=ids, seq_idx=seq_idx, position_ids=pos)
    assert output_cache(out) is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        pytest.param(dict(use_cache=True), "cannot be used with a cache", id="packed+use_cache"),
        pytest.param(dict(seq_idx=torch.tensor([[0, 0, 1, 1, 0, 1, 1, 2]], dtype=torch.int32)), "decreases", id="seq_idx-decreasing"),
        pytest.param(dict(seq_idx=torch.zeros(1, 8)), "integer dtype", id="seq_idx-float"),
        pytest.param(dict(seq_idx=torch.zeros(1, 7, dtype=torch.int32)), "shape", id="seq_idx-shape"),
        pytest.param(dict(cu_seq_lens_q=torch.tensor([0, 3, 7], dtype=torch.int32)), "add up to the row length", id="cu-sum"),
        pytest.param(dict(cu_seq_lens_q=torch.tensor([0, 3, 8], dtype=torch.int32),
                          cu_seq_lens_k=torch.tensor([0, 4, 8], dtype=torch.int32)), "differ", id="cu-q-vs-k"),
        pytest.param(dict(cu_seq_lens_q=torch.tensor([0, 3, 8], dtype=torch.int32),
                          seq_idx=torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]], dtype=torch.int32)), "disagrees with seq_idx", id="cu-vs-seq_idx"),
        pytest.param(dict(seq_idx=torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]], dtype=torch.int32),
                          position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])), "position_ids disagree", id="pos-vs-seq_idx"),
        pytest.param(dict(seq_idx=torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]], dtype=torch.int32),
                          attention_mask=torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1]])), "may only end in padding", id="packed+hole"),
    ],
)
def test_inputs_that_cannot_be_made_correct_raise(kwargs, match):
    _, wrapped, _ = _models("nemotron_h")
    ids = torch.randint(3, 200, (1, 8))
    if not any(k in kwargs for k in ("seq_idx", "cu_seq_lens_q")):
        kwargs = {**kwargs, "seq_idx": torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]], dtype=torch.int32)}
    with pytest.raises(ValueError, match=match):
        wrapped(input_ids=ids, **kwargs)


def test_mask_holes_with_cache_are_compacted():
    """A row with holes in its mask equals the row with the holes removed (pure SSM model: no positions)."""
    stock, wrapped, ref = _models("mamba2")
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(3, 200, (9,), generator=g), torch.randint(3, 200, (12,), generator=g)
    ids = torch.stack([torch.cat([a[:4], torch.zeros(2, dtype=torch.long), a[4:], torch.zeros(1, dtype=torch.long)]), b])
    mask = (torch.arange(12)[None] < 12).long().repeat(2, 1)
    mask[0, 4:6] = 0
    mask[0, 11] = 0
    nxt = torch.tensor([[5], [6]])
    with torch.no_grad():
        out = wrapped(input_ids=ids, attention_mask=mask, use_cache=True)
        step = wrapped(input_ids=nxt, **{cache_argument(wrapped): output_cache(out)}, use_cache=True,
                       attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)).logits[:, -1]
        full_a = ref(input_ids=torch.cat([a, nxt[0]])[None]).logits[0]
        full_b = ref(input_ids=torch.cat([b, nxt[1]])[None]).logits[0]
        real = mask[0].bool()
        assert (out.logits[0, real] - full_a[:-1]).abs().max() < 1e-4
        assert (step[0] - full_a[-1]).abs().max() < 1e-4
        assert (step[1] - full_b[-1]).abs().max() < 1e-4
        stock_out = stock(input_ids=ids, attention_mask=mask, use_cache=True)
        stock_kw = {cache_argument(stock): output_cache(stock_out)}
        stock_step = stock(input_ids=nxt, **stock_kw, use_cache=True).logits[:, -1]
        assert (stock_step[0] - full_a[-1]).abs().max() > 1e-3


def test_gradient_checkpointing_keeps_packed_boundaries():
    """Recomputed mixer forwards (during backward) must see the same boundaries as the first forward."""
    stock, _, _ = _models("nemotron_h")
    plain = safepad.wrap(copy.deepcopy(stock)).train()
    ckpt = safepad.wrap(copy.deepcopy(stock)).train()
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    _, ids, seq_idx, _, pos = packed_batch([5, 13, 8])
    labels = ids.clone()
    labels[0, [0, 5, 18]] = -100
    grads = []
    for m in (plain, ckpt):
        m.zero_grad()
        m(input_ids=ids, labels=labels, seq_idx=seq_idx).loss.backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["nemotron_h", "mamba2"])
def test_masked_decode_token_leaves_row_states_untouched(family):
    """A one-token step whose 2-D mask marks a row's new token as padding must not move that row's states
    (transformers hands recurrent layers no mask on one-token steps, so stock updates them)."""
    from safepad.testing.scenarios import cache_states

    stock, wrapped, _ = _models(family)
    ck = cache_argument(stock)
    ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, -1] = 0  # row 1's decode token is padding
    for model, expect_ok in ((wrapped, True), (stock, False)):
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True)
            cache = output_cache(out)
            before = {k: v.clone() for k, v in cache_states(cache).items()}
            model(input_ids=torch.tensor([[7], [0]]), attention_mask=mask, use_cache=True, **{ck: cache})
            after = cache_states(cache)
        held = all(torch.equal(after[k][1], before[k][1]) for k in before)
        moved = all(not torch.equal(after[k][0], before[k][0]) for k in before)
        assert moved
        assert held == expect_ok
