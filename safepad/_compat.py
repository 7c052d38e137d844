"""Version checks for the libraries safepad patches: transformers and torch, each against the range CI tests."""

from __future__ import annotations

import logging
import warnings

logger = logging.getLogger(__name__)

__all__ = ["TESTED_TORCH", "TESTED_TRANSFORMERS", "check_torch_version", "check_transformers_version"]

#: transformers versions safepad is tested against: [min, max), i.e. every 5.23.x and 5.24.x release. CI runs
#: the suite at both ends (constraints/tested.txt: 5.23.0, constraints/newest.txt: 5.24.0); the cache
#: argument / output names of both (``cache_params`` / ``past_key_values`` in 5.23, ``cache`` in 5.24) are
#: read from what each forward declares (safepad.cache). Raise max when a newer release joins the matrix.
TESTED_TRANSFORMERS = ("5.23.0", "5.25.0")

#: torch versions safepad is tested against: [min, max). Every tier runs torch 2.13.0 (the floor in
#: pyproject.toml) except ``make test-torch-newest``, which runs torch 2.15.0 (constraints/torch-newest.txt).
TESTED_TORCH = ("2.13.0", "2.16.0")


def _parse(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def _check(package: str, version: str, tested: tuple[str, str], hint: str) -> bool:
    lo, hi = tested
    ok = _parse(lo) <= _parse(version) < _parse(hi)
    if not ok:
        msg = f"safepad is tested with {package} >= {lo}, < {hi}; found {version}. {hint}"
        warnings.warn(msg, UserWarning, stacklevel=4)
        logger.warning(msg)
    return ok


def check_transformers_version(version: str | None = None) -> bool:
    """Warn (once, at import) when transformers is outside the tested range; return True if inside."""
    if version is None:
        import transformers

        version = transformers.__version__
    return _check(
        "transformers", version, TESTED_TRANSFORMERS,
        "Mixers are matched by class name and follow the module layout of the tested releases: run `safepad audit` "
        "on your model to confirm that wrapping is still correct.",
    )


def check_torch_version(version: str | None = None) -> bool:
    """Warn (once, at import) when torch is outside the tested range; return True if inside."""
    if version is None:
        import torch

        version = torch.__version__
    return _check(
        "torch", version, TESTED_TORCH,
        "safepad's custom ops, torch.library registrations and compile paths are tested on that range only: run "
        "`safepad audit` to confirm that wrapping is still correct.",
    )
