"""check_four_d_mask against transformers' own 4-D masks (masking_utils.sdpa_mask / eager_mask): the plain causal
masks transformers builds pass, the same masks with a padding mask folded in raise, naming the hidden key."""

from __future__ import annotations

import pytest
import torch

from safepad.layout.masks_4d import check_four_d_mask

masking_utils = pytest.importorskip("transformers.masking_utils")


def _built(kind: str, padding: torch.Tensor | None, q: int, kv: int) -> torch.Tensor:
    """transformers' 4-D mask ``[B, 1, q, kv]`` for queries at the last ``q`` of ``kv`` positions."""
    B = 2 if padding is None else padding.shape[0]
    kw = dict(batch_size=B, q_length=q, kv_length=kv, q_offset=kv - q, attention_mask=padding)
    if kind == "sdpa":
        return masking_utils.sdpa_mask(**kw, allow_is_causal_skip=False)
    return masking_utils.eager_mask(**kw, dtype=torch.float32)


@pytest.mark.parametrize("kind", [pytest.param("sdpa", id="bool-sdpa"), pytest.param("eager", id="additive-eager")])
@pytest.mark.parametrize(("q", "kv"), [pytest.param(5, 5, id="prefill"), pytest.param(2, 7, id="chunk"),
                                       pytest.param(1, 6, id="decode-step")])
def test_transformers_causal_masks_pass(kind: str, q: int, kv: int) -> None:
    check_four_d_mask(_built(kind, None, q, kv), "M")


@pytest.mark.parametrize("kind", [pytest.param("sdpa", id="bool-sdpa"), pytest.param("eager", id="additive-eager")])
@pytest.mark.parametrize(("pads", "col"), [pytest.param([0, 0, 1, 1, 1], 0, id="left"),
                                           pytest.param([1, 1, 0, 1, 1], 2, id="hole")])
def test_padding_folded_in_raises_naming_the_key(kind: str, pads: list[int], col: int) -> None:
    padding = torch.tensor([[1, 1, 1, 1, 1], pads]).bool()
    with pytest.raises(ValueError, match=rf"row 1, query \d+, key column {col}\).*2-D \[batch, seqlen\]"):
        check_four_d_mask(_built(kind, padding, 5, 5), "M")


@pytest.mark.parametrize("mask", [pytest.param(None, id="none"), pytest.param(torch.ones(2, 5), id="2-D"),
                                  pytest.param(torch.ones(2, 1, 0, 0), id="empty-4-D")])
def test_other_arguments_pass(mask) -> None:
    check_four_d_mask(mask, "M")
