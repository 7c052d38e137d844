"""Decoding strategies, as transformers' ``GenerationTesterMixin`` runs them: greedy, sample, beam search and
beam sample, with and without ``return_dict_in_generate`` / ``output_scores`` / ``output_logits``, and
``num_return_sequences``. References: each prompt alone by full forwards without a cache (greedy), and the
same strategy with ``use_cache=False`` (every step a full forward: the cache cannot be wrong there).

Batches are left-padded (what ``generate`` is for); a right-padded batch is in ``test_attention_masks``.
"""

from __future__ import annotations

import pytest
import torch

from .conftest import contract, family_params
from .helpers import N_NEW, close, gen_kwargs, greedy_alone, pad, prompts


def _batch():
    rows = prompts((6, 4))
    ids, mask = pad(rows, "left")
    return rows, ids, mask


@torch.no_grad()
def greedy(model, ref):
    rows, ids, mask = _batch()
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, **gen_kwargs())
    for i, r in enumerate(rows):
        want, _ = greedy_alone(ref, r)
        assert torch.equal(out[i, ids.shape[1] :], want), (i, out[i].tolist(), want.tolist())


@torch.no_grad()
def greedy_dict_scores_logits(model, ref):
    rows, ids, mask = _batch()
    plain = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, **gen_kwargs())
    out = model.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, return_dict_in_generate=True, output_scores=True,
        output_logits=True, **gen_kwargs(),
    )
    assert torch.equal(out.sequences, plain)
    assert len(out.scores) == len(out.logits) == N_NEW
    for i, r in enumerate(rows):
        want, steps = greedy_alone(ref, r)
        for t in range(N_NEW):
            assert out.scores[t].shape == (len(rows), steps.shape[-1])
            close(out.logits[t][i], steps[t], what=f"row {i} step {t} logits")
            assert int(out.scores[t][i].argmax()) == int(want[t])


@torch.no_grad()
def greedy_cache_equals_no_cache(model, ref):
    _, ids, mask = _batch()
    kw = {"input_ids": ids, "attention_mask": mask, "do_sample": False, "return_dict_in_generate": True,
          "output_scores": True}  # fmt: skip
    a = model.generate(use_cache=True, **kw, **gen_kwargs())
    b = model.generate(use_cache=False, **kw, **gen_kwargs())
    assert torch.equal(a.sequences, b.sequences)
    for sa, sb in zip(a.scores, b.scores):
        close(sa, sb, what="scores")


@torch.no_grad()
def sample(model, ref):
    """num_return_sequences=2: shapes, the seed reproduces the draw, cached == uncached draw, top_k is honoured."""
    rows, ids, mask = _batch()
    kw = dict(input_ids=ids, attention_mask=mask, do_sample=True, top_k=5, num_return_sequences=2,
              return_dict_in_generate=True, output_scores=True, **gen_kwargs())  # fmt: skip
    runs = []
    for use_cache in (True, True, False):
        torch.manual_seed(0)
        runs.append(model.generate(use_cache=use_cache, **kw))
    a = runs[0]
    assert a.sequences.shape == (2 * len(rows), ids.shape[1] + N_NEW)
    assert torch.equal(a.sequences, runs[1].sequences)  # no state leaks from one generate call into the next
    assert torch.equal(a.sequences, runs[2].sequences)
    for t, s in enumerate(a.scores):
        assert s.shape[0] == 2 * len(rows)
        chosen = s.gather(1, a.sequences[:, ids.shape[1] + t, None])
        assert torch.isfinite(chosen).all()  # the drawn token was among the top_k


def _beam(model, ids, mask, **kw):
    return model.generate(
        input_ids=ids, attention_mask=mask, num_beams=2, num_return_sequences=2, return_dict_in_generate=True,
        output_scores=True, **gen_kwargs(), **kw,
    )


@torch.no_grad()
def beam_search(model, ref):
    rows, ids, mask = _batch()
    a = _beam(model, ids, mask, do_sample=False, use_cache=True)
    b = _beam(model, ids, mask, do_sample=False, use_cache=False)
    assert a.sequences.shape == (2 * len(rows), ids.shape[1] + N_NEW)
    assert a.sequences_scores.shape == (2 * len(rows),)
    assert torch.equal(a.sequences, b.sequences)  # the cache follows the beams (reorder_cache)
    close(a.sequences_scores, b.sequences_scores, what="sequences_scores")
    plain = model.generate(input_ids=ids, attention_mask=mask, num_beams=2, do_sample=False, **gen_kwargs())
    assert torch.equal(plain, a.sequences[::2])  # the best beam without return_dict
    for i, r in enumerate(rows):  # batching: each prompt's beams are those of the prompt alone
        alone = _beam(model, r[None], torch.ones(1, len(r), dtype=torch.long), do_sample=False, use_cache=False)
        assert torch.equal(a.sequences[2 * i : 2 * i + 2, ids.shape[1] - len(r) :], alone.sequences), i


@torch.no_grad()
def beam_sample(model, ref):
    rows, ids, mask = _batch()
    runs = []
    for use_cache in (True, False):
        torch.manual_seed(0)
        runs.append(_beam(model, ids, mask, do_sample=True, top_k=5, use_cache=use_cache))
    a, b = runs
    assert a.sequences.shape == (2 * len(rows), ids.shape[1] + N_NEW)
    assert torch.equal(a.sequences, b.sequences)
    close(a.sequences_scores, b.sequences_scores, what="sequences_scores")


PROPERTIES = {
    "greedy": greedy,
    "greedy_dict_scores_logits": greedy_dict_scores_logits,
    "greedy_cache_equals_no_cache": greedy_cache_equals_no_cache,
    "sample": sample,
    "beam_search": beam_search,
    "beam_sample": beam_sample,
}


@pytest.mark.parametrize("name", list(PROPERTIES))
@pytest.mark.parametrize("family", family_params())
def test_generate_contract(family, name):
    contract(family, name, PROPERTIES[name])
