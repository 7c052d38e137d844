"""safepad.RolloutGapCallback in TRL 1.16's GRPOTrainer / RLOOTrainer: the logged rollout-vs-training gap.

The independent reference: each trained sequence alone through the stock (unwrapped) model, once with the weights
the rollout sampled with and once with the weights the training forward ran with, at TRL's temperature. A wrapped
model's rollout equals the sequence alone (docs/rl.md, ``tests/rl/test_rollout_parity.py``), so the logged gap must
equal the difference of those two.
"""

from __future__ import annotations

import logging

import pytest
import torch

import safepad
from safepad.testing.tiny import tiny_model
from safepad.trainer_ext import GRPO_METHOD, ROLLOUT_GAP_KEYS, RolloutGapCallback

from conftest import make_tokenizer

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

GAP_MAX, GAP_MEAN, GAP_TOKENS = ROLLOUT_GAP_KEYS
TEMPERATURE = 0.8


def _trainer(kind, model, tmp_path, base=None, **config):
    Trainer, Config = getattr(trl, f"{kind}Trainer"), getattr(trl, f"{kind}Config")
    g = torch.Generator().manual_seed(0)
    prompts = [" ".join(f"t{int(i)}" for i in torch.randint(3, 250, (n,), generator=g)) for n in (2, 9)]
    args = Config(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, max_steps=1, report_to=[], save_strategy="no",
        per_device_train_batch_size=8, num_generations=4, temperature=TEMPERATURE, logging_steps=1,
        disable_tqdm=True, dataloader_num_workers=0, beta=0.0, **{"max_completion_length": 6, **config},
    )  # fmt: skip
    cls = Trainer if base is None else type("Measured", (base, Trainer), {})
    return cls(
        model=model,
        reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
        args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
        processing_class=make_tokenizer("left"),
        callbacks=[RolloutGapCallback()],
    )


def _train(trainer):
    log = logging.getLogger("transformers")
    level = log.level
    log.setLevel(logging.ERROR)
    torch.manual_seed(0)
    try:
        trainer.train()
    finally:
        log.setLevel(level)
    (entry,) = [e for e in trainer.state.log_history if GAP_MAX in e]
    return entry


def _model(wrapped=True, family="nemotron_h", dtype=torch.float32):
    model = tiny_model(family, dtype=dtype, pad_token_id=0, eos_token_id=2)
    return safepad.wrap(model) if wrapped else model


class _PerturbAfterRollout:
    """Moves the LM head between the rollout and the training forward; keeps both weight sets and the batch."""

    seen: list

    def _generate_and_score_completions(self, inputs):
        before = _stock_copy(self.model)
        out = super()._generate_and_score_completions(inputs)
        with torch.no_grad():
            g = torch.Generator().manual_seed(1)
            w = self.model.lm_head.weight
            w.add_(torch.randn(w.shape, generator=g) * 0.05)
        after = _stock_copy(self.model)
        self.seen.append((before, after, {k: out[k].clone() for k in ("prompt_ids", "prompt_mask", "completion_ids",
                                                                       "completion_mask")}))  # fmt: skip
        return out


def _stock_copy(model):
    """A fresh stock model holding ``model``'s weights (no wrap, and none of the trainer's changes to the instance,
    such as TRL's fused LM head)."""
    fresh = _model(wrapped=False)
    fresh.load_state_dict(model.state_dict())
    return fresh.eval()


def _alone_logps(model, prompt, completion):
    """[n] log p of each completion token, the sequence alone through ``model`` at TRL's temperature."""
    seq = torch.cat([prompt, completion])
    with torch.no_grad():
        lp = (model(seq[None]).logits[0, :-1].float() / TEMPERATURE).log_softmax(-1)
    return lp.gather(-1, seq[1:, None]).squeeze(-1)[-completion.numel() :]


@pytest.mark.parametrize("kind", [pytest.param("GRPO", id="GRPOTrainer"), pytest.param("RLOO", id="RLOOTrainer")])
def test_the_logged_gap_equals_the_alone_recomputation_when_the_policy_moves_after_the_rollout(kind, tmp_path):
    trainer = _trainer(kind, _model(), tmp_path, base=_PerturbAfterRollout)
    trainer.seen = []
    own_generate = vars(trainer.model).get("generate")  # safepad.wrap's instance-level generate, if any
    entry = _train(trainer)
    (before, after, batch) = trainer.seen[0]
    gaps = []
    for b in range(batch["prompt_ids"].shape[0]):
        prompt = batch["prompt_ids"][b][batch["prompt_mask"][b].bool()]
        completion = batch["completion_ids"][b][batch["completion_mask"][b].bool()]
        gaps.append((_alone_logps(before, prompt, completion) - _alone_logps(after, prompt, completion)).abs())
    gaps = torch.cat(gaps)
    assert gaps.max().item() > 1e-2  # the injected gap is large
    assert entry[GAP_TOKENS] == gaps.numel()
    # rollout = alone and training = alone within 1e-5 each for a wrapped fp32 model (docs/rl.md, test_grpo.py)
    assert entry[GAP_MAX] == pytest.approx(gaps.max().item(), abs=1e-4)
    assert entry[GAP_MEAN] == pytest.approx(gaps.mean().item(), abs=1e-4)
    assert GRPO_METHOD not in vars(trainer) and vars(trainer.model).get("generate") is own_generate  # restored


def test_a_stock_model_shows_its_rollout_gap_and_the_wrapped_one_does_not(tmp_path):
    """Stock bf16 Bamba: its cached decode and its padded training forward round the recurrence differently
    (docs/rl.md: 1.5e-2 on this batch); wrapped, both paths round alike (4.8e-7, the log-softmax floor)."""
    stock = _train(_trainer("GRPO", _model(False, "bamba", torch.bfloat16), tmp_path / "s", max_completion_length=8))
    wrapped = _train(_trainer("GRPO", _model(True, "bamba", torch.bfloat16), tmp_path / "w", max_completion_length=8))
    assert stock[GAP_MAX] > 1e-3 and stock[GAP_TOKENS] > 0
    assert wrapped[GAP_MAX] < stock[GAP_MAX] / 100
    assert wrapped[GAP_MEAN] <= wrapped[GAP_MAX]


@pytest.mark.parametrize(
    "attr,message",
    [
        pytest.param("use_vllm", "sampling/sampling_logp_difference", id="vllm"),
        pytest.param("use_transformers_continuous_batching", "use_transformers_continuous_batching=False", id="cb"),
    ],
)
def test_rollouts_without_logits_are_refused_naming_the_setting(tmp_path, attr, message):
    trainer = _trainer("GRPO", _model(), tmp_path)
    setattr(trainer, attr, True)
    with pytest.raises(ValueError, match=message):
        trainer.train()


def test_a_trainer_that_is_not_grpo_or_rloo_is_refused(tmp_path):
    from transformers import Trainer, TrainingArguments

    ds = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7]] * 2, "labels": [[5, 6, 7]] * 2})
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, max_steps=1, report_to=[], save_strategy="no")
    trainer = Trainer(model=_model(), args=args, train_dataset=ds, callbacks=[RolloutGapCallback()])
    with pytest.raises(TypeError, match="GRPOTrainer / RLOOTrainer"):
        trainer.train()
