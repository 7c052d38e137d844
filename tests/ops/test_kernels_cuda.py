"""CUDA kernel path == torch core, on random varlen inputs (skipped without CUDA + kernels)."""

from __future__ import annotations

import pytest
import torch

from safepad.ops import causal_conv1d, causal_conv1d_step, kernels, ssd_scan, ssd_step
from safepad.testing.inputs import random_seq_idx
from safepad.testing.inputs import ssd_inputs as _ssd_inputs

pytestmark = pytest.mark.cuda

_NEED = ("mamba_chunk_scan_combined", "selective_state_update", "causal_conv1d_fn", "causal_conv1d_update")
_missing = [n for n in _NEED if not kernels.kernels_available()[n]]
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
if _missing:
    pytest.skip(f"kernels not installed: {', '.join(_missing)}", allow_module_level=True)

DEV = "cuda"
TOL = {torch.float32: 2e-3, torch.bfloat16: 3e-2}  # TF32 / bf16 matmuls inside the kernels


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def varlen_seq_idx(Bsz: int, T: int, seed: int, max_seqs: int = 5) -> torch.Tensor:
    return random_seq_idx(Bsz, T, seed, DEV, max_seqs=max_seqs)


def ssd_inputs(Bsz, T, H=8, P=64, G=2, N=64, dtype=torch.float32, seed=0):
    return _ssd_inputs(Bsz, T, DEV, dtype, heads=H, head_dim=P, groups=G, state=N, seed=seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["seq_idx", "initial_state", "mask"])
def test_conv_kernel_matches_torch(dtype, mode):
    Bsz, T, D, K = 3, 300, 256, 4
    g = torch.Generator(device=DEV).manual_seed(1)
    x = torch.randn(Bsz, T, D, generator=g, device=DEV).to(dtype)
    w = torch.randn(D, K, generator=g, device=DEV) * 0.5
    b = torch.randn(D, generator=g, device=DEV)
    kw = {"activation": "silu", "return_final_state": True, "state_len": K}
    if mode == "seq_idx":
        kw["seq_idx"] = varlen_seq_idx(Bsz, T, 2)
    else:
        kw["initial_state"] = torch.randn(Bsz, D, K, generator=g, device=DEV).to(dtype)
    if mode == "mask":
        mask = torch.ones(Bsz, T, dtype=torch.bool, device=DEV)
        mask[0, 250:] = False
        mask[2, 17:] = False
        kw["token_mask"] = mask
    y_k, s_k = causal_conv1d(x, w, b, backend="kernels", **kw)
    y_t, s_t = causal_conv1d(x, w, b, backend="torch", **kw)
    assert rel_err(y_k, y_t) < TOL[dtype] and torch.equal(s_k, s_t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_scan_kernel_matches_torch_varlen_init_mask(dtype):
    Bsz, T = 2, 700
    t = ssd_inputs(Bsz, T, dtype=dtype)
    seq = varlen_seq_idx(Bsz, T, 3)
    mask = torch.ones(Bsz, T, dtype=torch.bool, device=DEV)
    mask[1, 650:] = False
    kw = {"chunk_size": 128, "D": t["D"], "dt_bias": t["dt_bias"], "dt_limit": (0.01, 0.5), "seq_idx": seq,
              "initial_state": t["initial_state"], "token_mask": mask, "return_final_state": True}
    args = (t["x"], t["dt"], t["A"], t["B"], t["C"])
    y_k, f_k = ssd_scan(*args, backend="kernels", **kw)
    y_t, f_t = ssd_scan(*args, backend="torch", **kw)
    assert rel_err(y_k.float() * mask[..., None, None], y_t.float() * mask[..., None, None]) < TOL[dtype]
    assert rel_err(f_k, f_t) < TOL[dtype]


def test_scan_kernel_varlen_states_batch1():
    T = 900
    t = ssd_inputs(1, T)
    seq = varlen_seq_idx(1, T, 4, max_seqs=8)
    kw = {"chunk_size": 128, "D": t["D"], "dt_bias": t["dt_bias"], "seq_idx": seq, "initial_state": t["initial_state"],
              "return_final_state": True, "return_varlen_states": True}
    args = (t["x"], t["dt"], t["A"], t["B"], t["C"])
    with torch.no_grad():
        y_k, f_k, v_k = ssd_scan(*args, backend="kernels", **kw)
        y_t, f_t, v_t = ssd_scan(*args, backend="torch", **kw)
    assert rel_err(y_k, y_t) < TOL[torch.float32] and rel_err(v_k, v_t) < TOL[torch.float32]
    assert rel_err(f_k, f_t) < TOL[torch.float32]


def test_scan_kernel_varlen_states_with_grad_is_not_dropped():
    t = ssd_inputs(2, 200)
    x = t["x"].requires_grad_(True)
    with pytest.raises(ValueError, match="varlen"):
        ssd_scan(x, t["dt"], t["A"], t["B"], t["C"], backend="kernels", return_varlen_states=True)
    _, v = ssd_scan(x, t["dt"], t["A"], t["B"], t["C"], chunk_size=64, return_varlen_states=True)  # auto -> torch
    assert v.shape[0] == 2


def test_scan_kernel_grads_match_torch():
    Bsz, T = 2, 400
    t = ssd_inputs(Bsz, T, H=4, P=32, N=32, seed=5)
    seq = varlen_seq_idx(Bsz, T, 6)
    grads = {}
    for backend in ("kernels", "torch"):
        p = {k: v.detach().clone().requires_grad_(True) for k, v in t.items()}
        y, f = ssd_scan(p["x"], p["dt"], p["A"], p["B"], p["C"], chunk_size=64, D=p["D"], dt_bias=p["dt_bias"],
                        seq_idx=seq, initial_state=p["initial_state"], return_final_state=True, backend=backend)
        (y.square().sum() + f.sum()).backward()
        grads[backend] = {k: v.grad for k, v in p.items()}
    for k in grads["torch"]:
        assert rel_err(grads["kernels"][k], grads["torch"][k]) < 5e-3, k


@pytest.mark.parametrize("dt_limit", [(0.0, float("inf")), (0.05, float("inf")), (0.0, 0.01)])
def test_step_kernels_match_torch(dt_limit):
    t = ssd_inputs(4, 1)
    args = (t["initial_state"], t["x"][:, 0], t["dt"][:, 0], t["A"], t["B"][:, 0], t["C"][:, 0])
    kw = {"D": t["D"], "dt_bias": t["dt_bias"], "dt_limit": dt_limit}
    with torch.no_grad():
        y_k, s_k = ssd_step(*args, backend="kernels", **kw)
        y_t, s_t = ssd_step(*args, backend="torch", **kw)
    assert rel_err(y_k, y_t) < 1e-4 and rel_err(s_k, s_t) < 1e-4

    D, K = 128, 4
    g = torch.Generator(device=DEV).manual_seed(2)
    x = torch.randn(4, D, generator=g, device=DEV)
    state = torch.randn(4, D, K, generator=g, device=DEV)
    w, b = torch.randn(D, K, generator=g, device=DEV), torch.randn(D, generator=g, device=DEV)
    with torch.no_grad():
        yk, sk = causal_conv1d_step(x, state, w, b, activation="silu", backend="kernels")
        yt, st = causal_conv1d_step(x, state, w, b, activation="silu", backend="torch")
    assert rel_err(yk, yt) < 1e-5 and torch.equal(sk, st)
