"""safepad.PackedGRPOMixin inside the installed TRL's GRPOTrainer.

The mixin overrides TRL's private ``GRPOTrainer._get_per_token_logps_and_entropies``: the first test fails
loudly when TRL renames it or changes its leading parameters. The second runs one GRPO step (generation,
rewards, loss, optimizer step) on a tiny wrapped Nemotron-H with the packed path, and checks every per-token
log-prob and entropy it returned against TRL's own padded forward of the same batch (the unpacked path).
"""

from __future__ import annotations

import copy
import inspect
import logging

import pytest
import torch

import safepad
from safepad.testing.tiny import tiny_model
from safepad.trainer_ext import GRPO_METHOD, GRPO_METHOD_PARAMS, PackedGRPOMixin

from conftest import make_tokenizer

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")


def test_trl_still_has_the_method_the_mixin_overrides():
    method = getattr(trl.GRPOTrainer, GRPO_METHOD, None)
    assert method is not None, f"TRL {trl.__version__} has no GRPOTrainer.{GRPO_METHOD}: PackedGRPOMixin needs porting"
    params = tuple(inspect.signature(method).parameters)
    assert params[: len(GRPO_METHOD_PARAMS)] == GRPO_METHOD_PARAMS, (trl.__version__, params)

    class Packed(PackedGRPOMixin, trl.GRPOTrainer):  # defining it runs the same check
        def _get_per_token_logps_and_entropies(self, *args, **kwargs):  # an override of the mixin's own
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)

    class Further(Packed):  # subclasses of the subclass are checked against TRL's method too
        pass

    class Renamed:
        def _get_per_token_logps_and_entropies(self, model, input_ids, logits_to_keep, attention_mask):
            pass

    with pytest.raises(TypeError, match="no longer starts with"):

        class Broken(PackedGRPOMixin, Renamed):
            pass


@pytest.mark.parametrize("kind", [pytest.param("GRPO", id="GRPOTrainer"), pytest.param("RLOO", id="RLOOTrainer")])
def test_one_grpo_step_packed_equals_padded(kind, tmp_path):
    """RLOOTrainer has the same private method (TRL 1.16) and takes the same mixin."""
    Trainer, Config = getattr(trl, f"{kind}Trainer"), getattr(trl, f"{kind}Config")
    torch.manual_seed(0)
    log = logging.getLogger("transformers")
    level = log.level
    log.setLevel(logging.ERROR)
    calls = []

    class PackedGRPOTrainer(PackedGRPOMixin, Trainer):
        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *a, **k):
            args = (model, input_ids, attention_mask, logits_to_keep, *a)
            packed = super()._get_per_token_logps_and_entropies(*args, **k)
            with torch.no_grad():
                padded = Trainer._get_per_token_logps_and_entropies(
                    self, model, input_ids, attention_mask, logits_to_keep, *a, **k
                )
            with torch.no_grad():  # and each sequence alone through the stock model (no padding, no cache)
                stock = safepad.unwrap(copy.deepcopy(model))
                alone = torch.zeros_like(packed[0])
                for b in range(input_ids.shape[0]):
                    idx = attention_mask[b].nonzero().flatten()
                    seq = input_ids[b, idx]
                    lp = (stock(seq[None]).logits[0, :-1].float() / self.temperature).log_softmax(-1)
                    lp = lp.gather(-1, seq[1:, None]).squeeze(-1)  # [n - 1]: tokens idx[1:]
                    keep = idx[1:] >= input_ids.shape[1] - logits_to_keep
                    alone[b, idx[1:][keep] - (input_ids.shape[1] - logits_to_keep)] = lp[keep]
            calls.append((attention_mask[:, -logits_to_keep:].clone(), packed, padded, alone, attention_mask.clone()))
            return packed

    tok = make_tokenizer("left")
    g = torch.Generator().manual_seed(0)
    prompts = [" ".join(f"t{int(i)}" for i in torch.randint(3, 250, (n,), generator=g)) for n in (2, 9, 1, 5)]
    model = safepad.wrap(tiny_model("nemotron_h", pad_token_id=0, eos_token_id=2))
    config = Config(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, max_steps=1, report_to=[], save_strategy="no",
        per_device_train_batch_size=8, num_generations=4, max_completion_length=6, temperature=0.8,
        logging_steps=1, disable_tqdm=True, dataloader_num_workers=0, beta=0.0,  # beta=0: no reference model to load
    )  # fmt: skip
    trainer = PackedGRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
        args=config,
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
        processing_class=tok,
    )
    try:
        trainer.train()
    finally:
        log.setLevel(level)
    assert trainer.state.global_step == 1 and calls
    assert any(not bool(mask.all()) for *_, mask in calls)  # padded rows of different lengths
    for keep, (lp, ent, _), (ref_lp, ref_ent, _), alone, _ in calls:
        assert torch.isfinite(lp).all() and bool((lp != 0).any())
        assert (lp - ref_lp).abs().max().item() < 1e-5
        assert (lp - alone).abs().max().item() < 1e-5
        assert ((lp != 0) <= keep.bool()).all()
        if ref_ent is not None:
            assert (ent - ref_ent).abs().max().item() < 1e-4
