"""A packed IterableDataset under a real transformers.Trainer, one process, accelerate's default dispatcher.

For an IterableDataset accelerate dispatches batches (``dispatch_batches=True``) and cuts every tensor to the
batch size of ``input_ids`` along dim 0: ``DataCollatorForPackedSSM``'s ``cu_seq_lens_q`` ``[N + 1]`` became
``(1,)`` and a wrapped model failed at step 1. Without the callback the error now names the fix; with
``PaddingGuardCallback`` the batches reach the model whole, and training equals the documented workaround
(``dispatch_batches=False``) step for step, on the same data.
"""

from __future__ import annotations

import datasets
import pytest
import torch
from conftest import training_args
from transformers import Trainer

import safepad
from safepad.collators import DataCollatorForPackedSSM, pack_dataset
from safepad.testing.tiny import tiny_model
from safepad.trainer_ext import PaddingGuardCallback

datasets.disable_progress_bars()


def _packed_stream(vocab: int):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 30, (40,), generator=g).tolist()
    rows = [{"input_ids": torch.randint(3, vocab, (n,), generator=g).tolist()} for n in lengths]
    return pack_dataset(datasets.Dataset.from_list(rows).to_iterable_dataset(), 64, buffer_size=20)


def _train(tmp_path, callback: bool, dispatch: bool | None):
    model = safepad.wrap(tiny_model("nemotron_h"))
    seen: list[tuple[int, int]] = []  # (last cu_seq_lens_q entry, row length) of every forward

    def record(module, args, kwargs):
        cu, ids = kwargs.get("cu_seq_lens_q"), kwargs.get("input_ids")
        seen.append((int(cu[-1]), ids.shape[1]))

    model.register_forward_pre_hook(record, with_kwargs=True, prepend=True)
    extra = {} if dispatch is None else {"accelerator_config": {"dispatch_batches": dispatch}}
    args = training_args(tmp_path, per_device_train_batch_size=2, max_steps=3, seed=0, **extra)
    losses: list[float] = []

    class Recording(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            losses.append(float(loss))
            return loss

    trainer = Recording(
        model=model, args=args, train_dataset=_packed_stream(model.config.vocab_size),
        data_collator=DataCollatorForPackedSSM(pad_to_multiple_of=16, pad_token_id=0),
        callbacks=[PaddingGuardCallback(mode="error")] if callback else None,
    )
    trainer.train()
    return losses, seen


def test_default_dispatcher_without_callback_names_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"cu_seq_lens_q must have shape.*dispatch_batches': False"):
        _train(tmp_path, callback=False, dispatch=None)


def test_default_dispatcher_with_callback_trains_like_the_workaround(tmp_path):
    losses, seen = _train(tmp_path / "a", callback=True, dispatch=None)
    ref_losses, ref_seen = _train(tmp_path / "b", callback=False, dispatch=False)
    assert len(losses) == 3 and all(cu == T for cu, T in seen), seen  # cu_seq_lens reached the model whole
    assert seen == ref_seen
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=0)


def test_multi_process_dispatcher_with_the_packing_collator_raises():
    """Over several processes the dispatcher concatenates one packed batch per process and cuts the result, which
    no slice can undo for cu_seq_lens: refused, naming dispatch_batches=False (the state is faked to 2 processes)."""
    import types

    from accelerate.data_loader import DataLoaderDispatcher

    from safepad.trainer_ext.dispatch import DISPATCH_FIX, adapt_dispatcher

    stream = _packed_stream(256)
    loader = DataLoaderDispatcher(stream, batch_size=2, collate_fn=DataCollatorForPackedSSM())
    assert adapt_dispatcher(loader)  # one process: passed on whole
    batch = next(iter(loader))
    assert int(batch["cu_seq_lens_q"][-1]) == batch["input_ids"].shape[1] and batch["cu_seq_lens_q"].numel() > 2
    loader.state = types.SimpleNamespace(num_processes=2)
    with pytest.raises(ValueError, match=r"over 2 processes") as exc:
        adapt_dispatcher(loader)
    assert DISPATCH_FIX in str(exc.value)
    assert not adapt_dispatcher(torch.utils.data.DataLoader([1, 2]))  # any other loader: untouched
