"""``torch.compile(model)`` traces the model pre-hook as a frame of its own: it must not guard on keyword arguments
it does not read. It read ``CACHE_NAMES`` / ``real_token_mask`` through module-level names, and dynamo guards on
the whole key set of ``kwargs`` when such a key is missing (``len(kwargs) == 4``): two calls differing only in
``return_dict`` or ``output_attentions`` recompiled the hook, and a call sequence with many sets of keyword
arguments reached dynamo's recompile limit and ran the hook eagerly. Reference: the stock model's compiled frames
for the same two calls (transformers' own forward frame recompiles there too).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo as dynamo
from torch._dynamo.utils import counters

import safepad
from safepad.testing.tiny import family_available, tiny_model

pytestmark = pytest.mark.usefixtures("quiet_transformers")

#: torch 2.15's dynamo guards on the whole key set of ``kwargs`` for a missing key even when the key is a constant of
#: the traced code (``safepad._tracing.kwarg``'s way out on torch 2.11-2.14): the hook recompiles for another set of
#: keyword arguments, one more frame than stock (a recompile, not a wrong result; found by the torch-newest tier)
_TORCH_2_15 = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 15)


def _frames(model, calls: list[dict]) -> list[int]:
    """Frames dynamo compiles (first compiles and recompiles) for each call of ``calls`` on ``torch.compile(model)``."""
    dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="eager")
    out = []
    for kw in calls:
        before = counters["frames"]["ok"]
        compiled(**kw)
        out.append(counters["frames"]["ok"] - before)
    dynamo.reset()
    return out


@pytest.mark.parametrize(
    ("family", "cached", "extra"),
    [
        pytest.param("lfm2", False, {"return_dict": False}, id="lfm2-uncached-return_dict"),
        pytest.param("lfm2", True, {"return_dict": False}, id="lfm2-cached-return_dict"),
        pytest.param("bamba", True, {"output_attentions": False}, id="bamba-cached-output_attentions"),
    ],
)
@pytest.mark.xfail(_TORCH_2_15, strict=True, reason="torch 2.15 guards on every kwargs key for a missing one")
@torch.no_grad()
def test_an_unrelated_kwarg_recompiles_no_hook_frame(family: str, cached: bool, extra: dict):
    ok, why = family_available(family)
    if not ok:
        pytest.skip(why)
    stock = tiny_model(family).eval()
    wrapped = safepad.wrap(copy.deepcopy(stock), backend="torch")
    ids = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    base = {"input_ids": ids, "attention_mask": mask, "position_ids": torch.tensor([[0, 0, 1, 2], [0, 1, 2, 3]]),
            "use_cache": cached}
    want = _frames(stock, [base, {**base, **extra}])
    got = _frames(wrapped, [base, {**base, **extra}])
    # the wrapped model adds its hook frames on the first call, and recompiles only what stock recompiles
    assert got[1] == want[1], (got, want)
