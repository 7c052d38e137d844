"""Regression tests for defects the call-sequence fuzzer found (safepad.testing.fuzz), each as the fuzzer's
shrunk repro. Open ones are ``xfail(strict=True)``: when a fix lands, the test passes, strict xfail fails, and
the marker (and the matching entry of ``fuzz.KNOWN_DEFECTS``) comes out."""

from __future__ import annotations

import pytest

from safepad.testing import fuzz
from safepad.testing.tiny import family_available


def _param(family: str, *marks, id: str):
    ok, why = family_available(family)
    return pytest.param(family, id=id, marks=(*marks, *(() if ok else (pytest.mark.skip(reason=why),))))


_HOLE_NO_POS = pytest.mark.xfail(
    strict=True,
    reason="issue 28 item 7 on more RoPE hybrids: a hole in the mask of an uncached call without position_ids "
    "gets wrong positions (olmo_hybrid 3.2e-2, lfm2_moe 1.5e-4); the call must be right or raise",
)


@pytest.mark.parametrize(
    "family",
    [
        _param("olmo_hybrid", _HOLE_NO_POS, id="olmo_hybrid"),
        _param("lfm2_moe", _HOLE_NO_POS, id="lfm2_moe"),
    ],
)
def test_hole_without_position_ids(family: str) -> None:
    s = fuzz.Session(family, skip_known=False)
    s.forward([[4, None, 3, 3, 3, 3, 3, 3], [3, None, None, None, None, None, None, None]], position_ids=False)


@pytest.mark.xfail(
    strict=True,
    reason="issue 28 item 7 on zaya: with a hole and no position_ids the logits pass at 1e-4 but the gradients "
    "of the attention's qk_norm are 1.1e-3 (of the largest gradient) off the rows alone",
)
@pytest.mark.parametrize("family", [_param("zaya", id="zaya")])
def test_hole_without_position_ids_gradients(family: str) -> None:
    s = fuzz.Session(family, skip_known=False)
    s.forward(
        [
            [3, 3, 3, 3, 3, 3, 3, 3, 3, None, None, None],
            [3, 3, 3, 3, 3, 8, 162, 163, 212, 239, 247, 250],
            [3, None, None, None, None, 3, 30, 86, 120, 150, 214, 250],
        ],
        position_ids=False, labels=True, backward=True,
    )


@pytest.mark.xfail(
    strict=True,
    reason="output_attentions on a cached chunk after a hole returns the weights in the re-laid slot order "
    "(inkling2_loop_text 0.37; issue 28 item 1's mechanism with a hole instead of right padding)",
)
@pytest.mark.parametrize("family", [_param("inkling2_loop_text", id="inkling2_loop_text")])
def test_attentions_after_hole_in_cached_chunk(family: str) -> None:
    s = fuzz.Session(family, skip_known=False)
    s.prefill([[3]], position_ids=False)
    s.chunk([[None, 3]], position_ids=False, output_attentions=True)

