"""Version checks for the libraries safepad patches."""

from __future__ import annotations

import logging
import warnings

logger = logging.getLogger(__name__)

__all__ = ["TESTED_TRANSFORMERS", "check_transformers_version"]

#: transformers versions safepad is tested against: [min, max), i.e. every 5.23.x and 5.24.x release. CI runs
#: the suite at both ends (constraints/tested.txt: 5.23.0, constraints/newest.txt: 5.24.0); the cache
#: argument / output names of both (``cache_params`` / ``past_key_values`` in 5.23, ``cache`` in 5.24) are
#: read from what each forward declares (safepad.cache). Raise max when a newer release joins the matrix.
TESTED_TRANSFORMERS = ("5.23.0", "5.25.0")


def _parse(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def check_transformers_version(version: str | None = None) -> bool:
    """Warn (once, at import) when transformers is outside the tested range; return True if inside."""
    if version is None:
        import transformers

        version = transformers.__version__
    lo, hi = TESTED_TRANSFORMERS
    ok = _parse(lo) <= _parse(version) < _parse(hi)
    if not ok:
        msg = (
            f"safepad is tested with transformers >= {lo}, < {hi}; found {version}. Mixers are matched by class "
            "name and follow the module layout of the tested releases: run `safepad audit` on your model to "
            "confirm that wrapping is still correct."
        )
        warnings.warn(msg, UserWarning, stacklevel=3)
        logger.warning(msg)
    return ok
