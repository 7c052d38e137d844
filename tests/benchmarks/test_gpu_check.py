"""benchmarks/gpu_check (a package of parts) on CPU: the plan and its budgets, the per-part time budget (in this
process and in a part's own process, killed past its budget), the JSON report rewritten after every part, and the
CPU smoke run (``--device cpu``: every part's code path at small shapes through the torch core, end to end).

The kernel routes themselves run on CPU in the kernel tier (``--emulate``, tests/kernels/test_gpu_check_emulate.py)
and on a GPU (``make test-cuda``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import gpu_check  # noqa: E402
from benchmarks.gpu_check import common, parts, runner  # noqa: E402


def _report(out: str) -> dict:
    lines = [line for line in out.splitlines() if line.startswith("GPU_CHECK_JSON ")]
    assert len(lines) == 1, out
    return json.loads(lines[0].removeprefix("GPU_CHECK_JSON "))


def test_dry_run_prints_the_gpu_plan_budgets_and_schema(capsys, monkeypatch):
    monkeypatch.setattr(runner.torch.cuda, "is_available", lambda: False)
    assert runner.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "gpu_check plan (gpu)" in out  # without CUDA a dry run shows what a GPU would run
    for part in parts.PARTS:
        assert part.name in out
        assert f"budget {part.budget_s:5.0f} s" in out
    schema = json.loads(out[out.index("JSON report schema:") + len("JSON report schema:") :])
    assert schema == runner.REPORT_SCHEMA
    assert "GPU_CHECK_JSON" not in out  # a dry run runs nothing


def test_the_gpu_plan_fits_8_minutes_in_priority_order():
    names = [p.name for p in parts.PARTS]
    assert names[:3] == ["audit", "routes", "generate"]  # the most valuable parts first
    steps = runner.plan("gpu")
    planned = [(p, b) for p, skip, b in steps if skip is None]
    assert sum(b for _, b in planned) <= runner.MAX_TOTAL_S <= 480
    assert [p.name for p, _ in planned][:3] == ["audit", "routes", "generate"]
    capped = [p.name for p, skip, _ in steps if skip and "--max-total" in skip]
    assert capped, "with every package present, some speed parts fall outside the 8-minute plan"
    for name in capped:  # a capped part is planned when named
        assert runner.plan("gpu", names=[name], max_total=runner.MAX_TOTAL_S)[0][1] is None


def test_the_plan_skips_parts_whose_packages_are_missing_with_the_reason(monkeypatch):
    from safepad.ops import kernels

    monkeypatch.setattr(kernels, "_KERNELS", {**kernels._KERNELS, "causal_conv1d_fn": None, "selective_scan_fn": None})
    steps = {p.name: skip for p, skip, _ in runner.plan("gpu", max_total=None)}
    assert "causal_conv1d_fn" in steps["mixer_vs_mamba_ssm"] and "selective_scan_fn" in steps["mamba1_time_per_token"]
    assert steps["audit"] is None and steps["routes"] is None  # the correctness parts never need a package


def test_every_issue_figure_has_a_part():
    figures = {f for p in parts.PARTS for f in p.figures}
    for f in ("ratio", "packed_wrapped_tokens_per_s", "padded_stock_tokens_per_s", "syncs_per_step",
              "graph_tokens_per_s", "eager_tokens_per_s", "packed_wrapped_peak_mem_gib", "packed_us_per_token",
              "kernels_us_per_token", "models", "routes", "scenarios", "wrapped_right_graph_tokens_per_s",
              "stock_left_graph_tokens_per_s", "continuous_tokens_per_s", "padded_tokens_per_s",
              "continuous_vs_padded"):  # fmt: skip
        assert f in figures, f


def test_a_part_past_its_budget_is_stopped_keeping_what_it_measured():
    def slow(device):
        common.emit(common.Row("first", "float32", 0.0, 1.0), seen=1)
        time.sleep(30)
        return [], {}

    t0 = time.perf_counter()
    res = runner.run_part(parts.Part("slow", 0.5, "any", "sleeps", slow), "cpu", 0.5)
    assert time.perf_counter() - t0 < 5
    assert res["status"] == "timeout" and "budget" in res["message"]
    assert [r["name"] for r in res["rows"]] == ["first"] and res["figures"] == {"seen": 1}
    fast = runner.run_part(parts.Part("fast", 5, "any", "x", lambda d: ([], {"v": 1.0})), "cpu", 5)
    assert fast["status"] == "ok" and fast["figures"] == {"v": 1.0}


def test_errors_skips_and_failed_rows_are_reported_not_raised():
    def boom(device):
        raise RuntimeError("no kernel")

    def skip(device):
        raise common.PartSkipped("needs CUDA graphs")

    res = runner.run_part(parts.Part("boom", 5, "any", "x", boom), "cpu", 5)
    assert res["status"] == "error" and "RuntimeError: no kernel" in res["message"]
    res = runner.run_part(parts.Part("skip", 5, "any", "x", skip), "cpu", 5)
    assert res["status"] == "skipped" and res["message"] == "needs CUDA graphs"
    bad = common.Row("route", "float32", float("inf"), 1e-3)
    res = runner.run_part(parts.Part("bad", 5, "any", "x", lambda d: ([bad], {})), "cpu", 5)
    assert res["status"] == "fail"
    assert res["rows"][0]["err"] == "inf" and res["rows"][0]["ok"] is False  # valid JSON (no bare inf)
    json.dumps(res, allow_nan=False)


@pytest.mark.parametrize("how", ["alarm", "hang"])
def test_a_part_in_its_own_process_is_killed_past_its_budget_keeping_its_rows(how, monkeypatch):
    """``hang`` ignores SIGALRM, as a Triton compile in C++ does: the parent kills the part's process."""
    monkeypatch.setenv("SAFEPAD_GPU_CHECK_TEST_PART", how)
    monkeypatch.setattr(runner, "GRACE_S", 3)
    part = parts.Part("test_hang", 5, "any", "hangs", parts._test_part)
    budget = 15.0  # the child's interpreter start-up (torch, transformers) counts against it
    t0 = time.perf_counter()
    res = runner.run_part_isolated(part, budget, ["--device", "cpu"], "pin")
    assert time.perf_counter() - t0 < budget + 3 + 10
    assert res["status"] == "timeout", res
    assert ("killed" in res["message"]) == (how == "hang")
    assert [r["name"] for r in res["rows"]] == ["measured before the hang"] and res["figures"] == {"before": 1}


