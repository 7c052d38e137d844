"""Packing read from every ``position_ids`` layout a stock model accepts (issue 25, items 2 and 9).

``[T]`` (one row for the batch, as transformers' mask code expands it), ``[1, T]``, the text row of ``[4, B, T]``
(Qwen3.5 / Qwen4-Exp: row 0 is what their text models hand to ``create_causal_mask``), Qwen4-Exp's ``[1, B, T]``
and ``[3, B, T]`` multimodal RoPE rows restarting at ``(0, 0, 0)``. Each is checked against each sequence run alone
through the stock model, eager and compiled, and the guard must see the packing on the unwrapped model.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch._dynamo as dynamo

import safepad
from safepad.errors import PaddingWarning
from safepad.testing import tiny_model

LENGTHS = (5, 1, 7, 4)
TOL = 1e-4


def _positions(layout: str) -> torch.Tensor:
    pos = torch.cat([torch.arange(n) for n in LENGTHS])  # [T] restarting at 0 per sequence
    return {
        "1d": pos,  # [T]
        "2d": pos[None],  # [1, T]
        "text_row": pos[None, None].expand(4, 1, -1),  # [4, 1, T]: text, t, h, w
        "one_row": pos[None, None],  # [1, 1, T]
        "rope_rows": pos[None, None].expand(3, 1, -1),  # [3, 1, T]: t, h, w
    }[layout]


def _batch(model) -> tuple[list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    vocab = min(model.get_input_embeddings().num_embeddings, 250)
    seqs = [torch.randint(3, vocab, (n,), generator=g) for n in LENGTHS]
    return seqs, torch.cat(seqs)[None]  # [1, T]


def _alone(model, seqs: list[torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(input_ids=s[None], use_cache=False).logits[0] for s in seqs])  # [T, V]


#: (family, layout): every layout its stock model runs with position_ids
CASES = [
    pytest.param("mamba2", "1d", id="mamba2-1d"),
    pytest.param("mamba2", "text_row", id="mamba2-text_row"),
    pytest.param("nemotron_h", "1d", id="nemotron_h-1d"),
    pytest.param("qwen3_5_text", "text_row", id="qwen3_5_text-text_row"),
    pytest.param("qwen3_5_text", "rope_rows", id="qwen3_5_text-rope_rows"),
    pytest.param("qwen3_5_text", "one_row", id="qwen3_5_text-one_row"),
    pytest.param("qwen4_exp_text", "text_row", id="qwen4_exp_text-text_row"),
    pytest.param("qwen4_exp_text", "one_row", id="qwen4_exp_text-one_row"),
    pytest.param("qwen4_exp_text", "rope_rows", id="qwen4_exp_text-rope_rows"),
    pytest.param("qwen4_exp", "text_row", id="qwen4_exp_vlm-text_row"),
    pytest.param("qwen4_exp", "rope_rows", id="qwen4_exp_vlm-rope_rows"),
]


#: compiled (dynamo's own eager backend: the traced pre-hook reads the layouts) on one case per reading rule
COMPILED = [
    pytest.param("mamba2", "1d", True, id="mamba2-1d-compiled"),
    pytest.param("nemotron_h", "1d", True, id="nemotron_h-1d-compiled"),
    pytest.param("qwen3_5_text", "rope_rows", True, id="qwen3_5_text-rope_rows-compiled"),
]


@pytest.mark.parametrize(
    "family,layout,compiled", [pytest.param(*p.values, False, id=f"{p.id}-eager") for p in CASES] + COMPILED
)
def test_restarting_position_ids_are_read_as_packing(family: str, layout: str, compiled: bool):
    torch.manual_seed(0)
    stock = tiny_model(family).eval()
    seqs, ids = _batch(stock)
    ref = _alone(stock, seqs)
    model = safepad.wrap(copy.deepcopy(stock))
    if compiled:
        dynamo.reset()
        model = torch.compile(model, backend="eager")
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=_positions(layout)).logits[0]
    dynamo.reset()
    err = (out - ref).abs().max().item()
    assert err < TOL, f"{family} {layout}: packed logits differ from each sequence alone by {err:.3g}"


@pytest.mark.parametrize("layout", ["text_row", "rope_rows"])
def test_rope_rows_on_a_model_that_reads_two_d_position_ids_raise(layout: str):
    """NemotronH's mask code expands position_ids as [B, T]: a packed call with RoPE rows cannot be served."""
    model = safepad.wrap(tiny_model("nemotron_h").eval())
    _, ids = _batch(model)
    with pytest.raises(ValueError, match=r"several RoPE rows.*\[batch, seqlen\]"):
        with torch.no_grad():
            model(input_ids=ids, position_ids=_positions(layout))


@pytest.mark.parametrize(
    "family,layout",
    [
        pytest.param("mamba2", "1d", id="mamba2-1d"),
        pytest.param("qwen3_5_text", "text_row", id="qwen3_5_text-text_row"),
        pytest.param("qwen3_5_text", "rope_rows", id="qwen3_5_text-rope_rows"),
        pytest.param("qwen4_exp_text", "one_row", id="qwen4_exp_text-one_row"),
    ],
)
def test_guard_sees_packing_in_every_position_layout(family: str, layout: str):
    model = tiny_model(family).eval()
    _, ids = _batch(model)
    with safepad.guard(model, "warn"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            model(input_ids=ids, position_ids=_positions(layout), use_cache=False)
    packed = [w for w in caught if issubclass(w.category, PaddingWarning) and "packed" in str(w.message)]
    assert packed, f"the guard did not report the packed {layout} position_ids on {family}"
    assert "restart at 0 at token 5" in str(packed[0].message)


def test_rope_rows_of_one_sequence_with_an_image_are_not_packing():
    """``get_rope_index``'s rows for one sequence whose image opens it: (0, 0, 0), then (0, h, w) patches, then
    text at (p, p, p). Only the first token is all-zero, so nothing is read as packing."""
    from safepad.layout.normalize import normalize_boundaries

    t, h, w = torch.meshgrid(torch.zeros(1, dtype=torch.long), torch.arange(2), torch.arange(3), indexing="ij")
    vision = torch.stack([t, h, w]).reshape(3, -1).long()  # [3, 6]
    text = torch.arange(3, 8)[None].expand(3, -1)  # [3, 5]
    rows = torch.cat([vision, text], 1)[:, None]  # [3, 1, 11]
    assert normalize_boundaries((1, 11), position_ids=rows) == (None, "none")
    packed = torch.cat([rows, rows], -1)  # [3, 1, 22]: the same sequence twice
    seq_idx, source = normalize_boundaries((1, 22), position_ids=packed)
    assert source == "position_ids" and seq_idx.tolist() == [[0] * 11 + [1] * 11]
