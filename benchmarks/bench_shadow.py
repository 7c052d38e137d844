"""Overhead of ``ShadowCheckCallback`` per training step at ``every_n_steps=100`` (target: <= 1%).

bench_train's model (the Nemotron-H of ``examples/train_packed.py``, wrapped) on bench_train's packed rows
(``pack_dataset`` BFD rows of ``--row-tokens``, ``DataCollatorForPackedSSM``), AdamW, one torch thread. The
callback's events are driven as Trainer drives them (``on_step_begin`` -> forward / backward ->
``on_pre_optimizer_step`` -> optimizer step), in three kinds of steps interleaved so that machine load hits all
alike:

* ``plain``: no callback installed;
* ``idle``: callback installed, not a check step (its forward hook returns at once);
* ``check``: a check step (capture of the chosen sequence's logits + its alone forward).

Overhead at ``every_n_steps=N`` = (check - idle) / (N * plain) + hook / plain, from the medians, where
``hook`` is the idle forward hook alone, timed directly on a step's own output (the ``idle`` vs ``plain`` A/B
is printed too; on a shared CPU it is noise at the 1% level).

    python benchmarks/bench_shadow.py [--quick] [--every 100]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1024-token rows, 6 rounds")
    ap.add_argument("--row-tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=12, help="rounds of (plain, idle, check) steps (default 12)")
    ap.add_argument("--every", type=int, default=100, help="every_n_steps to report the overhead for")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.quick:
        args.row_tokens, args.rounds = 1024, 6

    import datasets
    import torch
    from bench_train import make_docs
    from byte_data import PAD_ID, VOCAB_SIZE
    from train_packed import build_model
    from transformers import TrainerControl, TrainerState, TrainingArguments

    import safepad
    from safepad.trainer_ext import ShadowCheckCallback

    torch.set_num_threads(1)
    datasets.disable_progress_bars()
    docs = make_docs(96 if args.quick else 256, args.row_tokens, args.seed, VOCAB_SIZE)
    packed = safepad.pack_dataset(datasets.Dataset.from_dict({"input_ids": docs}), args.row_tokens)
    rows = packed.to_list()
    collator = safepad.DataCollatorForPackedSSM(pad_to_multiple_of=64, pad_token_id=PAD_ID)
    batches = [collator([r]) for r in rows]
    model = safepad.wrap(build_model("nemotron_h", args.seed)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    targs = TrainingArguments(output_dir="/tmp/bench_shadow", report_to=[], use_cpu=True)
    state, control = TrainerState(), TrainerControl()
    cb = ShadowCheckCallback(every_n_steps=2)  # odd global steps are checks, even ones idle

    def step(batch, events: bool) -> float:
        t0 = time.perf_counter()
        if events:
            cb.on_step_begin(targs, state, control)
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        if events:
            cb.on_pre_optimizer_step(targs, state, control)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if events:
            state.global_step += 1
        return time.perf_counter() - t0

    step(batches[0], False)  # warm-up
    times: dict[str, list[float]] = {"plain": [], "idle": [], "check": []}
    k = 0
    for _ in range(args.rounds):
        cb.on_train_begin(targs, state, control, model=model)
        for kind in ("check", "idle"):  # state.global_step even -> check (step 1 of every 2)
            assert ((state.global_step) % 2 == 0) == (kind == "check")
            times[kind].append(step(batches[k % len(batches)], True))
            k += 1
        cb.on_train_end(targs, state, control)
        times["plain"].append(step(batches[k % len(batches)], False))
        k += 1
    med = {kind: statistics.median(v) for kind, v in times.items()}
    tokens = statistics.mean(b["input_ids"].numel() for b in batches)
    seqs = statistics.mean(len(r["seq_lengths"]) for r in rows)
    checked = statistics.mean(r.checked_tokens for r in cb.results)
    n = args.every
    cb.on_train_begin(targs, state, control, model=model)
    with torch.no_grad():
        out = model(**batches[0], use_cache=False)
    reps = 10_000
    t0 = time.perf_counter()
    for _ in range(reps):
        cb._on_forward(model, (), batches[0], out)  # not armed: what every step without a check pays
    hook = (time.perf_counter() - t0) / reps
    cb.on_train_end(targs, state, control)
    overhead = (med["check"] - med["idle"]) / (n * med["plain"]) + hook / med["plain"]
    print(
        f"rows of {tokens:.0f} tokens ({seqs:.1f} sequences), {len(cb.results)} checks of {checked:.0f} tokens on average"
    )
    for kind in ("plain", "idle", "check"):
        print(f"  {kind:5s} step median {med[kind] * 1e3:8.1f} ms  (n={len(times[kind])})")
    print(
        f"  one check costs {(med['check'] - med['idle']) * 1e3:.1f} ms = {med['check'] / med['idle'] - 1:.1%} of a step"
    )
    print(
        f"  idle hook alone {hook * 1e6:.1f} us = {hook / med['plain']:.4%} of a step; idle vs plain A/B "
        f"{med['idle'] / med['plain'] - 1:+.2%} (noise level on a shared CPU)"
    )
    print(f"shadow check overhead per step at every_n_steps={n}: {overhead:.3%}")


if __name__ == "__main__":
    main()
