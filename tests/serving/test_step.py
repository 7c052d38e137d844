"""safepad.serving.step: one continuous-batching step as rows of requests, and the slot-backed cache view."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.requests import RequestState

import safepad
from safepad.serving import RecurrentSlots, ServingStep, SlotRowsCache
from safepad.serving.step import StepEntry
from safepad.testing.syncs import count_syncs
from safepad.testing.tiny import tiny_model

from ..wrap.helpers import family_param


def _step(lengths: list[int], pasts: list[int], slots: list[int], store: RecurrentSlots) -> ServingStep:
    entries = [StepEntry(f"r{i}", s, p, q) for i, (q, p, s) in enumerate(zip(lengths, pasts, slots))]
    return ServingStep(entries, store, torch.device("cpu"))


@pytest.mark.parametrize(
    "lengths",
    [
        pytest.param([3, 1, 5, 1], id="mixed"),
        pytest.param([1, 1, 1, 1], id="decode"),
        pytest.param([7], id="one"),
        pytest.param([4, 4], id="equal-chunks"),
    ],
)
def test_rows_hold_each_requests_chunk_and_pack_back(lengths):
    """The decode steps form one group of ``[n, 1]`` rows and the prefill chunks one of right-padded ``[n, L]`` rows;
    each row holds its request's chunk of the packed row, and ``pack`` puts the groups' rows back in packed order."""
    store = RecurrentSlots(8, "cpu")
    step = _step(lengths, [0] * len(lengths), list(range(len(lengths))), store)
    T = sum(lengths)
    packed = torch.randn(1, T, 4, dtype=torch.float64)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    decode = [i for i, q in enumerate(lengths) if q == 1]
    prefill = [i for i, q in enumerate(lengths) if q > 1]
    expected = [g for g in (decode, prefill) if g]
    assert [[int(e.request_id[1:]) for e in group.entries] for group in step.groups] == expected
    rows = [group.unpack(packed) for group in step.groups]
    for group, members, r in zip(step.groups, expected, rows):
        L = max(lengths[i] for i in members)
        assert r.shape == (len(members), L, 4)
        for row, i in enumerate(members):
            q = lengths[i]
            torch.testing.assert_close(r[row, :q], packed[0, starts[i] : starts[i] + q], rtol=0, atol=0)
            if group.mask is not None:
                assert group.mask[row].tolist() == [True] * q + [False] * (L - q)
        assert (group.mask is None) == (len({lengths[i] for i in members}) == 1)
    torch.testing.assert_close(step.pack(rows), packed, rtol=0, atol=0)


def test_cache_view_reads_slots_zeroes_fresh_rows_and_writes_back():
    """Reads gather the step's slots (zeros for a request whose chunk starts its sequence, whatever its slot held);
    writes scatter into those slots only."""
    store = RecurrentSlots(4, "cpu")
    seed = torch.arange(4 * 2 * 3, dtype=torch.float32).view(4, 2, 3) + 1  # every slot non-zero
    store.write(0, "conv", 0, torch.arange(4), seed)
    step = _step([2, 3], pasts=[0, 5], slots=[3, 1], store=store)  # slot 3 reused by a fresh request
    (group,) = step.groups
    view = SlotRowsCache(group)
    got = view.get_conv_state(0)
    torch.testing.assert_close(got[0], torch.zeros(2, 3))
    torch.testing.assert_close(got[1], seed[1])
    assert view.get_recurrent_state(0) is None and view.layers[0].has_previous_state == {0: True}
    assert view.layers[1].has_previous_state == {}
    new = torch.full((2, 2, 3), -1.0)
    view.update_conv_state(new, 0)
    pool = store.pool(0, "conv", 0)
    torch.testing.assert_close(pool[[1, 3]], new)
    torch.testing.assert_close(pool[[0, 2]], seed[[0, 2]])


@pytest.mark.parametrize("family", [family_param(f) for f in ("lfm2", "nemotron_h", "qwen3_next")])
def test_decode_steps_read_nothing_on_the_host(family):
    """A decode-only step of several requests gathers and scatters their states by slot index on the device: no
    host sync (counted on CPU by safepad.testing.syncs). A step with prefill chunks of different lengths costs the
    padded prefill path's own reads, whatever the number of requests."""
    model = safepad.wrap(copy.deepcopy(tiny_model(family)))
    gen = GenerationConfig(do_sample=False, max_new_tokens=3, eos_token_id=-1, pad_token_id=0)
    mixed = {}
    for n in (3, 4):
        cb = ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=64, max_requests_per_batch=4, page_size=8)
        manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        processor = manager._create_batch_processor()
        manager.batch_processor = processor
        for i in range(n):
            prompt = list(range(5, 8 + 2 * i))
            state = RequestState(request_id=f"r{i}", initial_tokens=prompt, max_new_tokens=3, eos_token_id=-1)
            processor.scheduler.add_waiting_request(state)
        counts = []
        step = functools.partial(processor._generation_step, model)
        while processor.prepare_next_batch():
            decode = processor.inputs_and_outputs.max_length_q == 1
            counts.append((decode, count_syncs(step).count))
            processor.update_batch()
        assert [c for d, c in counts if d] == [0, 0], counts
        mixed[n] = [c for d, c in counts if not d]
    assert mixed[3] == mixed[4], mixed
