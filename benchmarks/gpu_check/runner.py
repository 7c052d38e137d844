"""The runner: the plan, one part at a time under a hard budget, the JSON report rewritten after every part."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import torch

from . import audit, env
from .common import RUN, PartSkipped, PartTimeout, Row, emitted, print_table, reset_sink
from .parts import PARTS, Part

#: JSON report version (bump when a field changes meaning)
SCHEMA_VERSION = 2
#: the default cap on the planned parts' budgets: 8 minutes, which leaves a 10-minute command time to start,
#: transfer and report, and a 15-minute lease time to rerun
MAX_TOTAL_S = 480
#: seconds a part run in its own process gets past its budget before it is killed (interpreter start-up, report)
GRACE_S = 10

#: the JSON report's shape (printed by --dry-run)
REPORT_SCHEMA = {
    "schema_version": "int",
    "mode": "'gpu' | 'cpu' | 'emulate' | 'none' (no CUDA and no --device cpu: every part skipped)",
    "device": "str",
    "torch": "str",
    "versions": "{distribution: version | null}",
    "kernels": "{kernel marker: importable}",
    "triton_cache_dir": "str | null",
    "isolated": "bool: each part ran in its own process",
    "total_budget_s": "float",
    "total_s": "float",
    "complete": "bool: every planned part has run (false in the reports written after each part)",
    "ok": "bool: no part failed, errored or timed out",
    "parts": [
        {
            "name": "str",
            "status": "'ok' | 'fail' | 'error' | 'timeout' | 'skipped'",
            "budget_s": "float",
            "seconds": "float",
            "autotune": "'pin' | 'full'",
            "peak_mem_gib": "float | null (CUDA only)",
            "figures": "{name: number | str | bool | list | dict} (the part's figures)",
            "rows": [
                {
                    "name": "str",
                    "dtype": "str",
                    "err": "float",
                    "tol": "float",
                    "t_kernel_ms": "float",
                    "t_torch_ms": "float",
                    "route": "str",
                    "ok": "bool",
                }
            ],  # fmt: skip
            "message": "str | null (skip reason, exception, timeout)",
        }
    ],
}


def _json_float(x: object) -> object:
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return str(x)  # JSON has no nan / inf
    if isinstance(x, dict):
        return {k: _json_float(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_float(v) for v in x]
    return x


def _row_dicts(rows: list[Row]) -> list[dict]:
    return [{**r.__dict__, "ok": r.ok} for r in rows]


def _result(part: Part, budget_s: float, status: str = "ok", message: str | None = None) -> dict:
    return {"name": part.name, "status": status, "budget_s": budget_s, "seconds": 0.0, "autotune": part.autotune,
            "peak_mem_gib": None, "figures": {}, "rows": [], "message": message}  # fmt: skip


def run_part(part: Part, device: str, budget_s: float, autotune: str | None = None, partial_path: str | None = None) -> dict:
    """Run one part in this process under a wall-clock budget (SIGALRM); never raises.

    What the part emitted before a timeout or an error is kept. ``partial_path``: rewrite the part's partial
    result there after every emit (the parent of a part run in its own process reads it when it had to kill it).
    """

    def on_alarm(signum, frame):
        raise PartTimeout(f"{part.name} ran past its budget of {budget_s:.0f} s")

    res = _result(part, budget_s)
    res["autotune"] = autotune or part.autotune

    def write_partial(rows, figures):
        if partial_path:
            with open(partial_path + ".tmp", "w") as f:
                json.dump(_json_float({**res, "rows": _row_dicts(rows), "figures": figures}), f, default=str)
            os.replace(partial_path + ".tmp", partial_path)

    reset_sink(write_partial if partial_path else None)
    cuda = device == "cuda" and torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, budget_s)
    t0 = time.perf_counter()
    try:
        with env.pinned_autotune(res["autotune"] == "pin"):
            rows, figures = part.run(device)
        if rows:
            print_table(rows)
        res["rows"], res["figures"] = _row_dicts(rows), figures
        if not all(r.ok for r in rows):
            res["status"] = "fail"
    except PartTimeout as e:
        rows, figures = emitted()
        res["status"], res["message"] = "timeout", f"{e}; {len(rows)} row(s) measured before it"
        res["rows"], res["figures"] = _row_dicts(rows), figures
    except PartSkipped as e:
        res["status"], res["message"] = "skipped", str(e)
    except Exception as e:  # noqa: BLE001
        rows, figures = emitted()
        res["status"], res["message"] = "error", f"{type(e).__name__}: {str(e)[:300]}"
        res["rows"], res["figures"] = _row_dicts(rows), figures
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        reset_sink()
        res["seconds"] = time.perf_counter() - t0
        if cuda:
            try:
                res["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
                torch.cuda.empty_cache()
            except Exception:  # noqa: BLE001 - a lost CUDA context (device-side assert) must not end the report
                pass
    return _json_float(res)


def run_part_isolated(part: Part, budget_s: float, child_args: list[str], autotune: str) -> dict:
    """Run one part in its own process (``--child-part``), killed ``GRACE_S`` after its budget.

    A compile that SIGALRM cannot interrupt, a hung kernel or a device-side assert (which poisons the CUDA
    context for the rest of a process) ends that part alone; what it emitted before is read back.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out, partial = os.path.join(tmp, "result.json"), os.path.join(tmp, "partial.json")
        cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--child-part", part.name, "--child-out", out,
               "--child-budget", str(budget_s), "--child-t0", repr(time.time()), "--autotune", autotune,
               *child_args]  # fmt: skip
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=env.ROOT, start_new_session=True)
        killed = False
        try:
            rc = proc.wait(timeout=budget_s + GRACE_S)
        except subprocess.TimeoutExpired:
            killed = True
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
        seconds = time.perf_counter() - t0
        for path in (out, partial):
            if os.path.exists(path):
                with open(path) as f:
                    res = json.load(f)
                break
        else:
            res = _result(part, budget_s)
            res["autotune"] = autotune
        if path == partial or not os.path.exists(out):
            res["status"] = "timeout" if killed else "error"
            n = len(res["rows"])
            res["message"] = (f"killed {GRACE_S} s past its budget of {budget_s:.0f} s" if killed
                              else f"the part's process exited {rc} without a report") + f"; {n} row(s) measured"
        res["seconds"] = seconds
        res["budget_s"] = budget_s
        return res


