"""One compile for a whole epoch of packed batches: ``pad_to_length`` rows, ``dynamic=True`` and ``mark_dynamic``.

A wrapped tiny Nemotron-H (mamba / attention / mamba / mlp, strengthened mixers) is compiled once and trained
for an epoch of ``pack_dataset`` rows. Packed rows differ in length and in their number of sequences, so every
tensor the collator emits (``cu_seq_lens_*`` included) would change shape from batch to batch. The recompile
count is read from ``torch._dynamo.utils.counters``: the number of frames dynamo compiled after the first batch
must not grow. Every batch's loss is checked against an independent reference: each real sequence run alone
through the STOCK model, the summed next-token cross-entropy divided by the number of predicted tokens (the
pad tail must add nothing).
"""

from __future__ import annotations

import copy

import datasets
import numpy as np
import pytest
import torch
import torch._dynamo as dynamo
import torch.nn.functional as F
from torch._dynamo.utils import counters

import safepad
from safepad.collators import DataCollatorForPackedSSM, pack_dataset
from safepad.testing import tiny_model

datasets.disable_progress_bars()

ROW = 64  # row length: several sequences per row, and more than one SSD chunk (16)
#: dynamo decides on guards and recompiles before any backend sees a graph, so the cheapest backend counts the
#: same compiles (and runs safepad's traced path); the numerics of inductor's step are tests/test_compile.py's
BACKEND = "eager"


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    dynamo.reset()
    counters.clear()
    yield
    dynamo.reset()


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    """An epoch of packed rows (no seq_lengths: boundaries travel as position_ids, as after Trainer's column pruning)."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 30, size=40)
    ds = datasets.Dataset.from_dict({"input_ids": [rng.integers(3, 250, n).tolist() for n in lengths]})
    packed = pack_dataset(ds, ROW, batch_size=8).remove_columns("seq_lengths")  # small bins: ragged rows
    out = list(packed)[:3]
    assert len({len(r["input_ids"]) for r in out}) > 1  # rows of different lengths
    assert len({r["position_ids"].count(0) for r in out}) > 1  # and different numbers of sequences
    return out


@pytest.fixture(scope="module")
def stock():
    return tiny_model("nemotron_h").train()


def _reference_loss(stock_model, batch: dict) -> float:
    """Mean next-token CE over the real sequences of ``batch``, each run alone through the stock model."""
    cu = batch["cu_seq_lens_q"].tolist()
    ids = batch["input_ids"][0]
    real_end = int((batch["labels"][0] != -100).nonzero().max()) + 1  # the pad tail has no label
    total, count = 0.0, 0
    with torch.no_grad():
        for s, e in zip(cu[:-1], cu[1:]):
            if s >= real_end or e - s < 2:
                continue
            seq = ids[s:e][None]  # [1, n]
            logits = stock_model(input_ids=seq, use_cache=False).logits[0, :-1]  # [n - 1, V]
            total += F.cross_entropy(logits.float(), seq[0, 1:], reduction="sum").item()
            count += e - s - 1
    return total / count


def _frames() -> int:
    return counters["frames"]["ok"]


def _epoch(model, batches: list[dict], prepare=None) -> tuple[list[float], list[int]]:
    """Train an epoch (forward + backward); losses and the compiled-frame count after every batch."""
    losses, frames = [], []
    for batch in batches:
        kw = prepare(batch) if prepare else batch
        loss = model(**kw, use_cache=False).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())
        frames.append(_frames())
    return losses, frames


def _mark_dynamic(batch: dict) -> dict:
    """``torch._dynamo.mark_dynamic`` on the sequence dim of every tensor (and on cu_seq_lens' length)."""
    out = dict(batch)
    for k, v in batch.items():
        if isinstance(v, torch.Tensor):
            out[k] = v.clone()
            dynamo.mark_dynamic(out[k], v.dim() - 1)
    out.pop("max_length_q")  # Python ints are specialised: pass them only when they are fixed (pad_to_length)
    out.pop("max_length_k")
    return out


def _drop_max_length(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k not in ("max_length_q", "max_length_k")}


CASES = [
    pytest.param("pad_to_length", id="fixed-length"),
    pytest.param("buckets", id="length-buckets"),
    pytest.param("dynamic", id="dynamic-true"),
    pytest.param("mark_dynamic", id="mark-dynamic"),
]


@pytest.mark.parametrize("mode", CASES)
def test_one_compile_per_epoch(rows, stock, mode):
    if mode == "pad_to_length":
        collator, compile_kw, prepare = DataCollatorForPackedSSM(pad_to_length=ROW), {"dynamic": False}, None
    elif mode == "buckets":  # two buckets: at most one more compile, whatever the epoch
        collator, compile_kw, prepare = (
            DataCollatorForPackedSSM(pad_to_length=(ROW // 2, ROW)),
            {"dynamic": False},
            None,
        )
    elif mode == "dynamic":
        collator, compile_kw, prepare = DataCollatorForPackedSSM(), {"dynamic": True}, _drop_max_length
    else:
        collator, compile_kw, prepare = DataCollatorForPackedSSM(), {}, _mark_dynamic
    batches = [collator([r]) for r in rows]
    if mode == "pad_to_length":
        for b in batches:  # every tensor has the same shape in every batch
            assert {k: tuple(v.shape) for k, v in b.items() if isinstance(v, torch.Tensor)} == {
                k: tuple(v.shape) for k, v in batches[0].items() if isinstance(v, torch.Tensor)
            }
    model = safepad.wrap(copy.deepcopy(stock))
    compiled = torch.compile(model, backend=BACKEND, **compile_kw)
    losses, frames = _epoch(compiled, batches, prepare)
    seen = {batches[0]["input_ids"].shape[1]}
    for i in range(1, len(batches)):  # a compile only for a bucket not seen before (one bucket unless "buckets")
        T = batches[i]["input_ids"].shape[1]
        assert mode == "buckets" or T == batches[0]["input_ids"].shape[1] or mode in ("dynamic", "mark_dynamic")
        if T in seen or mode != "buckets":
            assert frames[i] == frames[i - 1], f"recompiled at batch {i}: compiled frames after each batch {frames}"
        seen.add(T)
    assert frames[0] > 0
    for loss, b in zip(losses, batches):
        ref = _reference_loss(stock, b)
        assert abs(loss - ref) <= 1e-4 * max(1.0, abs(ref)), (loss, ref)


def test_variable_rows_recompile_without_fixed_shapes(rows, stock):
    """The control: the same epoch with rows of their own length and static shapes compiles more than once
    (what pad_to_length removes), so the counter above does see recompiles."""
    collator = DataCollatorForPackedSSM()
    batches = [collator([r]) for r in rows[:3]]
    assert (
        len({b["cu_seq_lens_q"].shape[0] for b in batches}) > 1 or len({b["input_ids"].shape[1] for b in batches}) > 1
    )
    compiled = torch.compile(safepad.wrap(copy.deepcopy(stock)), backend=BACKEND, dynamic=False)
    _, frames = _epoch(compiled, batches)
    assert frames[-1] > frames[0]


def test_trainer_torch_compile_one_compile_per_epoch(rows, stock, tmp_path):
    """The docs' recipe: Trainer(torch_compile=True) + pack_dataset rows + pad_to_length: one compile per epoch."""
    from transformers import Trainer, TrainingArguments

    model = safepad.wrap(copy.deepcopy(stock))
    ds = datasets.Dataset.from_list(rows)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=1,
        num_train_epochs=1,
        learning_rate=0.0,  # the weights stay the stock ones: every step's loss is checked against them
        torch_compile=True,
        torch_compile_backend=BACKEND,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        dataloader_num_workers=0,
    )
    losses: list[float] = []
    frames: list[int] = []

    class _Record(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            loss = out[0] if return_outputs else out
            losses.append((loss.item(), {k: v.clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)}))
            frames.append(_frames())
            return out

    trainer = _Record(
        model=model, args=args, train_dataset=ds, data_collator=DataCollatorForPackedSSM(pad_to_length=ROW)
    )
    trainer.train()
    assert len(frames) == len(rows)
    assert frames[0] > 0 and frames[-1] == frames[0], f"recompiled: compiled frames after each step {frames}"
    for loss, inputs in losses:
        ref = _reference_loss(stock, inputs)
        assert abs(loss - ref) <= 1e-4 * max(1.0, abs(ref)), (loss, ref)
