"""What the audit tests share: running ``safepad audit`` in-process and reading what it printed."""

from __future__ import annotations

from safepad.cli.main import main

__all__ = ["identity", "run_audit"]


def identity(model):
    """``wrap_fn`` that leaves the model stock."""
    return model


def run_audit(argv, capsys, wrap_fn=identity):
    """``safepad audit --no-progress *argv`` in this process: ``(exit code, stdout, stderr)``."""
    code = main(["audit", "--no-progress", *argv], wrap_fn=wrap_fn)
    out, err = capsys.readouterr()
    return code, out, err
