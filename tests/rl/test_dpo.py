"""TRL's DPOTrainer on a wrapped hybrid: each chosen / rejected log-prob equals the sequence alone.

The trainer's own code computes the sums (``DPOTrainer.compute_ref_log_probs``: the fused LM head over the
padded ``[chosen; rejected]`` batch, summed over the completion tokens); the reference runs each sequence's real
tokens alone through the stock model without a cache. ``padding_free=True`` is disabled in TRL 1.16 (it warns and
pads): the test pins that, so a TRL that brings it back shows up here.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import safepad
from safepad.testing.tiny import tiny_model

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2, **{f"t{i}": i for i in range(3, 256)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")


def _text(n: int, g: torch.Generator) -> str:
    return " ".join(f"t{int(i)}" for i in torch.randint(3, 250, (n,), generator=g))


@pytest.mark.parametrize("padding_free", [pytest.param(False, id="padded"), pytest.param(True, id="padding_free")])
def test_chosen_and_rejected_logps_equal_each_sequence_alone(padding_free, tmp_path):
    g = torch.Generator().manual_seed(0)
    # prompt / chosen / rejected lengths: 1-token completions, a long chosen next to a short rejected
    lengths = [(3, 1, 7), (9, 12, 1), (1, 4, 4), (6, 2, 14)]
    data = {
        "prompt": [_text(p, g) for p, _, _ in lengths],
        "chosen": [" " + _text(c, g) for _, c, _ in lengths],
        "rejected": [" " + _text(r, g) for _, _, r in lengths],
    }
    stock = tiny_model("nemotron_h", pad_token_id=0, eos_token_id=2)
    model = safepad.wrap(copy.deepcopy(stock))
    log = logging.getLogger("transformers")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        config = trl.DPOConfig(
            output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], per_device_train_batch_size=4,
            padding_free=padding_free, dataloader_num_workers=0, disable_tqdm=True,
        )  # fmt: skip
        trainer = trl.DPOTrainer(
            model=model, ref_model=safepad.wrap(copy.deepcopy(stock)), args=config,
            train_dataset=datasets.Dataset.from_dict(data), processing_class=_tokenizer(),
        )  # fmt: skip
        # TRL 1.16 turns padding_free off (it logs that it pads instead): revisit this test when TRL brings it back
        assert trainer.padding_free is False
        batch = next(iter(trainer.get_train_dataloader()))
        with torch.no_grad():
            chosen, rejected = trainer.compute_ref_log_probs(trainer.model, batch)
            expected = []
            for b in range(batch["input_ids"].shape[0]):
                idx = batch["attention_mask"][b].nonzero().flatten()
                seq = batch["input_ids"][b, idx]
                lp = stock(seq[None], use_cache=False).logits[0, :-1].float().log_softmax(-1)
                lp = lp.gather(-1, seq[1:, None]).squeeze(-1)  # [n - 1]: tokens idx[1:]
                expected.append((lp * batch["completion_mask"][b, idx[1:]]).sum())
            packed = safepad.packed_logprobs(  # the same batch scored on packed rows
                model, batch["input_ids"], batch["attention_mask"], completion_mask=batch["completion_mask"]
            ).sum(1)
    finally:
        log.setLevel(level)
    got = torch.cat([chosen, rejected]).float()
    assert torch.isfinite(got).all()
    assert (got - torch.stack(expected)).abs().max().item() < 1e-4
    assert (packed - torch.stack(expected)).abs().max().item() < 1e-4
    assert not bool(batch["attention_mask"].all())  # rows of different lengths were padded
