"""The RG-LRU's prepared gate parameters (stacked block weights, biases, ``-c softplus(Λ)`` in the compute dtype),
kept inside ``safepad.ops.prepared.keep_prepared`` (a wrapped ``generate``) between calls that need no gradient of
them: a changed parameter is read by the very next call, against a float64 token-by-token reference
(``tests/ops/reference_rg_lru.py``) on the parameters' current values; outside a scope nothing is kept."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from safepad.ops.prepared import keep_prepared
from safepad.ops.rg_lru import rg_lru, rg_lru_step
from tests.ops.reference_rg_lru import ref_rg_lru

H, P = 2, 4
W = H * P
B = 3
NAMES = ("input_gate_weight", "input_gate_bias", "recurrent_gate_weight", "recurrent_gate_bias", "recurrent_param")
#: float64 computes in float64 (the reference's rounding); bfloat16 parameters compute in float32: a few float32
#: ulps of the O(1) states
TOL = {torch.float64: {"rtol": 1e-12, "atol": 1e-12}, torch.bfloat16: {"rtol": 1e-5, "atol": 1e-5}}


class _Rglru(nn.Module):
    """The RG-LRU's parameters as RecurrentGemma's ``RecurrentGemmaRglru`` holds them (``[H, P, P]``, ``[H, P]``,
    ``[W]``)."""

    def __init__(self, dtype: torch.dtype, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.input_gate_weight = nn.Parameter((torch.randn(H, P, P, generator=g) * 0.6).to(dtype))
        self.input_gate_bias = nn.Parameter((torch.randn(H, P, generator=g) * 0.3).to(dtype))
        self.recurrent_gate_weight = nn.Parameter((torch.randn(H, P, P, generator=g) * 0.6).to(dtype))
        self.recurrent_gate_bias = nn.Parameter((torch.randn(H, P, generator=g) * 0.3).to(dtype))
        self.recurrent_param = nn.Parameter((torch.randn(W, generator=g) * 0.5 - 1.0).to(dtype))

    def params(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, n) for n in NAMES)


def _inputs(dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [B, W]`` in ``dtype``, ``state [B, W]`` float32 (float64 for float64), as the cache holds it."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, W, generator=g) * 1.5).to(dtype)
    state = torch.randn(B, W, generator=g).to(torch.float64 if dtype == torch.float64 else torch.float32)
    return x, state


def _ref_step(x: torch.Tensor, state: torch.Tensor, mod: _Rglru) -> torch.Tensor:
    """The float64 state after one token per row continuing ``state``, on ``mod``'s current parameters ``[B, W]``."""
    params = [p.detach() for p in mod.params()]
    return torch.stack([ref_rg_lru(x[b][None], *params, state[b])[1] for b in range(x.shape[0])])


