"""The kernel-route tier: safepad's CUDA dispatch executed on CPU (Triton interpreter + C++ stand-ins).

Run by ``make test-kernels`` in its own venv (``.venv-kernels``: CPU torch, triton, mamba-ssm and
causal-conv1d installed without their CUDA builds, flash-linear-attention) and its own process, with
``SAFEPAD_KERNEL_TIER=1`` and ``TRITON_INTERPRET=1``. In any other pytest run (``make test``) these tests
are not collected: they need that environment, and ``TRITON_INTERPRET`` must be set before triton is
imported. ``SAFEPAD_KERNEL_TIER=full`` also runs the whole audit matrix of every family with kernels.

``SAFEPAD_KERNEL_TIER=cuda`` (``make test-cuda`` on a GPU machine) runs the ``cuda``-marked tests
(``test_device_kernels.py``) on the real kernels and a CUDA device instead: nothing is emulated. Under the
emulation the same tests run on CPU tensors (:data:`DEVICE`), so the CUDA tier's code runs in every CI.

Before the emulation is installed, every transformers modeling module that the tiny families use is
imported with mamba-ssm, causal-conv1d and FLA hidden, so that the STOCK reference models keep
transformers' plain torch paths: the reference stays independent of the kernels under test.
"""

from __future__ import annotations

import collections
import importlib
import os
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

_TIER = os.environ.get("SAFEPAD_KERNEL_TIER", "")
_PACKAGES = ("triton", "mamba_ssm", "causal_conv1d", "fla")

#: the device the ``cuda``-marked tests run on: "cuda" on a GPU machine, "cpu" under the emulation
DEVICE = "cuda" if _TIER == "cuda" else "cpu"

if not _TIER:
    collect_ignore_glob = ["test_*.py"]
elif _TIER == "cuda":
    import torch

    if not torch.cuda.is_available():
        raise pytest.UsageError("SAFEPAD_KERNEL_TIER=cuda needs a CUDA device: use make test-cuda EMULATE=1 on CPU")
    # the other modules test the emulation itself (CPU tensors): only the device tests run on a GPU
    collect_ignore = [p.name for p in Path(__file__).parent.glob("test_*.py") if p.name != "test_device_kernels.py"]
else:
    _missing = [m for m in _PACKAGES if find_spec(m) is None]
    if _missing:
        raise pytest.UsageError(
            f"SAFEPAD_KERNEL_TIER is set but {', '.join(_missing)} cannot be imported: run make test-kernels"
        )
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise pytest.UsageError("the kernel tier needs TRITON_INTERPRET=1 in the environment (make test-kernels)")
    if "triton" in sys.modules:
        raise pytest.UsageError("triton was imported before the kernel tier's conftest: run tests/kernels alone")

    _hidden = {m: sys.modules.get(m) for m in ("mamba_ssm", "causal_conv1d", "fla")}
    for _m in _hidden:
        sys.modules[_m] = None  # `import _m` raises ImportError: transformers binds its torch fallbacks
    try:
        from safepad.testing.tiny import EXTRA_FAMILIES, FAMILIES

        for _fam in (*FAMILIES, *EXTRA_FAMILIES):
            try:
                importlib.import_module(f"transformers.models.{_fam}.modeling_{_fam}")
            except ImportError:
                pass
    finally:
        for _m, _mod in _hidden.items():
            if _mod is None:
                sys.modules.pop(_m, None)
            else:
                sys.modules[_m] = _mod

    from safepad.testing import kernel_emulation

    AVAILABLE = kernel_emulation.install()


def pytest_report_header(config):
    if _TIER:
        from safepad.ops import kernels

        return f"safepad kernel tier ({_TIER}): kernels {kernels.kernels_available()}"
    return None


@pytest.fixture
def kernel_calls(monkeypatch):
    """Count the calls that reach each kernel marker of ``safepad.ops.kernels`` (name -> count)."""
    from safepad.ops import kernels

    counts: collections.Counter[str] = collections.Counter()
    for name, fn in list(kernels._KERNELS.items()):
        if fn is None:
            continue

        def counted(*args, _fn=fn, _name=name, **kwargs):
            counts[_name] += 1
            return _fn(*args, **kwargs)

        monkeypatch.setattr(kernels, name, counted)
    return counts
