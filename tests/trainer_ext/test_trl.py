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
from safepad.guard import KIND_PACKED
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
