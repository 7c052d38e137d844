"""The version policy: `import safepad` refuses a transformers / torch outside the tested ranges (a warning under
SAFEPAD_ALLOW_UNTESTED=1), and the ranges have one source of truth: pyproject.toml's bounds, safepad/_compat.py's
tuples and the constraints/*.txt pins of the tiers all agree."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from safepad._compat import (
    ALLOW_UNTESTED_ENV,
    TESTED_TORCH,
    TESTED_TRANSFORMERS,
    UntestedVersionError,
    check_torch_version,
    check_transformers_version,
)

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "constraints"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
#: packages whose upper bound is the minor after the newest release a tier runs (pyproject.toml's comment)
CAPPED = {"torch", "transformers", "accelerate", "trl", "peft"}


@pytest.fixture
def strict(monkeypatch):
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)


@pytest.fixture
def allowed(monkeypatch):
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")


def _requirements(group: str | None = None) -> dict[str, Requirement]:
    project = PYPROJECT["project"]
    lines = project["dependencies"] if group is None else project["optional-dependencies"][group]
    return {(r := Requirement(line)).name.lower(): r for line in lines}


def _all_requirements() -> dict[str, Requirement]:
    out = _requirements()
    for group in PYPROJECT["project"]["optional-dependencies"]:
        out.update(_requirements(group))
    return out


def _bounds(req: Requirement) -> tuple[Version | None, Version | None]:
    lo = [Version(s.version) for s in req.specifier if s.operator == ">="]
    hi = [Version(s.version) for s in req.specifier if s.operator == "<"]
    return (lo[0] if lo else None), (hi[0] if hi else None)


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==(\S+)", line)
        if m:
            pins[m.group(1).lower()] = m.group(2)
    return pins


ALL_PINS = {p.name: _pins(p) for p in sorted(CONSTRAINTS.glob("*.txt"))}


# --- the check itself ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["5.23.0", "5.23.4", "5.24.0", "5.25.0", "5.25.3"])
def test_tested_range_is_silent(version, strict):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_transformers_version(version)


@pytest.mark.parametrize("version", ["5.22.9", "5.26.0", "5.26.0.dev0", "5.26.0rc1", "6.0.0"])
def test_outside_the_range_refuses_with_the_fix(version, strict):
    with pytest.raises(UntestedVersionError) as info:
        check_transformers_version(version)
    msg = str(info.value)
    assert "safepad is tested with transformers >= 5.23.0, < 5.26.0" in msg
    assert "pip install 'transformers>=5.23,<5.26'" in msg
    assert f"{ALLOW_UNTESTED_ENV}=1" in msg
    assert isinstance(info.value, ImportError)


def test_the_error_is_public():
    import safepad

    assert safepad.UntestedVersionError is UntestedVersionError and "UntestedVersionError" in safepad.__all__


@pytest.mark.parametrize("version", ["5.22.9", "5.26.0", "6.0.0"])
def test_the_override_warns_instead(version, allowed):
    with pytest.warns(UserWarning, match=r"safepad is tested with transformers >= 5\.23\.0, < 5\.26\.0"):
        assert not check_transformers_version(version)


@pytest.mark.parametrize("value", ["", "0", "no", "false"])
def test_only_a_true_value_overrides(value, monkeypatch):
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, value)
    with pytest.raises(UntestedVersionError):
        check_transformers_version("5.26.0")


def test_the_running_transformers_is_inside_the_range(strict):
    import transformers

    assert check_transformers_version(transformers.__version__), transformers.__version__


@pytest.mark.parametrize("version", ["2.11.0", "2.11.0+cu130", "2.12.1", "2.13.0+cpu", "2.14.1", "2.15.0"])
def test_tested_torch_range_is_silent(version, strict):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_torch_version(version)


@pytest.mark.parametrize("version", ["2.10.0", "2.10.0+cu128", "2.16.0", "2.16.0.dev20260101", "3.0.0"])
def test_torch_outside_the_range_refuses(version, strict):
    with pytest.raises(UntestedVersionError, match=r"safepad is tested with torch >= 2\.11\.0, < 2\.16\.0") as info:
        check_torch_version(version)
    assert "pip install 'torch>=2.11,<2.16'" in str(info.value)


def test_torch_outside_the_range_warns_under_the_override(allowed):
    with pytest.warns(UserWarning, match=r"safepad is tested with torch >= 2\.11\.0, < 2\.16\.0"):
        assert not check_torch_version("2.16.0")


def test_the_running_torch_is_inside_the_range(strict):
    import torch

    assert check_torch_version(torch.__version__), torch.__version__


_IMPORT_WITH_TRANSFORMERS_6 = (
    "import transformers; transformers.__version__ = '6.0.0'; import safepad; print('IMPORTED')"
)


def _run(env_value: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != ALLOW_UNTESTED_ENV}
    if env_value is not None:
        env[ALLOW_UNTESTED_ENV] = env_value
    return subprocess.run([sys.executable, "-c", _IMPORT_WITH_TRANSFORMERS_6], env=env, capture_output=True,
                          text=True, timeout=300)


def test_import_safepad_refuses_an_untested_transformers_and_the_override_imports():
    refused = _run(None)
    assert refused.returncode != 0 and "IMPORTED" not in refused.stdout
    assert "UntestedVersionError" in refused.stderr and "pip install 'transformers>=5.23,<5.26'" in refused.stderr
    allowed = _run("1")
    assert allowed.returncode == 0 and "IMPORTED" in allowed.stdout, allowed.stderr
    assert "UserWarning: safepad is tested with transformers" in allowed.stderr


# --- one source of truth: pyproject.toml, _compat, constraints/*.txt ---------------------------------------------


@pytest.mark.parametrize("package,tested", [("transformers", TESTED_TRANSFORMERS), ("torch", TESTED_TORCH)])
def test_compat_ranges_are_pyprojects_bounds(package, tested):
    lo, hi = _bounds(_requirements()[package])
    assert (lo, hi) == (Version(tested[0]), Version(tested[1])), (
        f"pyproject.toml allows {package} {_requirements()[package].specifier}, safepad/_compat.py tests {tested}"
    )


def test_every_capped_dependency_has_both_bounds_and_nothing_else_is_capped():
    reqs = _all_requirements()
    for name, req in reqs.items():
        lo, hi = _bounds(req)
        assert lo is not None, f"{name}: no floor in pyproject.toml"
        if name in CAPPED:
            assert hi is not None, f"{name}: the policy caps it at the minor after the newest tested release"
        else:
            assert hi is None, f"{name}: capped, but not in the policy's list (pyproject.toml comment, CAPPED here)"


@pytest.mark.parametrize("constraints", sorted(ALL_PINS))
def test_every_tier_pins_versions_inside_pyprojects_bounds(constraints):
    reqs = _all_requirements()
    pins = ALL_PINS[constraints]
    for name, version in pins.items():
        if name in reqs:
            assert reqs[name].specifier.contains(version, prereleases=True), (
                f"constraints/{constraints} pins {name}=={version}, outside pyproject.toml's {reqs[name]}"
            )


def test_the_newest_tiers_pin_the_newest_tested_minor_below_each_cap():
    """A cap is the minor after the newest release a tier runs: `<5.26` iff some tier runs 5.25.x."""
    reqs = _all_requirements()
    newest = {**ALL_PINS["newest.txt"], **ALL_PINS["torch-newest.txt"]}
    for name in CAPPED:
        _, hi = _bounds(reqs[name])
        assert name in newest, f"{name}: capped, but constraints/newest.txt / torch-newest.txt pin no version"
        pinned = Version(newest[name])
        assert (pinned.major, pinned.minor + 1) == (hi.major, hi.minor), (
            f"{name}: the newest tier runs {pinned}, so the cap must be <{pinned.major}.{pinned.minor + 1}, "
            f"pyproject.toml says <{hi}"
        )


def test_the_floor_tiers_pin_every_runtime_floor():
    """constraints/floor.txt pins every floor but torch's, which constraints/torch-floor.txt pins (a CUDA build)."""
    floor = {**ALL_PINS["floor.txt"], **ALL_PINS["torch-floor.txt"]}
    for name, req in _requirements().items():
        lo, _ = _bounds(req)
        assert name in floor, f"constraints/floor.txt pins no {name}"
        assert Version(floor[name]) == lo, f"{name}: pyproject.toml's floor is {lo}, the floor tiers run {floor[name]}"


def test_the_newest_end_is_the_compat_ranges_newest_minor():
    """constraints/newest.txt's transformers and torch-newest.txt's torch are inside _compat's range, at its top."""
    for package, tested, pins in (("transformers", TESTED_TRANSFORMERS, ALL_PINS["newest.txt"]),
                                  ("torch", TESTED_TORCH, ALL_PINS["torch-newest.txt"])):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            fn = check_transformers_version if package == "transformers" else check_torch_version
            assert fn(pins[package])
        hi = Version(tested[1])
        assert Version(pins[package]).minor == hi.minor - 1, (package, pins[package], tested)


def test_version_comes_from_the_installed_metadata():
    from importlib.metadata import version

    import safepad

    assert safepad.__version__ == version("safepad")
