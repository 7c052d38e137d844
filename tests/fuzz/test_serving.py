"""The fixed-seed tier of the continuous-batching fuzzer (safepad.testing.fuzz.serving): seeded serving sessions on
one family per recurrent kind (short conv, Mamba2, gated delta, Mamba1) and sliding attention, every finished
request equal to its prompt alone through the stock model; the draws cover what the fuzzer claims to draw; and the
fuzzer fails on a session whose reused slot leaks the previous request's state (a defect injected here)."""

from __future__ import annotations

import pytest
import torch

from safepad.serving.step import SlotRowsCache
from safepad.testing.fuzz import FuzzFailure
from safepad.testing.fuzz.serving import (
    SERVING_FAMILIES,
    ServingPlan,
    ServingRequest,
    draw_plan,
    fuzz_serving,
    known_hang,
    main_serving,
    run_plan,
)

from ..wrap.helpers import family_param

SESSIONS = 3


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("family", [family_param(f) for f in SERVING_FAMILIES])
def test_fixed_seed_serving_sessions(family):
    totals = fuzz_serving([family], sessions=SESSIONS, seed=0)[family]
    assert totals["sessions"] + totals["skipped_known_hang"] == SESSIONS, totals
    assert totals["sessions"] > 0 and totals["finished"] > 0 and totals["tokens"] > 0, totals


def test_the_transformers_hang_draw_is_skipped_by_name():
    """``draw_plan("lfm2", 1)`` hung about one run in two, on a stock Llama without safepad too (known_hang)."""
    assert "block pressure" in known_hang(draw_plan("lfm2", 1))
    assert known_hang(draw_plan("lfm2", 0)) is None


def test_draws_cover_chunked_prefill_arrivals_cancellations_slot_pressure_and_sampling():
    plans = [draw_plan("lfm2", s) for s in range(60)]
    assert draw_plan("lfm2", 7) == draw_plan("lfm2", 7) and draw_plan("lfm2", 7) != draw_plan("qwen3_next", 7)
    reqs = [(p, r) for p in plans for r in p.requests]
    assert any(len(r.prompt) > p.max_batch_tokens for p, r in reqs)  # chunked prefill
    assert any(len(r.prompt) == 1 for _, r in reqs)
    assert any(r.arrive_after > 0 for _, r in reqs)  # added to a running manager
    assert any(r.cancel_after == -1 for _, r in reqs) and any((r.cancel_after or -1) >= 0 for _, r in reqs)
    assert any(len(p.requests) > p.slots for p in plans)  # more requests than slots
    assert any(p.do_sample for p in plans) and not all(p.do_sample for p in plans)
    assert len({r.max_new for _, r in reqs}) == 8


def test_a_reused_slot_that_keeps_the_previous_state_is_caught(monkeypatch):
    """One slot, two requests one after the other: the second reuses the first's slot. With the zeroing of a fresh
    request's state removed (the defect injected here), its tokens / log-probs differ from its prompt alone."""
    plan = ServingPlan("nemotron_h", 0, False, slots=1, max_batch_tokens=8, page_size=8, num_blocks=8, requests=[
        ServingRequest("r0", [11, 42, 7, 99, 23], 4), ServingRequest("r1", [5, 17], 4, arrive_after=1)])  # fmt: skip
    assert run_plan(plan) == {"finished": 2, "cancelled": 0, "tokens": 8}
    read = SlotRowsCache._read

    def stale(self, layer_idx, kind, state_idx):
        pool = self.store.pool(layer_idx, kind, state_idx)
        return None if pool is None else pool.index_select(0, self.step.slots)  # no zeros for fresh rows

    monkeypatch.setattr(SlotRowsCache, "_read", stale)
    with pytest.raises(FuzzFailure, match=r"request r1 .* != its prompt alone[\s\S]*run_plan\(ServingPlan"):
        run_plan(plan)
    monkeypatch.setattr(SlotRowsCache, "_read", read)


def test_cli_entry_runs_and_reports(capsys):
    assert main_serving(0.01, ["lfm2"], sessions=1) == 0
    out = capsys.readouterr().out
    assert "== safepad serving fuzz" in out and "lfm2: sessions" in out


def test_a_slot_kept_after_its_request_ends_is_caught(monkeypatch):
    """With the slot release removed from ``SafepadPagedCache.free_blocks`` (the defect injected here), the slots of
    finished requests stay held after ``stop``: the fuzzer reports it."""
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    from safepad.serving.paged_cache import SafepadPagedCache

    plan = ServingPlan("lfm2", 0, False, slots=3, max_batch_tokens=8, page_size=8, num_blocks=8, requests=[
        ServingRequest("r0", [11, 42, 7], 3), ServingRequest("r1", [5, 17], 2)])  # fmt: skip
    assert run_plan(plan)["finished"] == 2
    monkeypatch.setattr(SafepadPagedCache, "free_blocks",
                        lambda self, rid, no_cache=False: PagedAttentionCache.free_blocks(self, rid, no_cache))  # fmt: skip
    with pytest.raises(FuzzFailure, match="recurrent-state slots are still held"):
        run_plan(plan)
