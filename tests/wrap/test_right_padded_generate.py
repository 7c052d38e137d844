"""generate() on right-padded (and mixed-side) batches: every row's continuation is that prompt's alone.

The wrapped model keeps every cached row ``[pads | real tokens]`` (``safepad.layout.slots``), so generate's
"last column" is each row's last real token. Reference: the stock model run on each row's own sequence alone
(no padding, no cache), one forward per row covering the whole generated continuation:

* greedy / ``return_dict_in_generate`` + ``output_scores`` / ``output_logits``: every step's logits and scores of
  the row equal the reference's at that position, and each token is the reference's argmax;
* sampling: a batched draw shares one random stream over the rows, so a row alone with the same seed may draw
  other tokens. Each step's raw logits of the row (``output_logits``) are compared with the reference's on the
  row's *own* sampled prefix: every sampling distribution equals the one of the prompt alone;
* beam search and beam sample (``num_return_sequences`` > 1): temperature 1, no top-k, ``length_penalty=0`` and
  ``min_new_tokens = max_new_tokens``, so each returned ``sequences_scores`` is the plain sum of the
  reference's log-probabilities of that sequence's tokens; beam search also returns exactly the beams of the
  stock model run on the prompt alone without a cache (stock's cached beam search is itself wrong on
  recurrent_gemma, ``test_recurrent_gemma.py``);
* ``inputs_embeds``, ``logits_to_keep`` and a second generate() continuing from the returned cache.

Greedy, sampling and beams run on every tiny family; the other modes on one family per mixer / cache kind.

The stock model fails every one of these on the padded rows (checked in ``test_stock_model_is_wrong``).
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

import safepad
from safepad.cache import cache_argument, output_cache
from safepad.testing.tiny import EXTRA_FAMILIES, FAMILIES, NEW_FAMILIES, tiny_model
from .helpers import family_param

TOL = 1e-4
N_NEW = 4
LENS = (7, 4, 5)
#: every mode on one family per mixer / cache kind; greedy (with scores), sampling and beams on every family
_ALL_MODES = ("nemotron_h", "mamba", "jamba", "qwen3_next", "lfm2", "lfm3", "inkling_text", "qwen4_exp")
_EVERY_FAMILY = FAMILIES + EXTRA_FAMILIES + NEW_FAMILIES


_param = family_param


pytestmark = pytest.mark.usefixtures("quiet_transformers")


_MODELS: dict[str, tuple] = {}


def _models(family: str):
    """(stock, wrapped copy), built once per family."""
    if family not in _MODELS:
        stock = tiny_model(family)
        _MODELS.clear()  # one family at a time in memory
        _MODELS[family] = (stock, safepad.wrap(copy.deepcopy(stock), backend="torch"))
    return _MODELS[family]


def _batch(side: str, seed: int = 4):
    """Prompts and their ``[B, T]`` batch: ``right`` padded, or ``mixed`` (unpadded, right, pads on both sides)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 250, (n,), generator=g) for n in LENS]
    T = max(LENS) + (2 if side == "mixed" else 0)
    ids = torch.zeros(len(LENS), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        start = (T - len(p), 0, 1)[i] if side == "mixed" else 0  # mixed: left-padded, right-padded, both sides
        ids[i, start : start + len(p)], mask[i, start : start + len(p)] = p, 1
    return prompts, ids, mask


def _gen_kwargs(**kw):
    return dict(max_new_tokens=N_NEW, pad_token_id=0, return_dict_in_generate=True, **kw)


@torch.no_grad()
def _alone(stock, seq: torch.Tensor) -> torch.Tensor:
    """``[L, V]`` logits of ``seq`` ``[L]`` run alone through the stock model (no padding, no cache)."""
    return stock(input_ids=seq[None], use_cache=False).logits[0].float()


def _new_tokens(out, T: int) -> torch.Tensor:
    return out.sequences[:, T:]


def _until_eos(tokens: torch.Tensor, eos: int | None) -> int:
    """How many of ``tokens`` ``[N]`` generate really produced (up to and including the first EOS)."""
    if eos is None:
        return tokens.numel()
    hits = (tokens == eos).nonzero()
    return tokens.numel() if hits.numel() == 0 else int(hits[0]) + 1


def _step_errors(stock, prompts, out, T: int, per_prompt: int = 1, fields=("logits",), greedy: bool = True) -> float:
    """Max |Δ| of every row's per-step ``fields`` against the stock model on the row's own sequence alone
    (``greedy``: each token is also the reference's argmax)."""
    eos = stock.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    new = _new_tokens(out, T)
    err = 0.0
    for r in range(new.shape[0]):
        p = prompts[r // per_prompt]
        n = _until_eos(new[r], eos)
        ref = _alone(stock, torch.cat([p, new[r, :n]]))[len(p) - 1 : len(p) - 1 + n]  # [n, V]
        for name in fields:
            got = torch.stack([step[r] for step in getattr(out, name)[:n]]).float()  # [n, V]
            err = max(err, (got - ref).abs().max().item())
        if greedy:
            assert torch.equal(new[r, :n], ref.argmax(-1)), (r, new[r, :n], ref.argmax(-1))
    return err


def _sequence_log_prob(stock, prompt: torch.Tensor, tokens: torch.Tensor) -> float:
    logp = torch.log_softmax(_alone(stock, torch.cat([prompt, tokens]))[len(prompt) - 1 : -1].double(), -1)
    return logp.gather(1, tokens[:, None]).sum().item()


# ------------------------------------------------------------------------------------------------------------


@torch.no_grad()
@pytest.mark.parametrize("side", ["right", "mixed"])
@pytest.mark.parametrize("family", [_param(f) for f in _EVERY_FAMILY])
def test_greedy_with_scores_equals_each_prompt_alone(family, side):
    stock, wrapped = _models(family)
    prompts, ids, mask = _batch(side)
    out = wrapped.generate(
        input_ids=ids, attention_mask=mask, **_gen_kwargs(do_sample=False, output_scores=True, output_logits=True)
    )
    assert _step_errors(stock, prompts, out, ids.shape[1], fields=("scores", "logits")) < TOL


def _all_modes(fn):
    return pytest.mark.parametrize("family", [_param(f) for f in _ALL_MODES])(fn)


def _every_family(fn):
    return pytest.mark.parametrize("family", [_param(f) for f in _EVERY_FAMILY])(fn)


@torch.no_grad()
@_every_family
def test_sampling_distributions_equal_each_prompt_alone(family):
    """Sampling (``num_return_sequences=2``): each draw's distribution is the prompt's alone, on its own prefix."""
    stock, wrapped = _models(family)
    prompts, ids, mask = _batch("right")
    torch.manual_seed(0)
    out = wrapped.generate(
        input_ids=ids, attention_mask=mask,
        **_gen_kwargs(do_sample=True, temperature=0.7, top_k=20, num_return_sequences=2, output_logits=True),
    )
    assert out.sequences.shape[0] == 2 * len(prompts)
    assert _step_errors(stock, prompts, out, ids.shape[1], per_prompt=2, fields=("logits",), greedy=False) < TOL


def _beam_kwargs(do_sample: bool):
    return _gen_kwargs(
        num_beams=3, num_return_sequences=2, do_sample=do_sample, output_scores=True, length_penalty=0.0,
        min_new_tokens=N_NEW, temperature=1.0, top_k=None, top_p=None,
    )


@torch.no_grad()
@_every_family
@pytest.mark.parametrize("do_sample", [pytest.param(False, id="beam_search"), pytest.param(True, id="beam_sample")])
def test_beams_equal_each_prompt_alone(family, do_sample):
    """Beam search / beam sample: each returned beam's score is its log-probability under the prompt alone;
    beam search returns the beams of the stock model on the prompt alone, without a cache."""
    stock, wrapped = _models(family)
    prompts, ids, mask = _batch("right")
    torch.manual_seed(1)
    out = wrapped.generate(input_ids=ids, attention_mask=mask, **_beam_kwargs(do_sample))
    new = _new_tokens(out, ids.shape[1])
    assert new.shape == (2 * len(prompts), N_NEW)
    for r in range(new.shape[0]):
        want = _sequence_log_prob(stock, prompts[r // 2], new[r])
        assert abs(out.sequences_scores[r].item() - want) < 1e-3, (r, out.sequences_scores[r].item(), want)
    if do_sample:
        return
    for i, p in enumerate(prompts):  # the reference: stock on the prompt alone, every step a full forward
        alone = stock.generate(input_ids=p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               use_cache=False, **_beam_kwargs(False))
        assert torch.equal(new[2 * i : 2 * i + 2], _new_tokens(alone, len(p))), f"row {i}"


@torch.no_grad()
@_all_modes
@pytest.mark.parametrize("keep", [pytest.param(None, id="default"), pytest.param(0, id="keep_all")])
def test_logits_to_keep(family, keep):
    """generate() asks for the last column only (``logits_to_keep=1``) unless told otherwise: both are right."""
    stock, wrapped = _models(family)
    prompts, ids, mask = _batch("right")
    extra = {} if keep is None else {"logits_to_keep": keep}
    out = wrapped.generate(input_ids=ids, attention_mask=mask, **_gen_kwargs(do_sample=False, output_logits=True),
                           **extra)
    assert _step_errors(stock, prompts, out, ids.shape[1], fields=("logits",)) < TOL


@torch.no_grad()
@_all_modes
def test_inputs_embeds(family):
    stock, wrapped = _models(family)
    if "inputs_embeds" not in inspect.signature(stock.prepare_inputs_for_generation).parameters:
        pytest.skip(f"{type(stock).__name__}.generate() takes no inputs_embeds (transformers refuses them)")
    prompts, ids, mask = _batch("right")
    embeds = wrapped.get_input_embeddings()(ids)
    out = wrapped.generate(inputs_embeds=embeds, attention_mask=mask, **_gen_kwargs(do_sample=False, output_logits=True))
    assert out.sequences.shape[1] == N_NEW  # only the new tokens come back
    assert _step_errors(stock, prompts, out, 0, fields=("logits",)) < TOL


@torch.no_grad()
@_all_modes
def test_continue_from_the_returned_cache(family):
    """A second generate() on the returned sequences, full mask and cache: the rows go on as alone."""
    stock, wrapped = _models(family)
    prompts, ids, mask = _batch("right")
    first = wrapped.generate(input_ids=ids, attention_mask=mask, **_gen_kwargs(do_sample=False, output_logits=True))
    cache = output_cache(first)
    assert cache is not None
    seqs = first.sequences
    full = torch.cat([mask, torch.ones(len(prompts), N_NEW, dtype=mask.dtype)], dim=1)
    second = wrapped.generate(input_ids=seqs, attention_mask=full, **{cache_argument(wrapped): cache},
                              **_gen_kwargs(do_sample=False, output_logits=True))
    T = ids.shape[1]
    joined = [torch.cat([p, seqs[i, T:]]) for i, p in enumerate(prompts)]
    assert _step_errors(stock, joined, second, seqs.shape[1], fields=("logits",)) < TOL


@torch.no_grad()
@pytest.mark.parametrize("how", ["static_cache", "compiled_forward"])
@pytest.mark.parametrize("family", [_param(f) for f in ("nemotron_h", "jamba", "qwen3_next", "kimi_linear")])
def test_continue_the_cache_of_a_prompt_relaid_before_generate(family, how):
    """A right-padded prompt that ``generate`` re-lays pads first before it starts (a ``StaticCache``, a compiled
    ``forward``), then the returned cache continued by a plain forward of the next token under the caller's mask, and
    by a second ``generate``: the rows go on as alone. The cache holds every row ``[pads | real]`` while the caller's
    mask says ``[real | pads]``; it was not marked re-laid, and every continuation read the caller's layout: the
    step's logits 2.1e-4 to 2.0e-3 off alone here on every case (before the fix; kimi_linear / qwen3_next /
    bailing_hybrid under a compiled forward found by the 60-minute make fuzz, stop 35)."""
    from transformers import StaticCache

    stock, wrapped = _models(family)
    prompts, ids, mask = _batch("right")
    kw = _gen_kwargs(do_sample=False, output_logits=True)
    if how == "static_cache":
        kw[cache_argument(wrapped)] = StaticCache(config=wrapped.config, max_cache_len=32)
    else:
        wrapped.forward = torch.compile(wrapped.forward, backend="eager")
    try:
        first = wrapped.generate(input_ids=ids, attention_mask=mask, **kw)
        cache = output_cache(first) if how != "static_cache" else kw[cache_argument(wrapped)]
        seqs, T = first.sequences, ids.shape[1]
        joined = [torch.cat([p, seqs[i, T:]]) for i, p in enumerate(prompts)]
        assert _step_errors(stock, prompts, first, T) < TOL
        # the last generated token was not fed: one forward step under the caller's full mask
        full = torch.cat([mask, torch.ones(len(prompts), N_NEW, dtype=mask.dtype)], dim=1)
        step = wrapped(input_ids=seqs[:, -1:], attention_mask=full, **{cache_argument(wrapped): copy.deepcopy(cache)},
                       use_cache=True)
        for i, seq in enumerate(joined):
            ref = _alone(stock, seq)[-1]
            assert (step.logits[i, -1].float() - ref).abs().max().item() < TOL, i
        second = wrapped.generate(input_ids=seqs, attention_mask=full, **{cache_argument(wrapped): cache},
                                  **_gen_kwargs(do_sample=False, output_logits=True))
        assert _step_errors(stock, joined, second, seqs.shape[1]) < TOL
    finally:
        wrapped.__dict__.pop("forward", None)
        torch._dynamo.reset()


@torch.no_grad()
@pytest.mark.parametrize(
    "family, how",
    [pytest.param(f, how, id=f"{f}-{how}") for f, how in (
        ("nemotron_h", "eager"), ("jamba", "eager"), ("qwen3_next", "eager"),
        ("nemotron_h", "compiled_forward"), ("qwen3_next", "compiled_forward"),
    )],
)
def test_continue_a_cache_in_the_callers_layout(family, how):
    """A hybrid's ``generate`` lays a right-padded prompt pads first, except over a cache that holds tokens in the
    caller's layout (no call re-laid it): a left-padded prefill, then a hand-written step whose token is a pad in
    one row (the cache row ``[pads | reals | pad]``), continued by ``generate`` on the whole sequence (a pad after
    real tokens) and one more real token: every row goes on as its real tokens alone. Re-laying that sequence
    described cached slots that never moved: the padded row's logits 4e-4 to 1.4e-3 off alone (eager, before the
    fix; the same under a compiled forward, whose generate re-laid every right-padded prompt, before)."""
    stock, wrapped = _models(family)
    if how == "compiled_forward":
        wrapped.forward = torch.compile(wrapped.forward, backend="eager")
    try:
        _continue_a_cache_in_the_callers_layout(stock, wrapped)
    finally:
        wrapped.__dict__.pop("forward", None)
        torch._dynamo.reset()


def _continue_a_cache_in_the_callers_layout(stock, wrapped):
    prompts, ids, mask = _batch("right")
    T = ids.shape[1]
    left = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # the same prompts, left-padded
        left[i, T - len(p) :] = p
    lmask = (left != 0).to(mask.dtype)
    name = cache_argument(wrapped)
    cache = output_cache(wrapped(input_ids=left, attention_mask=lmask, use_cache=True))
    step_ids, step_mask = torch.tensor([[11], [0], [13]]), torch.tensor([[1], [0], [1]], dtype=mask.dtype)
    full = torch.cat([lmask, step_mask], 1)
    wrapped(input_ids=step_ids, attention_mask=full, **{name: cache}, use_cache=True)
    nxt = torch.tensor([[21], [22], [23]])
    seq = torch.cat([left, step_ids, nxt], 1)
    full = torch.cat([full, torch.ones(len(prompts), 1, dtype=mask.dtype)], 1)
    out = wrapped.generate(input_ids=seq, attention_mask=full, **{name: cache},
                           **_gen_kwargs(do_sample=False, output_logits=True))
    own = [torch.cat([p, step_ids[i], nxt[i]] if step_mask[i, 0] else [p, nxt[i]]) for i, p in enumerate(prompts)]
    assert _step_errors(stock, own, out, seq.shape[1]) < TOL


@torch.no_grad()
@pytest.mark.parametrize("family", [_param(f) for f in ("jamba", "qwen3_next")])
def test_continue_the_static_cache_of_an_inputs_embeds_prompt_relaid_before_generate(family):
    """As above, with the prompt given as ``inputs_embeds`` (no ``input_ids``): ``generate`` re-lays it pads first
    just the same, and the returned ``StaticCache`` must be marked re-laid too. It was not (the mark followed the
    caller's ``input_ids``, which such a call has none of): the next step 2.1e-4 (jamba) and 2.0e-3 (qwen3_next) off
    the row alone."""
    from transformers import StaticCache

    stock, wrapped = _models(family)
    if "inputs_embeds" not in inspect.signature(stock.prepare_inputs_for_generation).parameters:
        pytest.skip(f"{type(stock).__name__}.generate() takes no inputs_embeds (transformers refuses them)")
    prompts, ids, mask = _batch("right")
    cache = StaticCache(config=wrapped.config, max_cache_len=32)
    first = wrapped.generate(inputs_embeds=wrapped.get_input_embeddings()(ids), attention_mask=mask,
                             **{cache_argument(wrapped): cache}, **_gen_kwargs(do_sample=False, output_logits=True))
    new = first.sequences  # [B, N_NEW]: only the new tokens come back
    assert _step_errors(stock, prompts, first, 0) < TOL
    full = torch.cat([mask, torch.ones(len(prompts), N_NEW, dtype=mask.dtype)], dim=1)
    step = wrapped(input_ids=new[:, -1:], attention_mask=full, **{cache_argument(wrapped): cache}, use_cache=True)
    for i, p in enumerate(prompts):
        ref = _alone(stock, torch.cat([p, new[i]]))[-1]
        assert (step.logits[i, -1].float() - ref).abs().max().item() < TOL, i


@torch.no_grad()
@pytest.mark.parametrize("family", [_param(f) for f in ("nemotron_h", "mamba", "qwen3_next", "lfm3")])
def test_stock_model_is_wrong(family):
    """The same right-padded greedy generate() on the stock model: the padded rows go wrong."""
    stock, _ = _models(family)
    prompts, ids, mask = _batch("right")
    out = stock.generate(input_ids=ids, attention_mask=mask, **_gen_kwargs(do_sample=False, output_logits=True))
    assert _step_errors(stock, prompts, out, ids.shape[1], fields=("logits",), greedy=False) > 1e-2
