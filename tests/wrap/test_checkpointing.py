"""Gradient checkpointing: a recompute uses the boundaries of the call that produced it, never another's.

Two packed forwards of the same shape but different boundaries before one backward (DPO-style double
forwards), and an unpacked no-grad forward between a forward and its backward (evaluation inside a training
step), must give the same gradients as the same steps without checkpointing, for both ``use_reentrant``
values. The reference is the wrapped model without checkpointing, itself checked against each sequence run
alone through the stock model in the family tests.
"""

from __future__ import annotations

import copy

import pytest
import torch

import safepad
from safepad.testing.tiny import tiny_model
from safepad.wrap import wrapped_modules

from .helpers import packed_batch

FAMILIES = [
    pytest.param("recurrent_gemma", id="recurrent_gemma"),
    pytest.param("mamba2", id="mamba2"),
    pytest.param("nemotron_h", id="nemotron_h"),
    pytest.param("qwen3_next", id="qwen3_next"),
    pytest.param("jamba", id="jamba"),
    pytest.param("lfm2", id="lfm2"),
]
REENTRANT = [pytest.param(True, id="reentrant"), pytest.param(False, id="non-reentrant")]


def _loss(out) -> torch.Tensor:
    return (out.logits.float() ** 2).mean()


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel_err(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a
    num = sum(float((a[k] - b[k]).double().norm() ** 2) for k in a) ** 0.5
    den = sum(float(b[k].double().norm() ** 2) for k in b) ** 0.5
    return num / den


def _models(family: str, reentrant: bool):
    base = safepad.wrap(tiny_model(family)).train()
    ckpt = copy.deepcopy(base)
    ckpt.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    return base, ckpt


def _count_recomputes(model) -> list:
    calls: list = []
    for _, mod in wrapped_modules(model):
        mod.register_forward_pre_hook(lambda *a: calls.append(torch.is_grad_enabled()))
    return calls


@pytest.mark.parametrize("reentrant", REENTRANT)
@pytest.mark.parametrize("family", FAMILIES)
def test_two_packed_forwards_one_backward(family, reentrant):
    _, ids1, s1, _, _ = packed_batch([5, 9, 3], seed=1)
    _, ids2, s2, _, _ = packed_batch([8, 4, 5], seed=2)
    base, ckpt = _models(family, reentrant)
    for model in (base, ckpt):
        model.zero_grad()
        loss = _loss(model(input_ids=ids1, seq_idx=s1, use_cache=False))
        loss = loss + _loss(model(input_ids=ids2, seq_idx=s2, use_cache=False))
        loss.backward()
    err = _rel_err(_grads(ckpt), _grads(base))
    assert err < 1e-5, f"{family}: checkpointed grads differ from plain grads by {err:.3g} (relative)"


@pytest.mark.parametrize("reentrant", REENTRANT)
@pytest.mark.parametrize("family", FAMILIES)
def test_unpacked_no_grad_forward_between_forward_and_backward(family, reentrant):
    _, ids1, s1, _, _ = packed_batch([5, 9, 3], seed=1)
    _, ids2, _, _, _ = packed_batch([17], seed=3)
    base, ckpt = _models(family, reentrant)
    for model in (base, ckpt):
        model.zero_grad()
        loss = _loss(model(input_ids=ids1, seq_idx=s1, use_cache=False))
        with torch.no_grad():
            model(input_ids=ids2, use_cache=False)  # an evaluation inside the training step
        calls = _count_recomputes(model)
        loss.backward()
        if model is ckpt:
            assert calls, "the checkpointed mixers were not recomputed during backward"
    err = _rel_err(_grads(ckpt), _grads(base))
    assert err < 1e-5, f"{family}: checkpointed grads differ from plain grads by {err:.3g} (relative)"


@pytest.mark.parametrize("reentrant", REENTRANT)
def test_checkpointing_enabled_before_wrap(reentrant):
    """``gradient_checkpointing_enable`` before ``safepad.wrap`` works the same as after it."""
    _, ids1, s1, _, _ = packed_batch([5, 9, 3], seed=1)
    _, ids2, s2, _, _ = packed_batch([8, 4, 5], seed=2)
    base = safepad.wrap(tiny_model("mamba2")).train()
    ckpt = tiny_model("mamba2").train()
    ckpt.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    safepad.wrap(ckpt)
    for model in (base, ckpt):
        loss = _loss(model(input_ids=ids1, seq_idx=s1, use_cache=False))
        (loss + _loss(model(input_ids=ids2, seq_idx=s2, use_cache=False))).backward()
    assert _rel_err(_grads(ckpt), _grads(base)) < 1e-5


def test_recompute_without_its_context_raises():
    """A checkpoint mechanism safepad does not hook re-runs a mixer without its call context: raise, never guess."""
    from torch.utils.checkpoint import checkpoint

    model = safepad.wrap(tiny_model("mamba2")).train()
    mixer = model.backbone.layers[0].mixer
    _, ids, s, _, _ = packed_batch([5, 9, 3], seed=1)
    model(input_ids=ids, seq_idx=s, use_cache=False)  # the mixer has seen packed boundaries
    h = torch.randn(1, 17, model.config.hidden_size, requires_grad=True)
    out = checkpoint(mixer, h, use_reentrant=False)
    with pytest.raises(RuntimeError, match="without the safepad call context"):
        out.sum().backward()


def test_unwrap_restores_checkpoint_function():
    model = tiny_model("mamba2").train()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    layer = model.backbone.layers[0]
    before = layer._gradient_checkpointing_func
    safepad.wrap(model)
    _, ids, s, _, _ = packed_batch([5, 9, 3], seed=1)
    model(input_ids=ids, seq_idx=s, use_cache=False)
    assert layer._gradient_checkpointing_func is not before  # wrapped for this call
    safepad.unwrap(model)
    assert layer._gradient_checkpointing_func is before


def test_checkpointed_layer_called_outside_a_model_call():
    """A layer called directly (no model call, so no boundaries) recomputes as one sequence per row, no raise."""
    _, ids, s, _, _ = packed_batch([5, 9, 3], seed=1)
    base, ckpt = _models("mamba2", False)
    h = torch.randn(1, 17, base.config.hidden_size, generator=torch.Generator().manual_seed(0))
    grads = []
    for model in (base, ckpt):
        model(input_ids=ids, seq_idx=s, use_cache=False)  # packed call first: installs the hook, mixers saw packing
        model.zero_grad()
        x = h.clone().requires_grad_(True)
        out = model.backbone.layers[0](x)
        (out[0] if isinstance(out, tuple) else out).pow(2).sum().backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-5)
