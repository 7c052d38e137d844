"""The conv route without causal-conv1d: FLA's Triton ``causal_conv1d`` / ``causal_conv1d_update`` (run by the
Triton interpreter) == the torch core, on packed rows with per-row initial states, right pads and final states, fwd
and bwd, and the decode step. causal-conv1d's markers are set to None here, as on a machine without it."""

from __future__ import annotations

import pytest
import torch

from safepad.ops import causal_conv1d, causal_conv1d_step, kernels

from .test_ops_routes import packed_seq_idx, rel


@pytest.fixture
def no_causal_conv1d(monkeypatch, kernel_calls):
    for name in ("causal_conv1d_fn", "causal_conv1d_update"):
        monkeypatch.setattr(kernels, name, None)
        monkeypatch.setitem(kernels._KERNELS, name, None)
    return kernel_calls


CASES = [
    pytest.param({}, id="plain"),
    pytest.param({"seq_idx": [[5, 7], [12]]}, id="seq_idx"),
    pytest.param({"seq_idx": [[5, 7], [3, 9]], "initial_state": 4, "return_final_state": True}, id="seq_idx+init"),
    pytest.param({"initial_state": 3, "token_mask": "right", "return_final_state": True}, id="init+right-pad"),
    pytest.param({"seq_idx": [[1, 4, 7], [12]], "token_mask": "right", "return_varlen_states": True},
                 id="seq_idx+pad+varlen-states"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("kw", CASES)
def test_fla_conv_matches_torch_fwd_bwd(kw, dtype, no_causal_conv1d):
    Bsz, T, D, K = 2, 12, 16, 4
    g = torch.Generator().manual_seed(3)
    x = torch.randn(Bsz, T, D, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(D, K, generator=g) * 0.5).requires_grad_()
    b = torch.randn(D, generator=g).requires_grad_()
    extra: dict = {}
    for k, v in kw.items():
        if k == "seq_idx":
            extra[k] = packed_seq_idx(v)
        elif k == "initial_state":
            extra[k] = (torch.randn(Bsz, D, v, generator=g) * 0.5).to(dtype).requires_grad_()
        elif k == "token_mask":
            m = torch.ones(Bsz, T, dtype=torch.bool)
            m[1, T - 4 :] = False
            extra[k] = m
        else:
            extra[k] = v
    # fla 0.6.0's compute_dh0_kernel (the backward with an initial state) stops in the Triton interpreter ("mask has
    # unsupported dtype": a scalar bool & a vector mask, which compiled Triton takes): forward only here, the
    # backward with an initial state is checked on a GPU (python -m benchmarks.gpu_check --parts routes)
    backward = "initial_state" not in extra
    outs = {}
    for backend in ("kernels", "torch"):
        leaves = [t for t in (x, w, b, extra.get("initial_state")) if t is not None]
        for t in leaves:
            t.grad = None
        with torch.set_grad_enabled(backward):
            res = causal_conv1d(x, w, b, activation="silu", backend=backend, **extra)
        res = res if isinstance(res, tuple) else (res,)
        if backward:
            (res[0].float().square().sum() + sum(r.float().sum() for r in res[1:])).backward()
        outs[backend] = ([r.detach() for r in res], [t.grad.clone() for t in leaves] if backward else [])
    assert no_causal_conv1d["fla_causal_conv1d"] == 1
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    for a, c in zip(*(outs[k][0] for k in ("kernels", "torch"))):
        assert a.shape == c.shape and a.dtype == c.dtype
        assert rel(a, c) < tol
    for a, c in zip(*(outs[k][1] for k in ("kernels", "torch"))):
        assert rel(a, c) < (1e-4 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("S", [3, 4, 6], ids=lambda s: f"S{s}")
def test_fla_conv_step_matches_torch(S, no_causal_conv1d):
    Bsz, D, K = 3, 16, 4
    g = torch.Generator().manual_seed(5)
    x, st = torch.randn(Bsz, D, generator=g), torch.randn(Bsz, D, S, generator=g)
    w, b = torch.randn(D, K, generator=g), torch.randn(D, generator=g)
    with torch.no_grad():
        yk, sk = causal_conv1d_step(x, st, w, b, activation="silu", backend="kernels")
        yt, s_t = causal_conv1d_step(x, st, w, b, activation="silu", backend="torch")
    assert no_causal_conv1d["fla_causal_conv1d_update"] == 1
    assert rel(yk, yt) < 1e-5 and torch.equal(sk, s_t)


def test_fla_conv_is_not_taken_where_causal_conv1d_is(kernel_calls):
    """With causal-conv1d installed (its stand-in here), its route is the one taken."""
    x, w = torch.randn(1, 8, 16), torch.randn(16, 4)
    causal_conv1d(x, w, activation="silu", backend="kernels")
    assert kernel_calls["causal_conv1d_fn"] == 1 and kernel_calls["fla_causal_conv1d"] == 0
