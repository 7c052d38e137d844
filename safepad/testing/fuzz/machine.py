"""The hypothesis ``RuleBasedStateMachine`` that draws :class:`~safepad.testing.fuzz.Session` calls for one
family, and the time-bounded runs of it."""

from __future__ import annotations

import logging
import time

import torch

from .core import FIRST_TOKEN, Batch, FuzzStats, _io, _models, _stats
from .forms import MASK_FORMS, POSITION_FORMS
from .session import Session

__all__ = ["COMPILE_MODES", "fuzz_families", "machine_for", "run_family"]


def _strategies(vocab: int):
    from hypothesis import strategies as st

    token = st.integers(FIRST_TOKEN, vocab - 1)

    @st.composite
    def batch(draw, min_rows: int = 1, max_rows: int = 3, max_len: int = 12, pads: bool = True,
              holes: bool = True, min_len: int = 1) -> Batch:
        n_rows = draw(st.integers(min_rows, max_rows))
        lens = [draw(st.integers(min_len, max_len)) for _ in range(n_rows)]
        width = max(lens) + (draw(st.integers(0, 2)) if pads else 0)
        side = draw(st.sampled_from(["right", "left"])) if pads else "right"
        rows: Batch = []
        for n in lens:
            toks: list[int | None] = [draw(token) for _ in range(n)]
            if holes and n > 1 and width > n and draw(st.booleans()):
                at = draw(st.integers(1, n - 1))
                toks = toks[:at] + [None] * (width - n) + toks[at:]
            elif side == "right" or not pads:
                toks = toks + [None] * (width - n)
            else:
                toks = [None] * (width - n) + toks
            rows.append(toks)
        return rows

    return st, token, batch


#: how each call sequence runs the subject: eager, or compiled as users compile (:meth:`Session.compile`).
#: backend "eager": dynamo traces safepad's hooks with the forward (the traced path, where compiled calls differ
#: from eager) and runs the captured graphs eagerly, seconds per sequence on CPU where inductor takes minutes;
#: "aot_eager" adds AOTAutograd (functionalized forward and backward graphs: the compiled backward).
COMPILE_MODES: tuple[tuple[str, str], ...] = (("model", "eager"), ("forward", "eager"), ("model", "aot_eager"))


