"""Collator and packing benchmark: safepad vs transformers / TRL, measured side by side in one run.

Lengths: lognormal with median 300 tokens (sigma 1.0), capped at 4096. Part 4 is a second, long-tailed
workload that no test uses: ``--tail-examples`` (60 000) documents of lognormal lengths with median 350
(sigma 1.0) NOT capped, so about 0.7% of them are longer than ``max_length=4096``: safepad splits them
(``overflow="split"``, every token kept), TRL's ``bfd`` truncates them. Both run with Dataset caching
disabled (a cached ``map`` would time a cache hit), each on its defaults, interleaved (safepad, TRL, safepad,
TRL, ... ``--tail-rounds`` times; the median of the per-round ratios, robust to a loaded machine), once on the
in-memory Dataset and once on the same Dataset saved to and loaded from disk (memory-mapped: both write their
output through ``Dataset.map``). Prints the ratios LAST.

    python benchmarks/bench_collator.py [--examples 100000] [--batches 400] [--tail-examples 60000] [--tail-rounds 5]
    python benchmarks/bench_collator.py --tail-only     # part 4 alone
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import datasets
import numpy as np
import pyarrow as pa
import torch
from transformers import DataCollatorWithFlattening

from safepad.collators import DataCollatorForPackedSSM, pack_dataset

MAX_LENGTH = 4096


def lognormal_lengths(rng: np.random.Generator, n: int) -> np.ndarray:
    return np.clip(np.round(rng.lognormal(np.log(300), 1.0, n)), 1, MAX_LENGTH).astype(np.int64)


def make_dataset(rng: np.random.Generator, lengths: np.ndarray) -> datasets.Dataset:
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = rng.integers(0, 32000, int(offsets[-1]), dtype=np.int32)
    col = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(tokens))
    return datasets.Dataset(pa.table({"input_ids": col}))


def best_of(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_collators(rng: np.random.Generator, n_batches: int) -> tuple[float, float, int]:
    batches = [
        [{"input_ids": rng.integers(0, 32000, int(n)).tolist()} for n in lognormal_lengths(rng, 8)]
        for _ in range(n_batches)
    ]
    ours = DataCollatorForPackedSSM()
    theirs = DataCollatorWithFlattening(return_seq_idx=True, return_flash_attn_kwargs=True)
    a, b = ours(batches[0]), theirs(batches[0])  # warm-up, and both agree on the layout
    for k in ("input_ids", "labels", "position_ids", "seq_idx", "cu_seq_lens_q"):
        assert torch.equal(a[k], b[k]), k
    t_ours = best_of(lambda: [ours(f) for f in batches])
    t_theirs = best_of(lambda: [theirs(f) for f in batches])
    tokens = sum(len(f["input_ids"]) for batch in batches for f in batch)
    return t_ours, t_theirs, tokens


def padded_efficiency(rng: np.random.Generator, lengths: np.ndarray, batch: int = 8) -> float:
    perm = rng.permutation(lengths)[: len(lengths) // batch * batch].reshape(-1, batch)  # [n_batches, 8]
    return float(perm.sum() / (perm.max(axis=1) * batch).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=100_000)
    parser.add_argument("--batches", type=int, default=400)
    parser.add_argument("--tail-examples", type=int, default=60_000)
    parser.add_argument("--tail-rounds", type=int, default=5)
    parser.add_argument("--tail-only", action="store_true", help="run only part 4 (the long-tailed workload)")
    args = parser.parse_args()
    datasets.disable_progress_bars()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    if args.tail_only:
        from trl import pack_dataset as trl_pack_dataset

        tail = bench_long_tail(np.random.default_rng(1), args.tail_examples, trl_pack_dataset, args.tail_rounds)
        print_tail(tail)
        return

    # 1. collator throughput on identical plain features (batches of 8)
    t_ours, t_hf, tokens = bench_collators(rng, args.batches)
    print(f"collator, {args.batches} batches of 8 ({tokens} tokens):")
    print(f"  DataCollatorForPackedSSM           {t_ours * 1e3:9.1f} ms  ({tokens / t_ours / 1e6:6.1f} M tok/s)")
    print(f"  DataCollatorWithFlattening (HF)    {t_hf * 1e3:9.1f} ms  ({tokens / t_hf / 1e6:6.1f} M tok/s)")

    # 2. pack_dataset BFD vs TRL on the same Dataset
    from trl import pack_dataset as trl_pack_dataset

    lengths = lognormal_lengths(rng, args.examples)
    ds = make_dataset(rng, lengths)
    print(
        f"\npack_dataset (best of 2) on {args.examples} examples, {int(lengths.sum())} tokens, max_length={MAX_LENGTH}:"
    )
    results = {}
    runs = [
        ("safepad bfd, batch 1000, no position_ids", dict(batch_size=1000, emit_position_ids=False)),
        ("safepad bfd, batch 10000, no position_ids", dict(batch_size=10_000, emit_position_ids=False)),
        ("safepad bfd, default (batch 10000, + position_ids)", dict()),
    ]
    for name, kw in runs:
        out = {}
        t = best_of(lambda kw=kw, out=out: out.update(res=pack_dataset(ds, MAX_LENGTH, return_stats=True, **kw)), 2)
        packed, stats = out["res"]
        results[name] = (t, stats.fill_ratio, len(packed))
    for strategy in ("bfd", "bfd_split"):
        out = {}
        t = best_of(lambda s=strategy, out=out: out.update(res=trl_pack_dataset(ds, MAX_LENGTH, strategy=s)), 2)
        packed = out["res"]  # map default: batch 1000
        fill = float(lengths.clip(max=MAX_LENGTH).sum() / (len(packed) * MAX_LENGTH))
        results[f"TRL {strategy}, batch 1000"] = (t, fill, len(packed))
    for name, (t, fill, rows) in results.items():
        print(f"  {name:<52s} {t:7.2f} s  fill {fill * 100:6.2f}%  rows {rows}")

    # 3. token efficiency of plain padding
    eff = padded_efficiency(rng, lengths)
    print(f"\npadded random batches of 8 (pad to longest): token efficiency {eff * 100:.1f}%")

    # 4. long-tailed lengths with overflow splitting (a workload no test uses)
    tail = bench_long_tail(np.random.default_rng(1), args.tail_examples, trl_pack_dataset, args.tail_rounds)

    t_trl = results["TRL bfd, batch 1000"][0]
    t_same = results["safepad bfd, batch 1000, no position_ids"][0]
    t_default = results["safepad bfd, default (batch 10000, + position_ids)"][0]
    fill_default = results["safepad bfd, default (batch 10000, + position_ids)"][1]
    print("\nratios (higher is better):")
    print(f"  collator speed-up vs DataCollatorWithFlattening:        {t_hf / t_ours:6.2f}x  (target >= 3x)")
    print(f"  pack_dataset speed-up vs TRL bfd, same output/batching: {t_trl / t_same:6.2f}x  (target >= 1x)")
    print(f"  pack_dataset speed-up vs TRL bfd, safepad defaults:     {t_trl / t_default:6.2f}x")
    print(f"  BFD fill ratio (defaults):                              {fill_default * 100:6.2f}%  (target >= 98%)")
    print(f"  packed vs padded token efficiency:                      {fill_default / eff:6.2f}x")
    print_tail(tail)


def print_tail(tail: dict) -> None:
    print(f"  long tail: pack_dataset speed-up vs TRL bfd, defaults:  {tail['speedup']:6.2f}x  (target >= 1x; "
          f"median of interleaved rounds, in memory)")  # fmt: skip
    print(f"  long tail, dataset on disk: speed-up vs TRL bfd:        {tail['speedup_disk']:6.2f}x")
    print(f"  long tail: tokens kept safepad / TRL:                   {tail['kept'] * 100:6.2f}% / "
          f"{tail['trl_kept'] * 100:.2f}%")  # fmt: skip
    print(f"  long tail: fill safepad / TRL:                          {tail['fill'] * 100:6.2f}% / "
          f"{tail['trl_fill'] * 100:.2f}%")  # fmt: skip


def _interleaved(ours, theirs, rounds: int) -> tuple[list[float], list[float]]:
    """``rounds`` x (ours, theirs) back to back: a load spike hits both sides of a round alike."""
    t_ours, t_theirs = [], []
    for _ in range(rounds):
        for fn, times in ((ours, t_ours), (theirs, t_theirs)):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return t_ours, t_theirs


def bench_long_tail(rng: np.random.Generator, n: int, trl_pack_dataset, rounds: int = 5) -> dict:
    """60k documents, lognormal median 350, uncapped (some > max_length): safepad split vs TRL bfd (truncates)."""
    lengths = np.maximum(1, np.round(rng.lognormal(np.log(350), 1.0, n))).astype(np.int64)
    ds = make_dataset(rng, lengths)
    total = int(lengths.sum())
    caching = datasets.is_caching_enabled()
    datasets.disable_caching()
    try:
        out = {}
        t_ours, t_trl = _interleaved(
            lambda: out.update(ours=pack_dataset(ds, MAX_LENGTH, return_stats=True)),
            lambda: out.update(trl=trl_pack_dataset(ds, MAX_LENGTH, strategy="bfd")),
            rounds,
        )
        with tempfile.TemporaryDirectory() as tmp:
            ds.save_to_disk(tmp)
            on_disk = datasets.load_from_disk(tmp)
            d_ours, d_trl = _interleaved(
                lambda: pack_dataset(on_disk, MAX_LENGTH), lambda: trl_pack_dataset(on_disk, MAX_LENGTH, strategy="bfd"),
                rounds,
            )
            del on_disk
    finally:
        if caching:
            datasets.enable_caching()
    packed, stats = out["ours"]
    trl_tokens = int(sum(sum(s) for s in out["trl"].with_format("arrow")[:]["seq_lengths"].to_pylist()))
    res = {
        "speedup": statistics.median(b / a for a, b in zip(t_ours, t_trl)),
        "speedup_disk": statistics.median(b / a for a, b in zip(d_ours, d_trl)),
        "kept": stats.tokens / total,
        "trl_kept": trl_tokens / total,
        "fill": stats.fill_ratio,
        "trl_fill": trl_tokens / (len(out["trl"]) * MAX_LENGTH),
    }
    long = int((lengths > MAX_LENGTH).sum())
    print(
        f"\nlong tail: {n} documents, lognormal median 350, {total} tokens, {long} longer than {MAX_LENGTH} "
        f"({rounds} interleaved rounds; median s):"
    )
    print(f"  safepad bfd, defaults (split, batch 10000, + position_ids) {statistics.median(t_ours):7.2f} s  "
          f"rows {len(packed)}  fill {res['fill'] * 100:6.2f}%  tokens kept {res['kept'] * 100:6.2f}%")  # fmt: skip
    print(f"  TRL bfd (truncates), batch 1000                           {statistics.median(t_trl):7.2f} s  "
          f"rows {len(out['trl'])}  fill {res['trl_fill'] * 100:6.2f}%  tokens kept {res['trl_kept'] * 100:6.2f}%")  # fmt: skip
    print(f"  per-round ratio TRL / safepad: {' '.join(f'{b / a:.2f}' for a, b in zip(t_ours, t_trl))}; "
          f"on disk: {' '.join(f'{b / a:.2f}' for a, b in zip(d_ours, d_trl))}")  # fmt: skip
    return res


if __name__ == "__main__":
    main()
