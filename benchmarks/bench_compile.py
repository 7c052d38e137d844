"""torch.compile training step: compiled vs eager, wrapped vs stock, on the bench_train model.

The model is bench_train's (``examples/train_packed.py``'s Nemotron-H: hidden 128, mamba / attention /
mamba / mlp, byte vocabulary). A step is forward + backward + AdamW step on one packed row of
``--row-tokens`` tokens (documents of bench_train's lognormal lengths capped at a quarter row, the fullest row
that ``pack_dataset`` makes of them, collated
by ``DataCollatorForPackedSSM``: position_ids, seq_idx and cu_seq_lens). Four sides, in one process with one
torch thread, timed round-robin (one step of each side per round, so a load change on the shared box hits
all four alike):

* **wrapped eager** / **wrapped compiled** (``torch.compile(model)``, inductor): the packed row with its
  boundaries, through ``safepad.wrap``;
* **stock eager** / **stock compiled**: the same token row as one sequence (input_ids and labels only; the
  stock model would leak state across the boundaries, so it gets no packing columns) — the same shapes
  and the same work per token.

Compile time is the wall time of a side's first compiled step (forward + backward compilation) minus its
median step. Ratios are medians of per-round ratios.

    python benchmarks/bench_compile.py            # 2048-token row, 20 rounds
    python benchmarks/bench_compile.py --quick    # 512-token row, 6 rounds

The last line is ``compile: wrapped compiled vs wrapped eager step: X.XXx faster (stock: Y.YYx), ...``.

``--epoch`` measures instead how the shapes of an epoch of packed rows are best fed to ``torch.compile``
(inductor, wrapped model, training steps): ``--epoch-rows`` rows of ``pack_dataset`` (their lengths and numbers
of sequences differ) collated three ways, each in a fresh compile:

* **fixed** — ``DataCollatorForPackedSSM(pad_to_length=row)``: every tensor has one shape, one compile;
* **dynamic** — rows of their own length, ``torch.compile(dynamic=True)``: one symbolic-shape compile;
* **mark_dynamic** — rows of their own length, ``torch._dynamo.mark_dynamic`` on the sequence dim of every
  tensor, default ``torch.compile``.

For each: compiled frames (``torch._dynamo.utils.counters["frames"]["ok"]``, after the first batch and after the
epoch), the first step (compile + run), the median later step, and the epoch's wall time. Last line:
``compile epoch: fixed X s, dynamic Y s, mark_dynamic Z s; recompiles 0/0/0; fastest on CPU: ...``.

    python benchmarks/bench_compile.py --epoch [--row-tokens 1024] [--epoch-rows 12]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a 512-token row, 6 rounds: a smoke run")
    ap.add_argument("--row-tokens", type=int, default=2048, help="packed row length (default 2048)")
    ap.add_argument("--rounds", type=int, default=20, help="timed rounds (default 20)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--epoch", action="store_true", help="fixed vs dynamic shapes over an epoch of packed rows")
    ap.add_argument("--epoch-rows", type=int, default=12, help="rows in the --epoch run (default 12)")
    args = ap.parse_args()
    if args.epoch:
        return epoch(args)
    if args.quick:
        args.row_tokens, args.rounds = 512, 6
    if args.row_tokens < 64 or args.rounds < 1:
        ap.error("--row-tokens must be >= 64 and --rounds >= 1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

    import datasets
    import torch
    from bench_train import make_docs
    from byte_data import PAD_ID, VOCAB_SIZE
    from train_packed import build_model

    import safepad

    torch.set_num_threads(1)
    datasets.disable_progress_bars()
    docs = make_docs(256, args.row_tokens // 4, args.seed, VOCAB_SIZE)  # capped at a quarter row: several per row
    packed = safepad.pack_dataset(datasets.Dataset.from_dict({"input_ids": docs}), args.row_tokens)
    collator = safepad.DataCollatorForPackedSSM(pad_to_multiple_of=64, pad_token_id=PAD_ID)
    fill = [sum(r["seq_lengths"]) for r in packed]
    row = packed.remove_columns("seq_lengths")[max(range(len(fill)), key=fill.__getitem__)]  # the fullest row
    batch = collator([row])
    n_seq = len(batch["cu_seq_lens_q"]) - 1
    stock_batch = {"input_ids": batch["input_ids"], "labels": batch["labels"]}

    base = build_model("nemotron_h", args.seed).train()
    models = {
        "wrapped eager": safepad.wrap(copy.deepcopy(base)),
        "stock eager": copy.deepcopy(base),
    }
    models["wrapped compiled"] = torch.compile(safepad.wrap(copy.deepcopy(base)))
    models["stock compiled"] = torch.compile(copy.deepcopy(base))
    inputs = {k: (batch if k.startswith("wrapped") else stock_batch) for k in models}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}

    def step(name: str) -> float:
        model, opt = models[name], opts[name]
        t0 = time.perf_counter()
        loss = model(**inputs[name], use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    first = {k: step(k) for k in models}  # eager: warm-up; compiled: compilation + first run
    times: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(args.rounds):
        for k in models:
            times[k].append(step(k))
    med = {k: statistics.median(v) for k, v in times.items()}

    def ratio(slow: str, fast: str) -> float:
        return statistics.median(a / b for a, b in zip(times[slow], times[fast], strict=True))

    print(f"compile: bench_train's Nemotron-H, fp32, 1 thread, AdamW; one row of {batch['input_ids'].shape[1]} tokens "
          f"({n_seq} packed documents); {args.rounds} rounds, torch {torch.__version__}")  # fmt: skip
    print(f"{'':20s}{'median step ms':>16s}{'first step s':>14s}{'compile s':>11s}")
    for k in models:
        comp = f"{first[k] - med[k]:11.1f}" if k.endswith("compiled") else f"{'':11s}"
        print(f"{k:20s}{med[k] * 1e3:16.1f}{first[k]:14.1f}{comp}")
    w, s = ratio("wrapped eager", "wrapped compiled"), ratio("stock eager", "stock compiled")
    ws = ratio("stock compiled", "wrapped compiled")
    print(f"compile: wrapped compiled vs wrapped eager step: {w:.2f}x faster (stock: {s:.2f}x), "
          f"wrapped compiled vs stock compiled: {ws:.2f}x, compile time wrapped "
          f"{first['wrapped compiled'] - med['wrapped compiled']:.1f} s / stock "
          f"{first['stock compiled'] - med['stock compiled']:.1f} s")  # fmt: skip


def epoch(args: argparse.Namespace) -> None:
    """Fixed-length rows vs dynamic shapes over an epoch of packed rows (see the module docstring)."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import datasets
    import torch
    import torch._dynamo as dynamo
    from bench_train import make_docs
    from byte_data import PAD_ID, VOCAB_SIZE
    from torch._dynamo.utils import counters
    from train_packed import build_model

    import safepad

    torch.set_num_threads(1)
    datasets.disable_progress_bars()
    row = args.row_tokens
    docs = make_docs(64 * args.epoch_rows, row // 2, args.seed, VOCAB_SIZE)
    packed = safepad.pack_dataset(datasets.Dataset.from_dict({"input_ids": docs}), row, batch_size=6)  # ragged rows
    rows = list(packed.remove_columns("seq_lengths"))[: args.epoch_rows]
    base = build_model("nemotron_h", args.seed).train()

    def marked(batch: dict) -> dict:
        out = {k: v for k, v in batch.items() if k not in ("max_length_q", "max_length_k")}  # ints specialise
        for v in out.values():
            if isinstance(v, torch.Tensor):
                dynamo.mark_dynamic(v, v.dim() - 1)
        return out

    variable = safepad.DataCollatorForPackedSSM(pad_token_id=PAD_ID)
    sides = {
        "fixed": (safepad.DataCollatorForPackedSSM(pad_to_length=row, pad_token_id=PAD_ID), {"dynamic": False}, None),
        "dynamic": (variable, {"dynamic": True}, lambda b: {k: v for k, v in b.items() if not k.startswith("max_")}),
        "mark_dynamic": (variable, {}, marked),
    }
    res = {}
    for name, (collator, kw, prepare) in sides.items():
        dynamo.reset()
        counters.clear()
        batches = [collator([r]) for r in rows]
        model = torch.compile(safepad.wrap(copy.deepcopy(base)), **kw)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        times, frames = [], []
        t_all = time.perf_counter()
        for b in batches:
            b = prepare(b) if prepare else b
            t0 = time.perf_counter()
            model(**b, use_cache=False).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
            frames.append(counters["frames"]["ok"])
        res[name] = {"epoch": time.perf_counter() - t_all, "first": times[0],
                     "median": statistics.median(times[1:]) if len(times) > 1 else float("nan"),
                     "frames": (frames[0], frames[-1]), "tokens": sum(b["input_ids"].shape[1] for b in batches)}  # fmt: skip
        v = res[name]
        print(f"  {name}: frames {v['frames'][0]}/{v['frames'][1]}, first step {v['first']:.1f} s, median step "
              f"{v['median'] * 1e3:.1f} ms, epoch {v['epoch']:.1f} s", flush=True)  # fmt: skip
    lengths = [len(r["input_ids"]) for r in rows]
    print(f"compile epoch: bench_train's Nemotron-H, inductor, 1 thread, AdamW; {len(rows)} packed rows of "
          f"{min(lengths)}..{max(lengths)} real tokens (row {row}), torch {torch.__version__}")  # fmt: skip
    print(f"{'':14s}{'frames 1st/end':>16s}{'first step s':>14s}{'median step ms':>16s}{'epoch s':>10s}{'tokens':>8s}")
    for k, v in res.items():
        fr = f"{v['frames'][0]}/{v['frames'][1]}"
        print(f"{k:14s}{fr:>16s}{v['first']:14.1f}{v['median'] * 1e3:16.1f}{v['epoch']:10.1f}{v['tokens']:8d}")
    fastest = min(res, key=lambda k: res[k]["epoch"])
    steady = min(res, key=lambda k: res[k]["median"])
    recompiles = "/".join(str(v["frames"][1] - v["frames"][0]) for v in res.values())
    print(f"compile epoch: fixed {res['fixed']['epoch']:.1f} s, dynamic {res['dynamic']['epoch']:.1f} s, mark_dynamic "
          f"{res['mark_dynamic']['epoch']:.1f} s; recompiles {recompiles}; fastest on CPU: {fastest} (epoch), "
          f"{steady} (median step)")  # fmt: skip


if __name__ == "__main__":
    main()
