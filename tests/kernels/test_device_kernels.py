"""The ``cuda``-marked kernel tests: each kernel route == the torch core, on random varlen inputs.

One module, two modes (``tests/kernels/conftest.py``):

* ``SAFEPAD_KERNEL_TIER=cuda`` (``make test-cuda`` on a GPU machine): the real kernels on a CUDA device, at the
  shapes below;
* the kernel tier's emulation (``make test-kernels``, ``make test-cuda EMULATE=1``): the same tests on CPU tensors
  through the Triton interpreter and the C++ stand-ins, at smaller shapes (``_size``) that still cross chunk
  boundaries, sequence boundaries and every flag.

Under the emulation, two things differ and are said where they apply: the half-precision cases run in float16
(the Triton interpreter's ``tl.dot`` is wrong for bfloat16: numpy has no bf16), and FLA's ``chunk_delta_h`` kernel
cannot run under the interpreter, so its route is fed FLA's fused-recurrent kernel, the same function (forward
only: it has no backward).

Tolerances: float32 kernels round their matmuls through TF32 (``tl.dot``) on a GPU, bf16 kernels compute in bf16
with float32 accumulation; both are far above float32 rounding, so the bounds here are the kernels' documented
precision (mamba-ssm and FLA test at the same sizes), not one machine's rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from safepad.ops import causal_conv1d, causal_conv1d_step, kernels, ssd_scan, ssd_step
from safepad.ops.delta_rule import chunk_gated_delta_rule
from safepad.ops.selective_scan import selective_scan, selective_state_step
from safepad.testing.inputs import random_seq_idx
from safepad.testing.inputs import ssd_inputs as _ssd_inputs

from .conftest import DEVICE

pytestmark = pytest.mark.cuda

DEV = DEVICE
ON_GPU = DEV == "cuda"
#: the half-precision dtype of the bf16 cases: float16 under the interpreter (its tl.dot is wrong for bfloat16)
HALF = torch.bfloat16 if ON_GPU else torch.float16
TOL = {torch.float32: 2e-3, HALF: 3e-2}  # TF32 / bf16 matmuls inside the kernels (fp16 rounds finer than bf16)


def _size(gpu: int, cpu: int) -> int:
    """``gpu`` on a CUDA device, ``cpu`` under the interpreter (minutes per test at the GPU sizes)."""
    return gpu if ON_GPU else cpu


def _need(*names: str) -> None:
    missing = [n for n in names if not kernels.kernels_available().get(n)]
    if missing:
        pytest.skip(f"kernels not installed: {', '.join(missing)}")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def rms_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """RMS ratio, as FLA's own tests compare bf16 kernels."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).square().mean().sqrt() / b.square().mean().sqrt()).item()


def varlen_seq_idx(Bsz: int, T: int, seed: int, max_seqs: int = 5) -> torch.Tensor:
    return random_seq_idx(Bsz, T, seed, DEV, max_seqs=max_seqs)


def seq_idx_from_lengths(rows: list[list[int]]) -> torch.Tensor:
    """[[3, 5], [8]] -> ``seq_idx`` ``[2, 8]`` int32 on the test device."""
    return torch.tensor([[i for i, n in enumerate(r) for _ in range(n)] for r in rows], dtype=torch.int32, device=DEV)


def ssd_inputs(Bsz, T, H=8, P=64, G=2, N=64, dtype=torch.float32, seed=0):
    return _ssd_inputs(Bsz, T, DEV, dtype, heads=H, head_dim=P, groups=G, state=N, seed=seed)


# ---------------------------------------------------------------------------------------------- conv


@pytest.mark.parametrize("dtype", [torch.float32, HALF], ids=["fp32", "half"])
@pytest.mark.parametrize("mode", ["seq_idx", "initial_state", "mask"])
def test_conv_kernel_matches_torch(dtype, mode):
    _need("causal_conv1d_fn")
    Bsz, T, D, K = 3, _size(300, 70), _size(256, 64), 4
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
        mask[0, T - 50 :] = False
        mask[2, 17:] = False
        kw["token_mask"] = mask
    y_k, s_k = causal_conv1d(x, w, b, backend="kernels", **kw)
    y_t, s_t = causal_conv1d(x, w, b, backend="torch", **kw)
    assert rel_err(y_k, y_t) < TOL[dtype] and torch.equal(s_k, s_t)


