"""The continuous-batching fuzzer: seeded random serving sessions on a wrapped hybrid, every finished request checked
against its prompt generated alone by the stock model.

A session (:class:`ServingPlan`) is drawn from a seed: the continuous-batching config (``max_requests_per_batch``
1-4 slots, ``max_batch_tokens`` 4-24, page size 4 or 8, ``num_blocks`` from what the longest request needs to what
all of them need: a tight cache makes transformers soft-reset and re-prefill requests), greedy or seeded sampling,
and 2-8 requests (:class:`ServingRequest`): prompt lengths from 1 to 2.5x ``max_batch_tokens`` (forcing chunked
prefill), ``max_new_tokens`` 1-8, arrival (at start, or added to the running manager once ``k`` results have
finished), and cancellation (``manager.cancel_request`` right after the request is added, or once ``k`` results
have finished).

:func:`run_plan` serves one session through ``model.init_continuous_batching`` (``start`` / ``add_request`` /
``get_result`` / ``cancel_request`` / ``stop``) and checks, with :mod:`safepad.testing.serving_reference`:

* every request that finishes without being cancelled: no error, exactly its ``max_new_tokens`` tokens (no eos),
  greedy tokens and log-probs equal to its prompt alone through the stock model (sampling: each token's log-prob);
* a cancelled request that still finished (its cancellation came late): the same;
* the session ends (no request hangs: 120 s without a result is a failure) and, after ``stop``, every recurrent-state
  slot is free again (a slot kept by a cancelled or finished request would starve the pool).

A failure raises :class:`~safepad.testing.fuzz.core.FuzzFailure` whose message holds the plan as a Python repro
(``run_plan(ServingPlan(...))``). :func:`fuzz_serving` draws and runs ``sessions`` plans per family from one seed;
``python -m safepad.testing.fuzz --serving`` runs it time-bounded.

Skipped, and counted (``skipped_known_hang``), never hidden: :func:`known_hang`, a transformers scheduler hang.
"""

from __future__ import annotations

import copy
import logging
import random
import time
from dataclasses import dataclass, field

import torch

from ..serving_reference import greedy_mismatch, sampled_mismatch
from ..tiny import tiny_model
from .core import FuzzFailure

logger = logging.getLogger(__name__)

__all__ = [
    "SERVING_FAMILIES",
    "ServingPlan",
    "ServingRequest",
    "draw_plan",
    "fuzz_serving",
    "known_hang",
    "main_serving",
    "run_plan",
]

#: one family per recurrent kind served (short conv, Mamba2, gated delta rule, Mamba1), plus sliding attention
SERVING_FAMILIES = ("lfm2", "nemotron_h", "qwen3_next", "jamba", "lfm3")
#: seconds without any result before a session counts as hung
HANG_S = 60.0
#: seconds ``manager.stop(block=True)`` may take
STOP_S = 30.0


