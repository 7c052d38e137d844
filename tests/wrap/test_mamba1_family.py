"""Mamba1 family (mamba, falcon_mamba, jamba) under ``safepad.wrap``: every layout vs each sequence run alone.

The oracle is the stock model running each sequence alone, unpadded, in one forward (fp32, CPU). Each
behaviour test also runs the stock model on the same layout and asserts that it is wrong there (error
> 1e-3, or it raises), so a test that passes for the wrong reason would show up. Where the stock model
is already right (token decode without a mask, left-padded ``generate``), the test says so and checks
that wrapping keeps it right.

Cached states are compared relative to their magnitude: the strengthened tiny Mamba's SSM states reach
~1e3, where fp32 summation order alone moves them by ~1e-4 absolute.
"""

from __future__ import annotations

import copy
import functools
import inspect
import itertools

import pytest
import torch
import torch.nn.functional as F

import safepad
from safepad.cache import cache_argument, output_cache
from safepad.testing.tiny import tiny_model
from safepad.wrap import wrapped_modules

from .helpers import packed_batch

FAMILIES = ("mamba", "falcon_mamba", "jamba")
MIXER_CLASS = {"mamba": "MambaMixer", "falcon_mamba": "FalconMambaMixer", "jamba": "JambaMambaMixer"}
TOL = 1e-4  # max |Δ logits|, fp32
STATE_RTOL = 1e-5  # cached states: |Δ| <= STATE_RTOL * max(1, max |ref|) + TOL
BROKEN = 1e-3  # the stock model counts as wrong above this
PACKED_LENS = [1, 3, 9, 6]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from intra-op threads, and under ``pytest -n 2`` on 2 cores the threads of two
    workers contend (10x slower here); restored after the module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.cache
def _models(family: str):
    """(stock, wrapped) tiny models with identical weights; tests must leave them unchanged."""
    stock = tiny_model(family)
    return stock, safepad.wrap(copy.deepcopy(stock))


def _cache_kw(model) -> str:
    return cache_argument(model)  # cache_params / past_key_values on transformers 5.23, cache on 5.24


def _takes_positions(model) -> bool:
    return "position_ids" in inspect.signature(model.forward).parameters


def _run(model, ids, *, mask=None, positions=None, cache=None, use_cache=False, **kw):
    """-> (logits [B, L, V] fp32, cache or None)."""
    args = {"input_ids": ids, "use_cache": use_cache, **kw}
    if mask is not None:
        args["attention_mask"] = mask
    if positions is not None and _takes_positions(model):
        args["position_ids"] = positions
    if cache is not None:
        args[_cache_kw(model)] = cache
    with torch.no_grad():
        out = model(**args)
    return out.logits.float(), (output_cache(out) if use_cache else None)


