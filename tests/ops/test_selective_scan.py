"""Varlen Mamba1 selective scan: float64 oracle, packing, masks, decode, gradients, bad input."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from safepad.layout.boundaries import cu_seqlens_from_seq_idx
from safepad.ops.selective_scan import selective_scan, selective_state_step

_spec = importlib.util.spec_from_file_location("reference_selective", Path(__file__).with_name("reference_selective.py"))
_ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_ref)
ref_selective_scan_seq = _ref.ref_selective_scan_seq
ref_selective_scan_packed = _ref.ref_selective_scan_packed

F64 = torch.float64
DM, N = 5, 3


def make_inputs(Bsz, T, *, dtype=F64, D=True, z=True, bias=True, h0=True, seed=0, dt_scale=1.0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=F64)

    x = dict(
        u=r(Bsz, T, DM),
        delta=r(Bsz, T, DM) * dt_scale,
        A=-torch.rand(DM, N, generator=g, dtype=F64) * 2 - 0.05,
        B=r(Bsz, T, N),
        C=r(Bsz, T, N),
        D=r(DM) if D else None,
        z=r(Bsz, T, DM) if z else None,
        delta_bias=r(DM) * 0.5 if bias else None,
        initial_state=r(Bsz, DM, N) if h0 else None,
    )
    return {k: (v.to(dtype) if v is not None else None) for k, v in x.items()}


def seq_idx_from_lengths(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor([[i for i, n in enumerate(row) for _ in range(n)] for row in rows], dtype=torch.int32)


def scan(x, **kw):
    return selective_scan(
        x["u"], x["delta"], x["A"], x["B"], x["C"], D=x["D"], z=x["z"], delta_bias=x["delta_bias"],
        initial_state=x["initial_state"], **kw,
    )


def ref_packed(x, seq_idx):
    return ref_selective_scan_packed(
        x["u"], x["delta"], x["A"], x["B"], x["C"], seq_idx, D=x["D"], z=x["z"], delta_bias=x["delta_bias"],
        initial_state=x["initial_state"],
    )


def rel_err(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


# Odd/even recursion: powers of two and their neighbours are the awkward lengths.
LENGTHS = [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33]
OPTIONS = [
    pytest.param(dict(D=True, z=True, bias=True, h0=True), id="all"),
    pytest.param(dict(D=False, z=False, bias=False, h0=False), id="bare"),
    pytest.param(dict(D=True, z=False, bias=True, h0=False), id="D+bias"),
    pytest.param(dict(D=False, z=True, bias=False, h0=True), id="z+h0"),
]
LAYOUTS = [
    pytest.param([[1]], id="1x1"),
    pytest.param([[2]], id="1x2"),
    pytest.param([[17]], id="1x17"),
    pytest.param([[3, 1, 5]], id="1x[3,1,5]"),
    pytest.param([[8, 8], [1, 15]], id="2x[8,8|1,15]"),
    pytest.param([[4, 4, 4, 4], [16], [1, 1, 1, 13]], id="3x[4x4|16|1,1,1,13]"),
    pytest.param([[9, 2, 6], [5, 12], [17]], id="3x[9,2,6|5,12|17]"),
]


@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("opts", OPTIONS)
def test_single_sequence_matches_float64_reference(T, opts):
    x = make_inputs(2, T, **opts, seed=T)
    y, fin, var = scan(x, return_final_state=True, return_varlen_states=True)
    seq_idx = torch.zeros(2, T, dtype=torch.int32)
    ry, rfin, rvar = ref_packed(x, seq_idx)
    torch.testing.assert_close(y, ry, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(fin, rfin, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(var, rvar, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("opts", OPTIONS[:2])
def test_packed_matches_float64_reference(layout, opts):
    seq_idx = seq_idx_from_lengths(layout)
    x = make_inputs(*seq_idx.shape, **opts, seed=len(layout))
    y, fin, var = scan(x, seq_idx=seq_idx, return_final_state=True, return_varlen_states=True)
    ry, rfin, rvar = ref_packed(x, seq_idx)
    torch.testing.assert_close(y, ry, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(fin, rfin, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(var, rvar, rtol=1e-10, atol=1e-10)
    assert var.shape[0] == cu_seqlens_from_seq_idx(seq_idx).numel() - 1


@pytest.mark.parametrize("layout", LAYOUTS[3:])
def test_fp32_within_1e5_of_float64_reference(layout):
    seq_idx = seq_idx_from_lengths(layout)
    x64 = make_inputs(*seq_idx.shape, seed=7)
    x32 = {k: (v.float() if v is not None else None) for k, v in x64.items()}
    y, fin, var = scan(x32, seq_idx=seq_idx, return_final_state=True, return_varlen_states=True)
    assert y.dtype == torch.float32 and fin.dtype == torch.float32 and var.dtype == torch.float32
    # the reference runs on the very same (fp32-representable) values, in float64
    ry, rfin, rvar = ref_packed({k: (v.double() if v is not None else None) for k, v in x32.items()}, seq_idx)
    assert rel_err(y, ry) < 1e-5
    assert rel_err(fin, rfin) < 1e-5
    assert rel_err(var, rvar) < 1e-5


def _per_sequence(x, layout):
    """Run every sequence alone (batch 1, no seq_idx); concatenate like the packed layout."""
    ys, finals, varlen = [], [], []
    for b, row in enumerate(layout):
        start, row_y = 0, []
        for i, n in enumerate(row):
            sl = slice(start, start + n)
            xs = {k: x[k][b : b + 1, sl] for k in ("u", "delta", "B", "C")}
            xs.update(A=x["A"], D=x["D"], delta_bias=x["delta_bias"])
            xs["z"] = x["z"][b : b + 1, sl] if x["z"] is not None else None
            xs["initial_state"] = x["initial_state"][b : b + 1] if (x["initial_state"] is not None and i == 0) else None
            y, h = scan(xs, return_final_state=True)
            row_y.append(y[0])
            varlen.append(h[0])
            start += n
        ys.append(torch.cat(row_y))
        finals.append(varlen[-1])
    return torch.stack(ys), torch.stack(finals), torch.stack(varlen)


GRAD_KEYS = ["u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [pytest.param(F64, id="f64"), pytest.param(torch.float32, id="f32")])
def test_packed_equals_per_sequence_outputs_states_and_grads(layout, dtype):
    seq_idx = seq_idx_from_lengths(layout)
    base = make_inputs(*seq_idx.shape, dtype=dtype, seed=3)
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == F64 else dict(rtol=2e-5, atol=2e-5)
    g = torch.Generator().manual_seed(11)

    def run(packed):
        x = {k: v.clone().requires_grad_() for k, v in base.items()}
        if packed:
            y, fin, var = scan(x, seq_idx=seq_idx, return_final_state=True, return_varlen_states=True)
        else:
            y, fin, var = _per_sequence(x, layout)
        wy = torch.randn(y.shape, generator=g, dtype=F64).to(dtype)
        wv = torch.randn(var.shape, generator=g, dtype=F64).to(dtype)
        (y * wy).sum().add((var * wv).sum()).add(fin.square().sum()).backward()
        return y.detach(), fin.detach(), var.detach(), {k: x[k].grad for k in GRAD_KEYS}

    g.manual_seed(11)
    y_p, fin_p, var_p, grads_p = run(True)
    g.manual_seed(11)
    y_s, fin_s, var_s, grads_s = run(False)
    torch.testing.assert_close(y_p, y_s, **tol)
    torch.testing.assert_close(fin_p, fin_s, **tol)
    torch.testing.assert_close(var_p, var_s, **tol)
    for k in GRAD_KEYS:
        torch.testing.assert_close(grads_p[k], grads_s[k], **tol, msg=lambda m, k=k: f"grad of {k}: {m}")


@pytest.mark.parametrize("layout", [LAYOUTS[3], LAYOUTS[6]])
def test_grads_match_float64_reference_autograd(layout):
    seq_idx = seq_idx_from_lengths(layout)
    base = make_inputs(*seq_idx.shape, seed=5)
    g = torch.Generator().manual_seed(2)
    x = {k: v.clone().requires_grad_() for k, v in base.items()}
    xr = {k: v.clone().requires_grad_() for k, v in base.items()}
    y, fin, var = scan(x, seq_idx=seq_idx, return_final_state=True, return_varlen_states=True)
    ry, rfin, rvar = ref_packed(xr, seq_idx)
    wy, wv = torch.randn(y.shape, generator=g, dtype=F64), torch.randn(var.shape, generator=g, dtype=F64)
    ((y * wy).sum() + (var * wv).sum() + fin.sum()).backward()
    ((ry * wy).sum() + (rvar * wv).sum() + rfin.sum()).backward()
    for k in GRAD_KEYS:
        torch.testing.assert_close(x[k].grad, xr[k].grad, rtol=1e-9, atol=1e-9, msg=lambda m, k=k: f"grad of {k}: {m}")


def test_gradcheck_packed_with_mask_and_initial_state():
    seq_idx = seq_idx_from_lengths([[3, 2, 1], [1, 5]])
    mask = torch.tensor([[1, 1, 0, 1, 1, 1], [0, 1, 1, 1, 1, 0]], dtype=torch.bool)
    x = make_inputs(2, 6, seed=9)
    ins = tuple(x[k].clone().requires_grad_() for k in GRAD_KEYS)

    def f(u, delta, A, B, C, D, z, bias, h0):
        y, fin, var = selective_scan(
            u, delta, A, B, C, D=D, z=z, delta_bias=bias, initial_state=h0, seq_idx=seq_idx, token_mask=mask,
            return_final_state=True, return_varlen_states=True,
        )
        return y * mask.unsqueeze(-1), fin, var

    assert torch.autograd.gradcheck(f, ins, fast_mode=True)


@pytest.mark.parametrize("split", [1, 2, 8, 15])
@pytest.mark.parametrize("h0", [pytest.param(False, id="zero-h0"), pytest.param(True, id="h0")])
def test_decode_steps_after_prefix_equal_full_scan(split, h0):
    T = 16
    x = make_inputs(2, T, h0=h0, seed=split)
    y_full, fin_full = scan(x, return_final_state=True)
    pre = {k: (v[:, :split] if k in ("u", "delta", "B", "C", "z") else v) for k, v in x.items()}
    y_pre, state = scan(pre, return_final_state=True)
    ys = [y_pre]
    for t in range(split, T):
        before = state.clone()
        y_t, state_new = selective_state_step(
            state, x["u"][:, t], x["delta"][:, t], x["A"], x["B"][:, t], x["C"][:, t], D=x["D"], z=x["z"][:, t],
            delta_bias=x["delta_bias"],
        )
        assert torch.equal(state, before), "selective_state_step must not modify its input state"
        state = state_new
        ys.append(y_t.unsqueeze(1))
    torch.testing.assert_close(torch.cat(ys, 1), y_full, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state, fin_full, rtol=1e-10, atol=1e-10)


def test_step_token_mask_keeps_masked_rows_bitwise():
    """A masked row keeps its state exactly, even with NaN inputs; the other rows equal the unmasked step."""
    x = make_inputs(3, 2, h0=True, seed=41)
    _, state = scan({k: (v[:, :1] if k in ("u", "delta", "B", "C", "z") else v) for k, v in x.items()},
                    return_final_state=True)
    step = {k: x[k][:, 1].clone() for k in ("u", "delta", "B", "C", "z")}
    for v in step.values():
        v[1] = float("nan")  # the masked row's token
    args = (step["u"], step["delta"], x["A"], step["B"], step["C"])
    kw = {"D": x["D"], "z": step["z"], "delta_bias": x["delta_bias"]}
    keep = torch.tensor([True, False, True])
    y, s1 = selective_state_step(state, *args, token_mask=keep, **kw)
    y_ref, s_ref = selective_state_step(state, *args, **kw)
    assert torch.equal(s1[1], state[1]) and not state[1].isnan().any()
    assert torch.equal(s1[keep], s_ref[keep]) and torch.equal(y[keep], y_ref[keep])
    assert s_ref[1].isnan().all()  # without the mask the NaN token reaches the state
    with pytest.raises(ValueError, match="token_mask"):
        selective_state_step(state, *args, token_mask=keep[:2], **kw)


@pytest.mark.parametrize("poisoned", ["u", "delta", "B"])
def test_step_token_mask_holds_a_nan_in_any_input_and_takes_a_column_mask(poisoned):
    """A masked row keeps its state bitwise whichever of its inputs (u, raw delta, B) holds a NaN; a decode step's
    ``[B, 1]`` mask means the same as ``[B]``; the kept rows equal the unmasked step."""
    x = make_inputs(3, 2, h0=True, seed=43)
    _, state = scan({k: (v[:, :1] if k in ("u", "delta", "B", "C", "z") else v) for k, v in x.items()},
                    return_final_state=True)
    step = {k: x[k][:, 1].clone() for k in ("u", "delta", "B", "C", "z")}
    step[poisoned][1] = float("nan")
    args = (step["u"], step["delta"], x["A"], step["B"], step["C"])
    kw = {"D": x["D"], "z": step["z"], "delta_bias": x["delta_bias"]}
    keep = torch.tensor([True, False, True])
    y, s1 = selective_state_step(state, *args, token_mask=keep, **kw)
    y_col, s_col = selective_state_step(state, *args, token_mask=keep[:, None], **kw)
    y_ref, s_ref = selective_state_step(state, *args, **kw)
    assert torch.equal(s1[1], state[1]) and not state[1].isnan().any()
    assert torch.equal(s_col, s1) and torch.equal(y_col, y)
    assert torch.equal(s1[keep], s_ref[keep]) and torch.equal(y[keep], y_ref[keep])
    assert s_ref[1].isnan().any()  # without the mask the NaN reaches the state
    with pytest.raises(ValueError, match="token_mask"):
        selective_state_step(state, *args, token_mask=keep[None, :], **kw)


MASKS = [
    pytest.param([[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8], id="left-pad"),
    pytest.param([[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0]], id="right-pad"),
    pytest.param([[0, 0, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1, 0]], id="both-sides"),
    pytest.param([[0, 0, 0, 0, 0, 0, 0, 1], [1, 0, 0, 0, 0, 0, 0, 0]], id="one-real-token"),
]


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("h0", [pytest.param(False, id="zero-h0"), pytest.param(True, id="h0")])
def test_masked_rows_equal_compacted(mask, h0):
    mask = torch.tensor(mask, dtype=torch.bool)
    x = make_inputs(2, 8, h0=h0, seed=4)
    y, fin = scan(x, token_mask=mask, return_final_state=True)
    for b in range(2):
        keep = mask[b]
        xs = {k: (v[b : b + 1][:, keep] if k in ("u", "delta", "B", "C", "z") else v) for k, v in x.items()}
        xs["initial_state"] = x["initial_state"][b : b + 1] if h0 else None
        y_c, fin_c = scan(xs, return_final_state=True)
        torch.testing.assert_close(y[b, keep], y_c[0], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(fin[b], fin_c[0], rtol=1e-10, atol=1e-10)


def test_packed_row_with_right_pads_and_masked_sequence_start():
    # row 0: sequences [3, 4] then 1 pad in the same (last) sequence; row 1: the 2nd sequence starts with pads
    seq_idx = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1, 1]], dtype=torch.int32)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    x = make_inputs(2, 8, seed=8)
    y, var = scan(x, seq_idx=seq_idx, token_mask=mask, return_varlen_states=True)
    ref_var = []
    for b in range(2):
        for s in seq_idx[b].unique():
            keep = (seq_idx[b] == s) & mask[b]
            xs = {k: (v[b : b + 1][:, keep] if k in ("u", "delta", "B", "C", "z") else v) for k, v in x.items()}
            first = bool((seq_idx[b] == s)[0])
            xs["initial_state"] = x["initial_state"][b : b + 1] if first else None
            y_c, h_c = scan(xs, return_final_state=True)
            torch.testing.assert_close(y[b, keep], y_c[0], rtol=1e-10, atol=1e-10)
            ref_var.append(h_c[0])
    torch.testing.assert_close(var, torch.stack(ref_var), rtol=1e-10, atol=1e-10)


def test_without_seq_idx_the_packed_output_differs():
    layout = [[6, 10]]
    seq_idx = seq_idx_from_lengths(layout)
    x = make_inputs(1, 16, h0=False, seed=1)
    y_sep = scan(x, seq_idx=seq_idx)
    y_leak = scan(x)
    torch.testing.assert_close(y_sep[:, :6], y_leak[:, :6])  # the first sequence is unaffected
    assert (y_sep[:, 6:] - y_leak[:, 6:]).abs().max() > 1e-3  # the second one sees the first's state


def test_stable_with_huge_decays():
    # dt * A reaches about -1e3 per token and -1e4 over a row: nothing may overflow
    x = make_inputs(1, 12, dtype=torch.float32, seed=2, dt_scale=0.0, bias=False)
    x["delta"] = torch.full_like(x["delta"], 500.0)
    x["delta"][0, 5] = 1e-3
    x = {k: (v.clone().requires_grad_() if v is not None else None) for k, v in x.items()}
    y, fin = scan(x, return_final_state=True)
    (y.sum() + fin.sum()).backward()
    assert torch.isfinite(y).all() and torch.isfinite(fin).all()
    for k in GRAD_KEYS:
        if x[k] is not None:
            assert torch.isfinite(x[k].grad).all(), k
    ry, rfin, _ = ref_packed({k: (v.detach().double() if v is not None else None) for k, v in x.items()},
                             torch.zeros(1, 12, dtype=torch.int32))
    torch.testing.assert_close(y.detach().double(), ry, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fin.detach().double(), rfin, rtol=1e-4, atol=1e-4)


def test_matches_transformers_mamba_selective_scan():
    from transformers.models.mamba.modeling_mamba import mamba_selective_scan

    x = make_inputs(2, 9, dtype=torch.float32, h0=False, seed=6)
    y, fin = scan(x, return_final_state=True)
    def t(v):
        return v.transpose(1, 2)  # [B, T, X] -> [B, X, T]

    hy, hfin = mamba_selective_scan(
        t(x["u"]), t(x["delta"]), x["A"], t(x["B"]), t(x["C"]), D=x["D"], z=t(x["z"]), delta_bias=x["delta_bias"],
        delta_softplus=True, return_last_state=True,
    )
    torch.testing.assert_close(y, t(hy), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fin, hfin.float(), rtol=1e-5, atol=1e-5)


def test_low_precision_inputs_keep_dtype_and_fp32_states():
    x = make_inputs(1, 7, dtype=torch.bfloat16, seed=3)
    y, fin, var = scan(x, return_final_state=True, return_varlen_states=True)
    assert y.dtype == torch.bfloat16 and fin.dtype == torch.float32 and var.dtype == torch.float32
    ry, rfin, _ = ref_packed({k: (v.double() if v is not None else None) for k, v in x.items()},
                             torch.zeros(1, 7, dtype=torch.int32))
    assert rel_err(fin, rfin) < 1e-5
    assert rel_err(y, ry) < 1e-2


def test_delta_softplus_false_uses_raw_delta():
    x = make_inputs(1, 6, seed=12, bias=False)
    x["delta"] = x["delta"].abs()
    y = scan(x, delta_softplus=False)
    ry, _ = ref_selective_scan_seq(x["u"][0], x["delta"][0], x["A"], x["B"][0], x["C"][0], D=x["D"], z=x["z"][0],
                                   delta_softplus=False, initial_state=x["initial_state"][0])
    torch.testing.assert_close(y[0], ry, rtol=1e-10, atol=1e-10)


def _bad(**over):
    x = make_inputs(2, 4, seed=0)
    x.update(over)
    return x


BAD_SCAN = [
    pytest.param(dict(u=torch.randn(4, DM)), {}, "u", id="u-2d"),
    pytest.param(dict(u=torch.zeros(2, 4, DM, dtype=torch.int64)), {}, "u", id="u-int"),
    pytest.param(dict(u=torch.randn(2, 0, DM, dtype=F64)), {}, "u", id="u-empty"),
    pytest.param(dict(delta=torch.randn(2, 3, DM, dtype=F64)), {}, "delta", id="delta-shape"),
    pytest.param(dict(A=torch.randn(DM + 1, N, dtype=F64)), {}, "A", id="A-shape"),
    pytest.param(dict(A=torch.rand(DM, N, dtype=F64)), {}, "A", id="A-positive"),
    pytest.param(dict(B=torch.randn(2, 4, N + 1, dtype=F64)), {}, "B", id="B-shape"),
    pytest.param(dict(C=torch.randn(2, 4, dtype=F64)), {}, "C", id="C-shape"),
    pytest.param(dict(D=torch.randn(DM, 1, dtype=F64)), {}, "D", id="D-shape"),
    pytest.param(dict(z=torch.randn(2, 4, DM + 1, dtype=F64)), {}, "z", id="z-shape"),
    pytest.param(dict(delta_bias=torch.randn(DM + 2, dtype=F64)), {}, "delta_bias", id="bias-shape"),
    pytest.param(dict(initial_state=torch.randn(1, DM, N, dtype=F64)), {}, "initial_state", id="h0-shape"),
    pytest.param({}, dict(seq_idx=torch.tensor([[0, 1, 0, 1], [0, 0, 0, 0]])), "seq_idx", id="seq_idx-decreasing"),
    pytest.param({}, dict(seq_idx=torch.zeros(2, 5, dtype=torch.int32)), "seq_idx", id="seq_idx-shape"),
    pytest.param({}, dict(seq_idx=torch.zeros(2, 4)), "seq_idx", id="seq_idx-float"),
    pytest.param({}, dict(token_mask=torch.ones(2, 3, dtype=torch.bool)), "token_mask", id="mask-shape"),
    pytest.param({}, dict(token_mask=torch.full((2, 4), 2)), "token_mask", id="mask-not-boolean"),
    pytest.param({}, dict(backend="cuda"), "backend", id="backend-name"),
    pytest.param({}, dict(backend="kernels"), "kernels", id="kernels-on-cpu"),
]


@pytest.mark.parametrize("over, kw, name", BAD_SCAN)
def test_bad_scan_input_raises(over, kw, name):
    with pytest.raises(ValueError, match=name):
        scan(_bad(**over), **kw)


BAD_STEP = [
    pytest.param(dict(state=torch.randn(2, DM, dtype=F64)), "state", id="state-2d"),
    pytest.param(dict(u=torch.randn(2, DM + 1, dtype=F64)), "u", id="u-shape"),
    pytest.param(dict(delta=torch.randn(3, DM, dtype=F64)), "delta", id="delta-shape"),
    pytest.param(dict(A=torch.randn(DM, N + 1, dtype=F64).abs().neg()), "A", id="A-N-mismatch"),
    pytest.param(dict(A=torch.rand(DM, N, dtype=F64)), "A", id="A-positive"),
    pytest.param(dict(B=torch.randn(2, 1, N, dtype=F64)), "B", id="B-shape"),
    pytest.param(dict(C=torch.randn(2, N + 1, dtype=F64)), "C", id="C-shape"),
    pytest.param(dict(z=torch.randn(2, 1, dtype=F64)), "z", id="z-shape"),
    pytest.param(dict(D=torch.randn(1, dtype=F64)), "D", id="D-shape"),
    pytest.param(dict(delta_bias=torch.randn(1, dtype=F64)), "delta_bias", id="bias-shape"),
]


@pytest.mark.parametrize("over, name", BAD_STEP)
def test_bad_step_input_raises(over, name):
    x = make_inputs(2, 1, seed=0)
    args = dict(
        state=x["initial_state"], u=x["u"][:, 0], delta=x["delta"][:, 0], A=x["A"], B=x["B"][:, 0],
        C=x["C"][:, 0], D=x["D"], z=x["z"][:, 0], delta_bias=x["delta_bias"],
    )
    args.update(over)
    with pytest.raises(ValueError, match=name):
        selective_state_step(
            args.pop("state"), args.pop("u"), args.pop("delta"), args.pop("A"), args.pop("B"), args.pop("C"), **args
        )


def test_softplus_pipeline_is_the_shared_one():
    # selective_scan's dt pipeline equals process_dt(dt, bias, no clamp): checked through one token
    x = make_inputs(1, 1, seed=13, h0=False, D=False, z=False)
    y = scan(x)
    dt = F.softplus(x["delta"][0, 0] + x["delta_bias"])
    expect = ((dt * x["u"][0, 0])[:, None] * x["B"][0, 0][None] * x["C"][0, 0][None]).sum(-1)
    torch.testing.assert_close(y[0, 0], expect, rtol=1e-12, atol=1e-12)


def test_strided_inputs_in_the_hf_layout():
    # views of [B, X, T] tensors (the HF / mamba-ssm layout), as the mixers hand them over
    x = make_inputs(2, 9, seed=14)
    views = {k: (v.transpose(1, 2).contiguous().transpose(1, 2) if v is not None and v.dim() == 3 and k != "initial_state"
                 else v) for k, v in x.items()}
    assert not views["u"].is_contiguous()
    views = {k: (v.clone().requires_grad_() if v is not None else None) for k, v in views.items()}
    dense = {k: (v.detach().clone().requires_grad_() if v is not None else None) for k, v in views.items()}
    y_v, y_d = scan(views), scan(dense)
    torch.testing.assert_close(y_v, y_d, rtol=0, atol=0)
    y_v.transpose(1, 2).sum().backward()
    y_d.sum().backward()
    for k in GRAD_KEYS:
        torch.testing.assert_close(views[k].grad, dense[k].grad, rtol=1e-12, atol=1e-12)


def test_scan_primitives_every_length_up_to_40():
    from safepad.ops.selective_scan import _rscan_, _scan_

    g = torch.Generator().manual_seed(0)
    for T in range(1, 41):
        a = torch.rand(2, T, 3, generator=g, dtype=F64)
        b = torch.randn(2, T, 3, generator=g, dtype=F64)
        a_before = a.clone()
        fwd, h = [], torch.zeros(2, 3, dtype=F64)
        for t in range(T):
            h = a[:, t] * h + b[:, t]
            fwd.append(h)
        rev, G = [None] * T, torch.zeros(2, 3, dtype=F64)
        for t in reversed(range(T)):
            G = b[:, t] + (a[:, t + 1] * G if t + 1 < T else 0.0)
            rev[t] = G
        torch.testing.assert_close(_scan_(a, b.clone()), torch.stack(fwd, 1), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(_rscan_(a, b.clone()), torch.stack(rev, 1), rtol=1e-12, atol=1e-12)
        assert torch.equal(a, a_before), "the decays must not be modified"
