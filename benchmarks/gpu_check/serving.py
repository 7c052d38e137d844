"""Part ``serving``: continuous batching (``init_continuous_batching``, the manager) of a wrapped Nemotron-H vs
``generate`` over left-padded batches at the same load (lognormal prompt / output lengths, seed 0; the load and both
sides are :mod:`benchmarks.bench_serving`'s): requests/s and useful output tokens/s of each, wall time synchronised
on CUDA (bf16, hidden 1024, 64 requests, 16 per step / batch); on ``--device cpu`` float32, hidden 64, 8 requests
(the figures prove the code path, not a speed). ``same_tokens_fraction``: the requests whose greedy tokens are the
same on both sides (a near-tie of the top two logits may flip one in bf16)."""

from __future__ import annotations

import time

import torch

from .common import S, small, sync

__all__ = ["run"]


def run(device: str) -> tuple[list, dict]:
    from benchmarks.bench_serving import make_load, make_model, run_continuous, run_padded

    from .common import emit

    dtype = torch.float32 if small() else torch.bfloat16
    n, slots, hidden = S(64, 8), S(16, 8), S(1024, 64)
    load = make_load(n, seed=0)
    model = make_model(hidden, device=device, dtype=dtype)
    figures: dict = {"requests": n, "slots": slots, "hidden": hidden, "dtype": str(dtype).removeprefix("torch."),
                     "output_tokens": load.tokens}  # fmt: skip
    results = {}
    for name, fn in (("continuous", lambda: run_continuous(model, load, slots, max_batch_tokens=S(1024, 256))),
                     ("padded", lambda: run_padded(model, load, slots))):  # fmt: skip
        if not small():
            fn()  # warm-up (kernel autotuning, allocator)
        sync()
        t0 = time.perf_counter()
        results[name] = fn()
        sync()
        seconds = time.perf_counter() - t0
        figures[f"{name}_requests_per_s"] = n / seconds
        figures[f"{name}_tokens_per_s"] = load.tokens / seconds
        emit(**{k: v for k, v in figures.items() if k.startswith(name)})
    figures["continuous_vs_padded"] = figures["continuous_tokens_per_s"] / figures["padded_tokens_per_s"]
    figures["same_tokens_fraction"] = sum(a == b for a, b in zip(results["continuous"], results["padded"])) / n
    return [], figures
