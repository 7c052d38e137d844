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


# ------------------------------------------------------------------------------------------------------------
# ops that run as plain torch under torch.compile: one graph (fullgraph), values and grads equal eager
# ------------------------------------------------------------------------------------------------------------

dynamic_conv = importlib.import_module("safepad.ops.dynamic_conv")
conv_stack = importlib.import_module("safepad.ops.conv_stack")


def _traced_equals_eager(fn, args: tuple, rtol: float = 1e-10) -> None:
    """``fn(*args)`` (a tensor or a tuple) eager vs ``torch.compile(fullgraph=True)``: outputs and the gradients of
    every float input that requires grad (float64, so only the summation order may differ)."""
    import torch._dynamo as dynamo

    dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager_decomp_partition", fullgraph=True)  # a graph break raises
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    res = {}
    for name, f in (("eager", fn), ("compiled", compiled)):
        out = f(*args)
        outs = out if isinstance(out, tuple) else (out,)
        loss = sum((o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view(o.shape)).sum() for o in outs)
        res[name] = (outs, torch.autograd.grad(loss, leaves))
    dynamo.reset()
    for e, c in zip(res["eager"][0] + res["eager"][1], res["compiled"][0] + res["compiled"][1], strict=True):
        torch.testing.assert_close(c, e, rtol=rtol, atol=rtol)


def _packed(Bsz: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    seq_idx = torch.zeros(Bsz, T, dtype=torch.int32)
    seq_idx[0, 3:] = 1
    seq_idx[0, 5:] = 2  # row 0: sequences of 3, 2 and T-5 tokens
    mask = torch.ones(Bsz, T, dtype=torch.bool)
    mask[-1, T - 2 :] = False  # last row right-padded
    return seq_idx, mask


def test_dynamic_conv_traces_in_one_graph():
    Bsz, T, D, K = 2, 9, 4, 4
    seq_idx, mask = _packed(Bsz, T)

    def f(x, taps, init):
        return dynamic_conv.dynamic_causal_conv1d(x, taps, seq_idx=seq_idx, initial_state=init, token_mask=mask,
                                                  return_final_state=True)

    _traced_equals_eager(f, (_r(Bsz, T, D), _r(Bsz, T, D, K), _r(Bsz, D, K)))


def test_conv_stack_traces_in_one_graph():
    Bsz, T, C = 2, 9, 4
    seq_idx, mask = _packed(Bsz, T)
    w0, b0, w1, b1 = _r(C, 1, 2), _r(C), _r(C, 2, 3), _r(C)  # depthwise K=2, then grouped (2 groups) K=3

    def f(x, init, w0, b0, w1, b1):
        return conv_stack.causal_conv_stack(x, [(w0, b0, C), (w1, b1, 2)], seq_idx=seq_idx, initial_state=init,
                                            token_mask=mask, return_final_state=True)

    _traced_equals_eager(f, (_r(Bsz, T, C), _r(Bsz, C, 3), w0, b0, w1, b1))


@pytest.mark.parametrize("silu", [True, False], ids=["silu", "linear"])
def test_causal_conv_traced_form_equals_op(silu):
    """Under compile the causal conv runs as plain torch (inductor fuses it); same values and grads as the op."""
    Bsz, T, D, K = 2, 9, 6, 4
    seq_idx, _ = _packed(Bsz, T)

    def f(x, w, b, init):
        return conv.causal_conv1d(x, w, b, activation="silu" if silu else None, seq_idx=seq_idx, initial_state=init)

    _traced_equals_eager(f, (_r(Bsz, T, D), _r(D, K), _r(D), _r(Bsz, D, K - 1)))


def test_gated_rms_norm_traced_form_equals_op():
    """(The norm computes in float32 whatever the input dtype, as the transformers module does.)"""
    args = (_r(2, 5, 8), _r(2, 5, 8), _r(8))
    _traced_equals_eager(lambda y, g, w: norm.gated_rms_norm(y, g, w, 4, 1e-6), args, rtol=1e-5)


@pytest.mark.parametrize("op", ["dynamic_conv", "conv_stack"])
def test_plain_ops_reject_left_padding_under_compile(op):
    """The right-padding check runs on the device while tracing: the eager message, as a RuntimeError."""
    import torch._dynamo as dynamo

    Bsz, T, C = 2, 6, 4
    mask = torch.ones(Bsz, T, dtype=torch.bool)
    mask[1, :2] = False  # left-padded: not accepted
    x = torch.randn(Bsz, T, C, dtype=torch.float64)
    if op == "dynamic_conv":
        def f(x):
            return dynamic_conv.dynamic_causal_conv1d(x, torch.ones(Bsz, T, C, 3, dtype=x.dtype), token_mask=mask)
    else:
        def f(x):
            return conv_stack.causal_conv_stack(x, [(torch.ones(C, 1, 2, dtype=x.dtype), None, C)], token_mask=mask)
    with pytest.raises(ValueError, match="must be right-padded"):
        f(x)
    dynamo.reset()
    with pytest.raises(RuntimeError, match="must be right-padded"):
        torch.compile(f, backend="aot_eager_decomp_partition", fullgraph=True)(x)
    dynamo.reset()
