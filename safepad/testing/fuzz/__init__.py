"""The stateful differential call-sequence fuzzer: random call programs on a wrapped model, each call checked
against every row run alone through the stock model.

A :class:`Session` holds one family's tiny model wrapped by :func:`safepad.wrap`, its stock twin (the same
weights, unwrapped) and the live state a user builds up: a batch of rows that share one cache (each row carries
its own token history and the columns of the mask it was fed), and a saved copy of it. Each public method of
:class:`Session` is one user call (a rule): an uncached forward of a padded / holed batch with labels and
backward, a packed row (``position_ids`` restarts, ``seq_idx``, ``cu_seq_lens_q/k``), a cached prefill, a
chunk or decode step continuing the live cache, ``generate`` (greedy, seeded sampling, beams, both pad sides,
``use_cache`` on and off, continuing from the returned cache), cache operations (deepcopy, reuse, reorder,
select) and output options (``output_hidden_states``, ``output_attentions``, ``logits_to_keep``,
``return_dict=False``). Beyond the plain forward: every attention-mask form transformers accepts (2-D int / bool /
float, 4-D bool and additive float, the form changing within one cached session), ``position_ids`` conventions
(none, generate-style, offset and -1 starts, restarts read by ``find_packed_sequence_indices``), degenerate sizes,
:func:`safepad.packed_logprobs`, :func:`safepad.guard`, the Trainer callbacks, the audit's verdict and assisted
generation; each is counted per family (``FuzzStats.surfaces``) and printed.

The oracle: every returned tensor (logits of real tokens, hidden states, attention weights over real keys,
loss, parameter gradients, generated tokens and their logits) equals what each row gives alone through the
stock model without padding and without a cache (generated tokens: the stock model's greedy continuation of the
prompt alone, a full forward per step). The tolerance is relative: ``max |Δ| <= tol * max(1, max |ref|)``,
``tol`` 1e-4 in float32 (:func:`safepad.testing.scenarios.default_tol`); a generated token may differ only
where the reference's top two logits are within that tolerance (a tie). A call may instead raise an error
raised by safepad itself (its raise site inside the ``safepad`` package) that names the problem; any other
exception (from deep inside transformers or torch) is a failure.

Every failure raises :class:`FuzzFailure` whose message is a standalone Python repro: the session calls that
led to it, which re-run the same comparisons. :class:`FuzzMachine` drives a session with hypothesis'
``RuleBasedStateMachine`` (shrinking to a minimal call sequence); :func:`machine_for` makes one per family and
:func:`main` (``python -m safepad.testing.fuzz``, ``make fuzz``) runs them time-bounded over every family.

Known open defects are skipped, not hidden: :data:`KNOWN_DEFECTS` names each (the issue item, the predicate of
the draws it skips, why) and every skipped draw is counted and printed.

The package by concern: ``core`` (ids, failure type, model pairs, counts, batch layout), ``known``
(:data:`KNOWN_DEFECTS`), ``oracle`` (reference runs and comparisons), ``session`` (:class:`Session`, the calls),
``machine`` (the state machine, :func:`run_family`), ``cli`` (:func:`main`), ``forms`` (mask forms and position
conventions), ``entry`` (the rules for forms, sizes, log-probs, the guard and the audit), ``trainer`` (the Trainer
callbacks rule).
"""

from __future__ import annotations

from .core import FIRST_TOKEN, PAD_ID, STATS, FuzzFailure, FuzzStats
from .known import KNOWN_DEFECTS, KnownDefect
from .machine import COMPILE_MODES, fuzz_families, machine_for, run_family
from .session import Session
from .cli import main

__all__ = [
    "COMPILE_MODES",
    "KNOWN_DEFECTS",
    "FuzzFailure",
    "FuzzStats",
    "KnownDefect",
    "Session",
    "fuzz_families",
    "machine_for",
    "main",
    "run_family",
]
