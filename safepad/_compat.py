"""Version checks for the libraries safepad patches: transformers and torch, each against the range CI tests.

Policy (README.md, "Install"; docs/limits.md, "Versions"): ``import safepad`` refuses a transformers or torch
outside the tested range with :class:`UntestedVersionError` (an ``ImportError``) whose message gives the pip
command that installs a tested release. safepad replaces the recurrent mixers inside transformers' models and
registers custom ops with torch; on a release no tier has run, a wrapped model can compute wrong outputs
without raising, which is the failure safepad exists to prevent. ``SAFEPAD_ALLOW_UNTESTED=1`` turns the refusal
into a warning (what ``make test-latest`` runs under, to try the next releases before the range admits them).

The ranges below are the bounds of ``[project] dependencies`` in pyproject.toml; tests/test_compat.py checks
that the two agree and that the constraints/*.txt pins of the tiers lie inside them.
"""

from __future__ import annotations

import logging
import os
import re
import warnings

from .errors import UntestedVersionError

logger = logging.getLogger(__name__)

__all__ = [
    "ALLOW_UNTESTED_ENV",
    "TESTED_TORCH",
    "TESTED_TRANSFORMERS",
    "UntestedVersionError",
    "allow_untested",
    "check_torch_version",
    "check_transformers_version",
]

#: transformers versions safepad is tested against: [min, max), i.e. every 5.23.x, 5.24.x and 5.25.x release.
#: CI runs the suite at both ends (constraints/tested.txt: 5.23.0, constraints/newest.txt: 5.25.0); the cache
#: argument / output names (``cache_params`` / ``past_key_values`` in 5.23, ``cache`` from 5.24) are read from
#: what each forward declares (safepad.cache). Raise max (here and in pyproject.toml) when a newer release
#: passes ``make test-latest`` and joins constraints/newest.txt.
TESTED_TRANSFORMERS = ("5.23.0", "5.26.0")

#: torch versions safepad is tested against: [min, max). Every tier runs torch 2.13.0 except
#: ``make test-torch-floor`` (torch 2.11.0, the floor in pyproject.toml; constraints/torch-floor.txt) and
#: ``make test-torch-newest`` (torch 2.15.0; constraints/torch-newest.txt).
TESTED_TORCH = ("2.11.0", "2.16.0")

#: the environment variable that turns the refusal outside the tested ranges into a warning
ALLOW_UNTESTED_ENV = "SAFEPAD_ALLOW_UNTESTED"


def allow_untested() -> bool:
    """Whether ``SAFEPAD_ALLOW_UNTESTED`` is set to a true value (``1``, ``true``, ``yes``, ``on``)."""
    return os.environ.get(ALLOW_UNTESTED_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


_RELEASE = re.compile(r"\s*v?(\d+)(?:\.(\d+))?(?:\.(\d+))?")


def _parse(v: str) -> tuple[int, int, int]:
    """The release triple of a version string: ``"2.15.0+cpu"`` -> (2, 15, 0), ``"5.26.0.dev0"`` -> (5, 26, 0).

    Pre-, dev- and post-release suffixes are dropped, so a 5.26 pre-release is outside ``[5.23, 5.26)`` as pip's
    ``<5.26`` treats it.
    """
    m = _RELEASE.match(v)
    if not m:
        raise ValueError(f"not a version: {v!r}")
    return tuple(int(g) if g else 0 for g in m.groups())  # type: ignore[return-value]


def _short(v: str) -> str:
    """``"5.26.0"`` -> ``"5.26"`` (the form pyproject.toml and the pip command use)."""
    major, minor, patch = _parse(v)
    return f"{major}.{minor}" if patch == 0 else f"{major}.{minor}.{patch}"


def _check(package: str, version: str, tested: tuple[str, str], why: str, note: str = "") -> bool:
    lo, hi = tested
    if _parse(lo) <= _parse(version) < _parse(hi):
        return True
    pip = f"pip install '{package}>={_short(lo)},<{_short(hi)}'"
    head = f"safepad is tested with {package} >= {lo}, < {hi}; found {package} {version}. {why}"
    if allow_untested():
        msg = (f"{head} {ALLOW_UNTESTED_ENV} is set: importing anyway. Run `safepad audit --model YOUR_CHECKPOINT` "
               f"before trusting a wrapped model; a tested release: {pip}")
        warnings.warn(msg, UserWarning, stacklevel=4)
        logger.warning(msg)
        return False
    raise UntestedVersionError(
        f"{head}\nInstall a tested release:\n    {pip}\n{note}or, to import anyway at your own risk (then run "
        f"`safepad audit --model YOUR_CHECKPOINT` before trusting a wrapped model), set {ALLOW_UNTESTED_ENV}=1."
    )


def check_transformers_version(version: str | None = None) -> bool:
    """Return True inside the tested range; outside it raise :class:`UntestedVersionError`, or warn and return
    False when ``SAFEPAD_ALLOW_UNTESTED`` is set. ``import safepad`` runs it once."""
    if version is None:
        import transformers

        version = transformers.__version__
    return _check(
        "transformers", version, TESTED_TRANSFORMERS,
        "safepad replaces the recurrent mixers of transformers' models, matched by class name and module layout, "
        "and reads the cache layout of the tested releases; on another release a wrapped model can compute wrong "
        "outputs without raising.",
    )


def check_torch_version(version: str | None = None) -> bool:
    """Return True inside the tested range; outside it raise :class:`UntestedVersionError`, or warn and return
    False when ``SAFEPAD_ALLOW_UNTESTED`` is set. ``import safepad`` runs it once."""
    if version is None:
        import torch

        version = torch.__version__
    return _check(
        "torch", version, TESTED_TORCH,
        "safepad's custom ops, torch.library registrations and compile paths are tested on that range only.",
        "(for a CUDA build add its index, e.g. --index-url https://download.pytorch.org/whl/cu130)\n",
    )
