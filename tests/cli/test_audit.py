"""``safepad audit`` run in-process: usage errors (2), failing checks (1), passing checks (0), JSON, plot."""

from __future__ import annotations

import json
import runpy
import sys

import pytest

from safepad.cli.main import main
from safepad.testing import tiny_model

from .helpers import run_audit as _run

BROKEN_AND_OK = "right_pad_decode,left_pad_decode"  # broken in stock mamba2, and right in stock mamba2


@pytest.mark.parametrize(
    "argv,message",
    [
        pytest.param(["--family", "mamba3"], "unknown family 'mamba3'", id="unknown-family"),
        pytest.param(["--model", "/nonexistent/ckpt"], "is not a directory", id="bad-path"),
        pytest.param(["--scenarios", "right_pad,generate"], "--scenarios: unknown right_pad", id="unknown-scenario"),
        pytest.param(["--family", "mamba", "--model", "/tmp"], "not allowed with argument", id="family-and-model"),
        pytest.param(["--dtype", "int8"], "invalid choice", id="bad-dtype"),
        pytest.param(["--max-pads", "-1", "--plot", "x.png"], "--max-pads", id="negative-pads"),
    ],
)
def test_usage_errors_exit_2_with_a_message(capsys, argv, message):
    code, out, err = _run(argv, capsys)
    assert code == 2
    assert message in err
    assert "safepad audit" not in out  # nothing ran


def test_no_command_exits_2(capsys):
    assert main([]) == 2
    assert "audit" in capsys.readouterr().out


def test_identity_wrap_fails_because_stock_fails(tmp_path, capsys):
    path = tmp_path / "audit.json"
    code, out, _ = _run(["--family", "mamba2", "--scenarios", BROKEN_AND_OK, "--json", str(path)], capsys)
    assert code == 1
    assert "right_pad_decode" in out and "FAIL" in out
    data = json.loads(path.read_text())
    assert data["exit_code"] == 1 and data["passed"] is False and data["model"] == "tiny mamba2"
    assert [r["name"] for r in data["wrapped"]] == ["right_pad_decode", "left_pad_decode"]
    assert [r["status"] for r in data["wrapped"]] == ["FAIL", "ok"]
    assert data["stock"][0]["max_abs_logits"] > 1e-3
    assert data["stock"][0]["state_errors"]  # cached-state errors are reported


def test_passing_scenarios_exit_0(capsys):
    code, out, _ = _run(["--family", "mamba2", "--scenarios", "left_pad_decode"], capsys)
    assert code == 0
    assert "PASS" in out


def test_no_wrap_audits_stock_only(capsys):
    def must_not_wrap(model):
        raise AssertionError("--no-wrap must not wrap")

    code, out, _ = _run(["--family", "mamba2", "--scenarios", BROKEN_AND_OK, "--no-wrap"], capsys, must_not_wrap)
    assert code == 1
    assert "wrapped" not in out
    code, _, _ = _run(["--family", "mamba2", "--scenarios", "left_pad_decode", "--no-wrap"], capsys, must_not_wrap)
    assert code == 0


def test_raising_scenarios_are_reported_not_crashing(capsys):
    code, out, _ = _run(["--family", "nemotron_h", "--scenarios", "packed_seq_idx"], capsys)
    assert code == 1
    assert "raises ValueError" in out
    assert "wrapped packed_seq_idx" in out  # the full message of the wrapped model's exception


def test_plot_writes_a_png(tmp_path, capsys):
    png = tmp_path / "sweep.png"
    code, out, _ = _run(
        ["--family", "lfm2", "--scenarios", "left_pad_decode", "--plot", str(png), "--max-pads", "2"], capsys
    )
    assert code == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "plot written" in out


def test_local_checkpoint_directory(tmp_path, capsys):
    tiny_model("falcon_mamba").save_pretrained(tmp_path / "ckpt")
    code, out, _ = _run(["--model", str(tmp_path / "ckpt"), "--scenarios", "left_pad_decode"], capsys)
    assert code == 0
    assert "ckpt" in out
    (tmp_path / "empty").mkdir()
    code, _, err = _run(["--model", str(tmp_path / "empty")], capsys)
    assert code == 2 and "cannot load" in err


def test_python_dash_m_entry_point(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["safepad", "audit", "--family", "nope"])
    with pytest.raises(SystemExit) as exc:
        runpy.run_module("safepad", run_name="__main__")
    assert exc.value.code == 2
    assert "unknown family" in capsys.readouterr().err


@pytest.mark.parametrize("model_type", __import__("safepad").supported_model_types())
def test_every_supported_model_type_is_a_family_that_passes(model_type, capsys):
    """`safepad audit --family T` accepts every safepad.supported_model_types() entry (qwen3_5 and
    qwen3_5_moe build their text model) and the wrapped model passes; chunked prefill feeds the cache back
    under the name the model's forward declares (transformers 5.24 renamed it to `cache`)."""
    from safepad.testing.tiny import family_available
    from safepad.wrap import wrap

    available, why = family_available(model_type)
    if not available:  # a family newer than the installed transformers: a usage error that says so
        code, _, err = _run(["--family", model_type], capsys, wrap)
        assert code == 2 and why in err
        return
    code, out, err = _run(["--family", model_type, "--scenarios", "chunked_prefill,left_pad_decode"], capsys, wrap)
    assert code == 0, out + err
    assert f"tiny {model_type}" in out and "PASS" in out