def _states(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(conv [B, I, K], ssm [B, I, N]) of every Mamba layer of a transformers cache."""
    out = []
    for layer in cache.layers:
        conv = getattr(layer, "conv_states", {}).get(0)
        if conv is not None:
            out.append((conv.clone(), layer.recurrent_states[0].clone()))
    return out


def _state_err(got: list, row: int, ref: list) -> float:
    """Worst scaled error of row ``row`` of ``got`` vs row 0 of ``ref`` (0 when within tolerance)."""
    worst = 0.0
    assert len(got) == len(ref) > 0
    for (gc, gs), (rc, rs) in zip(got, ref):
        for g, r in ((gc[row], rc[0]), (gs[row], rs[0])):
            err = (g.float() - r.float()).abs().max().item()
            worst = max(worst, err / (TOL + STATE_RTOL * max(1.0, r.abs().max().item())))
    return worst * TOL  # in units comparable to TOL


def _alone(stock, seq: torch.Tensor, cached: bool = False):
    """``seq`` [L] alone through the stock model: (logits [L, V], states after it or None)."""
    logits, cache = _run(stock, seq[None], positions=torch.arange(seq.numel())[None], use_cache=cached)
    return logits[0], (_states(cache) if cached else None)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _stock_error(fn) -> float:
    """``fn()`` -> error; a stock model that raises counts as infinitely wrong."""
    try:
        return fn()
    except (RuntimeError, ValueError, IndexError):
        return float("inf")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _tokens(g: torch.Generator, n: int) -> torch.Tensor:
    return torch.randint(3, 250, (n,), generator=g)


# ----------------------------------------------------------------------------------------------------------
# wrap contract
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_wrap_patches_every_mamba_mixer_and_unwraps(family):
    stock, wrapped = _models(family)
    names = [n for n, _ in wrapped_modules(wrapped)]
    n_mixers = sum(type(m).__name__ == MIXER_CLASS[family] for m in stock.modules())
    assert len(names) == n_mixers >= 1
    assert {type(m).__name__ for _, m in wrapped_modules(wrapped)} == {f"Safepad{MIXER_CLASS[family]}"}
    assert f"safepad=mamba1:{family}" in repr(wrapped)
    ids = _tokens(_gen(1), 13)[None]
    # one unpadded row is a layout the stock model gets right: wrapping must not change it
    assert _err(_run(wrapped, ids)[0], _run(stock, ids)[0]) <= TOL
    m = safepad.unwrap(copy.deepcopy(wrapped))
    assert not safepad.is_wrapped(m) and repr(m) == repr(stock)
    assert torch.equal(_run(m, ids)[0], _run(stock, ids)[0])


# ----------------------------------------------------------------------------------------------------------
# packed rows
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "source",
    [
        pytest.param("seq_idx", id="seq_idx-only"),
        pytest.param("cu_seq_lens", id="cu_seq_lens-only"),
        pytest.param("position_ids", id="restarting-position_ids"),
    ],
)
def test_packed_row_matches_each_sequence_alone(family, source):
    stock, wrapped = _models(family)
    seqs, ids, seq_idx, cu, pos = packed_batch(PACKED_LENS, seed=2)
    kw = {
        "seq_idx": {"seq_idx": seq_idx},
        "cu_seq_lens": {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 9, "max_length_k": 9},
        "position_ids": {"position_ids": pos},
    }[source]
    expected = torch.cat([_alone(stock, s)[0] for s in seqs])  # [T, V]
    got = _run(wrapped, ids, **kw)[0][0]
    assert _err(got, expected) <= TOL
    assert _stock_error(lambda: _err(_run(stock, ids, **kw)[0][0], expected)) > BROKEN


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_bf16_is_as_close_to_fp32_as_stock_alone(family):
    """bf16: the packed wrapped row is no further from the fp32 oracle than the stock bf16 model run alone."""
    stock, _ = _models(family)
    stock16 = copy.deepcopy(stock).to(torch.bfloat16)
    wrapped16 = safepad.wrap(copy.deepcopy(stock16))
    seqs, ids, seq_idx, _, _ = packed_batch(PACKED_LENS, seed=11)
    oracle = torch.cat([_alone(stock, s)[0] for s in seqs])  # fp32 [T, V]
    noise = _err(torch.cat([_alone(stock16, s)[0] for s in seqs]), oracle)  # bf16 rounding of the stock model
    got = _run(wrapped16, ids, seq_idx=seq_idx)[0][0]
    assert _err(got, oracle) <= 1.25 * noise + 1e-2
    stock_packed = _run(stock16, ids, seq_idx=seq_idx)[0][0]
    assert _err(stock_packed, oracle) > 2 * noise + 1e-2


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["eval", pytest.param("train", id="train-gradient-checkpointing")])
def test_packed_loss_and_parameter_grads_match_per_sequence(family, mode):
    stock, wrapped = _models(family)
    if mode == "train":  # a Trainer step: train mode, checkpointed layers re-run the mixers in backward
        stock, wrapped = copy.deepcopy(stock).train(), copy.deepcopy(wrapped).train()
        wrapped.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    seqs, ids, seq_idx, _, pos = packed_batch(PACKED_LENS, seed=3)
    bounds = torch.tensor([0, *PACKED_LENS]).cumsum(0).tolist()

    def seq_loss(logits, s):  # next-token loss inside one sequence: [L, V], [L]
        return F.cross_entropy(logits[:-1], s[1:], reduction="sum") if s.numel() > 1 else logits.sum() * 0

    def packed_loss(model):
        logits = model(input_ids=ids, seq_idx=seq_idx, position_ids=pos, use_cache=False).logits[0].float()
        return sum(seq_loss(logits[a:b], ids[0, a:b]) for a, b in itertools.pairwise(bounds))

    def grads(model, loss_fn):
        model.zero_grad(set_to_none=True)
        loss = loss_fn()
        loss.backward()
        g = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return loss.item(), g

    ref_loss, ref_g = grads(stock, lambda: sum(seq_loss(stock(input_ids=s[None], use_cache=False).logits[0].float(), s) for s in seqs))
    scale = max(g.abs().max().item() for g in ref_g.values())

    def errors(model):
        loss, g = grads(model, lambda: packed_loss(model))
        assert g.keys() == ref_g.keys()
        return abs(loss - ref_loss) / abs(ref_loss), max(_err(g[n], ref_g[n]) for n in ref_g) / scale

    loss_rel, grad_rel = errors(wrapped)
    assert loss_rel <= TOL and grad_rel <= TOL
    # the mixers' own parameters get gradients (nothing detached on the safepad path)
    mixer_params = [n for n in ref_g if any(k in n for k in ("A_log", "dt_proj", "x_proj", "conv1d", ".D"))]
    assert len(mixer_params) >= 5
    stock_loss_rel, stock_grad_rel = errors(stock)
    assert max(stock_loss_rel, stock_grad_rel) > BROKEN


# ----------------------------------------------------------------------------------------------------------
# padded prefill, chunked continuation, decode
# ----------------------------------------------------------------------------------------------------------


def _padded(seqs: list[torch.Tensor], side: str):
    """(ids [B, W], mask [B, W], generate-style position ids [B, W])."""
    longest = max(s.numel() for s in seqs)
    width = 2 * longest - 1 if side == "holes" else longest
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for b, s in enumerate(seqs):
        n = s.numel()
        if side == "right":
            ids[b, :n], mask[b, :n] = s, 1
        elif side == "left":
            ids[b, width - n :], mask[b, width - n :] = s, 1
        else:  # "holes": one pad between each pair of real tokens, then trailing pads
            ids[b, 0 : 2 * n : 2], mask[b, 0 : 2 * n : 2] = s, 1
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    return ids, mask, pos


def _padded_prefill_continue_decode(model, stock, family, side, *, seed=4):
    """Padded cached prefill -> 3-token continuation chunk -> 1 decode token, full-length masks throughout.

    Returns (max logits error, max scaled state error after the prefill, after the decode).
    """
    g = _gen(seed)
    lens = [5, 11, 8] if side != "holes" else [3, 6, 5]
    seqs = [_tokens(g, n) for n in lens]
    cont = [_tokens(g, 4) for _ in seqs]  # 3 continuation tokens + 1 decode token per row
    ids, mask, pos = _padded(seqs, side)
    logits, cache = _run(model, ids, mask=mask, positions=pos, use_cache=True)
    err, s_pre, s_end = 0.0, 0.0, 0.0
    prefill_states = _states(cache)
    for b, s in enumerate(seqs):
        ref_logits, ref_states = _alone(stock, s, cached=True)
        err = max(err, _err(logits[b, mask[b].bool()], ref_logits))
        s_pre = max(s_pre, _state_err(prefill_states, b, ref_states))
    n = torch.tensor(lens)[:, None]
    chunk = torch.stack([c[:3] for c in cont])  # [B, 3]
    mask = torch.cat([mask, torch.ones(len(seqs), 3, dtype=torch.long)], 1)
    l_chunk, cache = _run(model, chunk, mask=mask, positions=n + torch.arange(3), cache=cache, use_cache=True)
    step = torch.stack([c[3:] for c in cont])  # [B, 1]
    mask = torch.cat([mask, torch.ones(len(seqs), 1, dtype=torch.long)], 1)
    l_step, cache = _run(model, step, mask=mask, positions=n + 3, cache=cache, use_cache=True)
    end_states = _states(cache)
    for b, (s, c) in enumerate(zip(seqs, cont)):
        ref_logits, ref_states = _alone(stock, torch.cat([s, c]), cached=True)
        err = max(err, _err(l_chunk[b], ref_logits[-4:-1]), _err(l_step[b, -1], ref_logits[-1]))
        s_end = max(s_end, _state_err(end_states, b, ref_states))
    return err, s_pre, s_end


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("side", ["right", "left", pytest.param("holes", id="holes-in-mask")])
def test_padded_prefill_then_chunk_then_decode(family, side):
    stock, wrapped = _models(family)
    err, s_pre, s_end = _padded_prefill_continue_decode(wrapped, stock, family, side)
    assert err <= TOL
    assert s_pre <= TOL and s_end <= TOL  # cached conv + SSM states equal each row's own
    stock_err = _stock_error(lambda: max(_padded_prefill_continue_decode(stock, stock, family, side)))
    assert stock_err > BROKEN


# Not jamba: its model builds the mixers' mask with transformers' create_recurrent_attention_mask, which returns
# None for every single-token step ("a generated token is never padding"), so no mixer of any hybrid is told.
@pytest.mark.parametrize("family", ["mamba", "falcon_mamba"])
def test_masked_decode_token_leaves_its_row_untouched(family):
    """A decode step whose mask column is 0 for one row (an idle row in a batch) must not move that row."""
    stock, wrapped = _models(family)
    g = _gen(12)
    seqs = [_tokens(g, n) for n in (5, 11, 8)]
    steps = _tokens(g, 6).view(2, 3).T  # [B, 2]: two decode tokens per row
    idle = 1  # row 1 skips the first decode step

    def run(model):
        ids, mask, pos = _padded(seqs, "right")
        _, cache = _run(model, ids, mask=mask, positions=pos, use_cache=True)
        n = torch.tensor([s.numel() for s in seqs])[:, None]
        col = torch.ones(3, 1, dtype=torch.long)
        col[idle] = 0
        mask = torch.cat([mask, col], 1)
        first, cache = _run(model, steps[:, :1], mask=mask, positions=n, cache=cache, use_cache=True)
        mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)
        second, cache = _run(model, steps[:, 1:], mask=mask, positions=n + col, cache=cache, use_cache=True)
        err = 0.0
        for b, s in enumerate(seqs):
            fed = steps[b] if b != idle else steps[b, 1:]
            ref_logits, ref_states = _alone(stock, torch.cat([s, fed]), cached=True)
            if b != idle:
                err = max(err, _err(first[b, -1], ref_logits[-2]))
            err = max(err, _err(second[b, -1], ref_logits[-1]), _state_err(_states(cache), b, ref_states))
        return err

    assert run(wrapped) <= TOL
    assert _stock_error(lambda: run(stock)) > BROKEN


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "splits",
    [
        pytest.param((5, 6, 17), id="5-1-11-rest"),
        pytest.param((1, 2, 12), id="1-1-10-rest"),
        pytest.param((20,), id="20-rest"),
    ],
)
@pytest.mark.parametrize("mask", [None, "full"], ids=["no-mask", "full-length-mask"])
def test_chunked_prefill_any_split_equals_one_forward(family, splits, mask):
    stock, wrapped = _models(family)
    g = _gen(5)
    ids = torch.stack([_tokens(g, 24), _tokens(g, 24)])  # [2, 24]
    expected = [_alone(stock, row, cached=True) for row in ids]

    def run(model):
        cache, outs = None, []
        bounds = [0, *splits, ids.shape[1]]
        for a, b in itertools.pairwise(bounds):
            m = torch.ones(2, b, dtype=torch.long) if mask == "full" else None  # past + current tokens
            pos = torch.arange(a, b)[None].expand(2, -1)
            logits, cache = _run(model, ids[:, a:b], mask=m, positions=pos, cache=cache, use_cache=True)
            outs.append(logits)
        logits, states = torch.cat(outs, 1), _states(cache)
        err = max(_err(logits[b], ref[0]) for b, ref in enumerate(expected))
        return err, max(_state_err(states, b, ref[1]) for b, ref in enumerate(expected))

    err, state_err = run(wrapped)
    assert err <= TOL and state_err <= TOL
    assert _stock_error(lambda: max(run(stock))) > BROKEN


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mask", [None, "full"], ids=["no-mask", "full-length-mask"])
def test_token_decode_equals_full_forward(family, mask):
    stock, wrapped = _models(family)
    g = _gen(6)
    ids = torch.stack([_tokens(g, 16), _tokens(g, 16)])  # [2, 16]
    expected = torch.stack([_alone(stock, row)[0] for row in ids])  # [2, 16, V]

    def run(model):
        logits, cache = _run(model, ids[:, :6], positions=torch.arange(6)[None].expand(2, -1), use_cache=True)
        outs = [logits]
        for t in range(6, ids.shape[1]):
            m = torch.ones(2, t + 1, dtype=torch.long) if mask == "full" else None
            logits, cache = _run(model, ids[:, t : t + 1], mask=m, positions=torch.full((2, 1), t), cache=cache, use_cache=True)
            outs.append(logits)
        return _err(torch.cat(outs, 1), expected)

    assert run(wrapped) <= TOL
    stock_err = _stock_error(lambda: run(stock))
    if mask == "full" and family != "jamba":
        # mamba / falcon_mamba broadcast the [B, past + 1] mask against the [B, 1, I] token: conv state corrupted
        assert stock_err > BROKEN
    else:
        # stock decode is right here (jamba trims the mask to the current token first)
        assert stock_err <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_full_length_mask_equals_no_mask(family):
    """An all-ones full-length mask on chunked prefill and decode gives bit-for-bit the no-mask result."""
    _, wrapped = _models(family)
    ids = _tokens(_gen(7), 14)[None].expand(2, -1)

    def run(with_mask: bool):
        outs, cache = [], None
        for a, b in ((0, 5), (5, 11), (11, 12), (12, 13), (13, 14)):
            m = torch.ones(2, b, dtype=torch.long) if with_mask else None
            logits, cache = _run(wrapped, ids[:, a:b], mask=m, positions=torch.arange(a, b)[None].expand(2, -1), cache=cache, use_cache=True)
            outs.append(logits)
        return torch.cat(outs, 1), _states(cache)

    (l1, s1), (l2, s2) = run(True), run(False)
    assert torch.equal(l1, l2)
    assert all(torch.equal(a, b) for pa, pb in zip(s1, s2) for a, b in zip(pa, pb))


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_left_padded_matches_each_prompt_alone(family):
    stock, wrapped = _models(family)
    g = _gen(8)
    prompts = [_tokens(g, n) for n in (5, 9, 7)]

    def generate(model, ids, mask):
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                pad_token_id=0, output_logits=True, return_dict_in_generate=True,
            )
        return out.sequences[:, ids.shape[1] :], torch.stack(out.logits, 1).float()  # [B, 4], [B, 4, V]

    alone = [generate(stock, p[None], torch.ones(1, p.numel(), dtype=torch.long)) for p in prompts]
    ids, mask, _ = _padded(prompts, "left")
    tokens, logits = generate(wrapped, ids, mask)
    for b, (ref_tokens, ref_logits) in enumerate(alone):
        assert torch.equal(tokens[b], ref_tokens[0])
        assert _err(logits[b], ref_logits[0]) <= TOL
    # stock left-padded generate is already right (generate() drops the mask after the prefill)
    stock_tokens, _ = generate(stock, ids, mask)
    assert all(torch.equal(stock_tokens[b], a[0][0]) for b, a in enumerate(alone))


# ----------------------------------------------------------------------------------------------------------
# PEFT: adapters on the mixer's projections stay active (stock bypasses a LoRA on dt_proj)
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_on_mixer_projections_stays_active(family):
    peft = pytest.importorskip("peft")
    stock, _ = _models(family)
    cfg = peft.LoraConfig(r=4, target_modules=["in_proj", "x_proj", "dt_proj"], init_lora_weights=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        lora = peft.get_peft_model(copy.deepcopy(stock), cfg)
    merged = copy.deepcopy(lora).merge_and_unload()  # the adapters folded into plain weights: the reference
    wrapped = safepad.wrap(copy.deepcopy(lora))
    seqs, ids, seq_idx, _, _ = packed_batch(PACKED_LENS, seed=9)
    expected = torch.cat([_alone(merged, s)[0] for s in seqs])  # [T, V]
    assert _err(_run(wrapped, ids, seq_idx=seq_idx)[0][0], expected) <= TOL
    # stock ignores the LoRA on dt_proj (it reads dt_proj.weight directly), even on single sequences
    stock_alone = torch.cat([_alone(lora, s)[0] for s in seqs])
    assert _err(stock_alone, expected) > BROKEN


# ----------------------------------------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_with_cache_raises(family):
    from transformers import DynamicCache

    stock, wrapped = _models(family)
    _, ids, seq_idx, _, _ = packed_batch(PACKED_LENS)
    with pytest.raises(ValueError, match="cache"):
        _run(wrapped, ids, seq_idx=seq_idx, use_cache=True)
    with pytest.raises(ValueError, match="cache"):
        _run(wrapped, ids, seq_idx=seq_idx, cache=DynamicCache(config=wrapped.config))
    # the stock model silently builds a cache from a row of several sequences
    _, cache = _run(stock, ids, seq_idx=seq_idx, use_cache=True)
    assert cache is not None
    # packed calls without an explicit cache run with the config's default use_cache=True: no cache is built
    assert wrapped.config.use_cache
    with torch.no_grad():
        out = wrapped(input_ids=ids, seq_idx=seq_idx)
    assert getattr(out, _cache_kw(wrapped)) is None


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "bad, match",
    [
        pytest.param({"seq_idx": torch.tensor([[0, 0, 1, 1, 0, 2]], dtype=torch.int32)}, "seq_idx", id="decreasing-seq_idx"),
        pytest.param({"seq_idx": torch.tensor([[0.0, 0, 1, 1, 1, 2]])}, "seq_idx", id="float-seq_idx"),
        pytest.param({"cu_seq_lens_q": torch.tensor([0, 2, 5], dtype=torch.int32)}, "cu_seq_lens_q", id="cu_seq_lens-short"),
        pytest.param({"cu_seq_lens_q": torch.tensor([0, 4, 2, 6], dtype=torch.int32)}, "cu_seq_lens_q", id="cu_seq_lens-decreasing"),
        pytest.param(
            {"cu_seq_lens_q": torch.tensor([0, 2, 6], dtype=torch.int32), "cu_seq_lens_k": torch.tensor([0, 3, 6], dtype=torch.int32)},
            "cu_seq_lens", id="cu_seq_lens-q-k-differ",
        ),
    ],
)
def test_bad_boundaries_raise_value_error(family, bad, match):
    stock, wrapped = _models(family)
    ids = _tokens(_gen(10), 6)[None]
    with pytest.raises(ValueError, match=match):
        _run(wrapped, ids, **bad)
    _run(stock, ids, **bad)  # the stock model drops these kwargs without a word
