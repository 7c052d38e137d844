"""benchmarks/gpu_check.py's machinery on CPU: the plan and dry run, the per-part time budget, the JSON report.

The CUDA parts themselves run only on a GPU; ``--emulate`` (the agreement part through the emulated kernels) is
run by the kernel tier (tests/kernels/test_gpu_check_emulate.py).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # dataclasses look their module up while the file executes
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop("gpu_check", None)


def _report(out: str) -> dict:
    lines = [line for line in out.splitlines() if line.startswith("GPU_CHECK_JSON ")]
    assert len(lines) == 1, out
    return json.loads(lines[0].removeprefix("GPU_CHECK_JSON "))


def test_dry_run_prints_plan_budgets_and_schema(gpu_check, capsys):
    assert gpu_check.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    for part in gpu_check.PARTS:
        assert part.name in out
        assert f"budget {part.budget_s:5.0f} s" in out
    assert sum(p.budget_s for p in gpu_check.PARTS) <= 600  # the one 10-minute script
    schema = json.loads(out[out.index("JSON report schema:") + len("JSON report schema:") :])
    assert schema == gpu_check.REPORT_SCHEMA
    assert "GPU_CHECK_JSON" not in out  # a dry run runs nothing


def test_every_issue_figure_has_a_part(gpu_check):
    figures = {f for p in gpu_check.PARTS for f in p.figures}
    for f in ("ratio", "packed_wrapped_tokens_per_s", "padded_stock_tokens_per_s", "syncs_per_step",
              "graph_tokens_per_s", "eager_tokens_per_s", "packed_wrapped_peak_mem_gib", "packed_us_per_token",
              "kernels_us_per_token"):  # fmt: skip
        assert f in figures, f


def test_a_part_past_its_budget_is_stopped_and_the_next_part_runs(gpu_check):
    def slow(device):
        time.sleep(30)
        return [], {}

    t0 = time.perf_counter()
    res = gpu_check.run_part(gpu_check.Part("slow", 0.5, "any", "sleeps", slow), "cpu", 0.5)
    assert time.perf_counter() - t0 < 5
    assert res["status"] == "timeout" and "budget" in res["message"]
    fast = gpu_check.run_part(gpu_check.Part("fast", 5, "any", "x", lambda d: ([], {"v": 1.0})), "cpu", 5)
    assert fast["status"] == "ok" and fast["figures"] == {"v": 1.0}


def test_errors_and_failed_rows_are_reported_not_raised(gpu_check):
    def boom(device):
        raise RuntimeError("no kernel")

    res = gpu_check.run_part(gpu_check.Part("boom", 5, "any", "x", boom), "cpu", 5)
    assert res["status"] == "error" and "RuntimeError: no kernel" in res["message"]
    bad = gpu_check.Row("route", "float32", float("inf"), 1e-3)
    res = gpu_check.run_part(gpu_check.Part("bad", 5, "any", "x", lambda d: ([bad], {})), "cpu", 5)
    assert res["status"] == "fail"
    assert res["rows"][0]["err"] == "inf" and res["rows"][0]["ok"] is False  # valid JSON (no bare inf)
    json.dumps(res, allow_nan=False)


def test_cpu_run_skips_every_part_and_writes_the_json_report(gpu_check, capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    path = tmp_path / "report.json"
    assert gpu_check.main(["--json", str(path)]) == 0
    out = capsys.readouterr().out
    report = _report(out)
    assert json.loads(path.read_text()) == report
    assert set(report) == set(gpu_check.REPORT_SCHEMA)
    assert report["mode"] == "cpu" and report["ok"] is True
    assert [p["name"] for p in report["parts"]] == [p.name for p in gpu_check.PARTS]
    for i, part in enumerate(report["parts"], 1):
        assert set(part) == set(gpu_check.REPORT_SCHEMA["parts"][0])
        assert part["status"] == "skipped" and part["message"]
        assert f"[{i}/{len(gpu_check.PARTS)}] {part['name']}: skipped" in out  # a progress line per part


def test_unknown_part_is_an_error_naming_the_known_ones(gpu_check, capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--parts", "nope"])
    assert "kernel_agreement" in capsys.readouterr().err
