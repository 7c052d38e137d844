"""The installed-wheel check of ``make test-wheel``: run by a fresh venv's python, from outside the repository.

Usage: ``python check_wheel.py WHEEL_DIR`` (the directory holding the one built ``safepad-*.whl``).

1. The wheel holds only ``safepad/`` and its dist-info, with ``LICENSE`` and ``py.typed``, and every package of
   the repository (``safepad/**``, ``collators/`` as ``safepad/collators``, ``trainer_ext/`` as
   ``safepad/trainer_ext``).
2. ``safepad`` is imported from the venv's site-packages (not the checkout), ``collators`` / ``trainer_ext`` are not
   importable, the public API resolves and ``safepad.__version__`` is the installed metadata's.
3. ``safepad audit`` (the console script) exits 0.
"""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
import zipfile
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def check_contents(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/", 1)[0] for n in names}
    dist_info = f"safepad-{version('safepad')}.dist-info"
    assert top == {"safepad", dist_info}, f"the wheel must hold only safepad and its dist-info, got {sorted(top)}"
    assert f"{dist_info}/licenses/LICENSE" in names, "LICENSE is missing from the wheel's dist-info"
    assert "safepad/py.typed" in names, "py.typed is missing"
    expected = {p.parent.relative_to(REPO).as_posix() for p in (REPO / "safepad").rglob("__init__.py")}
    expected |= {"safepad/collators", "safepad/trainer_ext"}
    present = {n.rsplit("/", 1)[0] for n in names if n.endswith("/__init__.py")}
    missing = sorted(expected - present)
    assert not missing, f"packages of the repository missing from the wheel (add them to pyproject.toml): {missing}"
    for folder, package in (("collators", "safepad/collators"), ("trainer_ext", "safepad/trainer_ext")):
        for py in (REPO / folder).glob("*.py"):
            assert f"{package}/{py.name}" in names, f"{folder}/{py.name} is not in the wheel as {package}/{py.name}"


def check_import() -> None:
    import safepad

    where = Path(safepad.__file__).resolve()
    assert "site-packages" in where.parts and where.parent != REPO / "safepad", (
        f"safepad was imported from the checkout ({where}), not from the installed wheel"
    )
    for name in ("collators", "trainer_ext"):
        assert importlib.util.find_spec(name) is None, f"the wheel installs a top-level {name!r} package"
    for name in ("wrap", "unwrap", "guard", "DataCollatorForPackedSSM", "pack_dataset", "PaddingGuardCallback",
                 "PaddingError", "supported_model_types"):
        assert getattr(safepad, name) is not None, name
    assert safepad.__version__ == version("safepad"), (safepad.__version__, version("safepad"))
    from safepad.collators import DataCollatorForPackedSSM
    from safepad.trainer_ext import PaddingGuardCallback

    assert DataCollatorForPackedSSM is safepad.DataCollatorForPackedSSM
    assert PaddingGuardCallback is safepad.PaddingGuardCallback


def main(argv: list[str]) -> int:
    wheels = sorted(Path(argv[1]).glob("safepad-*.whl"))
    assert len(wheels) == 1, f"expected one safepad wheel in {argv[1]}, found {wheels}"
    check_contents(wheels[0])
    check_import()
    script = Path(sys.executable).with_name("safepad")
    result = subprocess.run([str(script), "audit"], capture_output=True, text=True)
    sys.stdout.write(result.stdout[-3000:])
    assert result.returncode == 0, f"safepad audit exited {result.returncode}:\n{result.stderr[-3000:]}"
    print(f"wheel check: {wheels[0].name} holds only safepad (+ LICENSE, py.typed); installed, imported and audited "
          f"from {Path.cwd()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