def detect_mode(args: argparse.Namespace) -> str:
    if args.emulate:
        return "emulate"
    if (args.device or os.environ.get("SAFEPAD_GPU_CHECK_DEVICE", "")).lower() == "cpu":
        return "cpu"
    return "gpu" if torch.cuda.is_available() else "none"


def plan(mode: str, scale: float = 1.0, max_total: float | None = MAX_TOTAL_S,
         names: list[str] | None = None) -> list[tuple[Part, str | None, float]]:
    """``(part, skip reason or None, budget_s)`` for every part, in order, in ``mode``.

    A part is skipped when it needs CUDA and the mode has none, when a package it requires is missing (on a GPU or
    under --emulate; the CPU smoke run takes the torch paths instead), or when its budget no longer fits
    ``max_total`` on a GPU (``None`` / 0: no cap; parts named in ``names`` are always planned).
    """
    out = []
    total = 0.0
    for p in PARTS:
        budget = p.budget(mode) * scale
        skip = None
        if names is not None and p.name not in names:
            continue
        if mode == "none":
            skip = "no CUDA device (--device cpu runs the CPU smoke run, --emulate the emulated kernels)"
        elif p.needs == "cuda" and mode != "gpu":
            skip = "needs CUDA"
        elif mode == "emulate" and p.name not in EMULATED_PARTS:
            skip = "not under --emulate (the Triton interpreter runs the correctness parts only)"
        elif p.requires is not None and mode != "cpu" and (why := p.requires()) is not None:
            skip = why
        elif max_total and mode == "gpu" and names is None and total + budget > max_total:
            skip = f"outside the {max_total:.0f} s plan (--max-total); run it with --parts {p.name}"
        if skip is None:
            total += budget
        out.append((p, skip, budget))
    return out


#: the parts --emulate runs (the speed parts time nothing on the interpreter)
EMULATED_PARTS = ("routes", "generate")


