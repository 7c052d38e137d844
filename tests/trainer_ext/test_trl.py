"""ShadowCheckCallback and PaddingGuardCallback inside the installed TRL's trainers (issue 30).

TRL (>= 1.16) adds its fused LM head to every SFT / GRPO / DPO model: the training forward is called with
``fused_lm_head=True`` and returns per-token log-probabilities, no logits. The shadow check then compares the
backbone's last hidden states through the LM head weight. Each test runs a tiny Nemotron-H for 1-3 steps; an
injected leak (a scan that ignores ``seq_idx`` on packed rows, a backbone that loses the padding mask on GRPO's
left-padded rows) must be flagged, and the same run without it must pass. Each leak is silent without the
callback: the run trains and its loss stays finite.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from conftest import make_examples, make_model, make_tokenizer

import safepad
from safepad.errors import PaddingError, PaddingWarning
from safepad.guard import KIND_HOLES, KIND_PACKED
from safepad.trainer_ext import KIND_SHADOW_MISMATCH, SHADOW_TOLERANCES, PaddingGuardCallback, ShadowCheckCallback

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

COMMON = {
    "per_device_train_batch_size": 4, "logging_steps": 1, "report_to": [], "save_strategy": "no", "use_cpu": True,
    "disable_tqdm": True, "learning_rate": 1e-3, "dataloader_num_workers": 0, "bf16": False,
}  # fmt: skip
LENGTHS = (5, 17, 9, 30, 12, 3)


@pytest.fixture
def broken_scan():
    """A broken kernel route: the Mamba2 scan called without its ``seq_idx`` (the conv still gets it)."""
    import safepad.mixers.mamba2 as m2

    good = m2.ssd_scan

    def install():
        def broken(*args, **kwargs):
            kwargs["seq_idx"] = None
            return good(*args, **kwargs)

        m2.ssd_scan = broken

    yield install
    m2.ssd_scan = good


def _finite_losses(trainer) -> bool:
    return all(math.isfinite(e["loss"]) for e in trainer.state.log_history if "loss" in e)


# ------------------------------------------------------------------------------------------------ SFTTrainer
def _sft(tmp_path, mode: str, callbacks, model, steps: int = 2):
    from trl import SFTConfig, SFTTrainer

    layout = {"packing": True, "max_length": 48} if mode == "packing" else {"padding_free": True, "max_length": None}
    args = SFTConfig(output_dir=str(tmp_path), max_steps=steps, dataset_num_proc=None, **layout, **COMMON)
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_list(make_examples(24, lengths=LENGTHS)),
        processing_class=make_tokenizer("right"),
        callbacks=list(callbacks),
    )
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        trainer.train()
    return trainer, [w for w in rec if issubclass(w.category, PaddingWarning)]


SFT_MODES = [pytest.param("packing", id="packing"), pytest.param("padding_free", id="padding_free")]


@pytest.mark.parametrize("mode", SFT_MODES)
def test_sft_shadow_passes_a_correct_run(tmp_path, mode):
    """Old: step 1 raised "the packed forward returned no logits" (TRL's fused LM head)."""
    shadow = ShadowCheckCallback(every_n_steps=1, mode="error")
    trainer, warned = _sft(tmp_path, mode, [shadow], safepad.wrap(make_model(strong=True)))
    assert warned == [] and trainer.state.global_step == 2 and len(shadow.results) == 2
    assert all(r.segment.index > 0 and not r.flagged for r in shadow.results), shadow.results
    assert max(r.rel_diff for r in shadow.results) <= SHADOW_TOLERANCES[torch.float32] / 10


@pytest.mark.parametrize("mode", SFT_MODES)
def test_sft_shadow_flags_a_leak(tmp_path, mode, broken_scan):
    broken_scan()
    trainer, warned = _sft(tmp_path, mode, [], safepad.wrap(make_model(strong=True)), steps=1)
    assert warned == [] and _finite_losses(trainer)  # silent without the callback
    shadow = ShadowCheckCallback(every_n_steps=1, mode="error")
    with pytest.raises(PaddingError, match=r"step 1, sequence [1-9]\d* of row 0") as exc:
        _sft(tmp_path, mode, [shadow], safepad.wrap(make_model(strong=True)), steps=1)
    assert exc.value.kinds == (KIND_SHADOW_MISMATCH,)
    assert shadow.results[-1].rel_diff > 100 * shadow.results[-1].tol


@pytest.mark.parametrize("mode", SFT_MODES)
def test_sft_padding_guard(tmp_path, mode):
    """The guard runs inside SFTTrainer: it flags the unwrapped model's packed rows, and passes a wrapped one."""
    with pytest.raises(PaddingError, match="packed inputs") as exc:
        _sft(tmp_path, mode, [PaddingGuardCallback(mode="error")], make_model(), steps=1)
    assert exc.value.kinds == (KIND_PACKED,)
    trainer, warned = _sft(tmp_path, mode, [PaddingGuardCallback(mode="error")], safepad.wrap(make_model()), steps=1)
    assert warned == [] and trainer.state.global_step == 1
    assert "safepad/sequences_per_batch" in trainer.state.log_history[0]


# ------------------------------------------------------------------------------------------------ GRPOTrainer
PROMPTS = ["t5 t6", "t7 t8 t9 t10 t11 t12 t13 t14 t15", "t16 t17 t18", "t19 t20 t21 t22 t23 t24 t25 t26"]


def _reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def _mask_lost(model):
    """A backbone that loses the padding mask of GRPO's left-padded rows (pads enter every later state)."""

    def drop(module, args, kwargs):
        kwargs["attention_mask"] = None
        return args, kwargs

    return model.base_model.register_forward_pre_hook(drop, with_kwargs=True)


def _grpo(tmp_path, callbacks, model, steps: int = 2):
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path), max_steps=steps, num_generations=2, max_completion_length=4, seed=0, **COMMON
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=_reward,
        args=args,
        train_dataset=datasets.Dataset.from_list([{"prompt": p} for p in PROMPTS * 4]),
        processing_class=make_tokenizer("left"),
        callbacks=list(callbacks),
    )
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        trainer.train()
    return trainer, [w for w in rec if issubclass(w.category, PaddingWarning)]


