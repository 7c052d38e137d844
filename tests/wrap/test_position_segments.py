"""Every layer of a hybrid reads the same sequences from ``position_ids`` (docs/limits.md, "`position_ids` layouts
read as packing").

safepad's recurrent layers start a new sequence at each 0 after a row's first real token; transformers' attention
(``masking_utils.find_packed_sequence_indices``, used when no mask and no cache reach the model) wherever a position
is not the previous one plus 1. Where the two readings agree (positions ``0, 1, 2, ...`` restarting at 0), every
layer's hidden states equal each sequence run alone through the stock model; where they differ (``[-1, 0, 1, ...]``:
attention one sequence, recurrent layers two; ``[0, 1, 5, 6, ...]``: the reverse) the output matched neither reading
(nemotron_h 0.66 off one sequence, 0.014 off the two) and now raises.
"""

from __future__ import annotations

import copy

import pytest
import torch

import safepad
from safepad.testing.tiny import tiny_model

from .helpers import family_param

pytestmark = pytest.mark.usefixtures("quiet_transformers")

HYBRIDS = ["nemotron_h", "qwen3_next", "lfm2", "jamba", "bamba"]


@pytest.fixture(scope="module", params=[family_param(f) for f in HYBRIDS])
def models(request):
    stock = tiny_model(request.param)
    return stock, safepad.wrap(copy.deepcopy(stock))


def _ids(T: int) -> torch.Tensor:
    return torch.randint(3, 200, (1, T), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
@pytest.mark.parametrize(
    "pos, col",
    [
        pytest.param([-1, 0, 1, 2, 3, 4, 5], 1, id="minus1_then_0"),
        pytest.param([0, 1, 2, -1, 0, 1, 2], 3, id="restart_at_minus1"),
        pytest.param([0, 1, 5, 6, 7, 8, 9], 2, id="jump"),
    ],
)
def test_positions_the_two_readings_split_differently_raise(models, pos, col):
    _, wrapped = models
    with pytest.raises(ValueError, match=rf"position_ids\[0\] go from .* at column {col}.*restarting at 0"):
        wrapped(input_ids=_ids(len(pos)), position_ids=torch.tensor([pos]), use_cache=False)


@torch.no_grad()
@pytest.mark.parametrize("pads", [pytest.param(0, id="no_pads"), pytest.param(2, id="trailing_pads")])
def test_every_layer_equals_each_segment_alone(models, pads):
    """Positions restarting at 0 (both readings agree): every hidden state of every layer, per segment, equals the
    segment alone through the stock model (a trailing pad tail with a mask, which safepad drops)."""
    stock, wrapped = models
    lens = [3, 4]
    T = sum(lens) + pads
    ids = _ids(T)
    pos = torch.tensor([[*range(3), *range(4), *([0] * pads)]])
    kw = {"attention_mask": torch.tensor([[1] * sum(lens) + [0] * pads])} if pads else {}
    got = wrapped(input_ids=ids, position_ids=pos, use_cache=False, output_hidden_states=True, **kw).hidden_states
    start = 0
    for L in lens:
        alone = stock(input_ids=ids[:, start : start + L], use_cache=False, output_hidden_states=True).hidden_states
        assert len(alone) == len(got)
        for layer, (g, a) in enumerate(zip(got, alone)):
            torch.testing.assert_close(g[:, start : start + L], a, atol=1e-4, rtol=1e-4, msg=f"layer {layer}")
        start += L
