"""What every part shares: the row type, the error measure, timers, the shape scale and the partial-result sink."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from safepad.testing.inputs import random_seq_idx
from safepad.testing.inputs import ssd_inputs as _ssd_inputs

#: run-wide settings, set by the runner before any part runs
RUN = {"small": False, "mode": "gpu", "device": "cuda"}

TOL = {torch.float32: 2e-3, torch.bfloat16: 3e-2, torch.float16: 5e-3}


class PartSkipped(Exception):
    """Raised by a part that cannot run here (its message is the reason); reported as ``skipped``."""


class PartTimeout(Exception):
    """A part ran past its budget (raised in the main thread by SIGALRM)."""


def small() -> bool:
    """True on CPU (``--device cpu`` / ``--emulate``): small shapes, no repeated timings."""
    return bool(RUN["small"])


def S(n: int, small_n: int) -> int:
    """``n`` on a GPU, ``small_n`` on CPU."""
    return small_n if small() else n


@dataclass
class Row:
    name: str
    dtype: str
    err: float
    tol: float
    t_kernel_ms: float = float("nan")
    t_torch_ms: float = float("nan")
    #: which route the "kernel" side took: a kernel package's name, or "torch" when no kernel was importable
    route: str = ""

    @property
    def ok(self) -> bool:
        return self.err <= self.tol


# ------------------------------------------------------------------------------------------------------------------
# Partial results: a part emits rows / figures as it goes, so a timeout or a killed child keeps what was measured.
# ------------------------------------------------------------------------------------------------------------------

_SINK: dict = {"rows": [], "figures": {}, "listener": None}


def reset_sink(listener: Callable[[list[Row], dict], None] | None = None) -> None:
    _SINK["rows"], _SINK["figures"], _SINK["listener"] = [], {}, listener


def emit(rows: list[Row] | Row = (), **figures) -> None:
    """Record rows / figures of the running part now (kept if the part is stopped later)."""
    if isinstance(rows, Row):
        rows = [rows]
    _SINK["rows"].extend(rows)
    _SINK["figures"].update(figures)
    if _SINK["listener"] is not None:
        _SINK["listener"](_SINK["rows"], _SINK["figures"])


def emitted() -> tuple[list[Row], dict]:
    return list(_SINK["rows"]), dict(_SINK["figures"])


# ------------------------------------------------------------------------------------------------------------------
# measures and timers
# ------------------------------------------------------------------------------------------------------------------


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def sync() -> None:
    if torch.cuda.is_available() and RUN["device"] == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], reps: int = 5) -> tuple[object, float]:
    """Result of ``fn`` and its best time in ms (synchronising on CUDA; one call, no timing on CPU)."""
    out = fn()
    if small():
        return out, float("nan")
    best = float("inf")
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        best = min(best, (time.perf_counter() - t0) * 1e3)
    return out, best


def median_ms(fn: Callable[[], object], reps: int, warmup: int = 3) -> float:
    """Median wall time of ``fn`` in ms, synchronising around every call (warm-up calls first: autotuning).
    On CPU (small shapes) one warm-up and two timed calls: the figure proves the code path, not a speed."""
    if small():
        reps, warmup = 2, 1
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def varlen_seq_idx(Bsz: int, T: int, seed: int, device: str, max_seqs: int = 6) -> torch.Tensor:
    """Random packed layout: ``[B, T]`` int32 with 1..max_seqs sequences per row."""
    return random_seq_idx(Bsz, T, seed, device, max_seqs=max_seqs)


def ssd_inputs(Bsz: int, T: int, device: str, dtype: torch.dtype, H=16, P=64, G=2, N=64, seed=0) -> dict:
    if small():
        H, P, G, N = 2, 8, 1, 8
    return _ssd_inputs(Bsz, T, device, dtype, heads=H, head_dim=P, groups=G, state=N, seed=seed)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def print_table(rows: list[Row]) -> None:
    print(f"{'check':<48} {'dtype':<9} {'max rel err':>11} {'tol':>8} {'kernel ms':>10} {'torch ms':>10}  ok  route")
    for r in rows:
        print(
            f"{r.name:<48} {r.dtype:<9} {r.err:>11.2e} {r.tol:>8.0e} {r.t_kernel_ms:>10.2f} {r.t_torch_ms:>10.2f}  "
            f"{'PASS' if r.ok else 'FAIL'}  {r.route}",
            flush=True,
        )
