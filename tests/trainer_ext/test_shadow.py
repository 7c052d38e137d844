"""ShadowCheckCallback under a real transformers Trainer: it flags every injected packing fault within one check
interval, and never a correct run.

The reference is independent of the check's own bookkeeping: each fault is one the stock training run does
NOT report (its loss stays finite and nothing is raised, checked in ``test_faults_are_silent_without_callback``),
and the flagged error must be far above the tolerance (a leak, not noise). Correct runs: 200 steps with a check
at every step, in fp32, bf16 autocast (with gradient accumulation) and bf16 weights.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import make_examples, make_model, training_args
from transformers import Trainer, TrainerCallback

import safepad
from safepad.collators import DataCollatorForPackedSSM
from safepad.errors import PaddingError, PaddingWarning
from safepad.testing import tiny_model
from safepad.trainer_ext import KIND_SHADOW_MISMATCH, SHADOW_TOLERANCES, ShadowCheckCallback

LOG_KEYS = ("safepad/shadow_max_abs_diff", "safepad/shadow_rel_diff", "safepad/shadow_checked_tokens")
BOUNDARY_KEYS = ("seq_idx", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
LENGTHS = (5, 17, 9, 30, 12, 3)


class Dropping:
    """DataCollatorForPackedSSM, then drop ``keys`` from its output (a collator / column filter losing them)."""

    def __init__(self, *keys: str, extra: dict | None = None):
        self.inner, self.keys, self.extra = DataCollatorForPackedSSM(), keys, extra or {}

    def __call__(self, features):
        out = {k: v for k, v in self.inner(features).items() if k not in self.keys}
        out.update(self.extra)
        return out


class AtStep(TrainerCallback):
    """Run ``fn(model)`` once, at the end of optimizer step ``step`` (a fault injected mid-run)."""

    def __init__(self, step: int, fn):
        self.step, self.fn = step, fn

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.step:
            self.fn(model)


def train(tmp_path, model, collator, callbacks=(), steps=6, examples=None, **args):
    trainer = Trainer(
        model=model,
        args=training_args(tmp_path, max_steps=steps, per_device_train_batch_size=4, **args),
        train_dataset=examples if examples is not None else make_examples(64, lengths=LENGTHS),
        data_collator=collator,
        callbacks=list(callbacks),
    )
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        trainer.train()
    return trainer, [w for w in rec if issubclass(w.category, PaddingWarning)]


def wrapped(dtype=torch.float32):
    return safepad.wrap(make_model(strong=True).to(dtype))


def _scan_ignoring_seq_idx(model):
    """A broken op route: the Mamba2 scan called without its ``seq_idx`` (the conv still gets it)."""
    import safepad.mixers.mamba2 as m2

    good = m2.ssd_scan

    def broken(*args, **kwargs):
        kwargs["seq_idx"] = None
        return good(*args, **kwargs)

    m2.ssd_scan = broken


@pytest.fixture
def restore_scan():
    import safepad.mixers.mamba2 as m2

    good = m2.ssd_scan
    yield
    m2.ssd_scan = good


# ------------------------------------------------------------------------------------------ injected faults
def _pack_mamba(tmp_path):
    from datasets import Dataset

    model = safepad.wrap(tiny_model("mamba"))
    packed = safepad.pack_dataset(Dataset.from_list(make_examples(32, lengths=LENGTHS)), max_length=48)
    return model, packed


FAULTS = [
    pytest.param("stock", id="stock-model"),
    pytest.param("unwrapped-mid-run", id="unwrapped-mid-run"),
    pytest.param("collator-drops-seq_idx", id="mamba-collator-drops-seq_idx-and-positions"),
    pytest.param("remove_unused_columns", id="mamba-remove_unused_columns"),
    pytest.param("scan-ignores-seq_idx", id="scan-ignores-seq_idx"),
]


def _fault(name, tmp_path):
    """(model, collator, callbacks, examples, training args, every_n_steps, the step that must be flagged)."""
    if name == "stock":  # positions only: the stock torch path raises on seq_idx, leaks silently on positions
        return make_model(strong=True), Dropping(*BOUNDARY_KEYS), [], None, {}, 4, 1
    if (
        name == "unwrapped-mid-run"
    ):  # unwrapped after step 7 (positions only, as TRL's padding_free): checks at 1, 6, 11
        return wrapped(), Dropping(*BOUNDARY_KEYS), [AtStep(7, safepad.unwrap)], None, {}, 5, 11
    if name == "collator-drops-seq_idx":
        return safepad.wrap(tiny_model("mamba")), Dropping(*BOUNDARY_KEYS, "position_ids"), [], None, {}, 3, 1
    if name == "remove_unused_columns":  # Trainer drops pack_dataset's seq_lengths / position_ids columns
        model, packed = _pack_mamba(tmp_path)
        return model, DataCollatorForPackedSSM(), [], packed, {"remove_unused_columns": True}, 3, 1
    if name == "scan-ignores-seq_idx":  # broken after step 2: checks at 1, 4 -> 4
        return wrapped(), DataCollatorForPackedSSM(), [AtStep(2, _scan_ignoring_seq_idx)], None, {}, 3, 4
    raise AssertionError(name)


@pytest.mark.parametrize("name", FAULTS)
def test_faults_are_silent_without_callback(tmp_path, name, restore_scan):
    model, collator, callbacks, examples, args, every, step = _fault(name, tmp_path)
    trainer, warned = train(tmp_path, model, collator, callbacks, steps=step + every, examples=examples, **args)
    assert warned == [] and trainer.state.global_step == step + every
    assert all(torch.isfinite(torch.tensor(e["loss"])) for e in trainer.state.log_history if "loss" in e)


@pytest.mark.parametrize("name", FAULTS)
def test_error_mode_flags_fault_within_one_interval(tmp_path, name, restore_scan):
    model, collator, callbacks, examples, args, every, step = _fault(name, tmp_path)
    shadow = ShadowCheckCallback(every_n_steps=every, mode="error")
    with pytest.raises(PaddingError, match=rf"step {step}, sequence [1-9]\d* of row \d+") as exc:
        train(tmp_path, model, collator, [*callbacks, shadow], steps=step + every, examples=examples, **args)
    assert exc.value.kinds == (KIND_SHADOW_MISMATCH,)
    assert "packed vs alone max |Δ logits|" in str(exc.value)
    last = shadow.results[-1]
    assert last.flagged and last.step == step and last.rel_diff > 100 * last.tol, last
    assert all(not r.flagged for r in shadow.results[:-1])


def test_warn_mode_warns_and_keeps_training(tmp_path):
    shadow = ShadowCheckCallback(every_n_steps=2, mode="warn")
    trainer, warned = train(tmp_path, make_model(strong=True), Dropping(*BOUNDARY_KEYS), [shadow], steps=4)
    assert trainer.state.global_step == 4
    assert [w.message.kind for w in warned] == [KIND_SHADOW_MISMATCH] * 2  # steps 1 and 3
    assert [r.step for r in shadow.results] == [1, 3] and all(r.flagged for r in shadow.results)


# ------------------------------------------------------------------------------------------ correct runs
CORRECT = [
    pytest.param(torch.float32, {}, id="fp32"),
    pytest.param(torch.float32, {"bf16": True, "gradient_accumulation_steps": 2}, id="bf16-autocast-grad-accum"),
    pytest.param(torch.bfloat16, {}, id="bf16-weights"),
]


@pytest.mark.parametrize(("dtype", "args"), CORRECT)
def test_correct_run_never_flagged(tmp_path, dtype, args):
    shadow = ShadowCheckCallback(every_n_steps=1, mode="error")
    steps = 200 // args.get("gradient_accumulation_steps", 1)
    trainer, warned = train(tmp_path, wrapped(dtype), DataCollatorForPackedSSM(), [shadow], steps=steps, **args)
    assert warned == [] and trainer.state.global_step == steps
    assert len(shadow.results) == steps and not any(r.flagged for r in shadow.results)
    expected = torch.bfloat16 if dtype == torch.bfloat16 or args.get("bf16") else torch.float32
    assert {r.dtype for r in shadow.results} == {expected}
    assert all(r.segment.index > 0 for r in shadow.results)  # always a sequence after a packed boundary
    worst = max(r.rel_diff for r in shadow.results)
    assert worst <= SHADOW_TOLERANCES[expected] / 4, worst  # the tolerance keeps a margin over the spread


def test_logs_reach_reporting_callbacks(tmp_path):
    seen: list[dict] = []

    class Reporter(TrainerCallback):  # stands for W&B / TensorBoard: registered before the shadow callback
        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append(dict(logs))

    shadow = ShadowCheckCallback(every_n_steps=2)
    trainer, _ = train(tmp_path, wrapped(), DataCollatorForPackedSSM(), [Reporter(), shadow], steps=4)
    entries = [e for e in trainer.state.log_history if "loss" in e]
    assert [all(k in e for k in LOG_KEYS) for e in entries] == [True, False, True, False]  # checks at 1 and 3
    assert [all(k in e for k in LOG_KEYS) for e in seen if "loss" in e] == [True, False, True, False]
    assert entries[0]["safepad/shadow_checked_tokens"] == shadow.results[0].checked_tokens > 1


def test_check_does_not_change_training(tmp_path):
    """Same seed with and without the check at every step: bitwise-equal losses and final weights."""
    runs = []
    for callbacks in ([], [ShadowCheckCallback(every_n_steps=1)]):
        trainer, _ = train(tmp_path, wrapped(), DataCollatorForPackedSSM(), callbacks, steps=5)
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        runs.append((losses, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][n], runs[1][1][n]) for n in runs[0][1])


# ------------------------------------------------------------------------------------------ refused set-ups
def test_dropout_is_refused(tmp_path):
    model = make_model(strong=True)
    model.config.attention_dropout = 0.1
    with pytest.raises(ValueError, match=r"dropout \(config.attention_dropout=0.1\).*Set the dropout to 0"):
        train(tmp_path, safepad.wrap(model), DataCollatorForPackedSSM(), [ShadowCheckCallback()], steps=1)


def test_truncated_logits_are_refused(tmp_path):
    """Truncated logits and no backbone hidden states to compute them from (a model with a backbone is checked on
    its hidden states instead: TRL's fused LM head, tests/trainer_ext/test_trl.py)."""
    collator = Dropping("labels", extra={"logits_to_keep": 1})  # (with labels the model's own loss fails first)
    model = wrapped()
    model.base_model_prefix = ""  # model.base_model is the model itself: no backbone to read
    with pytest.raises(ValueError, match=r"logits of shape \(1, 1, 256\).*logits_to_keep=0"):
        train(tmp_path, model, collator, [ShadowCheckCallback()], steps=1)


def test_sequence_parallel_is_refused(tmp_path):
    trainer = Trainer(
        model=wrapped(),
        args=training_args(tmp_path, max_steps=1),
        train_dataset=make_examples(8),
        data_collator=DataCollatorForPackedSSM(),
        callbacks=[ShadowCheckCallback()],
    )
    trainer._safepad_sp = object()  # what safepad.distributed.prepare_trainer leaves on the Trainer
    with pytest.raises(ValueError, match="sequence parallelism.*sp_size=1"):
        trainer.train()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"every_n_steps": 0}, "every_n_steps", id="every_n_steps"),
        pytest.param({"mode": "fix"}, "mode", id="mode"),
        pytest.param({"tol": 0.0}, "tol", id="tol"),
        pytest.param({"ranks": "rank0"}, "ranks", id="ranks"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ShadowCheckCallback(**kwargs)


def test_reexported():
    assert safepad.ShadowCheckCallback is ShadowCheckCallback


class RightPadded:
    """``[B, T]`` right-padded rows with an attention_mask, labels -100 at pads (a correct training layout)."""

    def __call__(self, features):
        T = max(len(f["input_ids"]) for f in features)
        ids = torch.zeros(len(features), T, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, f in enumerate(features):
            ids[i, : len(f["input_ids"])] = torch.tensor(f["input_ids"])
            mask[i, : len(f["input_ids"])] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_padded_rows_are_checked_on_their_real_tokens(tmp_path):
    """Right padding without a cache is correct even on the stock model: checked, never flagged."""
    shadow = ShadowCheckCallback(every_n_steps=1, mode="error")
    examples = make_examples(16, lengths=(5, 17, 9, 30))
    train(tmp_path, make_model(strong=True), RightPadded(), [shadow], steps=4, examples=examples)
    assert len(shadow.results) == 4 and not any(r.flagged for r in shadow.results)
    assert {r.checked_tokens for r in shadow.results} <= {5, 17, 9, 30}  # one row's real tokens, no pad


# ------------------------------------------------------------------------------------------ coverage (issue 28)
class LeakyEveryOtherBatch:
    """DataCollatorForPackedSSM whose odd batches lose every boundary: under gradient accumulation 2 only the
    step's second micro-batch reads its packed row as ONE sequence (the first one is correct)."""

    def __init__(self):
        self.inner, self.calls = DataCollatorForPackedSSM(), 0

    def __call__(self, features):
        out = self.inner(features)
        self.calls += 1
        if self.calls % 2 == 0:
            out = {k: v for k, v in out.items() if k not in (*BOUNDARY_KEYS, "position_ids")}
        return out


class LastSequenceMerged:
    """DataCollatorForPackedSSM whose boundaries lose the row's LAST boundary: state leaks into the last sequence
    only (the features still tell the shadow check where it starts)."""

    def __init__(self):
        self.inner = DataCollatorForPackedSSM()

    def __call__(self, features):
        out = self.inner(features)
        seq, pos, cu = out["seq_idx"].clone(), out["position_ids"].clone(), out["cu_seq_lens_q"]
        start = int(cu[-2])  # first token of the last sequence
        seq[0, start:] -= 1
        pos[0, start:] = pos[0, start - 1] + 1 + torch.arange(pos.shape[1] - start)
        cu = torch.cat([cu[:-2], cu[-1:]])
        longest = int((cu[1:] - cu[:-1]).max())
        out.update(seq_idx=seq, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
        out.update(max_length_q=longest, max_length_k=longest)
        return out


def test_leak_in_a_later_micro_batch_is_flagged(tmp_path):
    """Old: only the step's first micro-batch was checked (0 flags however long the run)."""
    shadow = ShadowCheckCallback(every_n_steps=1, mode="error")
    with pytest.raises(PaddingError, match=r"step 1, sequence [1-9]\d* of row 0 .* of micro-batch 1 \(2 checked\)"):
        train(tmp_path, wrapped(), LeakyEveryOtherBatch(), [shadow], steps=2, gradient_accumulation_steps=2)
    last = shadow.results[-1]
    assert last.flagged and last.micro_batch == 1 and last.rel_diff > 100 * last.tol, last


def test_leak_into_the_last_sequence_only_is_flagged_within_the_rotation(tmp_path):
    """Batches of 4 features hold 3 sequences after a boundary; the rotation reaches the last one at check 3.
    Old: the seeded picker chose candidate 0 at steps 1-4 (the last one first at step 5)."""
    shadow = ShadowCheckCallback(every_n_steps=1, mode="error")
    with pytest.raises(PaddingError, match=r"step 3, sequence 3 of row 0"):
        train(tmp_path, wrapped(), LastSequenceMerged(), [shadow], steps=3)
    assert [r.flagged for r in shadow.results] == [False, False, True]
    assert [r.segment.index for r in shadow.results] == [1, 2, 3]


def test_rotation_visits_every_candidate():
    shadow = ShadowCheckCallback(every_n_steps=5, seed=3)
    picks = []
    for step in range(1, 5 * 7, 5):
        shadow._step = step
        picks.append([shadow._pick(7, m) for m in range(2)])
    assert sorted(p[0] for p in picks) == list(range(7)) and sorted(p[1] for p in picks) == list(range(7))
