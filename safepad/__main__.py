"""``python -m safepad ...``: same as the ``safepad`` console script."""

from __future__ import annotations

from safepad.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
