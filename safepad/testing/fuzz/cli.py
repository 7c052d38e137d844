"""``python -m safepad.testing.fuzz`` / ``make fuzz``: the open-ended, time-bounded run over every family."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch

from .core import _stats
from .known import KNOWN_DEFECTS
from .machine import fuzz_families, run_family

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """``python -m safepad.testing.fuzz``: fuzz every family round-robin until ``--minutes`` pass; print the
    per-family counts, skipped draws and each failure's repro. A failure is printed the moment it is found
    (as drawn), and again once shrunk; a round's totals are printed after each round. Exit status 1 iff
    something failed."""
    doc = sys.modules[__package__].__doc__ or ""
    p = argparse.ArgumentParser(prog="python -m safepad.testing.fuzz", description=doc.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=float(os.environ.get("FUZZ_MINUTES", "10")))
    p.add_argument("--families", default=os.environ.get("FUZZ_FAMILIES", ""),
                   help="comma-separated families (default: every supported one)")
    p.add_argument("--examples", type=int, default=10, help="call sequences per family per round")
    p.add_argument("--steps", type=int, default=int(os.environ.get("FUZZ_STEPS", "8")))
    p.add_argument("--compile-every", type=int, default=int(os.environ.get("FUZZ_COMPILE_EVERY", "8")),
                   help="about one call sequence in N runs compiled (torch.compile(model) or a compiled forward); "
                        "0: eager only")
    p.add_argument("--shrink-minutes", type=float, default=float(os.environ.get("FUZZ_SHRINK_MINUTES", "10")),
                   help="shrink a failure only while at least this much of the run is left; otherwise report it "
                        "as drawn")
    p.add_argument("--dtype", default=os.environ.get("FUZZ_DTYPE", "float32"), choices=("float32", "bfloat16"),
                   help="the models' dtype (bfloat16: the tolerance of safepad.testing.scenarios.default_tol)")
    p.add_argument("--serving", action="store_true", help="fuzz continuous batching instead (fuzz/serving.py)")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(1)
    if args.serving:
        from .serving import main_serving

        return main_serving(args.minutes, [f for f in args.families.split(",") if f], args.examples)
    handler = logging.StreamHandler(sys.stdout)  # a failure as drawn, the moment it happens (session.py logs it)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    fuzz_log = logging.getLogger(__package__)
    fuzz_log.addHandler(handler)
    fuzz_log.setLevel(logging.WARNING)
    families = [f for f in args.families.split(",") if f] or fuzz_families()
    start = time.monotonic()
    deadline = start + args.minutes * 60
    failed: dict[str, str] = {}
    rounds = 0
    try:
        while time.monotonic() < deadline:
            rounds += 1
            for fam in families:
                if fam in failed or time.monotonic() >= deadline:
                    continue
                shrink = deadline - time.monotonic() >= args.shrink_minutes * 60
                try:
                    run_family(fam, args.examples, args.steps, seed=None, dtype=dtype,
                               compile_every=args.compile_every, shrink=shrink)
                except Exception as exc:  # noqa: BLE001 -- collect, report, go on with the others
                    notes = "\n".join(getattr(exc, "__notes__", []))  # hypothesis' reproduce blob, if any
                    failed[fam] = f"{type(exc).__name__}: {exc}" + (f"\n{notes}" if notes else "")
                    _stats(fam).failures.append(failed[fam])
                    print(f"\n==== FAILURE {fam} ({'shrunk' if shrink else 'as drawn'}) ====\n{failed[fam]}",
                          flush=True)
            s = [_stats(f) for f in families]
            print(f"-- round {rounds} done at {(time.monotonic() - start) / 60:.1f} min: sequences "
                  f"{sum(x.sequences for x in s)}, calls {sum(x.calls for x in s)}, failures {len(failed)}",
                  flush=True)
            if len(failed) == len(families):
                break
    finally:
        fuzz_log.removeHandler(handler)
    print(f"== safepad fuzz: {args.minutes:g} min, {rounds} rounds, {len(families)} families "
          f"({(time.monotonic() - start) / 60:.1f} min wall)")
    for fam in families:
        print(_stats(fam).line())
    tot = [_stats(f) for f in families]
    print(f"total: sequences {sum(s.sequences for s in tot)}, calls {sum(s.calls for s in tot)}, "
          f"failures {len(failed)}")
    print("known defects (skipped draws): " + "; ".join(f"{d.item}: {d.reason}" for d in KNOWN_DEFECTS))
    for fam, msg in failed.items():
        print(f"\n==== FAILURE {fam} ====\n{msg}")
    return 1 if failed else 0
