"""The fuzzer's shared pieces: token ids, the failure type, the model pairs, what counts as a safepad error, the
relative error, the per-family counts, and the drawn batch layout (rows of tokens and pads)."""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["FIRST_TOKEN", "PAD_ID", "STATS", "VARIANTS", "Batch", "FuzzFailure", "FuzzStats"]

PAD_ID = 0
FIRST_TOKEN = 3  # drawn tokens avoid the pad / bos / eos ids
_SAFEPAD_DIR = Path(__file__).resolve().parents[2]
_TESTING_DIR = Path(__file__).resolve().parents[1]


class FuzzFailure(AssertionError):
    """A call returned a wrong tensor, or raised an error that is not safepad's; the message is a repro."""


# --------------------------------------------------------------------------------------------------------------
# Models: one stock / wrapped pair per (family, dtype) and process
# --------------------------------------------------------------------------------------------------------------


#: fuzzed variants of a tiny family: name -> (family, config overrides). RecurrentGemma with a 4-token attention
#: window (the tiny model's 64 is longer than every drawn row, so no window would ever slide)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "recurrent_gemma_w4": ("recurrent_gemma", {"attention_window_size": 4}),
}


def _build(family: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A fresh stock tiny model of ``family`` (or of a :data:`VARIANTS` entry)."""
    from ..tiny import tiny_model

    base, overrides = VARIANTS.get(family, (family, {}))
    return tiny_model(base, dtype=dtype, **overrides)


@functools.lru_cache(maxsize=None)
def _models(family: str, dtype: torch.dtype = torch.float32, wrap: bool = True) -> tuple[nn.Module, nn.Module]:
    """(stock, subject) tiny models of ``family``: the same weights, the subject a deep copy, wrapped by
    :func:`safepad.wrap` (``wrap=False``: left stock, to check that the oracle catches stock's defects)."""
    import safepad

    stock = _build(family, dtype)
    subject = copy.deepcopy(stock)
    return stock, safepad.wrap(subject) if wrap else subject


def _io(model: nn.Module):
    from ..scenarios import _ModelIO

    return _ModelIO(model)


def _is_safepad_error(exc: BaseException) -> bool:
    """Whether ``exc`` was raised by safepad itself (its raise site in the package, not in safepad.testing); under
    ``torch.compile``, a dynamo error raised from one (its ``__cause__``, e.g. ``InternalTorchDynamoError``)."""
    from ..._tracing import is_device_check_error
    from ...errors import PaddingError, UnsupportedModelError

    if isinstance(exc, (PaddingError, UnsupportedModelError)) or is_device_check_error(exc):
        return True
    cause = exc.__cause__
    if cause is not None and type(exc).__module__.startswith("torch._dynamo") and _is_safepad_error(cause):
        return True
    if not isinstance(exc, (ValueError, TypeError, NotImplementedError, RuntimeError)):
        return False
    tb = exc.__traceback__
    last = None
    while tb is not None:
        last = tb
        tb = tb.tb_next
    if last is None:
        return False
    path = Path(last.tb_frame.f_code.co_filename).resolve()
    return _SAFEPAD_DIR in path.parents and _TESTING_DIR not in path.parents and path.parent != _TESTING_DIR


def _rel(got: Tensor, ref: Tensor) -> float:
    """max |got - ref| / max(1, max |ref|), inf on a shape mismatch."""
    if got.shape != ref.shape:
        return math.inf
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(got).all():
        return math.inf
    return (got - ref).abs().max().item() / max(1.0, ref.abs().max().item()) if ref.numel() else 0.0


# --------------------------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------------------------


@dataclass
class FuzzStats:
    """Counts of one family's fuzzing: call sequences (examples) and how many of them ran compiled, calls made,
    calls refused by a safepad error, skipped draws per known defect, failures (their repro messages)."""

    family: str
    sequences: int = 0
    compiled: int = 0
    calls: int = 0
    refused: int = 0
    rules: dict[str, int] = field(default_factory=dict)
    surfaces: dict[str, int] = field(default_factory=dict)  # input forms and entry points drawn ("mask:4d_bool", ...)
    skipped: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    first_unshrunk: str | None = None  # the first failing call sequence as drawn, before hypothesis shrinks it
    seconds: float = 0.0
    cpu_seconds: float = 0.0

    def line(self) -> str:
        skipped = ", ".join(f"{k}: {v}" for k, v in sorted(self.skipped.items())) or "none"
        return (
            f"{self.family:22s} sequences {self.sequences:5d} (compiled {self.compiled:3d})  calls {self.calls:6d}  "
            f"refused {self.refused:4d}  "
            f"failures {len(self.failures)}  {self.seconds:6.1f} s ({self.cpu_seconds:.1f} s CPU)  "
            f"skipped draws: {skipped}\n{'':22s} surfaces: {self.surface_line()}"
        )

    def surface_line(self) -> str:
        """The surfaces drawn, grouped: ``args keywords 5 positional 4 | masks int 3 bool 1 ... | positions ... |
        sizes ... | rl ... | guard ... | audit ...`` (a group with no draw reads 0)."""
        groups: dict[str, list[str]] = {g: [] for g in ("args", "mask", "positions", "sizes", "dtype", "rl", "guard",
                                                        "callbacks", "audit", "assisted")}
        for k, v in sorted(self.surfaces.items()):
            g, _, name = k.partition(":")
            groups.setdefault(g, []).append(f"{name} {v}")
        return " | ".join(f"{g} " + (" ".join(v) if v else "0") for g, v in groups.items())


STATS: dict[str, FuzzStats] = {}


def _stats(family: str) -> FuzzStats:
    return STATS.setdefault(family, FuzzStats(family))


# --------------------------------------------------------------------------------------------------------------
# The session: one family, the live cached batch, the rules
# --------------------------------------------------------------------------------------------------------------

Batch = list[list[int | None]]  # rows of equal width; None is a pad column


@dataclass
class _Stream:
    """The live cached batch: each row's real tokens so far, the ``[B, W]`` mask of every column fed, the cache,
    tokens generate returned but that were not fed yet (``pending``), and layout flags."""

    history: list[list[int]]
    mask: Tensor
    cache: Any
    pending: list[int] | None = None
    right: bool = False
    padded: bool = False


def _layout(batch: Batch) -> tuple[Tensor, Tensor, dict[str, bool]]:
    """(``[B, W]`` ids with pads = PAD_ID, ``[B, W]`` 0/1 mask, flags right / left / holes) of a drawn batch."""
    ids = torch.tensor([[PAD_ID if t is None else t for t in row] for row in batch], dtype=torch.long)
    mask = torch.tensor([[0 if t is None else 1 for t in row] for row in batch], dtype=torch.long)
    flags = {"right": False, "left": False, "holes": False}
    for row in mask.tolist():
        real = [i for i, m in enumerate(row) if m]
        if not real:
            continue
        lo, hi = real[0], real[-1]
        flags["left"] |= lo > 0
        flags["right"] |= hi < len(row) - 1
        flags["holes"] |= hi - lo + 1 != len(real)
    return ids, mask, flags


def _positions(mask: Tensor, start: Tensor | None = None) -> Tensor:
    """generate-style ``[B, W]`` position ids: each real token's index among its row's real tokens (from ``start``
    ``[B]``), pads set to 1."""
    pos = mask.cumsum(-1) - 1
    if start is not None:
        pos = pos + start[:, None]
    return pos.masked_fill(mask == 0, 1)

