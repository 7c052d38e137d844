"""End-to-end training throughput: packed rows + safepad.wrap vs batches padded to the longest, stock model.

Same model (the Nemotron-H of ``examples/train_packed.py``: hidden 128, mamba / attention / mamba / mlp,
byte vocabulary, same seed), same documents, same optimizer (AdamW), side by side in one run:

* **packed**: ``pack_dataset`` (BFD rows of ``--row-tokens``) -> ``DataCollatorForPackedSSM`` -> the
  ``safepad.wrap``-ped model; one packed row per step.
* **padded**: ``--batch`` documents per step, right-padded to the longest with an ``attention_mask``
  (labels -100 on pads) -> the stock model.

Document lengths are lognormal (median 300 tokens, sigma 1.0) capped at ``--max-doc``; token ids are
random. A step is collate + forward + backward + optimizer step. Each side runs in its own subprocess with
one torch thread, and the two run at the same time (``--sequential``: one after the other), so a load
change on a shared box hits both sides alike (if anything it favours the padded side, which runs alone
once the packed side is done). Each side runs one untimed warm-up step on its first batch, then one timed
pass over all the documents, so both sides time exactly the same real tokens. Throughput counts *real*
(document) tokens only; peak memory is the worker's max RSS above its RSS just before the timed pass.

Row length: the attention layer of the hybrid runs sdpa over the whole packed row with a block-diagonal
mask, so its cost grows with the square of the row length, not with the documents' lengths (flash-attention
varlen on GPU, fed by ``cu_seq_lens``, has no such cost). Rows as long as the longest document (the
default, ``--row-tokens 2048`` = ``--max-doc``) keep that term small; measured on this model, 4096-token
rows lower the packed throughput by ~1.5x.

    python benchmarks/bench_train.py           # 384 documents, a few minutes
    python benchmarks/bench_train.py --quick   # 64 documents, well under a minute

The last line is ``train: packed vs padded real tokens/s: X.XXx, peak-mem ratio Y.YY``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parent / "examples"


def doc_lengths(n: int, max_doc: int, seed: int) -> list[int]:
    """``n`` lognormal lengths, median 300, sigma 1.0, clipped to ``[2, max_doc]``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(300), 1.0, n)), 2, max_doc).astype(int).tolist()


def make_docs(n: int, max_doc: int, seed: int, vocab: int) -> list[list[int]]:
    """The documents both sides train on: random ids in ``[3, vocab)`` (0 / 1 / 2 are pad / bos / eos)."""
    import numpy as np

    rng = np.random.default_rng(seed + 1)
    return [rng.integers(3, vocab, size=length).tolist() for length in doc_lengths(n, max_doc, seed)]


def _max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KB


def padded_batches(docs: list[list[int]], batch: int, seed: int) -> list[list[dict]]:
    """Shuffled batches of ``batch`` documents (the last one may be smaller)."""
    import numpy as np

    order = np.random.default_rng(seed + 2).permutation(len(docs)).tolist()
    return [[{"input_ids": docs[i]} for i in order[k : k + batch]] for k in range(0, len(order), batch)]