def test_grpo_shadow_passes_a_correct_run(tmp_path):
    shadow = ShadowCheckCallback(every_n_steps=1, mode="error")
    trainer, warned = _grpo(tmp_path, [shadow], safepad.wrap(make_model(strong=True)))
    assert warned == [] and trainer.state.global_step == 2 and len(shadow.results) == 2
    assert not any(r.flagged for r in shadow.results), shadow.results
    assert max(r.rel_diff for r in shadow.results) <= SHADOW_TOLERANCES[torch.float32] / 10


def test_grpo_shadow_flags_a_leak(tmp_path):
    """GRPO rows are [left pads | prompt | completion | right pads]; the second check takes row 1, a short prompt's
    left-padded row (the first takes row 0, the long prompt's row, which has no left pad)."""
    model = make_model(strong=True)
    _mask_lost(model)
    trainer, warned = _grpo(tmp_path, [], model)
    assert warned == [] and _finite_losses(trainer)  # silent without the callback
    model = make_model(strong=True)
    _mask_lost(model)
    shadow = ShadowCheckCallback(every_n_steps=1, mode="error")
    with pytest.raises(PaddingError, match=r"step 2, sequence 0 of row 1"):
        _grpo(tmp_path, [shadow], model)
    assert [r.flagged for r in shadow.results] == [False, True]
    assert shadow.results[-1].rel_diff > 100 * shadow.results[-1].tol


