"""``safepad audit`` argument checks happen before the audit runs (exit 2, a message, no traceback), and the
table is readable on an 80-column terminal with every raise's message under it."""

from __future__ import annotations

import re
import sys

import pytest


from .helpers import run_audit as _run


@pytest.fixture
def no_audit(monkeypatch):
    """Fails the test if the audit itself starts (the checks must come first)."""

    def audit(*a, **k):
        raise AssertionError("the audit ran before the arguments were checked")

    monkeypatch.setattr("safepad.cli.audit.audit", audit)


@pytest.mark.parametrize(
    "argv,message",
    [
        pytest.param(["--backend", "banana"], "--backend: invalid choice: 'banana'", id="bad-backend"),
        pytest.param(["--json", "{missing}/out.json"], "--json: the directory", id="json-missing-dir"),
        pytest.param(["--plot", "{missing}/pads.png"], "--plot: the directory", id="plot-missing-dir"),
        pytest.param(["--json", "{tmp}"], "is a directory", id="json-is-a-directory"),
    ],
)
def test_bad_arguments_exit_2_before_the_audit(tmp_path, capsys, no_audit, argv, message):
    argv = [a.format(missing=tmp_path / "nope" / "deeper", tmp=tmp_path) for a in argv]
    code, out, err = _run(["--family", "mamba", "--scenarios", "left_pad_decode", *argv], capsys)
    assert code == 2, (out, err)
    assert message in err
    assert "Traceback" not in err and "safepad audit" not in out
    assert not (tmp_path / "nope").exists()


def test_plot_without_matplotlib_exits_2_naming_the_extra(tmp_path, capsys, no_audit, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    code, out, err = _run(["--family", "mamba", "--plot", str(tmp_path / "p.png")], capsys)
    assert code == 2
    assert 'pip install "safepad[plot]"' in err
    assert not (tmp_path / "p.png").exists()


def test_readme_names_the_plot_extra():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Quick start: the audit", 1)[1].split("\n## ", 1)[0]
    assert "safepad[plot]" in section


def test_table_on_an_80_column_terminal(capsys, monkeypatch):
    """Scenario names in full (not ``chunked_pr…``), nothing cut with an ellipsis, and below the table the message
    of every raise the table shows, stock or wrapped (the legend says so)."""
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    names = ["chunked_prefill", "packed_seq_idx", "left_pad_decode"]
    code, out, _ = _run(["--family", "nemotron_h", "--scenarios", ",".join(names)], capsys)
    plain = re.sub(r"\x1b\[[0-9;]*m", "", out)
    table = plain.split("How to read the cells")[0]
    assert "…" not in table
    assert max(len(line) for line in table.splitlines()) <= 80
    for name in names:
        assert re.search(rf"│ {name}\s+│", table), name
    raised = re.findall(r"│ (\w+)\s+│.*raises", table)
    assert raised  # stock nemotron_h raises on packed_seq_idx without causal_conv1d
    for name in raised:
        assert re.search(rf"^(stock|wrapped) {name}: \w+", plain, re.M), name