def print_plan(mode: str, steps: list[tuple[Part, str | None, float]], isolate: bool) -> None:
    total = sum(b for _, skip, b in steps if skip is None)
    print(f"gpu_check plan ({mode}): {len(steps)} parts, {total:.0f} s planned"
          f"{', each part in its own process' if isolate else ''}")  # fmt: skip
    for i, (p, skip, b) in enumerate(steps, 1):
        print(f"  {i}. {p.name:<22} budget {b:5.0f} s  autotune {p.autotune:<4}  {'SKIP: ' + skip if skip else 'run'}")
        print(f"     {p.what}; figures: {', '.join(p.figures)}")


def _write(report: dict, path: str | None) -> None:
    if path:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(json.dumps(report, indent=2, default=str))
        os.replace(tmp, path)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check",
                                 description="safepad's GPU check: audit, kernel routes, generate, speed")  # fmt: skip
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None,
                    help="cpu: the CPU smoke run (small shapes, torch core; env SAFEPAD_GPU_CHECK_DEVICE=cpu)")
    ap.add_argument("--emulate", action="store_true",
                    help="CPU, kernels emulated (Triton interpreter, C++ stand-ins): the correctness parts")
    ap.add_argument("--dry-run", action="store_true", help="print the plan, each part's budget and the JSON schema")
    ap.add_argument("--json", metavar="PATH", default=None,
                    help="write the JSON report there after every part (default $OUT/gpu_check.json when OUT is set)")
    ap.add_argument("--parts", help="comma-separated part names to run (default: the plan)")
    ap.add_argument("--max-total", type=float, default=MAX_TOTAL_S,
                    help=f"cap on the planned budgets in seconds (default {MAX_TOTAL_S}; 0: no cap)")
    ap.add_argument("--budget-scale", type=float, default=1.0, help="multiply every part's budget (default 1)")
    ap.add_argument("--isolate", choices=("auto", "yes", "no"), default="auto",
                    help="each part in its own process (auto: on a GPU)")
    ap.add_argument("--autotune", choices=("part", "pin", "full"), default="part",
                    help="Triton autotuning: each part's own setting (default), pinned to the first config, or full")
    ap.add_argument("--audit-backend", choices=("torch", "auto"), default="torch",
                    help="safepad.wrap backend of the audit part (default torch: no Triton compile)")
    ap.add_argument("--families", default=None, help="comma-separated families of the audit part (default: all)")
    ap.add_argument("--cache-from", metavar="TGZ", default=None, help="unpack a Triton cache archive first")
    ap.add_argument("--cache-archive", metavar="TGZ", default=None,
                    help="pack the Triton cache into this file at the end (e.g. $OUT/triton-cache.tgz)")
    ap.add_argument("--child-part", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    ap.add_argument("--child-budget", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--child-t0", type=float, help=argparse.SUPPRESS)
    return ap


def _child_args(args: argparse.Namespace) -> list[str]:
    out = ["--audit-backend", args.audit_backend]
    if args.emulate:
        out.append("--emulate")
    if args.device:
        out += ["--device", args.device]
    if args.families:
        out += ["--families", args.families]
    return out


def _configure(args: argparse.Namespace, mode: str) -> None:
    RUN["mode"] = mode
    RUN["small"] = mode in ("cpu", "emulate")
    RUN["device"] = "cuda" if mode == "gpu" else "cpu"
    audit.OPTIONS["backend"] = args.audit_backend
    audit.OPTIONS["families"] = args.families.split(",") if args.families else None
    if mode == "emulate":
        from safepad.testing import kernel_emulation

        if not kernel_emulation.installed():
            raise SystemExit("--emulate: the kernel emulation is not installed (run python -m benchmarks.gpu_check)")


def main(argv: list[str] | None = None) -> int:
    from safepad.ops import kernels

    ap = _parser()
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    mode = detect_mode(args)
    known = [p.name for p in PARTS]
    names = [n for n in args.parts.split(",") if n] if args.parts else None
    if names:
        unknown = sorted(set(names) - set(known))
        if unknown:
            ap.error(f"unknown parts {unknown}; known: {', '.join(known)}")
    _configure(args, mode)

    if args.child_part:  # one part, in this process, for a parent that runs each part in its own process
        part = next(p for p in PARTS if p.name == args.child_part)
        autotune = part.autotune if args.autotune == "part" else args.autotune
        budget = args.child_budget or part.budget(mode)
        if args.child_t0:  # the budget counts from the parent's start of this process (imports included)
            budget = max(1.0, budget - (time.time() - args.child_t0))
        res = run_part(part, RUN["device"], budget, autotune,
                       partial_path=os.path.join(os.path.dirname(args.child_out), "partial.json"))
        with open(args.child_out, "w") as f:
            json.dump(res, f, default=str)
        return 0

    # without CUDA a dry run shows the plan of a GPU with this machine's packages
    steps = plan("gpu" if (args.dry_run and mode == "none") else mode, args.budget_scale, args.max_total or None, names)
    isolate = args.isolate == "yes" or (args.isolate == "auto" and mode == "gpu")
    if args.dry_run:
        print_plan("gpu" if mode == "none" else mode, steps, isolate or mode == "none")
        print("JSON report schema:")
        print(json.dumps(REPORT_SCHEMA, indent=2))
        return 0
    path = args.json or (os.path.join(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") else None)
    cache_dir = os.environ.get("TRITON_CACHE_DIR") if mode == "gpu" else None
    if args.cache_from and cache_dir:
        print(f"triton cache: {env.unpack_cache(args.cache_from, cache_dir)} files from {args.cache_from}")
    device = RUN["device"]
    if mode == "gpu":
        print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}", flush=True)
    elif mode in ("cpu", "emulate"):
        print(f"device: CPU ({mode}): small shapes, timings prove the code path only", flush=True)
    report: dict = {"schema_version": SCHEMA_VERSION, "mode": mode,
                    "device": torch.cuda.get_device_name(0) if mode == "gpu" else "cpu", "torch": torch.__version__,
                    "versions": env.versions(), "kernels": kernels.kernels_available(),
                    "triton_cache_dir": cache_dir, "isolated": isolate,
                    "total_budget_s": sum(b for _, skip, b in steps if skip is None), "total_s": 0.0,
                    "complete": False, "ok": False, "parts": []}  # fmt: skip
    print_plan(mode, steps, isolate)
    from .selfcheck import cpu_self_check

    self_rows = cpu_self_check()
    print_table(self_rows)
    t_all = time.perf_counter()
    for i, (p, skip, budget) in enumerate(steps, 1):
        autotune = p.autotune if args.autotune == "part" else args.autotune
        if skip is not None:
            print(f"[{i}/{len(steps)}] {p.name}: skipped ({skip})", flush=True)
            res = _json_float({**_result(p, budget, "skipped", skip), "autotune": autotune})
        else:
            print(f"[{i}/{len(steps)}] {p.name}: running (budget {budget:.0f} s, autotune {autotune}) - {p.what}",
                  flush=True)  # fmt: skip
            if isolate:
                res = run_part_isolated(p, budget, _child_args(args), autotune)
            else:
                res = run_part(p, device, budget, autotune)
            figs = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                             for k, v in res["figures"].items() if k in p.figures)  # fmt: skip
            print(f"[{i}/{len(steps)}] {p.name}: {res['status']} in {res['seconds']:.1f} s"
                  + (f"; {figs}" if figs else "") + (f"; {res['message']}" if res["message"] else ""), flush=True)
        report["parts"].append(res)
        report["total_s"] = time.perf_counter() - t_all
        bad = [r for r in report["parts"] if r["status"] in ("fail", "error", "timeout")]
        report["ok"] = not bad and all(r.ok for r in self_rows)
        _write(report, path)  # after every part: a run cut short still leaves its results
        print("GPU_CHECK_PART " + json.dumps(res, default=str), flush=True)
    report["complete"] = True
    _write(report, path)
    if args.cache_archive and cache_dir:
        print(f"triton cache: {env.pack_cache(cache_dir, args.cache_archive)} files into {args.cache_archive}")
    print("GPU_CHECK_JSON " + json.dumps(report, default=str))
    return 0 if report["ok"] else 1