def machine_for(family: str, dtype: torch.dtype = torch.float32, wrap: bool = True, compile_every: int = 0,
                compile_modes: tuple[tuple[str, str], ...] = COMPILE_MODES, heavy: bool = True) -> type:
    """A hypothesis ``RuleBasedStateMachine`` subclass fuzzing ``family`` (its rules draw :class:`Session` calls;
    ``wrap=False`` fuzzes the stock model, which must fail). ``compile_every``: about one call sequence in that
    many runs compiled (a mode of ``compile_modes``, ``(mode, backend)`` pairs for :meth:`Session.compile`); 0:
    every sequence eager; 1: every sequence compiled. ``heavy=False``: no ``callbacks`` / ``audit`` draws (a Trainer
    step or an audit scenario, about a second each; the fixed-seed tier runs them on a few families of its own)."""
    from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

    stock, _ = _models(family, dtype, wrap)
    vocab = _io(stock).vocab
    st, token, batch = _strategies(vocab)
    moe = hasattr(_io(stock).text_config, "output_router_logits")

    class FuzzMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.s = Session(family, dtype, wrap=wrap)

        # eager first, so that shrinking leads to eager; each compile mode once in ``compile_every`` draws
        _runs = ([None] * max(0, len(compile_modes) * (compile_every - 1)) + list(compile_modes)
                 if compile_every else [None])

        @initialize(how=st.sampled_from(_runs))
        def start(self, how) -> None:
            self.s.stats.sequences += 1
            self.s._surface(f"dtype:{str(dtype).removeprefix('torch.')}")
            if how is not None:
                self.s.stats.compiled += 1
                self.s.compile(*how)

        def teardown(self) -> None:
            self.s.close()

        @rule(b=batch(), pos=st.booleans(), labels=st.booleans(), backward=st.booleans(),
              hidden=st.booleans(), attn=st.booleans(), keep=st.sampled_from([0, 0, 0, 1, 2]),
              rd=st.sampled_from([True, True, False]), router=st.booleans())
        def forward(self, b, pos, labels, backward, hidden, attn, keep, rd, router) -> None:
            # labels with logits_to_keep is a transformers usage error (stock raises the same): not drawn
            self.s.forward(b, position_ids=pos, labels=labels, backward=backward, output_hidden_states=hidden,
                           output_attentions=attn, logits_to_keep=0 if labels else keep,
                           return_dict=rd or (router and moe), output_router_logits=router and moe)

        @rule(seqs=st.lists(st.lists(token, min_size=1, max_size=10), min_size=1, max_size=4),
              via=st.sampled_from(["position_ids", "seq_idx", "cu_seq_lens"]), labels=st.booleans(),
              backward=st.booleans(), router=st.booleans())
        def packed(self, seqs, via, labels, backward, router) -> None:
            self.s.packed(seqs, via=via, labels=labels, backward=backward, output_router_logits=router and moe)

        @rule(b=batch(holes=False, max_len=20), pos=st.booleans(), hidden=st.booleans(), attn=st.booleans(),
              rd=st.sampled_from([True, True, False]))
        def prefill(self, b, pos, hidden, attn, rd) -> None:
            self.s.prefill(b, position_ids=pos, output_hidden_states=hidden, output_attentions=attn,
                           return_dict=rd)

        @precondition(lambda self: self.s.stream is not None)
        @rule(data=st.data(), pos=st.booleans(), hidden=st.booleans(), attn=st.booleans(),
              rd=st.sampled_from([True, True, False]))
        def chunk(self, data, pos, hidden, attn, rd) -> None:
            n = len(self.s.stream.history)
            b = data.draw(batch(min_rows=n, max_rows=n, max_len=8, min_len=0, holes=False))
            b = [row if any(t is not None for t in row) or not row else row for row in b]
            self.s.chunk(b, position_ids=pos, output_hidden_states=hidden, output_attentions=attn, return_dict=rd)

        @precondition(lambda self: self.s.stream is not None)
        @rule(steps=st.lists(st.lists(token, min_size=4, max_size=4), min_size=1, max_size=3),
              pos=st.booleans())
        def decode(self, steps, pos) -> None:
            self.s.decode(steps, position_ids=pos)

        # beams are compared token for token with stock's cache-free search: in half precision near-tied beam scores
        # flip between the two (nemotron_h bfloat16), so beams are drawn in float32 only
        @rule(b=batch(holes=False, max_len=8), n=st.integers(1, 4), use_cache=st.booleans(),
              mode=st.sampled_from(["greedy", "greedy", "sample", "lookup"] + (["beam"] if dtype == torch.float32
                                                                                 else [])), nrs=st.integers(1, 2),
              keep=st.booleans(), static=st.sampled_from([False, False, False, True]))
        def generate(self, b, n, use_cache, mode, nrs, keep, static) -> None:
            self.s.generate(b, max_new_tokens=n, use_cache=use_cache, mode=mode, num_return_sequences=nrs,
                            keep=keep, static=static)

        @precondition(lambda self: self.s.stream is not None)
        @rule(tokens=st.lists(token, min_size=1, max_size=3), n=st.integers(1, 3))
        def generate_more(self, tokens, n) -> None:
            self.s.generate_more(tokens, max_new_tokens=n)

        @precondition(lambda self: self.s.stream is not None)
        @rule()
        def fork(self) -> None:
            self.s.fork()

        @precondition(lambda self: self.s.saved is not None)
        @rule(copy=st.booleans())
        def restore(self, copy) -> None:
            self.s.restore(copy=copy)

        @precondition(lambda self: self.s.stream is not None)
        @rule(order=st.lists(st.integers(0, 3), min_size=1, max_size=4))
        def reorder(self, order) -> None:
            self.s.reorder(order)

        @precondition(lambda self: self.s.stream is not None)
        @rule(b=batch(holes=False, max_len=12), pos=st.booleans())
        def reset(self, b, pos) -> None:
            self.s.prefill(b, position_ids=pos, reset=True)

        @precondition(lambda self: self.s.stream is not None)
        @rule(indices=st.lists(st.integers(0, 3), min_size=1, max_size=3))
        def select(self, indices) -> None:
            self.s.select(indices)

        @precondition(lambda self: self.s.stream is not None)
        @rule(repeats=st.integers(1, 2))
        def repeat(self, repeats) -> None:
            self.s.repeat(repeats)

        # ---- input forms and entry points (entry.py) ----

        @rule(b=batch(max_len=10), mask_form=st.sampled_from(MASK_FORMS), positions=st.sampled_from(POSITION_FORMS),
              offset=st.integers(1, 6), cached=st.booleans(), blank=st.sampled_from([False, False, True]))
        def forms(self, b, mask_form, positions, offset, cached, blank) -> None:
            self.s.forms(b, mask_form=mask_form, positions=positions, offset=offset, cached=cached, blank=blank)

        @precondition(lambda self: self.s.stream is not None and self.s.stream.pending is None)
        @rule(data=st.data(), mask_form=st.sampled_from(MASK_FORMS), pos=st.booleans())
        def chunk_form(self, data, mask_form, pos) -> None:
            n = len(self.s.stream.history)
            b = data.draw(batch(min_rows=n, max_rows=n, max_len=6, min_len=0, holes=False))
            self.s.chunk_form(b, mask_form=mask_form, position_ids=pos)

        @rule(rows=st.lists(st.lists(st.lists(token, min_size=1, max_size=5), min_size=1, max_size=3),
                            min_size=1, max_size=3))
        def restarts(self, rows) -> None:
            self.s.restarts(rows)

        @rule(kind=st.sampled_from(["batch0", "len0", "single", "single_pad"]), rows=st.integers(1, 3),
              cached=st.booleans(), tok=token)
        def sizes(self, kind, rows, cached, tok) -> None:
            self.s.sizes(kind, rows=rows, cached=cached, token=min(tok, vocab - 4))

        @rule(b=batch(holes=False, max_len=10), completion=st.lists(st.booleans(), min_size=1, max_size=6),
              temperature=st.sampled_from([1.0, 1.0, 0.7]), entropy=st.booleans(), backward=st.booleans())
        def logprobs(self, b, completion, temperature, entropy, backward) -> None:
            self.s.logprobs(b, completion, temperature=temperature, entropy=entropy, backward=backward)

        @rule(b=batch(holes=False, max_len=10), keep=st.integers(1, 6), batch_size=st.integers(0, 2),
              entropy=st.booleans(), temperature=st.sampled_from([1.0, 0.7]))
        def grpo(self, b, keep, batch_size, entropy, temperature) -> None:
            self.s.grpo(b, keep=keep, batch_size=batch_size, entropy=entropy, temperature=temperature)

        @rule(b=batch(max_len=8), wrapped=st.booleans(), packed=st.booleans())
        def guard(self, b, wrapped, packed) -> None:
            self.s.guard(b, wrapped=wrapped, packed=packed)

        @precondition(lambda self: heavy)
        @rule(seqs=st.lists(st.lists(token, min_size=2, max_size=8), min_size=2, max_size=3), wrapped=st.booleans(),
              which=st.sampled_from(["guard", "shadow"]))
        def callbacks(self, seqs, wrapped, which) -> None:
            self.s.callbacks(seqs, wrapped=wrapped, which=which)

        @precondition(lambda self: heavy)
        @rule(scenario=st.sampled_from(["right_pad_decode", "left_pad_decode_no_pos", "packed_seq_idx",
                                        "chunked_prefill_pad"]), defect=st.booleans())
        def audit(self, scenario, defect) -> None:
            self.s.audit(scenario, defect=defect)

    FuzzMachine.__name__ = FuzzMachine.__qualname__ = f"Fuzz_{family}"
    return FuzzMachine


