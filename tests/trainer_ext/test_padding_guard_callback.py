"""PaddingGuardCallback with a real transformers Trainer and TRL's SFTTrainer(padding_free=True).

Each detection test also runs the same training without the callback and asserts that the stock model
raises (or warns) nothing that names the problem, so the test fails without the guard.
"""

from __future__ import annotations

import copy
import importlib.util
import itertools
import warnings

import pytest
import torch
from conftest import make_examples, make_model, make_tokenizer, training_args
from transformers import DataCollatorWithFlattening, Trainer

from safepad.errors import PaddingError, PaddingWarning
from safepad.guard import KIND_HOLES, KIND_PACKED, KIND_RIGHT_PADDING, get_guard
from safepad.trainer_ext import KIND_TOKENIZER, PaddingGuardCallback

HAS_WRAP = importlib.util.find_spec("safepad.wrap") is not None
needs_wrap = pytest.mark.skipif(not HAS_WRAP, reason="safepad.wrap is not importable yet (lead's safepad/wrap.py)")

STAT_KEYS = ("safepad/pad_fraction", "safepad/tokens_per_batch", "safepad/sequences_per_batch")


class RightPadCollator:
    """Right-pads ``input_ids`` ``[B, T]``; labels are -100 at pads; optionally adds ``use_cache`` / holes."""

    def __init__(self, pad_to_multiple_of: int | None = None, use_cache: bool | None = None, hole: bool = False):
        self.multiple, self.use_cache, self.hole = pad_to_multiple_of, use_cache, hole

    def __call__(self, features: list[dict]) -> dict:
        T = max(len(f["input_ids"]) for f in features)
        if self.multiple:
            T = -(-T // self.multiple) * self.multiple
        ids = torch.zeros(len(features), T, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, f in enumerate(features):
            n = len(f["input_ids"])
            ids[i, :n] = torch.tensor(f["input_ids"])
            mask[i, :n] = 1
        if self.hole:
            mask[:, 1] = 0  # a masked position between real tokens in every row
        labels = ids.masked_fill(mask == 0, -100)
        batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        if self.use_cache is not None:
            batch["use_cache"] = self.use_cache
        return batch


class CyclingCollator:
    """Each batch uses the next collator of ``collators`` in turn."""

    def __init__(self, *collators):
        self._cycle = itertools.cycle(collators)

    def __call__(self, features):
        return next(self._cycle)(features)


def flattening(seq_idx: bool):
    """transformers' packing collator: ``[1, T]`` rows, position_ids restarting, no mask (+ cu_seq_lens / seq_idx)."""
    return DataCollatorWithFlattening(return_flash_attn_kwargs=seq_idx, return_seq_idx=seq_idx)


def run(tmp_path, collator, callback=None, model=None, tokenizer=None, **args):
    model = model if model is not None else make_model()
    trainer = Trainer(
        model=model,
        args=training_args(tmp_path, **args),
        train_dataset=make_examples(),
        eval_dataset=make_examples(4) if args.get("eval_strategy", "no") != "no" else None,
        data_collator=collator,
        processing_class=tokenizer,
        callbacks=[callback] if callback is not None else None,
    )
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        trainer.train()
    return trainer, [w for w in rec if issubclass(w.category, PaddingWarning)]


# --------------------------------------------------------------------------------------- error mode
RIGHT_PAD_CACHE = [
    pytest.param({"collator": RightPadCollator(use_cache=True)}, id="use_cache-in-batch"),
    pytest.param({"collator": RightPadCollator(), "use_cache": True, "eval_strategy": "steps", "eval_steps": 1},
                 id="eval-with-config-use_cache"),
]  # fmt: skip


@pytest.mark.parametrize("setup", RIGHT_PAD_CACHE)
def test_error_on_right_padded_batches_with_cache(tmp_path, setup):
    trainer, warned = run(tmp_path, **setup)  # the stock model trains and evaluates without a word
    assert warned == [] and trainer.state.global_step == 3
    cb = PaddingGuardCallback(mode="error")
    with pytest.raises(PaddingError, match=r"ends in \d+ padding token") as exc:
        run(tmp_path, callback=cb, **setup)
    assert KIND_RIGHT_PADDING in exc.value.kinds


@pytest.mark.parametrize(
    "seq_idx",
    [pytest.param(False, id="position_ids-only"), pytest.param(True, id="position_ids+seq_idx+cu_seq_lens")],
)
def test_error_on_packed_batches_unwrapped(tmp_path, seq_idx):
    if seq_idx:  # the stock torch path refuses seq_idx, with a generic error that does not name the cause
        with pytest.raises(ValueError, match="can't keep packed sequences apart") as stock:
            run(tmp_path, flattening(True))
        assert not isinstance(stock.value, PaddingError)
    else:  # the stock model silently leaks the state across the packed sequences
        trainer, warned = run(tmp_path, flattening(False))
        assert warned == [] and trainer.state.global_step == 3
    with pytest.raises(PaddingError, match="packed inputs: row 0 holds 2 sequences") as exc:
        run(tmp_path, flattening(seq_idx), callback=PaddingGuardCallback(mode="error"))
    assert exc.value.kinds == (KIND_PACKED,)


# --------------------------------------------------------------------------------------- warn mode, stats
def test_warn_mode_one_warning_per_kind(tmp_path):
    collator = CyclingCollator(RightPadCollator(use_cache=True), flattening(False), RightPadCollator(hole=True))
    _, stock = run(tmp_path, collator, tokenizer=make_tokenizer("right"), max_steps=6)
    assert stock == []
    cb = PaddingGuardCallback(mode="warn")
    collator = CyclingCollator(RightPadCollator(use_cache=True), flattening(False), RightPadCollator(hole=True))
    trainer, warned = run(tmp_path, collator, callback=cb, tokenizer=make_tokenizer("right"), max_steps=6)
    assert trainer.state.global_step == 6
    assert sorted(w.message.kind for w in warned) == sorted([KIND_TOKENIZER, KIND_RIGHT_PADDING, KIND_PACKED, KIND_HOLES])
    assert get_guard(trainer.model) is None  # removed at train end


def test_left_padding_tokenizer_no_warning(tmp_path):
    _, warned = run(tmp_path, RightPadCollator(), callback=PaddingGuardCallback(), tokenizer=make_tokenizer("left"))
    assert warned == []


def test_stats_are_logged(tmp_path):
    # every example has 8 tokens, batches of 2 padded to 16: pad fraction 0.5, 16 tokens, 2 sequences per batch
    cb = PaddingGuardCallback(mode="error")
    trainer = Trainer(
        model=make_model(),
        args=training_args(tmp_path, use_cache=True),  # config-default cache in training: counted, not raised
        train_dataset=make_examples(lengths=(8,)),
        data_collator=RightPadCollator(pad_to_multiple_of=16),
        callbacks=[cb],
    )
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 3
    for h in logged:
        assert h["safepad/pad_fraction"] == pytest.approx(0.5)
        assert h["safepad/tokens_per_batch"] == pytest.approx(16.0)
        assert h["safepad/sequences_per_batch"] == pytest.approx(2.0)
        assert h["safepad/right_padded_default_cache"] == pytest.approx(1.0)


def test_packed_stats_logged_and_log_stats_off(tmp_path):
    trainer, _ = run(tmp_path, flattening(False), callback=PaddingGuardCallback(mode="warn"))
    logged = [h for h in trainer.state.log_history if "loss" in h]
    # 2 examples per batch, flattened into one row, no pads
    assert all(h["safepad/sequences_per_batch"] == pytest.approx(2.0) for h in logged)
    assert all(h["safepad/pad_fraction"] == 0.0 for h in logged)
    trainer, _ = run(tmp_path, flattening(False), callback=PaddingGuardCallback(mode="warn", log_stats=False))
    assert not any(k in h for h in trainer.state.log_history for k in STAT_KEYS)


def test_callback_validates_mode():
    with pytest.raises(ValueError, match="mode must be one of"):
        PaddingGuardCallback(mode="loud")


# --------------------------------------------------------------------------------------- TRL padding_free
def _sft(tmp_path, callback=None, model=None, bf16: bool | None = None):
    from datasets import Dataset
    pytest.importorskip("trl")
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, logging_steps=1, report_to=[],
        save_strategy="no", use_cpu=True, disable_tqdm=True, padding_free=True, max_length=None,
        dataset_num_proc=None, learning_rate=1e-3, **({} if bf16 is None else {"bf16": bf16}),
    )  # fmt: skip
    trainer = SFTTrainer(
        model=model if model is not None else make_model(),
        args=args,
        train_dataset=Dataset.from_list(make_examples()),
        processing_class=make_tokenizer("left"),
        callbacks=[callback] if callback is not None else None,
    )
    trainer.train()
    return trainer


def test_sft_padding_free_error(tmp_path):
    with pytest.raises(ValueError, match="can't keep packed sequences apart") as stock:  # generic kernel error
        _sft(tmp_path)
    assert not isinstance(stock.value, PaddingError)
    with pytest.raises(PaddingError, match="packed inputs") as exc:
        _sft(tmp_path, PaddingGuardCallback(mode="error"))
    assert exc.value.kinds == (KIND_PACKED,)


@needs_wrap
@pytest.mark.parametrize("bf16", [pytest.param(None, id="trl-default-bf16-autocast"), pytest.param(False, id="fp32")])
def test_sft_padding_free_fix_mode_trains_and_logs(tmp_path, bf16):
    from safepad.wrap import is_wrapped

    trainer = _sft(tmp_path, PaddingGuardCallback(mode="fix"), bf16=bf16)
    assert is_wrapped(trainer.model) and trainer.state.global_step == 2
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert all(h["safepad/sequences_per_batch"] == pytest.approx(2.0) for h in logged)


# --------------------------------------------------------------------------------------- with safepad.wrap
@needs_wrap
def test_wrapped_model_raises_nothing_and_logs_stats(tmp_path):
    from safepad.wrap import wrap

    collator = CyclingCollator(RightPadCollator(use_cache=True), flattening(True))
    model = wrap(make_model())
    trainer, warned = run(tmp_path, collator, callback=PaddingGuardCallback(mode="error"), model=model,
                          tokenizer=make_tokenizer("right"))  # fmt: skip
    assert warned == [] and trainer.state.global_step == 3
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 3 and all(k in h for h in logged for k in STAT_KEYS)


@needs_wrap
def test_fix_mode_wraps_before_the_first_forward(tmp_path):
    from safepad.wrap import is_wrapped

    model = make_model(strong=True)
    stock = copy.deepcopy(model).eval()
    first: list[torch.Tensor] = []

    def record(module, args, kwargs, output):
        if not first:
            first.append(output.logits.detach())
            first.append(kwargs["input_ids"].detach())
            first.append(kwargs["position_ids"].detach())

    handle = model.register_forward_hook(record, with_kwargs=True)
    trainer, _ = run(tmp_path, flattening(True), callback=PaddingGuardCallback(mode="fix"), model=model)
    handle.remove()
    assert is_wrapped(trainer.model) and trainer.state.global_step == 3
    logits, ids, pos = first
    starts = (pos[0] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
    with torch.no_grad():
        ref = torch.cat([stock(input_ids=ids[:, a:b]).logits for a, b in itertools.pairwise(starts)], 1)
    # the first training forward already ran wrapped: per-sequence logits (dropout-free model, train mode)
    torch.testing.assert_close(logits, ref, atol=1e-3, rtol=1e-3)


def test_stale_callback_guard_is_replaced_user_guard_is_kept(tmp_path):
    from safepad.guard import guard

    model = make_model()
    with pytest.raises(PaddingError):  # raises before on_train_end: the guard stays on the model
        run(tmp_path, flattening(False), callback=PaddingGuardCallback(mode="error"), model=model)
    assert get_guard(model) is not None
    _, warned = run(tmp_path, flattening(False), callback=PaddingGuardCallback(mode="warn"), model=model)
    assert [w.message.kind for w in warned] == [KIND_PACKED] and get_guard(model) is None
    user = guard(model, "error")
    with pytest.raises(PaddingError):  # the user's guard (mode="error") is reused, not replaced
        run(tmp_path, flattening(False), callback=PaddingGuardCallback(mode="warn"), model=model)
    assert get_guard(model) is user
    user.remove()


@pytest.mark.parametrize("remove_unused_columns", [True, False])
def test_warns_when_trainer_drops_pack_dataset_boundaries(tmp_path, remove_unused_columns):
    """Mamba2ForCausalLM.forward takes no position_ids: Trainer's column filter drops pack_dataset's boundary
    columns and every packed row would collate as one sequence. The callback says so (and only then)."""
    import warnings as _warnings

    from datasets import Dataset
    from transformers import Trainer

    import safepad
    from safepad.testing.tiny import tiny_model
    from safepad.trainer_ext import KIND_DROPPED_BOUNDARIES

    model = safepad.wrap(tiny_model("mamba2")).train()
    packed = safepad.pack_dataset(Dataset.from_list(make_examples(8)), max_length=32)
    trainer = Trainer(
        model=model,
        args=training_args(tmp_path, max_steps=1, remove_unused_columns=remove_unused_columns),
        train_dataset=packed,
        data_collator=safepad.DataCollatorForPackedSSM(),
        callbacks=[safepad.PaddingGuardCallback(mode="warn")],
    )
    with _warnings.catch_warnings(record=True) as caught:
        _warnings.simplefilter("always")
        trainer.train()
    kinds = [getattr(w.message, "kind", None) for w in caught if issubclass(w.category, safepad.PaddingWarning)]
    assert (KIND_DROPPED_BOUNDARIES in kinds) == remove_unused_columns


@pytest.mark.parametrize("mode", ["error", "fix"])
def test_error_mode_raises_when_trainer_drops_pack_dataset_boundaries(tmp_path, mode):
    """mode="error" must not only warn: without the columns each packed row trains as ONE sequence. "fix" cannot
    bring dropped columns back, so it raises too; remove_unused_columns=False trains."""
    from datasets import Dataset
    from transformers import Trainer

    import safepad
    from safepad.testing.tiny import tiny_model
    from safepad.trainer_ext import KIND_DROPPED_BOUNDARIES

    packed = safepad.pack_dataset(Dataset.from_list(make_examples(8)), max_length=32)

    def trainer(remove_unused_columns):
        model = safepad.wrap(tiny_model("mamba2")).train()
        return Trainer(
            model=model,
            args=training_args(tmp_path, max_steps=1, remove_unused_columns=remove_unused_columns),
            train_dataset=packed,
            data_collator=safepad.DataCollatorForPackedSSM(),
            callbacks=[safepad.PaddingGuardCallback(mode=mode)],
        )

    t = trainer(True)
    with pytest.raises(PaddingError, match="remove_unused_columns=False") as exc:
        t.train()
    assert exc.value.kinds == (KIND_DROPPED_BOUNDARIES,)
    assert t.state.global_step == 0 and get_guard(t.model) is None  # nothing trained, guard removed
    t = trainer(False)
    t.train()
    assert t.state.global_step == 1


def test_error_mode_leaves_unpacked_rows_alone(tmp_path):
    """One example per row, no boundary columns: the column filter loses nothing, so error mode trains (and warns
    nothing). The check reads the Trainer's dataset before the filter, not the loader's after it."""
    from datasets import Dataset
    from transformers import Trainer

    import safepad
    from safepad.testing.tiny import tiny_model

    trainer = Trainer(
        model=safepad.wrap(tiny_model("mamba2")).train(),
        args=training_args(tmp_path, max_steps=1),
        train_dataset=Dataset.from_list(make_examples(8)),
        data_collator=safepad.DataCollatorForPackedSSM(),
        callbacks=[safepad.PaddingGuardCallback(mode="error")],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", PaddingWarning)
        trainer.train()
    assert trainer.state.global_step == 1


def test_error_mode_raises_when_a_stream_loses_its_boundary_columns(tmp_path):
    """A packed IterableDataset: Trainer strips seq_lengths / position_ids batch by batch (RemoveColumnsCollator)."""
    from datasets import Dataset
    from transformers import Trainer

    import safepad
    from safepad.testing.tiny import tiny_model
    from safepad.trainer_ext import KIND_DROPPED_BOUNDARIES

    stream = safepad.pack_dataset(Dataset.from_list(make_examples(8)).to_iterable_dataset(), max_length=32)
    trainer = Trainer(
        model=safepad.wrap(tiny_model("mamba2")).train(),
        args=training_args(tmp_path, max_steps=1),
        train_dataset=stream,
        data_collator=safepad.DataCollatorForPackedSSM(),
        callbacks=[safepad.PaddingGuardCallback(mode="error")],
    )
    with pytest.raises(PaddingError, match="remove_unused_columns=False") as exc:
        trainer.train()
    assert exc.value.kinds == (KIND_DROPPED_BOUNDARIES,) and trainer.state.global_step == 0