def _hole(model):
    """A training forward whose mask has a hole (a masked token between real ones, as a tool-output mask makes):
    the unwrapped model's scan runs straight through it."""

    def poke(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if torch.is_grad_enabled() and isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[1] > 2:
            kwargs["attention_mask"] = mask.clone()
            kwargs["attention_mask"][:, -2] = 0  # every completion holds its 4 tokens (max_completion_length)
        return args, kwargs

    return model.register_forward_pre_hook(poke, with_kwargs=True)


@pytest.mark.parametrize("wrapped", [pytest.param(False, id="stock"), pytest.param(True, id="wrapped")])
def test_grpo_padding_guard(tmp_path, wrapped):
    """The guard runs inside GRPOTrainer: it logs its statistics, and flags an injected hole on the unwrapped model."""
    model = safepad.wrap(make_model()) if wrapped else make_model()
    trainer, warned = _grpo(tmp_path, [PaddingGuardCallback(mode="error")], model, steps=1)
    assert warned == [] and "safepad/sequences_per_batch" in trainer.state.log_history[0]
    model = safepad.wrap(make_model()) if wrapped else make_model()
    _hole(model)
    if wrapped:  # wrapped: the hole is handled
        trainer, warned = _grpo(tmp_path, [PaddingGuardCallback(mode="error")], model, steps=1)
        assert warned == [] and trainer.state.global_step == 1
        return
    trainer, _ = _grpo(tmp_path, [], model, steps=1)  # silent without the guard
    assert _finite_losses(trainer)
    model = make_model()
    _hole(model)
    with pytest.raises(PaddingError) as exc:
        _grpo(tmp_path, [PaddingGuardCallback(mode="error")], model, steps=1)
    assert exc.value.kinds == (KIND_HOLES,)


# ------------------------------------------------------------------------------------------------ DPOTrainer
def _dpo(tmp_path, callbacks, wrapped: bool, padding_free: bool, hole: bool = False):
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(
        output_dir=str(tmp_path), max_steps=1, max_length=32, padding_free=padding_free, beta=0.1, **COMMON
    )
    rows = [
        {"prompt": "t5 t6 t7", "chosen": " t8 t9", "rejected": " t10 t11 t12 t13"},
        {"prompt": "t14", "chosen": " t15 t16 t17", "rejected": " t18"},
    ]
    model, ref = ((safepad.wrap(make_model(seed)) if wrapped else make_model(seed)) for seed in (0, 0))
    if hole:
        _hole(model)
    trainer = DPOTrainer(
        model=model,
        ref_model=ref,
        args=args,
        train_dataset=datasets.Dataset.from_list(rows * 4),
        processing_class=make_tokenizer("left"),
        callbacks=list(callbacks),
    )
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        trainer.train()
    return trainer, [w for w in rec if issubclass(w.category, PaddingWarning)]


@pytest.mark.parametrize("wrapped", [pytest.param(False, id="stock"), pytest.param(True, id="wrapped")])
def test_dpo_padding_guard(tmp_path, wrapped):
    """The guard runs inside DPOTrainer, logging its statistics, and flags an injected hole on the unwrapped model.
    (TRL 1.16's DPO ``padding_free=True`` falls back to padding, with a warning.)"""
    trainer, warned = _dpo(tmp_path, [PaddingGuardCallback(mode="error")], wrapped, padding_free=False)
    assert warned == [] and "safepad/sequences_per_batch" in trainer.state.log_history[0]
    if wrapped:
        trainer, warned = _dpo(tmp_path, [PaddingGuardCallback(mode="error")], wrapped, False, hole=True)
        assert warned == [] and trainer.state.global_step == 1
        return
    trainer, _ = _dpo(tmp_path, [], wrapped, False, hole=True)  # silent without the guard
    assert _finite_losses(trainer)
    with pytest.raises(PaddingError) as exc:
        _dpo(tmp_path, [PaddingGuardCallback(mode="error")], wrapped, False, hole=True)
    assert exc.value.kinds == (KIND_HOLES,)