def _new_values(p: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return (p.detach().double() + torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5).to(p.dtype)


def _copy_under_no_grad(mod: _Rglru, name: str) -> None:
    p = getattr(mod, name)
    with torch.no_grad():
        p.copy_(_new_values(p))


def _load_state_dict(mod: _Rglru, name: str) -> None:
    mod.load_state_dict({**mod.state_dict(), name: _new_values(getattr(mod, name))})


def _optimizer_step(mod: _Rglru, name: str) -> None:
    p = getattr(mod, name)
    p.grad = (p.detach() - _new_values(p)).to(p.dtype)  # lr 1: the step lands on the new values
    torch.optim.SGD([p], lr=1.0).step()


def _new_parameter(mod: _Rglru, name: str) -> None:
    setattr(mod, name, nn.Parameter(_new_values(getattr(mod, name))))


def _new_parameter_over_the_same_memory(mod: _Rglru, name: str) -> None:
    p = getattr(mod, name)
    p.data.copy_(_new_values(p))  # through a throwaway alias: no version counter moves
    setattr(mod, name, nn.Parameter(p.data))  # another object, the same data pointer, at version 0 as p


def _data_assignment(mod: _Rglru, name: str) -> None:
    p = getattr(mod, name)
    p.data = _new_values(p)  # same object, new storage; its _version does not move


CHANGES = [
    pytest.param(_copy_under_no_grad, id="copy_-under-no_grad"),
    pytest.param(_load_state_dict, id="load_state_dict"),
    pytest.param(_optimizer_step, id="optimizer-step"),
    pytest.param(_new_parameter, id="new-parameter"),
    pytest.param(_new_parameter_over_the_same_memory, id="new-parameter-same-memory"),
    pytest.param(_data_assignment, id="data-assignment"),
]
DTYPES = [pytest.param(torch.float64, id="float64"), pytest.param(torch.bfloat16, id="bf16-params-float32-compute")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("change", CHANGES)
@pytest.mark.parametrize("name", NAMES)
def test_a_changed_parameter_is_read_by_the_next_step(name, change, dtype):
    mod = _Rglru(dtype)
    x, state = _inputs(dtype)
    with keep_prepared():
        with torch.no_grad():
            _, before = rg_lru_step(x, state, *mod.params())  # keeps the prepared parameters
            rg_lru_step(x, state, *mod.params())  # and reads them back
        torch.testing.assert_close(before.double(), _ref_step(x, state, mod), **TOL[dtype])
        change(mod, name)
        ref = _ref_step(x, state, mod)
        assert (before.double() - ref).abs().max() > 1e-3, "the change must move the state (else the test is void)"
        with torch.no_grad():
            _, after = rg_lru_step(x, state, *mod.params())
    torch.testing.assert_close(after.double(), ref, **TOL[dtype])


@pytest.mark.parametrize("change", CHANGES)
def test_a_changed_parameter_is_read_by_the_next_scan(change):
    """The scan (a prefill) keeps the same prepared parameters: a change between two prefills is read."""
    mod = _Rglru(torch.float64)
    x = (torch.randn(B, 5, W, generator=torch.Generator().manual_seed(3)) * 1.5).double()
    with keep_prepared(), torch.no_grad():
        rg_lru(x, *mod.params())
        change(mod, "recurrent_gate_weight")
        y = rg_lru(x, *mod.params())
    params = [p.detach() for p in mod.params()]
    for b in range(B):
        torch.testing.assert_close(y[b], ref_rg_lru(x[b], *params, None)[0], rtol=1e-12, atol=1e-12)


def test_gradients_reach_the_parameters_after_a_no_grad_step():
    """A call that needs the parameters' gradient builds the prepared parameters inside the graph, also after a
    no-grad call kept them: every parameter's gradient equals the float64 reference's."""
    mod = _Rglru(torch.float64)
    x, state = _inputs(torch.float64)
    w = torch.randn(B, W, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    with keep_prepared():
        with torch.no_grad():
            rg_lru_step(x, state, *mod.params())
        _, new = rg_lru_step(x, state, *mod.params(), started=torch.tensor([True, False, True]))
    (new * w).sum().backward()
    got = [p.grad.clone() for p in mod.params()]
    ref_params = [p.detach().clone().requires_grad_() for p in mod.params()]
    loss = 0.0
    for b in range(B):
        _, h = ref_rg_lru(x[b][None], *ref_params, state[b] if b != 1 else None)  # row 1 has not started: a reset
        loss = loss + (h * w[b]).sum()
    loss.backward()
    for name, g, r in zip(NAMES, got, ref_params):
        torch.testing.assert_close(g, r.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_an_inference_mode_step_then_a_step_with_a_gradient_of_the_input():
    """Prepared parameters kept under ``inference_mode`` (inference tensors, which autograd cannot save) are not
    reused by a grad-enabled call of frozen parameters: the input's gradient equals the reference's."""
    mod = _Rglru(torch.float64).requires_grad_(False)
    x, state = _inputs(torch.float64)
    xg = x.clone().requires_grad_()
    with keep_prepared():
        with torch.inference_mode():
            rg_lru_step(x, state, *mod.params())
        _, new = rg_lru_step(xg, state, *mod.params())
    new.sum().backward()
    xr = x.clone().requires_grad_()
    params = list(mod.params())
    sum(ref_rg_lru(xr[b][None], *params, state[b])[1].sum() for b in range(B)).backward()
    torch.testing.assert_close(xg.grad, xr.grad, rtol=1e-10, atol=1e-12)


def test_kept_parameters_do_not_outlive_the_scope():
    """Inside a scope the kept values hold the parameters; once it ends, nothing does."""
    mod = _Rglru(torch.bfloat16)
    x, state = _inputs(torch.bfloat16)
    with keep_prepared(), torch.no_grad():
        rg_lru_step(x, state, *mod.params())
    refs = [weakref.ref(p) for p in mod.params()]
    del mod
    gc.collect()
    assert all(r() is None for r in refs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_outside_a_scope_a_write_through_data_is_read(dtype):
    """A write through ``.data`` moves no version counter (nor the data pointer): a value kept between calls could
    not see it. Outside a scope (a hand-written decode loop, a training step) nothing is kept, so the next step
    reads the new values."""
    mod = _Rglru(dtype)
    x, state = _inputs(dtype)
    with torch.no_grad():
        _, before = rg_lru_step(x, state, *mod.params())
    p = mod.recurrent_gate_weight
    version, ptr = p._version, p.data_ptr()
    p.data.copy_(_new_values(p))
    assert (p._version, p.data_ptr()) == (version, ptr)  # the write is invisible to a version / pointer key
    ref = _ref_step(x, state, mod)
    assert (before.double() - ref).abs().max() > 1e-3, "the change must move the state (else the test is void)"
    with torch.no_grad():
        _, after = rg_lru_step(x, state, *mod.params())
    torch.testing.assert_close(after.double(), ref, **TOL[dtype])
