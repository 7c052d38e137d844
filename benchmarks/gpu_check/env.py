"""The process environment of a check: Triton's caches, pinned autotuning, the stock models' torch paths.

Everything here runs before (or around) the first Triton compile:

* ``TRITON_CACHE_DIR`` defaults to ``<repo>/.triton-cache`` (git-ignored): a rerun on the same lent machine (the
  repository copy and its ignored files stay while the machine is warm) reuses every compiled kernel, and
  ``--cache-archive`` packs it into one file that comes back under ``$OUT`` (``--cache-from`` unpacks it).
* ``TRITON_CACHE_AUTOTUNING=1`` persists Triton's autotune results next to the kernels (triton >= 3.4 reads it;
  FLA persists its own by default, ``FLA_CACHE_RESULTS=1``); mamba-ssm's ``@triton.autotune`` has no option of
  its own, the environment variable covers it.
* :func:`pinned_autotune` makes every ``triton.autotune`` (mamba-ssm's and FLA's alike) take its FIRST config: a
  kernel compiles once instead of once per config (mamba-ssm's SSD kernels list 18-96 configs each; timing them is
  what took the first GPU run's budget). The correctness parts run pinned; the speed parts autotune in full
  (``--autotune``).
* :func:`stock_models_on_torch_paths` imports transformers' modeling modules with the kernel packages hidden, so
  the STOCK reference models keep transformers' plain torch paths (transformers picks FLA / mamba-ssm /
  causal-conv1d per op whenever they import): the reference stays independent of the kernels under test.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE_DIR = ROOT / ".triton-cache"


def triton_caches(cache_dir: str | os.PathLike | None = None) -> str:
    """Set Triton's cache environment (before triton is imported); returns the kernel cache directory."""
    path = str(cache_dir or os.environ.get("TRITON_CACHE_DIR") or CACHE_DIR)
    os.environ["TRITON_CACHE_DIR"] = path
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    os.environ.setdefault("FLA_CACHE_RESULTS", "1")
    Path(path).mkdir(parents=True, exist_ok=True)
    return path


def unpack_cache(archive: str, cache_dir: str) -> int:
    """Unpack a ``--cache-archive`` file into ``cache_dir``; returns the number of files (0 when absent)."""
    if not os.path.isfile(archive):
        return 0
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and not m.name.startswith(("/", ".."))]
        tar.extractall(cache_dir, members=members, filter="data")
    return len(members)


def pack_cache(cache_dir: str, archive: str) -> int:
    """Pack ``cache_dir`` into ``archive`` (gzip); returns the number of files."""
    n = 0
    with tarfile.open(archive, "w:gz") as tar:
        for p in sorted(Path(cache_dir).rglob("*")):
            if p.is_file():
                tar.add(p, arcname=str(p.relative_to(cache_dir)))
                n += 1
    return n


_PRUNE: dict[str, object] = {}


@contextlib.contextmanager
def pinned_autotune(enabled: bool = True):
    """Every Triton autotuner takes its first config while inside (no-op without triton or when disabled).

    A kernel launched here keeps the pinned config for its autotune key afterwards (the autotuner caches it);
    the speed parts use other shapes, hence other keys.
    """
    try:
        from triton.runtime.autotuner import Autotuner
    except Exception:  # noqa: BLE001 - no triton: nothing to pin
        Autotuner = None
    if not enabled or Autotuner is None or getattr(Autotuner.prune_configs, "__safepad_pinned__", False):
        yield
        return
    prune = Autotuner.prune_configs

    def first_config(self, kwargs):
        return prune(self, kwargs)[:1]

    first_config.__safepad_pinned__ = True
    Autotuner.prune_configs = first_config
    try:
        yield
    finally:
        Autotuner.prune_configs = prune


@contextlib.contextmanager
def _hidden(modules: tuple[str, ...]):
    saved = {m: sys.modules.get(m) for m in modules}
    for m in modules:
        sys.modules[m] = None  # `import m` raises ImportError
    try:
        yield
    finally:
        for m, mod in saved.items():
            if mod is None:
                sys.modules.pop(m, None)
            else:
                sys.modules[m] = mod


def stock_models_on_torch_paths() -> None:
    """Import every tiny family's transformers modeling module with mamba-ssm, causal-conv1d and FLA hidden."""
    with _hidden(("mamba_ssm", "causal_conv1d", "fla")):
        from safepad.testing.tiny import EXTRA_FAMILIES, FAMILIES

        for fam in (*FAMILIES, *EXTRA_FAMILIES):
            try:
                importlib.import_module(f"transformers.models.{fam}.modeling_{fam}")
            except ImportError:
                pass


def versions() -> dict[str, str | None]:
    """Installed versions of what the check runs on (None: not installed); read from the package metadata, so
    nothing is imported (mamba-ssm's top-level import fails without its CUDA extension)."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for dist in ("torch", "triton", "transformers", "mamba-ssm", "causal-conv1d", "flash-linear-attention",
                 "fla-core", "safepad"):  # fmt: skip
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    return out