def test_no_cuda_skips_every_part_and_writes_the_json_report(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(runner.torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("SAFEPAD_GPU_CHECK_DEVICE", raising=False)
    path = tmp_path / "report.json"
    assert runner.main(["--json", str(path)]) == 0
    out = capsys.readouterr().out
    report = _report(out)
    assert json.loads(path.read_text()) == report
    assert set(report) == set(runner.REPORT_SCHEMA)
    assert report["mode"] == "none" and report["ok"] is True and report["complete"] is True
    assert [p["name"] for p in report["parts"]] == [p.name for p in parts.PARTS]
    for i, part in enumerate(report["parts"], 1):
        assert set(part) == set(runner.REPORT_SCHEMA["parts"][0])
        assert part["status"] == "skipped" and part["message"]
        assert f"[{i}/{len(parts.PARTS)}] {part['name']}: skipped" in out  # a progress line per part
    assert out.count("GPU_CHECK_PART ") == len(parts.PARTS)  # one line per part, as it ends


def test_cpu_smoke_run_end_to_end(tmp_path):
    """``python -m benchmarks.gpu_check --device cpu``: every part that can run on CPU runs its code path."""
    path = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "SAFEPAD_GPU_CHECK_TEST_PART": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--device", "cpu", "--json", str(path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(path.read_text())
    assert report == _report(proc.stdout)
    assert report["mode"] == "cpu" and report["ok"] is True and report["complete"] is True
    status = {p["name"]: p["status"] for p in report["parts"]}
    for name in ("audit", "routes", "generate", "decode_cuda_graph", "gdn_time_per_token", "train_tokens_per_s",
                 "generate_cuda_graph", "serving"):
        assert status[name] == "ok", (name, report)
    for name in ("syncs_per_step", "mixer_vs_mamba_ssm", "mamba1_time_per_token", "fsdp2_accelerate"):
        assert status[name] == "skipped"
    by = {p["name"]: p for p in report["parts"]}
    assert by["audit"]["figures"]["models"] == 2 * len(by["audit"]["figures"]["families"])
    assert by["routes"]["figures"]["routes"] > 10 and all(r["ok"] for r in by["routes"]["rows"])
    graphs = by["generate_cuda_graph"]
    assert len(graphs["rows"]) == 4 and all(r["ok"] for r in graphs["rows"])
    assert graphs["figures"]["wrapped_right_vs_left_token_agreement"] == 1.0
    serving = by["serving"]["figures"]
    assert serving["requests"] == 8 and serving["continuous_tokens_per_s"] > 0 and serving["padded_tokens_per_s"] > 0
    assert serving["same_tokens_fraction"] == 1.0  # float32 on the CPU: each request's greedy tokens on both sides


def test_unknown_part_is_an_error_naming_the_known_ones(capsys):
    with pytest.raises(SystemExit):
        runner.main(["--parts", "nope"])
    assert "routes" in capsys.readouterr().err


def test_importing_the_package_sets_nothing_up():
    """Only ``python -m benchmarks.gpu_check`` sets Triton's caches / the emulation up (before triton imports)."""
    assert gpu_check.__doc__ and "python -m benchmarks.gpu_check" in gpu_check.__doc__
    assert os.environ.get("TRITON_INTERPRET") != "1" or "triton" not in sys.modules
