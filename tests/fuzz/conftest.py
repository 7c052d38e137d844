"""Prints the fuzz tier's per-family counts (call sequences, calls, refused calls, skipped draws) at the end of
the run, also under xdist (each test records its line as a user property, which the workers send back)."""

from __future__ import annotations

_LINES: list[str] = []


def pytest_runtest_logreport(report):
    if report.when == "call":
        _LINES.extend(v for k, v in report.user_properties if k == "fuzz_counts")


def pytest_terminal_summary(terminalreporter):
    if _LINES:
        terminalreporter.section("call-sequence fuzzer: counts per family")
        for line in sorted(_LINES):
            terminalreporter.write_line(line)
