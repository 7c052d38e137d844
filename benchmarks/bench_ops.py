"""Benchmark: safepad's varlen Mamba2 core (conv + SSD scan) vs the transformers 5.23 torch path.

Both sides run the same unpacked inputs of one Mamba2 layer's core — depthwise causal conv1d (K=4,
silu) over ``xBC``, then the chunked scan (dt bias + softplus, D skip) — B=1, H=16, P=64, N=64, G=2,
chunk 128. Each (implementation, L) runs in its own subprocess, so peak memory is that process's max
RSS above its RSS just before the first call. Ratios are measured side by side in this one run.

    python benchmarks/bench_ops.py            # L in {512, 2048, 8192}
    python benchmarks/bench_ops.py --quick    # small L, seconds

The last line is ``ops: fwd+bwd speedup vs transformers torch path at L=<L>: X.XXx, peak-mem ratio Y.YY``.
Before it, the Mamba1 and Gated-DeltaNet op benchmarks (``bench_ops_mamba1.py``, ``bench_ops_gdn.py``)
run when present; each exposes ``main() -> list[str]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

H, P, N, G, K, CHUNK = 16, 64, 64, 2, 4, 128
HERE = Path(__file__).resolve().parent


def _inputs(L: int, seed: int = 0):
    """Mamba2-like inputs: A = -exp(U[log 1, log 16]), dt = softplus(raw + dt_bias) in ~[1e-3, 1e-1]."""
    import torch

    g = torch.Generator().manual_seed(seed)
    conv_dim = H * P + 2 * G * N
    dt_init = torch.exp(torch.rand(H, generator=g) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))  # [H]
    t = {
        "xBC": torch.randn(1, L, conv_dim, generator=g),  # [1, L, conv_dim]
        "conv_w": torch.randn(conv_dim, K, generator=g) * 0.5,  # [conv_dim, K]
        "conv_b": torch.randn(conv_dim, generator=g) * 0.1,  # [conv_dim]
        "dt": torch.randn(1, L, H, generator=g) * 0.5,  # [1, L, H] raw
        "dt_bias": dt_init + torch.log(-torch.expm1(-dt_init)),  # [H] inverse softplus of dt_init
        "A": -torch.exp(torch.rand(H, generator=g) * math.log(16.0)),  # [H]
        "D": torch.randn(H, generator=g),  # [H]
        "gy": torch.randn(1, L, H, P, generator=g),  # [1, L, H, P] upstream gradient
    }
    for k in ("xBC", "conv_w", "conv_b", "dt", "dt_bias", "A", "D"):
        t[k].requires_grad_(True)
    return t


def _run_stock(t, L: int):
    from transformers.models.nemotron_h import modeling_nemotron_h as nh

    xbc = nh.causal_conv1d_fn(t["xBC"].transpose(1, 2), t["conv_w"], t["conv_b"], activation="silu")  # [1, D, L]
    xbc = xbc.transpose(1, 2)  # [1, L, D]
    x, B, C = xbc.split([H * P, G * N, G * N], dim=-1)
    return nh.mamba2_chunk_scan(
        x.reshape(1, L, H, P),
        t["dt"],
        t["A"],
        B.reshape(1, L, G, N),
        C.reshape(1, L, G, N),
        CHUNK,
        D=t["D"],
        dt_bias=t["dt_bias"],
        dt_softplus=True,
    )


def _run_safepad(t, L: int, seq_idx=None):
    from safepad.ops import causal_conv1d, ssd_scan

    xbc = causal_conv1d(t["xBC"], t["conv_w"], t["conv_b"], activation="silu", seq_idx=seq_idx)  # [1, L, D]
    x, B, C = xbc.split([H * P, G * N, G * N], dim=-1)
    return ssd_scan(
        x.reshape(1, L, H, P),
        t["dt"],
        t["A"],
        B.reshape(1, L, G, N),
        C.reshape(1, L, G, N),
        chunk_size=CHUNK,
        D=t["D"],
        dt_bias=t["dt_bias"],
        seq_idx=seq_idx,
        backend="torch",
    )


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def _peak_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


IMPLS = ("stock", "safepad", "safepad-packed")


def _runner(impl: str, L: int):
    import torch

    if impl == "stock":
        return _run_stock
    seq_idx = None
    if impl == "safepad-packed":  # same tokens as 4 packed sequences (information only)
        seq_idx = (torch.arange(L) * 4 // L).to(torch.int32).unsqueeze(0)  # [1, L]
    return lambda tt, LL: _run_safepad(tt, LL, seq_idx)


def _once(t: dict, L: int, run, backward: bool) -> float:
    import torch

    for v in ("xBC", "conv_w", "conv_b", "dt", "dt_bias", "A", "D"):
        t[v].grad = None
    t0 = time.perf_counter()
    if backward:
        y = run(t, L)
        (y * t["gy"]).sum().backward()
    else:
        with torch.no_grad():
            y = run(t, L)
    del y
    return time.perf_counter() - t0


def time_worker(L: int, reps: int) -> dict:
    """All implementations in ONE process, interleaved round by round, so load drifts hit them alike."""
    import logging

    import torch

    logging.disable(logging.WARNING)  # the stock path warns about missing kernels on every call
    torch.manual_seed(0)
    t = _inputs(L)
    runs = {impl: _runner(impl, L) for impl in IMPLS}
    res = {impl: {"fwd": [], "fwdbwd": []} for impl in IMPLS}
    for rnd in range(reps + 1):  # round 0 is warm-up
        for impl, run in runs.items():
            f, fb = _once(t, L, run, False), _once(t, L, run, True)
            if rnd:
                res[impl]["fwd"].append(f)
                res[impl]["fwdbwd"].append(fb)
    return {impl: {k: min(v) for k, v in r.items()} for impl, r in res.items()}


def mem_worker(impl: str, L: int) -> dict:
    """Peak RSS of one fwd+bwd above the RSS just before it (one implementation per process)."""
    import logging

    logging.disable(logging.WARNING)
    t = _inputs(L)
    run = _runner(impl, L)
    base = _rss_mib()
    _once(t, L, run, True)
    return {"peak_mib": _peak_mib() - base}


def _spawn(*args: str) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", *args]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def _other_benchmarks(quick: bool) -> list[str]:
    """Run the sibling op benchmarks; ``--quick`` reaches them as ``SAFEPAD_BENCH_QUICK=1``."""
    if quick:
        os.environ["SAFEPAD_BENCH_QUICK"] = "1"
    lines: list[str] = []
    for name in ("bench_ops_mamba1", "bench_ops_gdn"):
        path = HERE / f"{name}.py"
        if not path.exists():
            continue
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(mod)
            lines.extend(mod.main())
        except Exception as e:  # noqa: BLE001 - report another benchmark's failure, do not hide it
            lines.append(f"{name}: failed: {type(e).__name__}: {e}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small L, for a smoke test")
    ap.add_argument("--skip-others", action="store_true", help="skip the Mamba1 / Gated-DeltaNet op benchmarks")
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        w = args.worker
        out = time_worker(int(w[1]), int(w[2])) if w[0] == "time" else mem_worker(w[1], int(w[2]))
        print(json.dumps(out))
        return
    lengths = [256, 512] if args.quick else [512, 2048, 8192]
    print(
        f"Mamba2 core (conv K={K} + SSD scan), B=1 H={H} P={P} N={N} G={G} chunk={CHUNK}, fp32; times: best of "
        "interleaved rounds in one process; memory: one fwd+bwd per process"
    )
    print(f"{'L':>6} {'impl':>15} {'fwd s':>8} {'fwd+bwd s':>10} {'peak MiB':>9} {'fwd x':>7} {'f+b x':>7} {'mem ratio':>9}")
    summary = None
    for L in lengths:
        times = _spawn("time", str(L), str(3 if L <= 2048 else 2))
        mems = {impl: _spawn("mem", impl, str(L)) for impl in IMPLS}
        s = times["stock"]
        for impl in IMPLS:
            r, m = times[impl], mems[impl]["peak_mib"]
            print(
                f"{L:>6} {impl:>15} {r['fwd']:>8.3f} {r['fwdbwd']:>10.3f} {m:>9.0f} "
                f"{s['fwd'] / r['fwd']:>6.2f}x {s['fwdbwd'] / r['fwdbwd']:>6.2f}x {m / mems['stock']['peak_mib']:>9.2f}"
            )
        summary = (L, s["fwdbwd"] / times["safepad"]["fwdbwd"], mems["safepad"]["peak_mib"] / mems["stock"]["peak_mib"])
        sys.stdout.flush()
    for line in [] if args.skip_others else _other_benchmarks(args.quick):
        print(line)
    L, speed, mem = summary
    print(f"ops: fwd+bwd speedup vs transformers torch path at L={L}: {speed:.2f}x, peak-mem ratio {mem:.2f}")


if __name__ == "__main__":
    main()
