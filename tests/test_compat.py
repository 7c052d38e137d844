"""The import warning fires only outside the tested transformers range, and both matrix ends are inside it."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

from safepad._compat import check_transformers_version

ROOT = Path(__file__).resolve().parents[1]


def _pinned_transformers(path: Path) -> str:
    match = re.search(r"^transformers==(\S+)$", path.read_text(), re.MULTILINE)
    assert match, f"{path} pins no transformers version"
    return match.group(1)


@pytest.mark.parametrize("constraints", ["tested.txt", "newest.txt"])
def test_both_ends_of_the_ci_matrix_import_silently(constraints):
    version = _pinned_transformers(ROOT / "constraints" / constraints)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_transformers_version(version)


@pytest.mark.parametrize("version", ["5.23.0", "5.23.4", "5.24.0", "5.24.1"])
def test_tested_range_is_silent(version):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_transformers_version(version)


@pytest.mark.parametrize("version", ["5.22.9", "5.25.0", "6.0.0"])
def test_outside_the_range_warns(version):
    with pytest.warns(UserWarning, match="safepad is tested with transformers >= 5.23.0, < 5.25.0"):
        assert not check_transformers_version(version)


def test_the_running_transformers_is_inside_the_range():
    import transformers

    assert check_transformers_version(transformers.__version__), transformers.__version__
