"""The hand-written-backward cores are torch.library custom ops: schema, fake (meta) kernels, autograd registration.

``torch.library.opcheck`` runs each op for real, under fake tensors (shapes, dtypes and strides of the fake
kernel must match the real outputs) and through AOT autograd (the registered backward). Values themselves
are checked against the float64 references in the other op tests, which run through these same ops.
"""

from __future__ import annotations

import importlib

import pytest
import torch

conv = importlib.import_module("safepad.ops.conv")
norm = importlib.import_module("safepad.ops.norm")
selective_scan = importlib.import_module("safepad.ops.selective_scan")  # the package exports a function of that name
ssd = importlib.import_module("safepad.ops.ssd")


def _r(*shape, requires_grad=True, scale=1.0):
    return (torch.randn(*shape, dtype=torch.float64) * scale).requires_grad_(requires_grad)


def _ssd_args(b=2, Q=4, c=3, H=4, P=3, G=2, N=5, seq=True, init=True, D=True):
    Tp = Q * c
    x, B, C = _r(b, Tp, H, P), _r(b, Tp, G, N), _r(b, Tp, G, N)
    dt = torch.rand(b, Tp, H, dtype=torch.float64).mul(0.5).requires_grad_()
    A = (-torch.rand(H, dtype=torch.float64) - 0.1).requires_grad_()
    seq_idx = torch.zeros(b, Tp, dtype=torch.int32)
    seq_idx[0, Tp // 2 :] = 1  # row 0: two sequences, the boundary inside a chunk
    seq_idx = seq_idx if seq else None
    return (x, dt, A, B, C, _r(H) if D else None, _r(b, H, P, N) if init else None, seq_idx, Q)


@pytest.mark.parametrize(
    "kw",
    [
        pytest.param({}, id="seq-init-D"),
        pytest.param({"seq": False, "init": False, "D": False}, id="plain"),
        pytest.param({"c": 1, "Q": 7}, id="one-chunk"),
    ],
)
def test_ssd_core_op(kw):
    torch.library.opcheck(ssd._ssd_core_op, _ssd_args(**kw))


def test_ssd_intra_chunk_op():
    b, c, H, G, Q, P = 2, 2, 4, 2, 5, 3
    acs = torch.cumsum(-torch.rand(b, c, H, Q, dtype=torch.float64), -1).requires_grad_()
    keep = torch.ones(Q, Q, dtype=torch.bool).tril()
    torch.library.opcheck(ssd._intra_chunk, (acs, _r(b, c, G, Q, Q), _r(b, c, H, Q, P), keep))


@pytest.mark.parametrize("silu", [True, False], ids=["silu", "linear"])
@pytest.mark.parametrize("same", [True, False], ids=["packed", "plain"])
def test_causal_conv_op(silu, same):
    Bsz, T, D, K = 2, 7, 6, 4
    same_t = (torch.rand(K - 1, Bsz, T, 1) > 0.3) if same else None  # bool: selection
    args = (_r(Bsz, T, D), _r(D, K), _r(D), _r(Bsz, K - 1, D), same_t, silu)
    torch.library.opcheck(conv._causal_conv_op, args)


def test_gated_rms_norm_op():
    torch.library.opcheck(norm._gated_rms_norm_op, (_r(6, 8), _r(6, 8), _r(8), 4, 1e-6))


@pytest.mark.parametrize("resets", [True, False], ids=["resets", "plain"])
@pytest.mark.parametrize("h0", [True, False], ids=["h0", "no-h0"])
def test_selective_scan_op(resets, h0):
    Bsz, T, Dm, N = 2, 7, 3, 4
    dt = torch.rand(Bsz, T, Dm, dtype=torch.float64).mul(0.5).requires_grad_()
    A = (-torch.rand(Dm, N, dtype=torch.float64) - 0.1).requires_grad_()
    r = torch.zeros(Bsz, T, dtype=torch.bool)
    r[0, 3] = True
    args = (_r(Bsz, T, Dm), dt, A, _r(Bsz, T, N), _r(Bsz, T, N), _r(Bsz, Dm, N) if h0 else None, r if resets else None)
    torch.library.opcheck(selective_scan._selective_scan_op, args)


def test_ops_are_registered():
    for name in ("ssd_core", "ssd_core_bwd", "ssd_intra_chunk", "causal_conv", "causal_conv_bwd", "gated_rms_norm",
                 "gated_rms_norm_bwd", "selective_scan", "selective_scan_bwd"):
        assert hasattr(torch.ops.safepad, name), name
