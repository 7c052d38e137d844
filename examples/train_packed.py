"""Fine-tune a small Nemotron-H on packed rows of real text with ``transformers.Trainer`` and safepad.

Everything runs offline: the model is built from a config (random init), the text is the docstrings of
the Python standard library (see ``byte_data.py``), and the tokenizer maps UTF-8 bytes to ids.

The recipe::

    packed = safepad.pack_dataset(tokenized, max_length)       # several documents per row, boundaries kept
    collator = safepad.DataCollatorForPackedSSM()              # [1, T] rows + seq_idx / cu_seq_lens / position_ids
    model = safepad.wrap(model)                                # the SSM state restarts at every boundary
    Trainer(..., callbacks=[safepad.PaddingGuardCallback(mode="error")])

Run::

    python examples/train_packed.py --max-steps 30
    accelerate launch --multi_gpu --num_processes 2 examples/train_packed.py   # 2-process DDP (gloo on CPU)
    torchrun --nproc_per_node 2 examples/train_packed.py                       # the same without accelerate
    accelerate launch --cpu --num_processes 2 examples/train_packed.py         # runs, but as ONE process
    accelerate launch --use_fsdp --fsdp_version 2 --num_processes 2 \
        --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP \
        --fsdp_transformer_layer_cls_to_wrap NemotronHBlock examples/train_packed.py   # FSDP2, block-level

The script is unchanged under every launcher. Note that accelerate 1.15 starts a single process for
``--cpu --num_processes 2`` (multi-CPU needs an MPI hostfile); ``--multi_gpu`` on a machine without GPUs
starts the two processes, and ``TrainingArguments(use_cpu=True)`` makes them DDP over gloo.

The script prints the training loss of every logging step and the throughput in *real* tokens per second
(document tokens, not the collator's pad tail). With ``--output-dir`` set it also writes
``train_log.json`` (the Trainer's log history plus the token counts) there, from the main process. The log
also records how the model was distributed (``distributed_type``, ``fsdp_version``, the classes of the
modules FSDP2 sharded as their own units, how many parameters are sharded DTensors) and how many
safepad-patched mixers the trained (possibly sharded) model still holds.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import sys
import time
from pathlib import Path

import datasets
import torch
from transformers import (
    AutoModelForCausalLM,
    NemotronHConfig,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer_callback import PrinterCallback

import safepad
from safepad.wrap import wrapped_modules

sys.path.insert(0, str(Path(__file__).resolve().parent))
from byte_data import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    VOCAB_SIZE,
    ByteTokenizer,
    stdlib_docstrings,
)


def build_model(family: str, seed: int) -> torch.nn.Module:
    """A CPU-sized model of ``family`` (random init, byte vocabulary); Nemotron-H gets a 4-layer hybrid."""
    torch.manual_seed(seed)
    if family == "nemotron_h":
        config = NemotronHConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=128,
            layers_block_type=["mamba", "attention", "mamba", "mlp"],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size=256,
            ssm_state_size=32,
            mamba_num_heads=8,
            mamba_head_dim=32,
            n_groups=2,
            conv_kernel=4,
            expand=2,
            chunk_size=64,
            max_position_embeddings=4096,
            pad_token_id=PAD_ID,
            bos_token_id=BOS_ID,
            eos_token_id=EOS_ID,
            tie_word_embeddings=True,
            use_mamba_kernels=False,
        )
    else:
        from safepad.testing.tiny import tiny_config

        config = tiny_config(family, vocab_size=VOCAB_SIZE)
    return AutoModelForCausalLM.from_config(config)


def distribution_summary(trainer: Trainer) -> dict:
    """How the Trainer distributed the model: accelerate's distributed type, FSDP version and FSDP2 units.

    ``fsdp_units`` lists the original classes of the modules that ``fully_shard`` made FSDP units (FSDP2
    swaps each unit's class for ``FSDP<Class>``); ``sharded_params`` counts parameters held as DTensors.
    ``wrapped_mixers`` counts safepad-patched mixers in the model as trained (sharding must keep them).
    """
    acc = trainer.accelerator
    plugin = getattr(acc.state, "fsdp_plugin", None)
    model = trainer.model_wrapped
    units: set[str] = set()
    sharded = 0
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without FSDP2
        FSDPModule = DTensor = None  # noqa: N806
    if FSDPModule is not None:
        for m in model.modules():
            if isinstance(m, FSDPModule):
                base = next((c for c in type(m).__mro__ if not issubclass(c, FSDPModule)), type(m))
                units.add(base.__name__)
        sharded = sum(isinstance(p, DTensor) for p in model.parameters())
    return {
        "distributed_type": str(acc.distributed_type).rsplit(".", 1)[-1],
        "fsdp_version": getattr(plugin, "fsdp_version", None) if plugin is not None else None,
        "fsdp_units": sorted(units),
        "sharded_params": int(sharded),
        "wrapped_mixers": len(wrapped_modules(model)),
    }


class _CountingCollator:
    """The packed collator, plus a count of the real (document) tokens of every batch it builds."""

    def __init__(self, collator: safepad.DataCollatorForPackedSSM) -> None:
        self.collator = collator
        self.real_tokens: list[int] = []
        self.row_tokens: list[int] = []

    def __call__(self, features):
        batch = self.collator(features)
        self.real_tokens.append(sum(len(f["input_ids"]) for f in features))
        self.row_tokens.append(int(batch["input_ids"].numel()))
        return batch


class _ProgressPrinter(TrainerCallback):
    """Print the loss of every logging step and the real tokens/s since training began (main process)."""

    def __init__(self, counter: _CountingCollator, world_size: int) -> None:
        self.counter = counter
        self.world_size = world_size
        self.start = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or "loss" not in logs:
            return
        elapsed = time.perf_counter() - self.start
        # the DataLoader runs one batch ahead: the batches of the steps done so far are the first global_step
        done = state.global_step
        tokens = sum(self.counter.real_tokens[:done]) * self.world_size  # rank 0's count, scaled (printing only)
        fill = sum(self.counter.real_tokens[:done]) / max(1, sum(self.counter.row_tokens[:done]))
        print(
            f"step {done:4d}  loss {logs['loss']:.4f}  real tokens/s {tokens / elapsed:8.0f}  fill {fill:.1%}",
            flush=True,
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-steps", type=int, default=60, help="optimizer steps (default 60)")
    p.add_argument(
        "--max-length",
        type=int,
        default=512,
        help="packed row length in tokens (default 512)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=4,
        help="packed rows per device and step (default 4)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--output-dir",
        default=None,
        help="where train_log.json goes (default: a temporary folder)",
    )
    p.add_argument(
        "--family",
        default="nemotron_h",
        help="model family (default nemotron_h; others use the tiny configs of safepad.testing.tiny)",
    )
    p.add_argument("--learning-rate", type=float, default=2e-3)
    p.add_argument(
        "--max-docs",
        type=int,
        default=1500,
        help="stdlib docstrings to train on (default 1500)",
    )
    p.add_argument("--logging-steps", type=int, default=5)
    p.add_argument(
        "--device",
        choices=("cpu", "auto"),
        default="cpu",
        help="cpu (default; gloo between processes) or auto (the accelerator when there is one, e.g. for FSDP)",
    )
    args = p.parse_args(argv)
    for name in ("max_steps", "max_length", "batch_size", "max_docs", "logging_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    if "OMP_NUM_THREADS" not in os.environ:
        # processes on one machine share its cores: give each its share, not all of them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    datasets.disable_progress_bars()
    logging.getLogger("transformers").setLevel(logging.ERROR)  # "use_mamba_kernels is deprecated" and the like

    tokenizer = ByteTokenizer()
    docs = stdlib_docstrings(max_docs=args.max_docs)
    tokenized = datasets.Dataset.from_dict({"input_ids": [tokenizer.encode(d) for d in docs]})
    packed, stats = safepad.pack_dataset(tokenized, args.max_length, return_stats=True)

    model = safepad.wrap(build_model(args.family, args.seed))
    use_cpu = args.device == "cpu" or not torch.cuda.is_available()
    counter = _CountingCollator(safepad.DataCollatorForPackedSSM(pad_to_multiple_of=64, pad_token_id=PAD_ID))
    output_dir = args.output_dir or os.path.join(os.environ.get("TMPDIR", "/tmp"), "safepad-train-packed")
    training_args = TrainingArguments(
        output_dir=output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        logging_steps=args.logging_steps,
        logging_first_step=True,
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        use_cpu=use_cpu,
        dataloader_num_workers=0,
        disable_tqdm=True,
        ddp_find_unused_parameters=False,
        # Trainer drops dataset columns that model.forward does not take: seq_lengths always, position_ids for
        # Mamba / Mamba2 / FalconMamba, whose forward has none. Keep them there, or every packed row would
        # collate as ONE sequence (pack_dataset keeps only packable columns, so nothing else gets through).
        remove_unused_columns="position_ids" in inspect.signature(model.forward).parameters,
        ddp_backend="gloo" if world_size > 1 and use_cpu else None,
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=packed,
        data_collator=counter,
        callbacks=[
            safepad.PaddingGuardCallback(mode="error", log_stats=True),
            _ProgressPrinter(counter, world_size),
        ],
    )
    trainer.remove_callback(PrinterCallback)  # _ProgressPrinter prints the lines that matter
    main_process = trainer.is_world_process_zero()
    if main_process:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"{len(docs)} stdlib docstrings -> {stats}", flush=True)
        print(
            f"model: {args.family}, {n_params / 1e6:.2f}M parameters, safepad-wrapped; "
            f"{world_size} process(es) x {args.batch_size} packed rows of <= {args.max_length} tokens",
            flush=True,
        )

    start = time.perf_counter()
    result = trainer.train()
    elapsed = time.perf_counter() - start

    steps = trainer.state.global_step
    local_tokens = torch.tensor(sum(counter.real_tokens[:steps]), dtype=torch.int64)
    if world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(local_tokens)
    real_tokens = int(local_tokens)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    summary = {
        "family": args.family,
        "world_size": world_size,
        "steps": steps,
        "train_loss": result.training_loss,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "real_tokens": real_tokens,
        "seconds": elapsed,
        "real_tokens_per_s": real_tokens / elapsed,
        "log_history": trainer.state.log_history,
        **distribution_summary(trainer),
    }
    if main_process:
        print(
            f"done: {steps} steps in {elapsed:.1f} s, loss {summary['first_loss']:.4f} -> "
            f"{summary['last_loss']:.4f}, {real_tokens} real tokens, {real_tokens / elapsed:.0f} real tokens/s",
            flush=True,
        )
        if args.output_dir:
            Path(args.output_dir).mkdir(parents=True, exist_ok=True)
            with open(Path(args.output_dir) / "train_log.json", "w") as f:
                json.dump(summary, f, indent=1)
    return summary


if __name__ == "__main__":
    try:
        main()
    finally:
        # tear the process group down before the interpreter does: a gloo group left to interpreter shutdown
        # can abort a rank ("terminate called without an active exception") after training has finished
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