def test_conv_step_kernel_matches_torch():
    _need("causal_conv1d_update")
    D, K = 128, 4
    g = torch.Generator(device=DEV).manual_seed(2)
    x = torch.randn(4, D, generator=g, device=DEV)
    state = torch.randn(4, D, K, generator=g, device=DEV)
    w, b = torch.randn(D, K, generator=g, device=DEV), torch.randn(D, generator=g, device=DEV)
    with torch.no_grad():
        yk, sk = causal_conv1d_step(x, state, w, b, activation="silu", backend="kernels")
        yt, st = causal_conv1d_step(x, state, w, b, activation="silu", backend="torch")
    assert rel_err(yk, yt) < 1e-5 and torch.equal(sk, st)


# ---------------------------------------------------------------------------------------------- SSD (Mamba2)


@pytest.mark.parametrize("dtype", [torch.float32, HALF], ids=["fp32", "half"])
def test_scan_kernel_matches_torch_varlen_init_mask(dtype):
    _need("mamba_chunk_scan_combined")
    Bsz, T, chunk = 2, _size(700, 150), _size(128, 32)
    t = ssd_inputs(Bsz, T, dtype=dtype, **({} if ON_GPU else {"H": 4, "P": 16, "N": 16}))
    seq = varlen_seq_idx(Bsz, T, 3)
    mask = torch.ones(Bsz, T, dtype=torch.bool, device=DEV)
    mask[1, T - 50 :] = False
    kw = {"chunk_size": chunk, "D": t["D"], "dt_bias": t["dt_bias"], "dt_limit": (0.01, 0.5), "seq_idx": seq,
              "initial_state": t["initial_state"], "token_mask": mask, "return_final_state": True}
    args = (t["x"], t["dt"], t["A"], t["B"], t["C"])
    y_k, f_k = ssd_scan(*args, backend="kernels", **kw)
    y_t, f_t = ssd_scan(*args, backend="torch", **kw)
    assert rel_err(y_k.float() * mask[..., None, None], y_t.float() * mask[..., None, None]) < TOL[dtype]
    assert rel_err(f_k, f_t) < TOL[dtype]


def test_scan_kernel_varlen_states_batch1():
    _need("mamba_chunk_scan_combined")
    T, chunk = _size(900, 150), _size(128, 32)
    t = ssd_inputs(1, T, **({} if ON_GPU else {"H": 4, "P": 16, "N": 16}))
    seq = varlen_seq_idx(1, T, 4, max_seqs=8)
    # mamba_chunk_scan_combined returns varlen states for batch 1 without an initial state only (safepad refuses the
    # rest on this backend: test_scan_kernel_varlen_states_with_grad_is_not_dropped)
    kw = {"chunk_size": chunk, "D": t["D"], "dt_bias": t["dt_bias"], "seq_idx": seq, "return_final_state": True,
          "return_varlen_states": True}
    args = (t["x"], t["dt"], t["A"], t["B"], t["C"])
    with torch.no_grad():
        y_k, f_k, v_k = ssd_scan(*args, backend="kernels", **kw)
        y_t, f_t, v_t = ssd_scan(*args, backend="torch", **kw)
    assert rel_err(y_k, y_t) < TOL[torch.float32] and rel_err(v_k, v_t) < TOL[torch.float32]
    assert rel_err(f_k, f_t) < TOL[torch.float32]


def test_scan_kernel_varlen_states_with_grad_is_not_dropped():
    _need("mamba_chunk_scan_combined")
    t = ssd_inputs(2, _size(200, 64), **({} if ON_GPU else {"H": 4, "P": 16, "N": 16}))
    x = t["x"].requires_grad_(True)
    with pytest.raises(ValueError, match="varlen"):
        ssd_scan(x, t["dt"], t["A"], t["B"], t["C"], backend="kernels", return_varlen_states=True)
    _, v = ssd_scan(x, t["dt"], t["A"], t["B"], t["C"], chunk_size=32, return_varlen_states=True)  # auto -> torch
    assert v.shape[0] == 2


