"""The import warning fires only outside the tested transformers range, and both matrix ends are inside it."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

from safepad._compat import check_torch_version, check_transformers_version

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


@pytest.mark.parametrize("version", ["2.13.0", "2.14.1", "2.15.0", "2.15.0+cpu"])
def test_tested_torch_range_is_silent(version):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_torch_version(version)


@pytest.mark.parametrize("version", ["2.12.1", "2.16.0", "3.0.0"])
def test_torch_outside_the_range_warns(version):
    with pytest.warns(UserWarning, match=r"safepad is tested with torch >= 2\.13\.0, < 2\.16\.0"):
        assert not check_torch_version(version)


def test_the_running_torch_is_inside_the_range():
    import torch

    assert check_torch_version(torch.__version__), torch.__version__


def test_every_tier_pins_a_torch_inside_the_tested_range_and_the_floor_is_pyprojects():
    """The floor in pyproject.toml is the torch the floor tier runs, and every pinned torch is in TESTED_TORCH."""
    pinned = {p.name: re.search(r"^torch==(\S+)$", p.read_text(), re.MULTILINE) for p in (ROOT / "constraints").glob("*.txt")}
    versions = {name: m.group(1) for name, m in pinned.items() if m}
    assert "floor.txt" in versions and "torch-newest.txt" in versions, versions
    floor = re.search(r'"torch>=([^",]+)', (ROOT / "pyproject.toml").read_text()).group(1)
    assert versions["floor.txt"] == floor
    for name, version in versions.items():
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert check_torch_version(version), name


def test_version_comes_from_the_installed_metadata():
    from importlib.metadata import version

    import safepad

    assert safepad.__version__ == version("safepad")