def run_family(family: str, examples: int, steps: int = 6, seed: int | None = 0,
               dtype: torch.dtype = torch.float32, wrap: bool = True, compile_every: int = 0,
               compile_modes: tuple[tuple[str, str], ...] = COMPILE_MODES, shrink: bool = True,
               heavy: bool = True) -> FuzzStats:
    """Fuzz ``family``: ``examples`` call sequences of up to ``steps`` calls; ``seed`` fixes the draws (None:
    random). Raises :class:`FuzzFailure` (the shrunk repro) on the first failure. ``wrap=False`` fuzzes the
    stock model (a check of the oracle: it must fail). ``compile_every``, ``compile_modes``: see
    :func:`machine_for`. ``shrink=False``: raise the failing sequence as drawn (no minutes spent shrinking it).
    ``heavy``: see :func:`machine_for`."""
    from hypothesis import HealthCheck, Phase, settings
    from hypothesis.stateful import run_state_machine_as_test

    machine = machine_for(family, dtype, wrap, compile_every, compile_modes, heavy)
    stats = _stats(family if wrap else f"{family} (stock)")
    t0, c0 = time.perf_counter(), time.process_time()
    cfg = settings(
        max_examples=examples, stateful_step_count=steps, deadline=None, database=None,
        derandomize=seed is not None, print_blob=True, report_multiple_bugs=False,
        suppress_health_check=list(HealthCheck),
        phases=tuple(Phase) if shrink else tuple(p for p in Phase if p is not Phase.shrink),
    )
    log = logging.getLogger("transformers")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        run_state_machine_as_test(machine, settings=cfg)
    finally:
        log.setLevel(level)
        stats.seconds += time.perf_counter() - t0
        stats.cpu_seconds += time.process_time() - c0
    return stats


def fuzz_families() -> list[str]:
    """Every supported tiny family the installed transformers has, and the variants of those (``VARIANTS``)."""
    from ..tiny import family_available, family_names
    from .core import VARIANTS

    names = [f for f in family_names() if family_available(f)[0]]
    return names + [v for v, (base, _) in VARIANTS.items() if base in names]

