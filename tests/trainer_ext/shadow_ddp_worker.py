"""Worker for test_shadow_ddp.py: ShadowCheckCallback under Trainer + DDP, 2 gloo processes, one spawn."""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))

#: (case id, ranks option, the rank whose collator drops every boundary or None, steps)
CASES = (
    ("all-clean", "all", None, 3),
    ("all-fault-on-rank1", "all", 1, 3),
    ("main-fault-on-rank0", "main", 0, 3),
    ("main-fault-on-rank1", "main", 1, 3),
)


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()


def _case(cid: str, ranks: str, faulty: int | None, steps: int, out: str) -> dict:
    import torch.distributed as dist
    from conftest import make_examples, make_model
    from transformers import Trainer, TrainingArguments

    import safepad
    from safepad.collators import DataCollatorForPackedSSM
    from safepad.errors import PaddingError
    from safepad.trainer_ext import ShadowCheckCallback

    packer = DataCollatorForPackedSSM()
    drop = ("seq_idx", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "position_ids")

    def collate(features):
        batch = packer(features)
        if faulty is not None and dist.get_rank() == faulty:
            batch = {k: v for k, v in batch.items() if k not in drop}
        return batch

    shadow = ShadowCheckCallback(every_n_steps=1, mode="error", ranks=ranks)
    args = TrainingArguments(
        output_dir=os.path.join(out, cid), max_steps=steps, per_device_train_batch_size=4, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=1,
    )  # fmt: skip
    trainer = Trainer(model=safepad.wrap(make_model(strong=True)), args=args,
                      train_dataset=make_examples(64, lengths=(5, 17, 9, 30, 12, 3)), data_collator=collate,
                      callbacks=[shadow])  # fmt: skip
    res: dict = {"error": None}
    try:
        trainer.train()
    except PaddingError as err:
        res["error"] = str(err)
    res["wrapper"] = type(trainer.model_wrapped).__name__
    res["results"] = [
        {"step": r.step, "rel": r.rel_diff, "tokens": r.checked_tokens, "flagged": r.flagged, "remote": r.remote}
        for r in shadow.results
    ]
    res["logged"] = [e.get("safepad/shadow_checked_tokens") for e in trainer.state.log_history if "loss" in e]
    return res


def worker(rank: int, world: int, port: int, out: str) -> None:
    faulthandler.enable()  # a native abort prints each thread's Python stack into the test's captured stderr
    sys.path.insert(0, HERE)
    torch.set_num_threads(1)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})  # fmt: skip
    res: dict = {}
    try:
        for cid, ranks, faulty, steps in CASES:
            res[cid] = _case(cid, ranks, faulty, steps, out)
            _reset_accelerate()
    except Exception as err:  # noqa: BLE001 - reported to the test
        res["crash"] = f"{type(err).__name__}: {err}\n{traceback.format_exc()}"
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    _teardown()


def _teardown() -> None:
    """Leave together: a rank that exits while its peer's gloo pairs are still open can make the peer abort at exit
    ("terminate called without an active exception", seen once in CI under load). Trainer never destroys the group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def spawn(world: int, out: str) -> list[dict]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(world, port, out), nprocs=world, join=True)
    results = []
    for r in range(world):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            results.append(json.load(f))
    return results
