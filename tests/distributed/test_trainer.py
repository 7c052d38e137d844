"""Sequence parallelism under accelerate and ``transformers.Trainer`` (4 gloo processes, ONE spawn for all).

* accelerate: docs/training.md's recipe (``Accelerator(cpu)`` + ``prepare``: DDP over the 4 SP ranks +
  ``gradients='ddp'``): loss, every gradient and every parameter after one step equal one process.
* Trainer + :func:`safepad.distributed.prepare_trainer` on the tiny Nemotron-H (Mamba2 + attention + MLP),
  ``DataCollatorForPackedSSM`` (one packed row per batch, random sequence lengths crossing the shard edges,
  padded to a multiple of 32 with its own segment), SGD without clipping (a clipped update would hide a
  gradient scaled by the wrong factor), 3 optimizer steps, then ``evaluate()``:

  - ``sp4``: one SP group of 4 ranks (no data parallelism), gradient accumulation 2 (Trainer's
    ``num_items_in_batch`` spans both micro-batches);
  - ``dp2xsp2``: two SP groups of 2 ranks (ranks 0-1, 2-3) that are data-parallel to each other.

  Each is compared with ONE process running the same Trainer over the same examples per step (batch
  ``dp`` times larger) in float64, from the same initial weights: every micro-step loss (mean over ranks,
  which is what Trainer logs), the eval loss and every final parameter tensor. The tolerance of each is
  measured in the test, not tuned to one CPU: :data:`NOISE_FACTOR` x how far the same single-process Trainer in
  float32 lands from the float64 one on that quantity (at least a few float32 ulps of its scale). The sharded
  float32 runs round differently from the single float32 process, not worse; a fixed 1e-5 of each tensor's
  scale failed dp2xsp2's embeddings (8.2e-7 apart) on an AVX-512/AMX CPU. ``conv1d.bias`` starts at 0 and its
  gradient is a cancelling sum over every token: the single float32 process is itself 3.4e-5 of its scale off
  float64 there, and that measured noise now sets its tolerance.
* Control: the SP model hooks alone under Trainer (its per-rank sampler gives every rank another batch)
  raise instead of training on mixed shards.
"""

from __future__ import annotations

import pytest
import torch

from .sp_worker import TRAINER_CASES, spawn_trainer

pytestmark = pytest.mark.slow

WORLD = 4
_RTOL = 1e-5  # the accelerate recipe (its own one-process comparison, in float32)
#: a sharded float32 run may be this many times further from float64 than the single float32 process is
NOISE_FACTOR = 8
_ULPS = 8 * torch.finfo(torch.float32).eps  # the floor of a measured noise, relative to the quantity's scale


def _tol(ref64: torch.Tensor, ref32: torch.Tensor) -> float:
    """``NOISE_FACTOR`` x max |float32 single process - float64| of one quantity (at least ``_ULPS`` of its scale)."""
    ref64, ref32 = ref64.double(), ref32.double()
    scale = float(ref64.abs().max())
    return NOISE_FACTOR * max(float((ref32 - ref64).abs().max()), _ULPS * scale)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    results = spawn_trainer(WORLD, tmp_path_factory.mktemp("trainer"))
    for rank, r in enumerate(results):
        assert "error" not in r, f"rank {rank}: {r['error']}"
    return results


def test_accelerate_recipe(runs):
    for rank, res in enumerate(runs):
        r = res["accelerate"]
        assert r["wrapper"] == "DistributedDataParallel" and "MULTI_CPU" in r["distributed_type"], r
        assert r["grads"] >= 10
        assert r["loss_rel"] <= _RTOL and r["grad_max_rel"] <= _RTOL and r["param_max_rel"] <= _RTOL, (rank, r)


def _ref(runs, cid, key: str = "ref"):
    return next(res[f"{key}-{cid}"] for res in runs if f"{key}-{cid}" in res)


@pytest.mark.parametrize("cid", [pytest.param(c[0], id=c[0]) for c in TRAINER_CASES])
def test_trainer_equals_single_process(runs, cid):
    ref, ref32 = _ref(runs, cid), _ref(runs, cid, "ref32")
    steps = len(ref["losses"])
    assert steps == 3 * dict((c[0], c[3]) for c in TRAINER_CASES)[cid]  # every micro-step ran
    for rank, res in enumerate(runs):
        assert len(res[cid]["losses"]) == steps, (rank, res[cid]["losses"])
    logged = torch.tensor([[res[cid]["losses"][i] for res in runs] for i in range(steps)]).mean(1)  # [steps]
    losses64, losses32 = (torch.tensor(r["losses"], dtype=torch.float64) for r in (ref, ref32))
    loss_tol = _tol(losses64, losses32)
    assert float((logged.double() - losses64).abs().max()) <= loss_tol, (logged, losses64, loss_tol)
    eval_tol = _tol(torch.tensor([ref["eval_loss"]]), torch.tensor([ref32["eval_loss"]]))
    failures = []
    for rank, res in enumerate(runs):
        got = res[cid]
        if abs(got["eval_loss"] - ref["eval_loss"]) > eval_tol:
            failures.append(f"rank {rank}: eval_loss {got['eval_loss']} != {ref['eval_loss']} (tol {eval_tol:.1e})")
        moved = 0
        for name, p_ref in ref["params"].items():
            a, b = torch.tensor(got["params"][name], dtype=torch.float64), torch.tensor(p_ref, dtype=torch.float64)
            tol = _tol(b, torch.tensor(ref32["params"][name]))
            if not float((a - b).abs().max()) <= tol:
                diff, scale = float((a - b).abs().max()), float(b.abs().max())
                failures.append(f"rank {rank}: {name} max |diff| {diff:.2e} > tol {tol:.2e} (scale {scale:.2e})")
            moved += bool(torch.tensor(ref["update"][name]).abs().max() > 1e-6)
        if moved < 10:
            failures.append(f"rank {rank}: only {moved} parameters moved: the comparison is vacuous")
    assert not failures, "\n".join(failures)


def test_dp_groups_see_different_batches(runs):
    # dp2xsp2: ranks 0-1 share a batch, 2-3 another (Trainer logs their mean); sp4: all ranks the same loss
    by_rank = [tuple(res["dp2xsp2"]["losses"]) for res in runs]
    assert by_rank[0] == by_rank[1] and by_rank[2] == by_rank[3] and by_rank[0] != by_rank[2], by_rank
    assert len({tuple(res["sp4"]["losses"]) for res in runs}) == 1


def test_sequence_parallel_alone_under_trainer_raises(runs):
    for rank, res in enumerate(runs):
        assert res["control"] is not None and "same full batch" in res["control"], (rank, res["control"])
