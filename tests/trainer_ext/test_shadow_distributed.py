"""ShadowCheckCallback under DDP (Trainer, 2 gloo processes) and under torch.compile.

DDP: a fault on ONE rank (its collator drops every boundary) must make EVERY rank raise at the same step with
``ranks="all"`` (a rank left behind would hang in the next collective); with ``ranks="main"`` rank 0's check
decides for all, so a fault on rank 1 only is not its business. A clean run logs the tokens checked on both
ranks. torch.compile: the check steps add no graph and no recompile to the compiled training step.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow

WORLD = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from shadow_ddp_worker import spawn

    results = spawn(WORLD, str(tmp_path_factory.mktemp("shadow_ddp")))
    for rank, r in enumerate(results):
        assert "crash" not in r, f"rank {rank}: {r['crash']}"
    return results


def test_clean_ddp_run_is_checked_on_every_rank(runs):
    for r in runs:
        case = r["all-clean"]
        assert case["wrapper"] == "DistributedDataParallel" and case["error"] is None, case
        assert [x["step"] for x in case["results"]] == [1, 2, 3] and not any(x["flagged"] for x in case["results"])
    tokens = [[x["tokens"] for x in r["all-clean"]["results"]] for r in runs]
    assert tokens[0] == tokens[1]  # the sum over both ranks' sequences, the same on every rank
    assert runs[0]["all-clean"]["logged"] == tokens[0]


def test_fault_on_one_rank_raises_on_every_rank(runs):
    for rank, r in enumerate(runs):
        case = r["all-fault-on-rank1"]
        assert case["error"] is not None and "step 1, " in case["error"], (rank, case)
        last = case["results"][-1]
        assert last["flagged"] and last["step"] == 1
        assert last["remote"] == (rank == 0)  # rank 0 reports the sequence rank 1 checked
        assert ("checked on another rank" in case["error"]) == (rank == 0)


def test_main_rank_decides_for_all(runs):
    for rank, r in enumerate(runs):
        on0, on1 = r["main-fault-on-rank0"], r["main-fault-on-rank1"]
        assert on0["error"] is not None and "step 1, " in on0["error"], (rank, on0)
        assert on1["error"] is None and len(on1["results"]) == 3, (rank, on1)  # rank 1 is never checked


def test_compiled_training_step_is_not_recompiled_by_the_check(tmp_path):
    from conftest import make_examples, make_model, training_args
    from torch._dynamo.utils import counters
    from transformers import Trainer, TrainerCallback

    import safepad
    from safepad.collators import DataCollatorForPackedSSM
    from safepad.trainer_ext import ShadowCheckCallback

    graphs: list[int] = []

    class Graphs(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            graphs.append(int(counters["stats"]["unique_graphs"]))

    torch._dynamo.reset()
    counters.clear()
    shadow = ShadowCheckCallback(every_n_steps=2, mode="error")
    args = training_args(tmp_path, max_steps=5, per_device_train_batch_size=4, torch_compile=True,
                         torch_compile_backend="aot_eager")  # fmt: skip
    trainer = Trainer(
        model=safepad.wrap(make_model(strong=True)),
        args=args,
        train_dataset=make_examples(64, lengths=(5, 17, 9, 30, 12, 3)),
        data_collator=DataCollatorForPackedSSM(pad_to_multiple_of=128),  # one shape: every recompile is ours
        callbacks=[shadow, Graphs()],
    )
    trainer.train()
    assert type(trainer.model_wrapped).__name__ == "OptimizedModule"
    assert [r.step for r in shadow.results] == [1, 3, 5] and not any(r.flagged for r in shadow.results)
    # steps 3 and 5 (checks) compile nothing beyond steps 2 and 4 (no check). Step 2 adds one graph of the
    # training step itself, with or without the callback (without it: [2, 3, 3, 3, 3] too).
    assert graphs[0] > 0 and graphs[2] == graphs[1] and graphs[4] == graphs[3], graphs
