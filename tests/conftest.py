"""Suite-wide settings: one torch thread per test process (``make test`` runs two xdist workers on 2 cores;
two threads per worker oversubscribe the cores and make small ops 10-100x slower), and CUDA's rules for device
checks on CPU (``safepad.testing.cuda_rules``: a ``torch._assert_async`` message of 255 bytes or more raises what
CUDA raises, eager and compiled, whether or not the check holds)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread_per_worker():
    torch.set_num_threads(1)
    yield


@pytest.fixture(autouse=True, scope="session")
def _cuda_assert_rules():
    """CUDA's message-length rule for every ``torch._assert_async`` of the session (every worker process).

    Imported here, not at the top: importing safepad imports the kernel packages (triton), which the kernel tier's
    conftest (tests/kernels) must see first, with ``TRITON_INTERPRET`` set."""
    from safepad.testing import cuda_rules

    cuda_rules.install()
    yield


# The fuzz tier's per-family counts (call sequences, calls, refused calls, skipped draws), printed at the end of the
# run, also under xdist: each tests/fuzz test records its line as a user property, which the workers send back. These
# hooks live here, not in tests/fuzz/conftest.py: under xdist the controller never collects, so a conftest below
# tests/ is not loaded there when `make test` runs the whole suite, and the section went missing.
_FUZZ_LINES: list[str] = []


def pytest_runtest_logreport(report):
    if report.when == "call":
        _FUZZ_LINES.extend(v for k, v in report.user_properties if k == "fuzz_counts")


def pytest_terminal_summary(terminalreporter):
    if _FUZZ_LINES:
        terminalreporter.section("call-sequence fuzzer: counts per family")
        for line in sorted(_FUZZ_LINES):
            terminalreporter.write_line(line)
