"""Sequence parallelism under ``transformers.Trainer``: :func:`prepare_trainer`, one line before ``train()``.

::

    trainer = Trainer(model=safepad.wrap(model), args=args, train_dataset=packed, data_collator=collator)
    spd.prepare_trainer(trainer, sp_size=2)   # ranks 0-1, 2-3, ... each shard one batch; DP across the groups
    trainer.train()

What it changes, so that the Trainer trains the unsharded model exactly:

* **Data.** Trainer's DataLoaders (prepared by accelerate) hand every rank a different batch. The
  ``W = dp * sp`` ranks are re-numbered for sampling as ``dp`` data-parallel ranks, one per SP group: every
  rank of a group receives the SAME full batch (the SP pre-hook checks it on every call), the groups
  different ones. The model's pre-hook (:func:`~safepad.distributed.sequence_parallel`) then shards
  ``input_ids``, ``labels``, ``position_ids`` and the boundaries per rank.
* **Loss and gradients.** The SP loss is the group's whole-batch loss; Trainer's DDP / FSDP wrapper over all
  ``W`` ranks AVERAGES gradients, while the ``sp`` ranks of a group hold partial gradients of one batch that
  must be SUMMED. The SP backward is scaled by ``sp`` (``gradients="ddp"``), so the average over ``W`` is
  the sum over each group, averaged over the ``dp`` groups. Trainer's token count (``num_items_in_batch``,
  gathered over all ``W`` ranks with ``average_tokens_across_devices``) counts each batch ``sp`` times, and
  its loss is multiplied by ``W``: together with the SP loss that is again the whole global batch's mean
  token loss on every group, and its logged value (the mean over ranks) is the unsharded one.
  With ``average_tokens_across_devices=False`` each group's loss is its own batch's mean (plain DP).
* Trainer's reported total batch size counts ``dp`` ranks, not ``W``.

Shapes: rows ``[B, T]`` with ``T`` a multiple of ``sp`` (``DataCollatorForPackedSSM(pad_to_multiple_of=...)``).
"""

from __future__ import annotations

import functools
import logging

import torch.distributed as dist
from torch.utils.data import BatchSampler

from .model import SequenceParallel, UnsupportedSequenceParallelError, sequence_parallel

logger = logging.getLogger(__name__)

__all__ = ["prepare_trainer"]


def _data_parallel_layout(group) -> tuple[int, int]:
    """(``dp_size``, ``dp_rank``): the SP groups partition the world; ``dp_rank`` numbers them by lowest rank."""
    mine = tuple(sorted(dist.get_process_group_ranks(group)))
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    groups = sorted(set(every))
    sizes = {len(g) for g in groups}
    covered = sorted(r for g in groups for r in g)
    if len(sizes) != 1 or covered != list(range(dist.get_world_size())):
        raise ValueError(
            f"the sequence-parallel groups {groups} must partition the {dist.get_world_size()} ranks into groups of "
            "one size (every rank in exactly one group); pass sp_size= to build consecutive groups"
        )
    return len(groups), groups.index(mine)


def _reshard(loader, dp_size: int, dp_rank: int, what: str):
    """Make an accelerate-prepared DataLoader yield one batch per SP group (``dp_size`` sampling ranks)."""
    from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher, IterableDatasetShard

    world = dist.get_world_size()
    if isinstance(loader, DataLoaderDispatcher):
        raise ValueError(
            f"{what}: accelerate's dispatch_batches DataLoader splits every batch over all {world} ranks; set "
            "TrainingArguments(accelerator_config={'dispatch_batches': False}) under sequence parallelism"
        )
    sampler = loader.sampler if isinstance(loader.sampler, BatchSampler) else getattr(loader, "batch_sampler", None)
    if isinstance(sampler, BatchSamplerShard):
        if type(sampler.batch_sampler).__name__ == "BatchRebalanceSampler":
            raise ValueError(f"{what}: a rank-aware BatchRebalanceSampler cannot be re-sharded per SP group")
        if sampler.split_batches and (sampler.batch_size or 0) % dp_size:
            raise ValueError(f"{what}: split_batches needs the batch size to be a multiple of the {dp_size} DP ranks")
        sampler.num_processes, sampler.process_index = dp_size, dp_rank
        return loader
    if isinstance(loader.dataset, IterableDatasetShard):
        loader.dataset.num_processes, loader.dataset.process_index = dp_size, dp_rank
        return loader
    if world > 1:
        raise ValueError(
            f"{what}: cannot re-shard a {type(loader).__name__} over {type(loader.dataset).__name__} per SP group (a "
            "`datasets` IterableDataset with enough shards is split by rank before safepad sees it); use a map-style "
            "dataset or an IterableDataset with fewer shards than ranks"
        )
    return loader


