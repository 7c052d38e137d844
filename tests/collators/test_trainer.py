"""DataCollatorForPackedSSM as transformers.Trainer's data_collator (tiny Llama from a config, no download)."""

from __future__ import annotations

import datasets
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from safepad.collators import DataCollatorForPackedSSM, pack_dataset

datasets.disable_progress_bars()

VOCAB = 4096


class _Recorder:
    """Wraps the collator and keeps what Trainer handed it and what it returned."""

    def __init__(self, collator: DataCollatorForPackedSSM) -> None:
        self.collator = collator
        self.feature_keys: list[set[str]] = []
        self.batches: list[dict] = []

    def __call__(self, features):
        self.feature_keys.append(set(features[0]))
        batch = self.collator(features)
        self.batches.append({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()})
        return batch


def _tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def examples():
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 40, size=80)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    assert lengths.sum() < VOCAB  # token = global position: every token identifies its example
    ids = [list(range(s, s + n)) for s, n in zip(starts.tolist(), lengths.tolist())]
    return datasets.Dataset.from_dict({"input_ids": ids, "text": ["x"] * len(ids)})


@pytest.mark.parametrize("streaming", [pytest.param(False, id="Dataset"), pytest.param(True, id="IterableDataset")])
def test_trainer_with_packed_rows_keeps_boundaries(examples, tmp_path, streaming):
    # Dataset: Trainer removes seq_lengths from the table; IterableDataset: its RemoveColumnsCollator
    # removes it from every batch. Either way the rows keep position_ids.
    source = examples.to_iterable_dataset() if streaming else examples
    packed = pack_dataset(source.remove_columns("text"), 64, buffer_size=20)
    originals = {tuple(r) for r in examples["input_ids"]}
    recorder = _Recorder(DataCollatorForPackedSSM(pad_to_multiple_of=16, pad_token_id=VOCAB - 1))
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=4,
        per_device_train_batch_size=3,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        use_cpu=True,
        dataloader_num_workers=0,
    )
    assert args.remove_unused_columns  # the default: Trainer drops seq_lengths before collation
    trainer = Trainer(model=_tiny_llama(), args=args, train_dataset=packed, data_collator=recorder)
    result = trainer.train()
    assert np.isfinite(result.training_loss)
    assert len(recorder.batches) >= 4  # the dataloader may prefetch one more
    pad_id = VOCAB - 1
    n_real = 0
    for keys, batch in zip(recorder.feature_keys, recorder.batches):
        assert "seq_lengths" not in keys and "position_ids" in keys  # what remove_unused_columns leaves
        cu = batch["cu_seq_lens_q"].tolist()
        ids = batch["input_ids"][0].tolist()
        seqs = [tuple(ids[a:b]) for a, b in zip(cu[:-1], cu[1:])]
        if seqs[-1] == (pad_id,) * len(seqs[-1]):
            seqs = seqs[:-1]  # the pad_to_multiple_of tail
        # every sequence is exactly one original example: the boundaries survived Trainer
        assert all(s in originals for s in seqs)
        n_real += len(seqs)
    assert n_real > 3 * len(recorder.batches)  # several sequences per row, not one per row


def test_packed_loss_equals_per_sequence_loss(examples):
    """The collator's boundaries (labels -100 at starts, restarting positions) reproduce unpacked training."""
    model = _tiny_llama().eval()
    feats = [examples[i] for i in range(6)]
    for f in feats:
        del f["text"]
    batch = DataCollatorForPackedSSM()(feats)
    with torch.no_grad():
        # use_cache=False as in Trainer (args.use_cache): transformers only detects packing without a cache
        packed_loss = model(**batch, use_cache=False).loss
        total, count = 0.0, 0
        for f in feats:
            ids = torch.tensor([f["input_ids"]])
            n = ids.shape[1] - 1
            total += model(input_ids=ids, labels=ids).loss * n
            count += n
    torch.testing.assert_close(packed_loss, total / count, rtol=1e-5, atol=1e-5)