def known_hang(plan: "ServingPlan") -> str | None:
    """Why ``plan`` is skipped, or None. transformers 5.25's scheduler can leave waiting requests unscheduled for
    good when a request is cancelled during generation while the paged cache cannot hold every request at once:
    about one run in two of ``draw_plan("lfm2", 1)`` hangs with r2 / r3 never finishing, and so does the same plan on
    a stock attention-only Llama without safepad (a transformers defect, not safepad's; not yet reduced further)."""
    need = sum(-(-(len(r.prompt) + r.max_new) // plan.page_size) for r in plan.requests)
    cancels_running = any(r.cancel_after is not None and r.cancel_after >= 0 for r in plan.requests)
    if cancels_running and plan.num_blocks < need:
        return "a cancellation during generation under block pressure (transformers' scheduler may hang)"
    return None


@dataclass
class ServingRequest:
    """One request of a session: ``arrive_after`` finished results before it is added (0: at start);
    ``cancel_after``: cancelled once that many results have finished (-1: right after it is added; None: never)."""

    rid: str
    prompt: list[int]
    max_new: int
    arrive_after: int = 0
    cancel_after: int | None = None


@dataclass
class ServingPlan:
    """One drawn session (see the module docstring)."""

    family: str
    seed: int
    do_sample: bool
    slots: int
    max_batch_tokens: int
    page_size: int
    num_blocks: int
    requests: list[ServingRequest] = field(default_factory=list)


def draw_plan(family: str, seed: int) -> ServingPlan:
    """A random session for ``family`` from ``seed`` (deterministic)."""
    rng = random.Random(f"{family}/{seed}")  # str seeds are deterministic across processes
    slots = rng.randint(1, 4)
    mbt = rng.choice((4, 8, 16, 24))
    page = rng.choice((4, 8))
    n = rng.randint(2, 8)
    requests = []
    for i in range(n):
        kind = rng.random()
        plen = 1 if kind < 0.15 else rng.randint(2, mbt) if kind < 0.6 else rng.randint(mbt + 1, int(2.5 * mbt) + 1)
        prompt = [rng.randint(3, 249) for _ in range(plen)]
        arrive = 0 if i == 0 or rng.random() < 0.5 else rng.randint(0, i)
        c = rng.random()
        cancel = None if c < 0.75 else -1 if c < 0.85 else rng.randint(arrive, n - 1)
        requests.append(ServingRequest(f"r{i}", prompt, rng.randint(1, 8), arrive, cancel))
    need = [-(-(len(r.prompt) + r.max_new) // page) for r in requests]
    num_blocks = rng.randint(max(need) + 1, sum(need) + 2)
    return ServingPlan(family, seed, rng.random() < 0.3, slots, mbt, page, num_blocks, requests)


_MODELS: dict[str, tuple[torch.nn.Module, torch.nn.Module]] = {}


def _models(family: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(stock, wrapped) tiny float32 models of ``family``, built once per process."""
    if family not in _MODELS:
        import safepad

        stock = tiny_model(family)
        _MODELS[family] = (stock, safepad.wrap(copy.deepcopy(stock)))
    return _MODELS[family]


def _fail(plan: ServingPlan, what: str) -> FuzzFailure:
    return FuzzFailure(
        f"serving fuzz ({plan.family}, seed {plan.seed}): {what}\nrepro:\n"
        f"from safepad.testing.fuzz.serving import *\nrun_plan({plan!r})"
    )


def run_plan(plan: ServingPlan) -> dict[str, int]:
    """Serve ``plan`` on the wrapped tiny model and check it (module docstring); returns counts: ``finished``
    (requests checked), ``cancelled`` (requests cancelled before finishing), ``tokens`` (tokens checked)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    stock, model = _models(plan.family)
    gen = GenerationConfig(do_sample=plan.do_sample, max_new_tokens=8, eos_token_id=-1, pad_token_id=0,
                           **({"temperature": 1.0, "top_k": 0, "top_p": 1.0} if plan.do_sample else {}))  # fmt: skip
    cb = ContinuousBatchingConfig(
        num_blocks=plan.num_blocks, max_batch_tokens=plan.max_batch_tokens, max_requests_per_batch=plan.slots,
        page_size=plan.page_size, return_logprobs=True, **({"seed": plan.seed} if plan.do_sample else {}),
    )  # fmt: skip
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    pending = list(plan.requests)
    added: set[str] = set()
    cancelled: set[str] = set()
    finals: dict = {}

    def add_due() -> None:
        """Add the requests whose turn has come (in order; the next one anyway when nothing else is running) and
        cancel those due, until nothing changes."""
        changed = True
        while changed:
            changed = False
            for r in list(pending):
                if r.arrive_after <= len(finals) or not added - cancelled - set(finals):
                    manager.add_request(r.prompt, request_id=r.rid, max_new_tokens=r.max_new)
                    added.add(r.rid)
                    pending.remove(r)
                    changed = True
                    if r.cancel_after == -1:
                        manager.cancel_request(r.rid)
                        cancelled.add(r.rid)
            for r in plan.requests:
                due = r.cancel_after is not None and 0 <= r.cancel_after <= len(finals)
                if due and r.rid in added and r.rid not in cancelled and r.rid not in finals:
                    manager.cancel_request(r.rid)
                    cancelled.add(r.rid)
                    changed = True

    manager.start()
    processor, ok = None, False
    try:
        add_due()
        last = time.monotonic()
        while pending or added - cancelled - set(finals):
            result = manager.get_result(timeout=0.5)
            if result is None:
                if time.monotonic() - last > HANG_S:
                    waiting = sorted(added - cancelled - set(finals))
                    raise _fail(plan, f"no result for {HANG_S:.0f} s; requests still unfinished: {waiting}")
                if manager.background_thread_status.fatal_error is not None:
                    raise _fail(plan, f"the manager's loop died: {manager.background_thread_status.fatal_error!r}")
                continue
            last = time.monotonic()
            processor = manager.batch_processor or processor  # stop() drops it
            if result.is_finished():
                finals[result.request_id] = result
                add_due()
        ok = True
    finally:  # a failed session is stopped hard (a flushing stop would wait for the request that hung)
        manager.stop(block=True, timeout=STOP_S, hard_stop=not ok)
    if manager._generation_thread is not None and manager._generation_thread.is_alive():
        raise _fail(plan, f"the manager's loop did not stop within {STOP_S:.0f} s of manager.stop()")
    cache = processor.cache if processor is not None else None
    if cache is not None and cache.slots.num_free != cache.slots.num_slots:
        raise _fail(plan, f"after stop, {cache.slots.num_slots - cache.slots.num_free} of {cache.slots.num_slots} "
                          "recurrent-state slots are still held")  # fmt: skip
    tokens = 0
    for r in plan.requests:
        result = finals.get(r.rid)
        if result is None:
            continue  # cancelled before it finished: transformers drops it without a result
        if result.error is not None:
            raise _fail(plan, f"request {r.rid} failed: {result.error}")
        got = list(result.generated_tokens)
        if len(got) != r.max_new:
            raise _fail(plan, f"request {r.rid}: {len(got)} tokens, max_new_tokens {r.max_new} (no eos)")
        check = sampled_mismatch if plan.do_sample else greedy_mismatch
        problem = check(stock, r.prompt, got, list(result.logprobs))
        if problem is not None:
            raise _fail(plan, f"request {r.rid} (prompt of {len(r.prompt)} tokens) != its prompt alone: {problem}")
        tokens += len(got)
    return {"finished": len(finals), "cancelled": len(cancelled - set(finals)), "tokens": tokens}


def fuzz_serving(families: tuple[str, ...] | list[str] = SERVING_FAMILIES, sessions: int = 4, seed: int = 0,
                 deadline: float | None = None) -> dict[str, dict[str, int]]:  # fmt: skip
    """Draw and run ``sessions`` plans per family (plan seeds ``seed * 1000 + i``), until ``deadline``
    (``time.monotonic()``) if given; returns per-family totals (``sessions``, ``finished``, ``cancelled``,
    ``tokens``, ``skipped_known_hang``: draws :func:`known_hang` skips). The first failure raises :class:`FuzzFailure` (a repro)."""
    totals: dict[str, dict[str, int]] = {}
    cb_log = logging.getLogger("ContinuousBatchingLogger")
    level = cb_log.level
    cb_log.setLevel(logging.ERROR)
    try:
        for i in range(sessions):
            for family in families:
                if deadline is not None and time.monotonic() >= deadline:
                    return totals
                plan = draw_plan(family, seed * 1000 + i)
                t = totals.setdefault(family, {"sessions": 0, "finished": 0, "cancelled": 0, "tokens": 0,
                                               "skipped_known_hang": 0})  # fmt: skip
                if known_hang(plan) is not None:
                    t["skipped_known_hang"] += 1
                    continue
                counts = run_plan(plan)
                logger.debug("serving fuzz %s seed %d: %s", family, seed * 1000 + i, counts)
                t["sessions"] += 1
                for k, v in counts.items():
                    t[k] += v
    finally:
        cb_log.setLevel(level)
    return totals


def main_serving(minutes: float, families: list[str] | None = None, sessions: int = 4) -> int:
    """``python -m safepad.testing.fuzz --serving``: :func:`fuzz_serving` round after round (``sessions`` plans per
    family each, new seeds every round) until ``minutes`` pass; prints each round's totals and the first failure's
    repro. Exit status 1 iff something failed."""
    import sys

    fams = tuple(families or SERVING_FAMILIES)
    start = time.monotonic()
    deadline = start + minutes * 60
    totals: dict[str, dict[str, int]] = {}
    rnd = 0
    try:
        while time.monotonic() < deadline:
            for fam, t in fuzz_serving(fams, sessions=sessions, seed=rnd, deadline=deadline).items():
                acc = totals.setdefault(fam, dict.fromkeys(t, 0))
                for k, v in t.items():
                    acc[k] += v
            rnd += 1
            print(f"-- serving round {rnd} done at {(time.monotonic() - start) / 60:.1f} min", flush=True)
    except FuzzFailure as exc:
        print(f"\n==== SERVING FAILURE ====\n{exc}", flush=True)
        return 1
    finally:
        print(f"== safepad serving fuzz: {minutes:g} min, {rnd} rounds", file=sys.stdout)
        for fam, t in totals.items():
            print(f"{fam}: " + ", ".join(f"{k} {v}" for k, v in t.items()))
    return 0