def prepare_trainer(
    trainer, group=None, *, sp_size: int | None = None, check_batch: bool = True
) -> SequenceParallel:
    """Train ``trainer.model`` (wrapped by ``safepad.wrap``) sequence-sharded over SP groups; call before ``train()``.

    ``group``: this rank's SP group (the groups must partition the world), or ``sp_size``: consecutive groups of
    that many ranks (``dist.new_subgroups``); neither: one group over all ranks (no data parallelism).
    Returns the :class:`~safepad.distributed.SequenceParallel` handle (``remove()`` undoes the model hooks).
    """
    if group is not None and sp_size is not None:
        raise ValueError("pass either group= or sp_size=, not both")
    if not dist.is_available() or not dist.is_initialized():
        raise UnsupportedSequenceParallelError(
            "prepare_trainer needs torch.distributed initialised: launch with torchrun / accelerate launch (Trainer's "
            "TrainingArguments then initialise the process group)"
        )
    if trainer.model_wrapped is not trainer.model:
        raise ValueError("prepare_trainer must run before trainer.train() wraps the model (DDP / FSDP)")
    if getattr(trainer.args, "n_gpu", 1) > 1:
        raise ValueError("sequence parallelism needs one device per process (torchrun), not DataParallel over n_gpu")
    pc = getattr(trainer.accelerator, "parallelism_config", None)
    if pc is not None and any(getattr(pc, f"{d}_size", 1) > 1 for d in ("cp", "sp", "tp")):
        raise ValueError(
            "ParallelismConfig(cp_size / sp_size / tp_size > 1) would shard the sequence a second time (and accelerate "
            "refuses recurrent layers there); leave them at 1 and let prepare_trainer shard the sequence"
        )
    _refuse_own_loss(trainer)
    world = dist.get_world_size()
    if sp_size is not None:
        if sp_size < 1 or world % sp_size:
            raise ValueError(f"sp_size={sp_size} must divide the world size {world}")
        group, _ = dist.new_subgroups(group_size=sp_size)
    sp = sequence_parallel(trainer.model, group, gradients="ddp", check_batch=check_batch)
    dp_size, dp_rank = _data_parallel_layout(sp.group)

    for name in ("get_train_dataloader", "get_eval_dataloader", "get_test_dataloader"):
        orig = getattr(trainer, name)

        @functools.wraps(orig)
        def resharded(*args, _orig=orig, _name=name, **kwargs):
            loader = _reshard(_orig(*args, **kwargs), dp_size, dp_rank, f"Trainer.{_name}")
            if _name != "get_train_dataloader":
                _check_eval(trainer, loader, dp_size)
            return loader

        setattr(trainer, name, resharded)

    def total_batch_size(args) -> int:  # Trainer counts W data-parallel ranks; there are dp
        return trainer._train_batch_size * args.gradient_accumulation_steps * dp_size

    trainer.get_total_train_batch_size = total_batch_size
    trainer._safepad_sp = sp
    logger.info("safepad: Trainer SP: groups of %d ranks, %d data-parallel groups", sp.world, dp_size)
    return sp


def _has_trl_fused_head(model) -> bool:
    """``model`` (or the model PEFT wraps) runs TRL's ``add_fused_lm_head`` forward."""
    for m in (model, getattr(model, "get_base_model", lambda: None)()):
        fn = getattr(getattr(m, "forward", None), "__func__", None)
        if fn is not None and getattr(getattr(fn, "__code__", None), "co_name", "") == "_fused_forward":
            return True
    return False


def _refuse_own_loss(trainer) -> None:
    """Refuse trainers that compute the loss themselves from the full rows' labels (TRL's trainers).

    Under sequence parallelism the model's forward sees one shard of every row, and the whole batch's loss is
    the one the SP hook returns (``outputs.loss``). TRL's ``SFTTrainer`` computes its loss in a fused LM head
    from ``labels`` inside the model's forward (the SP hook has replaced them by this shard's: it crashed at
    ``labels[:, 1:]``); its other trainers compute losses from the logits and full-row labels.
    """
    trl = [c for c in type(trainer).__mro__ if (c.__module__ or "").split(".")[0] == "trl"]
    if trl or _has_trl_fused_head(trainer.model):
        raise UnsupportedSequenceParallelError(
            f"prepare_trainer does not support TRL's {type(trainer).__name__}: it computes the loss itself (a fused LM "
            "head reading the full rows' labels), while under sequence parallelism each rank's forward sees one "
            "shard and the whole batch's loss is the model output's `loss`. Train with transformers.Trainer and "
            "safepad.DataCollatorForPackedSSM (the SFT loss on packed rows, labels -100 on the prompt), or train "
            "this TRL trainer without sequence parallelism"
        )


def _check_eval(trainer, loader, dp_size: int) -> None:
    """Refuse evaluations whose result the SP ranks' duplicated batches would change."""
    if trainer.compute_metrics is not None and not trainer.args.prediction_loss_only:
        raise ValueError(
            "compute_metrics under sequence parallelism would see this rank's shard of the logits; evaluate with "
            "prediction_loss_only=True (the eval loss is exact), or compute metrics on one process"
        )
    bs = getattr(loader, "total_batch_size", None)
    n = len(loader.dataset) if hasattr(loader.dataset, "__len__") else None
    if dp_size > 1 and bs and n is not None and n % bs:
        raise ValueError(
            f"evaluation set of {n} examples is not a multiple of per_device_eval_batch_size x {dp_size} DP groups = "
            f"{bs}: accelerate's gather_for_metrics would drop the wrong duplicated samples of the last batch"
        )
