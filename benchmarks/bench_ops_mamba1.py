"""Mamba1 selective scan, forward + backward, side by side in one run.

Candidates (same inputs, same D / z / delta_bias / softplus, fp32, B=1, I=1024, N=16):

* ``hf-sequential``: transformers 5.23 ``modeling_mamba.mamba_selective_scan``, the torch loop that
  ``MambaMixer`` runs without mamba-ssm (``use_mambapy=False``).
* ``hf-mambapy``: the same function with ``use_mambapy=True``, i.e. mambapy's Blelloch ``pscan``.
* ``safepad``: :func:`safepad.ops.selective_scan.selective_scan` (torch core).

Usage: ``python benchmarks/bench_ops_mamba1.py [--quick]``. ``main()`` returns the summary lines;
the ratios are the last lines.
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

from safepad.ops.selective_scan import selective_scan

__all__ = ["main"]

I_DIM, N_STATE = 1024, 16


def _inputs(L: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = {
        "u": torch.randn(1, L, I_DIM, generator=g),
        "delta": torch.randn(1, L, I_DIM, generator=g) - 2.0,
        "A": -torch.exp(torch.randn(I_DIM, N_STATE, generator=g) * 0.5),
        "B": torch.randn(1, L, N_STATE, generator=g),
        "C": torch.randn(1, L, N_STATE, generator=g),
        "D": torch.randn(I_DIM, generator=g),
        "z": torch.randn(1, L, I_DIM, generator=g),
        "delta_bias": torch.randn(I_DIM, generator=g) * 0.1,
    }
    return {k: v.requires_grad_() for k, v in x.items()}


def _hf(x: dict[str, torch.Tensor], use_mambapy: bool) -> torch.Tensor:
    from transformers.models.mamba.modeling_mamba import mamba_selective_scan

    def t(v: torch.Tensor) -> torch.Tensor:
        return v.transpose(1, 2)  # [B, L, X] -> [B, X, L], the HF kernel layout

    y = mamba_selective_scan(
        t(x["u"]), t(x["delta"]), x["A"], t(x["B"]), t(x["C"]), D=x["D"], z=t(x["z"]),
        delta_bias=x["delta_bias"], delta_softplus=True, use_mambapy=use_mambapy,
    )
    return t(y)  # [B, L, I]


def _safepad(x: dict[str, torch.Tensor]) -> torch.Tensor:
    return selective_scan(
        x["u"], x["delta"], x["A"], x["B"], x["C"], D=x["D"], z=x["z"], delta_bias=x["delta_bias"],
        backend="torch",
    )


CANDIDATES = {
    "hf-sequential": lambda x: _hf(x, use_mambapy=False),
    "hf-mambapy": lambda x: _hf(x, use_mambapy=True),
    "safepad": _safepad,
}


def _time_fwd_bwd(fn, x: dict[str, torch.Tensor], gy: torch.Tensor, reps: int) -> tuple[float, torch.Tensor]:
    best, y = float("inf"), None
    for _ in range(reps):
        for v in x.values():
            v.grad = None
        t0 = time.perf_counter()
        y = fn(x)
        y.backward(gy)
        best = min(best, time.perf_counter() - t0)
    return best, y.detach()


def main(argv: list[str] | None = None) -> list[str]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="L=512 only, one repetition")
    ap.add_argument("--reps", type=int, default=3, help="repetitions (best of) for the parallel scans")
    args = ap.parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    lengths = (512,) if args.quick else (512, 2048)
    reps = 1 if args.quick else args.reps

    lines = [
        (
            f"Mamba1 selective scan fwd+bwd, fp32, B=1 I={I_DIM} N={N_STATE}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads"
        )
    ]
    ratios = []
    for L in lengths:
        x = _inputs(L)
        gy = torch.randn(1, L, I_DIM, generator=torch.Generator().manual_seed(1))
        times, outs = {}, {}
        for name, fn in CANDIDATES.items():
            if name == "hf-sequential":
                # its backward is quadratic in L (a full-size select_backward per token): a single timed run
                with torch.no_grad():
                    fn({k: v[:, :8] if v.dim() == 3 else v for k, v in x.items()})  # warm-up on 8 tokens
                times[name], outs[name] = _time_fwd_bwd(fn, x, gy, 1)
            else:
                fn(x)  # warm-up (allocator)
                times[name], outs[name] = _time_fwd_bwd(fn, x, gy, reps)
        diff = max(float((outs["safepad"] - outs[n]).abs().max()) for n in ("hf-sequential", "hf-mambapy"))
        lines.append(
            f"L={L:5d}  " + "  ".join(f"{n} {t:8.3f}s" for n, t in times.items()) + f"  (max |dy| {diff:.1e})"
        )
        ratios.append(
            f"L={L:5d}  safepad vs hf-sequential: {times['hf-sequential'] / times['safepad']:6.2f}x faster   "
            f"safepad vs mambapy pscan: {times['hf-mambapy'] / times['safepad']:5.2f}x faster"
        )
    lines.extend(ratios)
    return lines


if __name__ == "__main__":
    for line in main():
        print(line)
