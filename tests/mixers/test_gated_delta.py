"""safepad.mixers.gated_delta: Qwen3-Next's qkvz / ba regrouping (one gather per output) against the stock split."""

from __future__ import annotations

import pytest
import torch

from safepad.mixers.gated_delta import _project_qkv
from safepad.testing import tiny_model


def _stock_regroup(gdn, hidden: torch.Tensor) -> list[torch.Tensor]:
    """transformers' own projection + split (Qwen3NextGatedDeltaNet.forward): [q | k | v] [B, T, conv_dim],
    z [B, T, H * Dv], b [B, T, H], a [B, T, H]."""
    q, k, v, z, b, a = gdn.fix_query_key_value_ordering(gdn.in_proj_qkvz(hidden), gdn.in_proj_ba(hidden))
    qkv = torch.cat([x.reshape(x.shape[0], x.shape[1], -1) for x in (q, k, v)], dim=-1)
    return [qkv, z.reshape(z.shape[0], z.shape[1], -1), b, a]


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({}, id="grouped_4v_2k"),
        # other sizes, same class: the cached column indices must not be the first config's
        pytest.param({"linear_num_value_heads": 2, "linear_value_head_dim": 8}, id="2v_2k_dv8"),
        pytest.param({"linear_num_value_heads": 6, "linear_num_key_heads": 3}, id="grouped_6v_3k"),
    ],
)
def test_qkvz_ba_regroup_equals_the_stock_split_with_gradients(overrides: dict) -> None:
    model = tiny_model("qwen3_next", **overrides)
    gdn = model.model.layers[0].linear_attn
    hidden = torch.randn(2, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    weights = [gdn.in_proj_qkvz.weight, gdn.in_proj_ba.weight]

    ours = list(_project_qkv(gdn, {"qkv": "qkvz_ba"}, hidden))
    ref = _stock_regroup(gdn, hidden)
    for name, x, r in zip(("qkv", "z", "b", "a"), ours, ref):
        assert x.shape == r.shape and torch.equal(x, r), name  # a permutation of the same values: exact

    # the gradients reach the projections unchanged (index_select's backward scatters each column back)
    cot = [torch.randn(r.shape, generator=torch.Generator().manual_seed(i)) for i, r in enumerate(ref)]
    g_ours = torch.autograd.grad(sum((x * c).sum() for x, c in zip(ours, cot)), weights)
    g_ref = torch.autograd.grad(sum((r * c).sum() for r, c in zip(ref, cot)), weights)
    for go, gr in zip(g_ours, g_ref):
        assert go.is_contiguous() and torch.equal(go, gr)  # the same products summed in the same order
