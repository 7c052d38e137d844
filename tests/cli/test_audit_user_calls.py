"""``safepad audit`` audits the calls as users make them (with and without ``position_ids``) and explains its cells."""

from __future__ import annotations

import json

import pytest

from safepad.testing.scenarios import AUDIT_SCENARIOS, NO_POSITION_SCENARIOS, SCENARIOS
from safepad.wrap import wrap

from .helpers import run_audit as _run


def test_the_default_audit_includes_every_call_without_position_ids():
    from safepad.cli.audit import _parse_scenarios

    class _Args:
        scenarios = None

    assert _parse_scenarios(_Args(), None) == list(AUDIT_SCENARIOS)
    assert set(NO_POSITION_SCENARIOS) <= set(AUDIT_SCENARIOS) and set(SCENARIOS) <= set(AUDIT_SCENARIOS)
    assert all(n.removesuffix("_no_pos") in SCENARIOS for n in NO_POSITION_SCENARIOS)


def test_calls_without_position_ids_catch_the_stock_defect_and_pass_wrapped(tmp_path, capsys):
    """The README's recipes (mask + cache, no position_ids): stock mamba2 keeps the state after the pads (fails),
    the wrapped model matches each sequence alone."""
    names = "right_pad_decode_no_pos,chunked_prefill_pad_no_pos"
    path = tmp_path / "stock.json"
    code, out, _ = _run(["--family", "mamba2", "--scenarios", names, "--json", str(path)], capsys)
    assert code == 1 and "FAIL" in out
    data = json.loads(path.read_text())
    assert [r["status"] for r in data["stock"]] == ["FAIL", "FAIL"]
    assert all(max(r["max_abs_logits"], r["max_state_error"]) > 1.0 for r in data["stock"])  # the cached states
    code, out, _ = _run(["--family", "mamba2", "--scenarios", names], capsys, lambda m: wrap(m, backend="torch"))
    assert code == 0, out


@pytest.mark.parametrize(
    "family",
    [
        pytest.param("nemotron_h", id="nemotron_h"),
        pytest.param("qwen3_5_text", id="qwen3_5_text"),
    ],
)
def test_hybrids_pass_the_calls_without_position_ids(family, capsys):
    """Hybrids derive the positions of a cached call from the cache length when none are passed."""
    names = ",".join(NO_POSITION_SCENARIOS)
    code, out, _ = _run(["--family", family, "--scenarios", names], capsys, lambda m: wrap(m, backend="torch"))
    assert code == 0, out


def test_the_output_explains_every_cell(capsys):
    code, out, _ = _run(["--family", "mamba2", "--scenarios", "right_pad_decode,decode_dt_min"], capsys)
    assert code == 1
    assert "How to read the cells" in out
    for notation in ("max|Δ|", "tok", "raises X", "n/a", "conv a / rec b", "result", "*_no_pos"):
        assert notation in out, notation