def test_scan_kernel_grads_match_torch():
    _need("mamba_chunk_scan_combined")
    Bsz, T, chunk = 2, _size(400, 100), _size(64, 32)
    t = ssd_inputs(Bsz, T, H=4, P=_size(32, 16), N=_size(32, 16), seed=5)
    seq = varlen_seq_idx(Bsz, T, 6)
    grads = {}
    for backend in ("kernels", "torch"):
        p = {k: v.detach().clone().requires_grad_(True) for k, v in t.items()}
        y, f = ssd_scan(p["x"], p["dt"], p["A"], p["B"], p["C"], chunk_size=chunk, D=p["D"], dt_bias=p["dt_bias"],
                        seq_idx=seq, initial_state=p["initial_state"], return_final_state=True, backend=backend)
        (y.square().sum() + f.sum()).backward()
        grads[backend] = {k: v.grad for k, v in p.items()}
    for k in grads["torch"]:
        assert rel_err(grads["kernels"][k], grads["torch"][k]) < 5e-3, k


@pytest.mark.parametrize(
    "dt_limit",
    [pytest.param((0.0, float("inf")), id="none"), pytest.param((0.05, float("inf")), id="floor"),
     pytest.param((0.0, 0.01), id="ceiling")],
)  # fmt: skip
def test_step_kernels_match_torch(dt_limit):
    _need("selective_state_update")
    t = ssd_inputs(4, 1)
    args = (t["initial_state"], t["x"][:, 0], t["dt"][:, 0], t["A"], t["B"][:, 0], t["C"][:, 0])
    kw = {"D": t["D"], "dt_bias": t["dt_bias"], "dt_limit": dt_limit}
    with torch.no_grad():
        y_k, s_k = ssd_step(*args, backend="kernels", **kw)
        y_t, s_t = ssd_step(*args, backend="torch", **kw)
    assert rel_err(y_k, y_t) < 1e-4 and rel_err(s_k, s_t) < 1e-4


# ---------------------------------------------------------------------------------------------- selective scan (Mamba1)


