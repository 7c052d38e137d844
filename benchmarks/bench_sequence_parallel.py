"""Sequence parallelism on CPU over gloo: per-rank activation memory, peak memory and step time at P = 1, 2, 4.

One long packed row (documents of random lengths, boundaries crossing the rank edges) through a small
Nemotron-H (Mamba2 + attention + MLP layers), wrapped by safepad and sharded by
``safepad.distributed.sequence_parallel``. A step is forward + backward + ``sync_gradients()``. Per rank:

* ``saved MB``: bytes of the tensors autograd saves for backward during the forward (the activation
  memory; counted with ``torch.autograd.graph.saved_tensors_hooks``, storage shared between tensors
  counted once) — it should fall close to ``1/P``;
* ``peak MB``: max RSS growth over the first step (from just before it; allocator noise included), and
  ``RSS MB`` the process's max RSS (interpreter, torch and the model included);
* ``step s``: median step time; ``comm %``: the share of the step spent inside the collectives (all-gathers
  of halos / states / K,V, their backward all-reduces, the gradient all-reduce), waiting for slower ranks
  included.

P = 1 runs the same sharded code path with one rank, and the plain wrapped model for reference (whose
packed attention goes through transformers' own 4-D mask, which costs it time and memory of its own). The ranks
are processes on this machine's cores: with fewer cores than ranks they share cores, so step times
measure contention, not scaling; the memory columns are what sequence parallelism is for.

    python benchmarks/bench_sequence_parallel.py [--tokens 4096] [--hidden 128] [--steps 3] [--worlds 1,2,4]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KB


def _model(hidden: int):
    from safepad.testing.tiny import tiny_model

    return tiny_model(
        "nemotron_h", hidden_size=hidden, intermediate_size=2 * hidden, mamba_num_heads=hidden // 16,
        mamba_head_dim=32, ssm_state_size=64, chunk_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=hidden // 4, vocab_size=1024,
    ).train()


def _row(tokens: int, seed: int, vocab: int):
    g = torch.Generator().manual_seed(seed)
    lens, left = [], tokens
    while left > 0:
        n = min(left, int(torch.randint(tokens // 16, tokens // 3, (1,), generator=g)))
        lens.append(n)
        left -= n
    ids = torch.randint(3, vocab, (1, tokens), generator=g)
    pos = torch.cat([torch.arange(n) for n in lens])[None]  # [1, T] restarting at each document
    labels = ids.clone()
    labels[pos == 0] = -100
    return {"input_ids": ids, "position_ids": pos, "labels": labels}, lens


class _Saved:
    """Bytes of distinct storages saved for backward while active."""

    def __init__(self):
        self.seen: set = set()
        self.bytes = 0

    def pack(self, t):
        key = (t.untyped_storage().data_ptr(), t.device)
        if key not in self.seen:
            self.seen.add(key)
            self.bytes += t.untyped_storage().nbytes()
        return t

    def unpack(self, t):
        return t


_COMM = [0.0]


def _timed(fn):
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            _COMM[0] += time.perf_counter() - t0

    return wrapper


def worker(rank: int, world: int, init: str, args: dict, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    for name in ("all_gather", "all_reduce"):
        setattr(dist, name, _timed(getattr(dist, name)))
    import safepad
    from safepad.distributed import sequence_parallel

    results = {}
    modes = ["plain", "sp"] if world == 1 else ["sp"]
    for mode in modes:
        model = safepad.wrap(_model(args["hidden"]))
        batch, _ = _row(args["tokens"], 0, model.config.vocab_size)
        sp = sequence_parallel(model) if mode == "sp" else None

        def step():
            model.zero_grad(set_to_none=True)
            loss = model(**batch).loss
            loss.backward()
            if sp is not None:
                sp.sync_gradients()
            return loss

        rss0 = _max_rss_mb()
        step()  # warm-up: its activations set the peak
        peak = _max_rss_mb() - rss0
        saved = _Saved()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            loss = model(**batch).loss
        loss.backward()
        del loss
        model.zero_grad(set_to_none=True)
        times, comm = [], []
        for _ in range(args["steps"]):
            dist.barrier()
            _COMM[0] = 0.0
            t0 = time.perf_counter()
            loss = step()
            times.append(time.perf_counter() - t0)
            comm.append(_COMM[0])
        results[mode] = {
            "saved_mb": saved.bytes / 2**20, "peak_mb": peak, "rss_mb": _max_rss_mb(),
            "step_s": statistics.median(times), "comm_share": statistics.median(c / t for c, t in zip(comm, times)),
            "loss": float(loss.detach()),
        }
        if sp is not None:
            sp.remove()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def run(world: int, args: dict) -> list[dict]:
    d = tempfile.mkdtemp()
    mp.spawn(worker, args=(world, os.path.join(d, "init"), args, d), nprocs=world, join=True)
    return [json.load(open(os.path.join(d, f"rank{r}.json"))) for r in range(world)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096, help="tokens of the packed row (divisible by 4)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--worlds", default="1,2,4")
    a = ap.parse_args()
    args = {"tokens": a.tokens, "hidden": a.hidden, "steps": a.steps}
    _, lens = _row(a.tokens, 0, 1024)
    print(f"one packed row of {a.tokens} tokens, {len(lens)} documents {lens}; Nemotron-H hidden {a.hidden}; "
          f"{os.cpu_count()} CPU cores, 1 thread per rank")
    print(f"{'P':>2} {'mode':>6} {'rank':>4} {'saved MB':>9} {'peak MB':>8} {'RSS MB':>7} {'step s':>7} {'comm %':>7} {'loss':>9}")
    base = None
    summary = []
    for world in [int(w) for w in a.worlds.split(",")]:
        res = run(world, args)
        for mode in res[0]:
            for r, rr in enumerate(res):
                x = rr[mode]
                print(f"{world:>2} {mode:>6} {r:>4} {x['saved_mb']:9.1f} {x['peak_mb']:8.1f} {x['rss_mb']:7.0f} {x['step_s']:7.2f} "
                      f"{100 * x['comm_share']:6.1f}% {x['loss']:9.5f}")
            if mode == "plain":
                base = res[0][mode]
            else:
                worst = max(rr[mode]["saved_mb"] for rr in res)
                summary.append((world, worst, max(rr[mode]["step_s"] for rr in res),
                                statistics.mean(rr[mode]["comm_share"] for rr in res)))
    one = next((x for x in summary if x[0] == 1), None)
    for label, ref in (("the plain wrapped model on one process", base),
                       ("the sharded code path with one rank (P = 1)", None if one is None else
                        {"saved_mb": one[1], "step_s": one[2]})):
        if ref is None:
            continue
        print(f"\nratios against {label}:")
        for world, saved, step, comm in summary:
            print(f"  P={world}: activation memory per rank {saved / ref['saved_mb']:.3f}x (ideal {1 / world:.3f}x), "
                  f"step time {step / ref['step_s']:.2f}x, communication share {100 * comm:.1f}%")

if __name__ == "__main__":
    main()
