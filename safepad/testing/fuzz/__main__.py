"""``python -m safepad.testing.fuzz``: see :func:`safepad.testing.fuzz.main`."""

import sys

from .cli import main

sys.exit(main())