def _selective_inputs(Bsz: int, T: int, dtype: torch.dtype, seed: int, DM: int = 16, N: int = 8, h0: bool = True):
    """``u`` / ``delta`` / ``z`` ``[B, T, DM]``, ``A`` ``[DM, N]`` < 0, ``B`` / ``C`` ``[B, T, N]``, ``D`` /
    ``delta_bias`` ``[DM]`` (fp32, as the models keep them), ``initial_state`` ``[B, DM, N]``, on the test device."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    x = dict(u=r(Bsz, T, DM), delta=r(Bsz, T, DM), A=-torch.rand(DM, N, generator=g, dtype=torch.float64) * 2 - 0.05,
             B=r(Bsz, T, N), C=r(Bsz, T, N), z=r(Bsz, T, DM), initial_state=r(Bsz, DM, N) if h0 else None)
    out = {k: (v.to(DEV, dtype) if v is not None else None) for k, v in x.items()}
    out["D"], out["delta_bias"] = r(DM).to(DEV, torch.float32), (r(DM) * 0.5).to(DEV, torch.float32)
    return out


def _scan(x, **kw):
    return selective_scan(x["u"], x["delta"], x["A"], x["B"], x["C"], D=x["D"], z=x["z"], delta_bias=x["delta_bias"],
                          initial_state=x["initial_state"], **kw)


@pytest.mark.parametrize("dtype", [torch.float32, HALF], ids=["fp32", "half"])
def test_selective_scan_kernel_matches_torch(dtype):
    _need("selective_scan_fn")
    x = _selective_inputs(2, 37, dtype, seed=0, h0=False)
    with torch.no_grad():
        y_k, fin_k = _scan(x, return_final_state=True, backend="kernels")
        y_t, fin_t = _scan(x, return_final_state=True, backend="torch")
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(y_k.float(), y_t.float(), **tol)
    torch.testing.assert_close(fin_k, fin_t, rtol=1e-4, atol=1e-4)
    # training: gradients through the kernel equal the torch core's
    xs = [{k: (v.detach().clone().requires_grad_() if v is not None else None) for k, v in x.items()} for _ in "kt"]
    _scan(xs[0], backend="kernels").float().square().sum().backward()
    _scan(xs[1], backend="torch").float().square().sum().backward()
    for k in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias"):
        torch.testing.assert_close(xs[0][k].grad.float(), xs[1][k].grad.float(), **tol, msg=lambda m, k=k: f"{k}: {m}")


def test_selective_state_step_kernel_matches_torch():
    _need("selective_state_update")
    x = _selective_inputs(3, 1, torch.float32, seed=1)
    args = (x["initial_state"], x["u"][:, 0], x["delta"][:, 0], x["A"], x["B"][:, 0], x["C"][:, 0])
    kw = dict(D=x["D"], z=x["z"][:, 0], delta_bias=x["delta_bias"])
    before = x["initial_state"].clone()
    y_k, s_k = selective_state_step(*args, **kw, backend="kernels")
    y_t, s_t = selective_state_step(*args, **kw, backend="torch")
    assert torch.equal(x["initial_state"], before)
    torch.testing.assert_close(y_k, y_t, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s_k, s_t, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------- gated delta rule (FLA)


def test_fla_kernel_matches_torch_core_packed(monkeypatch):
    if kernels.fla_chunk_gated_delta_rule is None:
        pytest.skip("flash-linear-attention not installed")
    if not ON_GPU:  # chunk_delta_h cannot run under the interpreter: the route gets the same function, recurrent
        fused = kernels._KERNELS["fla_fused_recurrent_gated_delta_rule"]
        monkeypatch.setattr(kernels, "fla_chunk_gated_delta_rule", lambda q, k, v, g, beta, **kw: fused(
            q, k, v, g=g, beta=beta, **kw))
    T, a, b, Dk = _size(200, 80), _size(70, 30), _size(30, 10), _size(64, 32)
    seq_idx = seq_idx_from_lengths([[a, b, T - a - b], [T]])
    mask = torch.ones(2, T, dtype=torch.bool, device=DEV)
    mask[1, :17] = False
    gen = torch.Generator().manual_seed(41)
    H = 4
    q = torch.randn(2, T, H, Dk, generator=gen, dtype=torch.float64)
    k = torch.randn(2, T, H, Dk, generator=gen, dtype=torch.float64) / Dk**0.5
    v = torch.randn(2, T, H, Dk, generator=gen, dtype=torch.float64)
    g = -F.softplus(torch.randn(2, T, H, generator=gen, dtype=torch.float64))
    beta = torch.rand(2, T, H, generator=gen, dtype=torch.float64)
    inputs = [x.to(DEV, HALF) for x in (q, k, v, g, beta)]
    h0 = torch.randn(2, H, Dk, Dk, generator=gen).to(DEV)
    kw = dict(initial_state=h0, seq_idx=seq_idx, token_mask=mask, use_qk_l2norm=True,
              return_final_state=True, return_varlen_states=True)
    leaves_k = [x.clone().requires_grad_() for x in inputs]
    leaves_t = [x.clone().requires_grad_() for x in inputs]
    ok, fk, vk = chunk_gated_delta_rule(*leaves_k, backend="kernels", **kw)
    ot, ft, vt = chunk_gated_delta_rule(*leaves_t, backend="torch", **kw)
    m = mask[..., None, None]
    assert ok.dtype == HALF and fk.dtype == torch.float32 and vk.shape == vt.shape == (4, H, Dk, Dk)
    assert rms_err(torch.where(m, ok, 0), torch.where(m, ot, 0)) < 2e-2
    assert rms_err(fk, ft) < 2e-2 and rms_err(vk, vt) < 2e-2
    if not ON_GPU:  # FLA's fused-recurrent kernel has no backward: the chunk kernel's gradients need a GPU
        return
    (torch.where(m, ok.float(), 0).square().sum() + fk.sum()).backward()
    (torch.where(m, ot.float(), 0).square().sum() + ft.sum()).backward()
    for x, y in zip(leaves_k, leaves_t):
        assert rms_err(x.grad, y.grad) < 3e-2
