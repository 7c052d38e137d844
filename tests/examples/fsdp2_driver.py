"""Packed training of the examples' Nemotron-H under FSDP2 (torch ``fully_shard`` over gloo) or in one process.

Used by ``tests/examples/test_train_packed.py`` because accelerate (and so ``Trainer``) cannot run FSDP on
CPU (see that test's skip reason); this loop reproduces what ``Trainer`` does for one step, without it:

* the same model (``examples/train_packed.py::build_model``), packed rows and collator;
* every step takes the next ``--rows`` packed rows of one seeded permutation; rank ``r`` of ``W`` takes rows
  ``r * rows / W ...`` of them, and the collator concatenates a process's rows into one ``[1, T]`` row;
* the loss is the sum of token losses over the global label count (``num_items_in_batch``, all-reduced,
  as ``average_tokens_across_devices``), scaled by ``W`` because FSDP2 averages gradients over ranks;
* Adam (lr 2e-3, no weight decay, no clipping), ``--steps`` steps.

With ``WORLD_SIZE`` > 1 every decoder block (``NemotronHBlock``) is its own ``fully_shard`` unit, then the
root; parameters are sharded DTensors. Rank 0 writes ``{"losses", "world_size", "fsdp_units",
"sharded_params", "wrapped_mixers"}`` to ``--out``. Run::

    torchrun --nproc_per_node 2 tests/examples/fsdp2_driver.py --out two.json
    python tests/examples/fsdp2_driver.py --out one.json
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
from pathlib import Path

import datasets
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import safepad  # noqa: E402
from byte_data import PAD_ID, ByteTokenizer, stdlib_docstrings  # noqa: E402
from safepad.wrap import wrapped_modules  # noqa: E402
from train_packed import build_model  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rows", type=int, default=4, help="packed rows per step, over all ranks")
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--max-docs", type=int, default=120)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--no-wrap", action="store_true", help="train the stock model on position_ids only (state leaks over documents)"
    )
    args = p.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if args.rows % world:
        raise SystemExit(f"--rows {args.rows} must be divisible by the world size {world}")
    if world > 1:
        dist.init_process_group("gloo")
    datasets.disable_progress_bars()
    tokenizer = ByteTokenizer()
    docs = stdlib_docstrings(max_docs=args.max_docs)
    tokenized = datasets.Dataset.from_dict({"input_ids": [tokenizer.encode(d) for d in docs]})
    packed = safepad.pack_dataset(tokenized, args.max_length)
    order = torch.randperm(len(packed), generator=torch.Generator().manual_seed(args.seed)).tolist()

    model = build_model("nemotron_h", args.seed)
    if not args.no_wrap:
        safepad.wrap(model)
    model.train()
    units: set[str] = set()
    if world > 1:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        for block in model.model.layers:  # decoder-block level: each mixer sits whole inside one unit
            fully_shard(block)
        fully_shard(model)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                units.add(next(c for c in type(m).__mro__ if not issubclass(c, FSDPModule)).__name__)
    from torch.distributed.tensor import DTensor

    sharded = sum(isinstance(q, DTensor) for q in model.parameters())
    optim = torch.optim.Adam(model.parameters(), lr=2e-3)
    collator = safepad.DataCollatorForPackedSSM(pad_to_multiple_of=64, pad_token_id=PAD_ID)
    per_rank = args.rows // world
    losses = []
    for step in range(args.steps):
        rows = order[step * args.rows : (step + 1) * args.rows]
        batch = collator([packed[i] for i in rows[rank * per_rank : (rank + 1) * per_rank]])
        if args.no_wrap:  # stock Nemotron-H raises on seq_idx without causal-conv1d: keep only position_ids
            batch = {k: v for k, v in batch.items() if k in ("input_ids", "labels", "position_ids")}
        n_items = (batch["labels"][:, 1:] != -100).sum()
        if world > 1:
            dist.all_reduce(n_items)
        out = model(**batch, num_items_in_batch=n_items)  # loss = sum of token losses / global label count
        (out.loss * world).backward()  # FSDP2 averages gradients over ranks: scale the sum back up
        optim.step()
        optim.zero_grad(set_to_none=True)
        loss = out.loss.detach().clone()
        if world > 1:
            dist.all_reduce(loss)
        losses.append(loss.item())
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "losses": losses,
                    "world_size": world,
                    "fsdp_units": sorted(units),
                    "sharded_params": int(sharded),
                    "wrapped_mixers": len(wrapped_modules(model)),
                },
                f,
            )
    if world > 1:
        dist.barrier()  # leave together: rank 0 writes the result while rank 1 would otherwise tear its pairs down
        dist.destroy_process_group()
        # then leave without the interpreter's teardown: in one CI run rank 1 aborted after main() had returned
        # ("terminate called without an active exception", no Python frame left: a gloo thread still joinable
        # while the objects holding it, FSDP2's device mesh among them, were destroyed at exit), and the launcher
        # failed the run after every step had been computed and written
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    faulthandler.enable()  # a native abort prints each thread's Python stack into the test's output
    main()
