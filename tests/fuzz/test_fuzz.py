"""The fixed-seed tier of the call-sequence fuzzer (safepad.testing.fuzz) over every supported tiny family.

Each family runs ``SAFEPAD_FUZZ_EXAMPLES`` call sequences (default 3) of up to ``SAFEPAD_FUZZ_STEPS`` calls
(default 5), with hypothesis derandomized: the same programs on every run. A failure prints the shrunk call
sequence as a standalone repro. ``make fuzz FUZZ_MINUTES=60`` runs the same machine open-ended.
"""

from __future__ import annotations

import os

import pytest

from safepad.testing import fuzz
from safepad.testing.tiny import family_available, family_names

EXAMPLES = int(os.environ.get("SAFEPAD_FUZZ_EXAMPLES", "3"))
STEPS = int(os.environ.get("SAFEPAD_FUZZ_STEPS", "5"))


def _param(family: str):
    ok, why = family_available(family)
    return pytest.param(family, id=family, marks=() if ok else pytest.mark.skip(reason=why))


@pytest.mark.parametrize("family", [_param(f) for f in family_names()])
def test_fuzz_family(family: str) -> None:
    stats = fuzz.run_family(family, EXAMPLES, STEPS, seed=0)
    print(stats.line())
    assert stats.calls > 0
