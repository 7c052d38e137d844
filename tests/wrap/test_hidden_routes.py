"""Returned hidden states are the tensors the loss depends on (``retain_grad`` gives their gradient), as in stock.

transformers' ``test_retain_grad_hidden_states_attentions`` failed on wrapped Nemotron-H: on a right-padded call
with a cache (the config's ``use_cache``) or a row with holes, safepad re-lays the rows and gave back gathered
copies of the hidden states, off the graph of the loss (``.grad`` None). Reference: each row's real tokens alone
through the stock model in float64, the same loss restricted to that row; the wrapped padded batch's
``hidden_states[i].grad`` at the row's real tokens must equal the alone run's, within 4x the float32 stock model's own
error on that row (measured: some ops compute in float32 inside a float64 model; a gradient off the path is None,
a wrong one is O(1) off).
"""

from __future__ import annotations

import copy

import pytest
import torch

import safepad
from safepad.testing.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("quiet_transformers")

_MASKS = {
    "unpadded": [[1] * 8, [1] * 8],
    "left": [[1] * 8, [0, 0, 0] + [1] * 5],
    "right": [[1] * 8, [1] * 5 + [0, 0, 0]],
    "holes": [[1, 0, 1, 1, 0, 1, 1, 1], [0, 1, 1, 0, 1, 1, 0, 1]],
}


def _stock64(family: str):
    model = tiny_model(family).double()
    if callable(getattr(model, "set_experts_implementation", None)):
        model.set_experts_implementation("eager")  # grouped_mm has no float64
    return model


def _hidden_grads(model, ids, mask, weight, base: bool):
    """``[grad of hidden_states[i]]`` ``[B, T, D]`` for loss = sum(weight * output) over the call's output
    (``last_hidden_state`` ``[B, T, D]`` for a base model, ``logits`` ``[B, T, V]`` else)."""
    out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    hidden = out.hidden_states
    for h in hidden:
        h.retain_grad()
    (out[0] * weight).sum().backward()
    model.zero_grad()
    return [h.grad for h in hidden]


@pytest.mark.parametrize("layout", [pytest.param(k, id=k) for k in _MASKS])
@pytest.mark.parametrize(
    "family,base",
    [
        pytest.param("nemotron_h", True, id="nemotron_h-base"),
        pytest.param("nemotron_h", False, id="nemotron_h"),
        pytest.param("bamba", False, id="bamba"),
        pytest.param("qwen3_next", False, id="qwen3_next"),
        pytest.param("lfm2", False, id="lfm2"),
    ],
)
def test_hidden_state_grads_equal_each_row_alone_through_stock(family, base, layout):
    stock32 = tiny_model(family)
    stock = _stock64(family)
    wrapped = safepad.wrap(copy.deepcopy(stock))
    if base:
        stock, stock32, wrapped = stock.model, stock32.model, wrapped.model
    mask = torch.tensor(_MASKS[layout])  # [B, T]
    B, T = mask.shape
    ids = torch.randint(3, 200, (B, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        width = stock(input_ids=ids[:1, :1])[0].shape[-1]
    weight = torch.randn(B, T, width, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    weight = weight * mask[..., None]  # the loss reads real tokens only
    got = _hidden_grads(wrapped, ids, mask, weight, base)
    assert all(g is not None for g in got), [g is None for g in got]
    for b in range(B):
        real = mask[b].bool()
        want = _hidden_grads(stock, ids[b][real][None], None, weight[b][real][None], base)
        # noise: the same row alone through the float32 stock model (some ops compute in float32 even in a float64
        # model, e.g. Nemotron-H's gated norm: float64 agreement stops at float32 rounding)
        noise = _hidden_grads(stock32, ids[b][real][None], None, weight[b][real][None].float(), base)
        assert len(want) == len(got) == len(noise)
        for i, (g, w, n) in enumerate(zip(got, want, noise)):
            # both float64 runs keep float32 steps of their own (stock's, safepad's): a few times that noise
            tol = max(4 * (n[0].double() - w[0]).abs().max().item(), 1e-12 * w.abs().max().item())
            assert (g[b][real] - w[0]).abs().max() <= tol, (b, i)