def pad_collate(features: list[dict], pad_id: int):
    """Right-pad to the longest: ``input_ids`` / ``attention_mask`` / ``labels`` ``[B, L_max]`` (labels -100 on pads)."""
    import torch

    width = max(len(f["input_ids"]) for f in features)
    ids = torch.full((len(features), width), pad_id, dtype=torch.long)  # [B, L_max]
    mask = torch.zeros((len(features), width), dtype=torch.long)  # [B, L_max]
    for b, f in enumerate(features):
        n = len(f["input_ids"])
        ids[b, :n] = torch.tensor(f["input_ids"])
        mask[b, :n] = 1
    labels = ids.masked_fill(mask == 0, -100)  # [B, L_max]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def worker(mode: str, n_docs: int, max_doc: int, row_tokens: int, batch: int, seed: int) -> dict:
    """Train ``mode`` ("packed" | "padded") over all documents once; return throughput and memory."""
    import datasets
    import torch

    sys.path.insert(0, str(EXAMPLES))
    from byte_data import PAD_ID, VOCAB_SIZE
    from train_packed import build_model

    import safepad

    torch.set_num_threads(1)
    datasets.disable_progress_bars()
    docs = make_docs(n_docs, max_doc, seed, VOCAB_SIZE)
    model = build_model("nemotron_h", seed)
    model.train()
    if mode == "packed":
        model = safepad.wrap(model)
        packed = safepad.pack_dataset(datasets.Dataset.from_dict({"input_ids": docs}), row_tokens)
        collator = safepad.DataCollatorForPackedSSM(pad_to_multiple_of=64, pad_token_id=PAD_ID)
        order = torch.randperm(len(packed), generator=torch.Generator().manual_seed(seed)).tolist()
        rows = packed.select(order).remove_columns("seq_lengths").to_list()
        steps = [[row] for row in rows]
        collate = collator
    elif mode == "padded":
        steps = padded_batches(docs, batch, seed)

        def collate(features):
            return pad_collate(features, PAD_ID)

    else:
        raise ValueError(f"mode must be 'packed' or 'padded', got {mode!r}")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(features) -> int:
        inputs = collate(features)
        loss = model(**inputs, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return int(inputs["input_ids"].numel())

    step(steps[0])  # untimed warm-up (allocator, first-call overheads); then every document, timed
    rss0 = _max_rss_mb()
    real = fed = 0
    t0 = time.perf_counter()
    for features in steps:
        fed += step(features)
        real += sum(len(f["input_ids"]) for f in features)
    seconds = time.perf_counter() - t0
    return {
        "mode": mode,
        "steps": len(steps),
        "real_tokens": real,
        "fed_tokens": fed,
        "seconds": seconds,
        "real_tok_s": real / seconds,
        "peak_mb": _max_rss_mb() - rss0,
        "peak_rss_mb": _max_rss_mb(),
    }


def start_worker(mode: str, args: argparse.Namespace) -> subprocess.Popen:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", mode, "--docs", str(args.docs),
           "--max-doc", str(args.max_doc), "--row-tokens", str(args.row_tokens), "--batch", str(args.batch),
           "--seed", str(args.seed)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish_worker(mode: str, proc: subprocess.Popen) -> dict:
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"the {mode} worker failed ({proc.returncode}):\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="64 documents capped at 1024 tokens: a smoke run",
    )
    ap.add_argument("--docs", type=int, default=384, help="documents (default 384)")
    ap.add_argument(
        "--max-doc",
        type=int,
        default=2048,
        help="document length cap in tokens (default 2048)",
    )
    ap.add_argument("--row-tokens", type=int, default=2048, help="packed row length (default 2048)")
    ap.add_argument("--batch", type=int, default=8, help="documents per padded batch (default 8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sequential", action="store_true", help="run the two sides one after the other")
    ap.add_argument("--worker", choices=("packed", "padded"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.docs, args.max_doc, args.row_tokens = 64, 1024, 1024
    for name in ("docs", "max_doc", "row_tokens", "batch"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_doc > args.row_tokens:
        ap.error(f"--max-doc ({args.max_doc}) must be <= --row-tokens ({args.row_tokens}): no document is split")
    if args.worker:
        print(
            json.dumps(
                worker(
                    args.worker,
                    args.docs,
                    args.max_doc,
                    args.row_tokens,
                    args.batch,
                    args.seed,
                )
            )
        )
        return

    lengths = doc_lengths(args.docs, args.max_doc, args.seed)
    print(f"training throughput: Nemotron-H (examples/train_packed.py config), fp32, 1 thread per side, AdamW; "
          f"{args.docs} documents, lognormal median 300 capped at {args.max_doc} "
          f"(mean {sum(lengths) / len(lengths):.0f}, max {max(lengths)})")  # fmt: skip
    if args.sequential:
        res = {m: finish_worker(m, start_worker(m, args)) for m in ("packed", "padded")}
    else:  # both at once, one thread each: load from anything else on the box hits both sides alike
        procs = {m: start_worker(m, args) for m in ("packed", "padded")}
        res = {m: finish_worker(m, p) for m, p in procs.items()}
    labels = {
        "packed": f"packed rows of {args.row_tokens} + safepad.wrap",
        "padded": f"padded batches of {args.batch}, stock",
    }
    print(f"{'':40s}{'steps':>7s}{'real tok':>10s}{'fill':>8s}{'seconds':>9s}{'real tok/s':>12s}{'peak MB':>9s}")
    for m, r in res.items():
        fill = r["real_tokens"] / r["fed_tokens"]
        print(f"{labels[m]:40s}{r['steps']:7d}{r['real_tokens']:10d}{fill:8.1%}{r['seconds']:9.1f}"
              f"{r['real_tok_s']:12.0f}{r['peak_mb']:9.0f}")  # fmt: skip
    speed = res["packed"]["real_tok_s"] / res["padded"]["real_tok_s"]
    mem = res["packed"]["peak_mb"] / max(res["padded"]["peak_mb"], 1e-9)
    print(f"train: packed vs padded real tokens/s: {speed:.2f}x, peak-mem ratio {mem:.2f}")


if __name__ == "__main__":
    main()
