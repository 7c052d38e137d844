"""safepad.ops.ssd against the float64 token-by-token oracle (tests/ops/reference.py)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import ref_ssd, split_rows

import safepad.ops.ssd as ssd_mod
from safepad.ops import ssd_scan, ssd_step

INF = float("inf")
H, P, N = 4, 3, 5
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (relative to the reference's scale)."""
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def seq_idx_of(rows: list[list[int]]) -> torch.Tensor:
    """Per-row sequence lengths -> seq_idx [B, T] int32 (rows must have equal totals)."""
    T = sum(rows[0])
    assert all(sum(r) == T for r in rows), "test layout rows must have equal totals"
    out = []
    for r in rows:
        out.append(torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(r)]))
    return torch.stack(out)


def make(Bsz: int, T: int, G: int, seed: int, dtype=torch.float64, D_shape=(H,), bias=True, init=True):
    g = torch.Generator().manual_seed(seed)

    def r(*s, scale=1.0):
        return (torch.randn(*s, generator=g, dtype=torch.float64) * scale).to(dtype)

    return {
        "x": r(Bsz, T, H, P),
        "dt": r(Bsz, T, H, scale=0.7) - 1.0,
        "A": -(torch.rand(H, generator=g, dtype=torch.float64) * 2 + 0.3).to(dtype),
        "B": r(Bsz, T, G, N),
        "C": r(Bsz, T, G, N),
        "D": None if D_shape is None else r(*D_shape),
        "dt_bias": r(H, scale=0.5) if bias else None,
        "initial_state": r(Bsz, H, P, N) if init else None,
    }


def reference_packed(t: dict, seq_idx: torch.Tensor, dt_limit) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference y [B, T, H, P], final [B, H, P, N], varlen [S, H, P, N] by running each sequence alone."""
    y = torch.zeros(t["x"].shape, dtype=torch.float64)
    states = []
    for b, s, e in split_rows(seq_idx):
        init = t["initial_state"][b] if (s == 0 and t["initial_state"] is not None) else None
        ys, hs = ref_ssd(
            t["x"][b, s:e], t["dt"][b, s:e], t["A"], t["B"][b, s:e], t["C"][b, s:e],
            t["D"], t["dt_bias"], dt_limit, True, init,
        )
        y[b, s:e] = ys
        states.append(hs)
    varlen = torch.stack(states)
    last = [i for i, (b, s, e) in enumerate(split_rows(seq_idx)) if e == seq_idx.shape[1]]
    return y, varlen[last], varlen


@pytest.fixture(params=[pytest.param(None, id="blocks-default"), pytest.param(1, id="block-per-chunk"),
                        pytest.param(3 * H * 64, id="uneven-blocks")])
def ssd_blocks(request, monkeypatch):
    """Run the intra-chunk part over its default chunk blocks (one block at these sizes) and over small ones."""
    if request.param is not None:
        monkeypatch.setattr(ssd_mod, "_BLOCK_ELEMS", request.param)


LAYOUTS = [
    pytest.param([[1]], id="len1"),
    pytest.param([[3]], id="len-K-1"),
    pytest.param([[7, 8, 9]], id="chunk-1,chunk,chunk+1"),
    pytest.param([[8, 8, 1, 7]], id="edges-at-chunk-boundaries"),
    pytest.param([[2, 1, 3, 2, 17]], id="many-per-chunk+spanning"),
    pytest.param([[30, 11]], id="several-chunks"),
    pytest.param([[5, 20], [25], [1, 1, 1, 22]], id="3-rows"),
    pytest.param([[1, 1, 1, 1, 1]], id="all-len1"),
]
OPTIONS = [
    pytest.param(1, (H,), True, True, (0.0, INF), id="G1-D-bias-init"),
    pytest.param(2, (H, P), True, False, (0.05, INF), id="G2-DHP-bias-lo"),
    pytest.param(4, None, False, True, (0.0, 0.01), id="G4-noD-nobias-init-hi"),
    pytest.param(2, (H,), True, True, (0.02, 0.5), id="G2-both-limits"),
]


@pytest.mark.parametrize("rows", LAYOUTS)
@pytest.mark.parametrize("G,D_shape,bias,init,dt_limit", OPTIONS)
@pytest.mark.usefixtures("ssd_blocks")
def test_packed_matches_per_sequence_reference(rows, G, D_shape, bias, init, dt_limit):
    seq = seq_idx_of(rows)
    Bsz, T = seq.shape
    t = make(Bsz, T, G, seed=hash((str(rows), G)) % 1000, D_shape=D_shape, bias=bias, init=init)
    y_ref, fin_ref, var_ref = reference_packed(t, seq, dt_limit)
    for dtype in (torch.float64, torch.float32):
        tt = {k: (v.to(dtype) if v is not None else None) for k, v in t.items()}
        y, fin, var = ssd_scan(
            tt["x"], tt["dt"], tt["A"], tt["B"], tt["C"], chunk_size=8, D=tt["D"], dt_bias=tt["dt_bias"],
            dt_limit=dt_limit, seq_idx=seq, initial_state=tt["initial_state"],
            return_final_state=True, return_varlen_states=True,
        )
        assert y.dtype == dtype and y.shape == (Bsz, T, H, P)
        assert var.shape == (len(split_rows(seq)), H, P, N) and fin.shape == (Bsz, H, P, N)
        assert rel_err(y, y_ref) < TOL[dtype], dtype
        assert rel_err(fin, fin_ref) < TOL[dtype], dtype
        assert rel_err(var, var_ref) < TOL[dtype], dtype


@pytest.mark.parametrize("chunk_size", [1, 3, 8, 64])
def test_chunk_size_does_not_change_the_result(chunk_size):
    seq = seq_idx_of([[2, 9, 1, 12]])
    t = make(1, 24, 2, seed=3)
    y_ref, fin_ref, _ = reference_packed(t, seq, (0.0, INF))
    y, fin = ssd_scan(
        t["x"], t["dt"], t["A"], t["B"], t["C"], chunk_size=chunk_size, D=t["D"], dt_bias=t["dt_bias"],
        seq_idx=seq, initial_state=t["initial_state"], return_final_state=True,
    )
    assert rel_err(y, y_ref) < 1e-10 and rel_err(fin, fin_ref) < 1e-10


def test_without_seq_idx_packed_rows_leak():
    """The boundary handling is what makes packing right: drop seq_idx and the outputs change."""
    seq = seq_idx_of([[7, 8, 9]])
    t = make(1, 24, 2, seed=5)
    y_ref, _, _ = reference_packed(t, seq, (0.0, INF))
    y = ssd_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], chunk_size=8, D=t["D"], dt_bias=t["dt_bias"],
                 initial_state=t["initial_state"])
    assert rel_err(y, y_ref) > 1e-3
    assert rel_err(y[:, :7], y_ref[:, :7]) < 1e-10  # the first sequence is unaffected


@pytest.mark.parametrize("dt_limit", [(0.0, INF), (0.05, INF), (0.0, 0.01)], ids=["default", "lo", "hi"])
@pytest.mark.parametrize("G", [1, 2])
def test_decode_after_prefix_equals_full_scan(dt_limit, G):
    T, prefix = 21, 13
    t = make(2, T, G, seed=11)
    kw = {"D": t["D"], "dt_bias": t["dt_bias"], "dt_limit": dt_limit}
    y_full, fin_full = ssd_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], chunk_size=8,
                                initial_state=t["initial_state"], return_final_state=True, **kw)
    y_pre, state = ssd_scan(t["x"][:, :prefix], t["dt"][:, :prefix], t["A"], t["B"][:, :prefix],
                            t["C"][:, :prefix], chunk_size=8, initial_state=t["initial_state"],
                            return_final_state=True, **kw)
    ys = [y_pre]
    for i in range(prefix, T):
        y_i, state = ssd_step(state, t["x"][:, i], t["dt"][:, i], t["A"], t["B"][:, i], t["C"][:, i], **kw)
        ys.append(y_i.unsqueeze(1))
    assert rel_err(torch.cat(ys, 1), y_full) < 1e-12
    assert rel_err(state, fin_full) < 1e-12


def test_step_does_not_modify_state_and_returns_fp32():
    t = make(2, 1, 2, seed=1, dtype=torch.float32)
    s0 = t["initial_state"].clone()
    y, s1 = ssd_step(t["initial_state"], t["x"][:, 0], t["dt"][:, 0], t["A"], t["B"][:, 0], t["C"][:, 0])
    assert torch.equal(t["initial_state"], s0) and s1.dtype == torch.float32 and y.shape == (2, H, P)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("dt_limit", [(0.0, INF), (0.05, INF)], ids=["default", "lo"])
def test_step_token_mask_keeps_masked_rows_bitwise(dt_limit, dtype):
    """A masked row keeps its state exactly (even with a NaN token and a dt floor that would move dt=0);
    the other rows equal the unmasked step."""
    t = make(3, 1, 2, seed=5, dtype=dtype)
    x = t["x"][:, 0].clone()
    x[1] = float("nan")  # the masked row's token
    args = (x, t["dt"][:, 0], t["A"], t["B"][:, 0], t["C"][:, 0])
    kw = {"D": t["D"], "dt_bias": t["dt_bias"], "dt_limit": dt_limit}
    keep = torch.tensor([True, False, True])
    y, s1 = ssd_step(t["initial_state"], *args, token_mask=keep, **kw)
    y_ref, s_ref = ssd_step(t["initial_state"], *args, **kw)
    assert torch.equal(s1[1], t["initial_state"][1].to(s1.dtype))
    assert torch.equal(s1[keep], s_ref[keep]) and torch.equal(y[keep], y_ref[keep])
    assert s_ref[1].isnan().any()  # without the mask the NaN token would reach the state
    with pytest.raises(ValueError, match="token_mask"):
        ssd_step(t["initial_state"], *args, token_mask=keep[:2], **kw)


@pytest.mark.parametrize("poisoned", ["x", "dt", "B"])
@pytest.mark.parametrize("G", [1, 2])
def test_step_token_mask_holds_a_nan_in_any_input_and_takes_a_column_mask(G, poisoned):
    """A masked row keeps its state bitwise whichever of its inputs (x, raw dt, B) holds a NaN (each is selected
    away, not multiplied by 0); a decode step's ``[B, 1]`` mask means the same as ``[B]``; the kept rows equal
    the unmasked step."""
    t = make(3, 1, G, seed=7)
    inp = {"x": t["x"][:, 0].clone(), "dt": t["dt"][:, 0].clone(), "B": t["B"][:, 0].clone()}
    inp[poisoned][1] = float("nan")
    kw = {"D": t["D"], "dt_bias": t["dt_bias"], "dt_limit": (0.05, INF)}

    def step(token_mask):
        return ssd_step(t["initial_state"], inp["x"], inp["dt"], t["A"], inp["B"], t["C"][:, 0], token_mask=token_mask,
                        **kw)

    keep = torch.tensor([True, False, True])
    y, s1 = step(keep)
    y_col, s_col = step(keep[:, None])
    y_ref, s_ref = step(None)
    assert torch.equal(s1[1], t["initial_state"][1])
    assert torch.equal(s_col, s1) and torch.equal(y_col, y)
    assert torch.equal(s1[keep], s_ref[keep]) and torch.equal(y[keep], y_ref[keep])
    assert s_ref[1].isnan().any()  # without the mask the NaN reaches the state
    with pytest.raises(ValueError, match="token_mask"):
        step(keep[None, :])


PAD_LAYOUTS = [
    pytest.param([(0, 9), (3, 2), (0, 12)], id="left-pads"),
    pytest.param([(9, 0), (2, 3), (12, 0)], id="right-pads"),
    pytest.param([(4, 5), (1, 1), (0, 0)], id="both"),
]


@pytest.mark.parametrize("pads", PAD_LAYOUTS)
@pytest.mark.parametrize("with_seq_idx", [False, True], ids=["one-seq", "packed"])
def test_masked_layout_equals_compacted(pads, with_seq_idx):
    """Rows with pads (masked) == each row's real tokens alone; pads leave the state unchanged."""
    lens = [7, 15, 3]
    T = max(l + a + b for l, (a, b) in zip(lens, pads))
    T = max(T, 19)
    G = 2
    t = make(3, T, G, seed=21)
    mask = torch.zeros(3, T, dtype=torch.bool)
    seq = torch.zeros(3, T, dtype=torch.int32)
    starts = []
    for r, (l, (left, _)) in enumerate(zip(lens, pads)):
        s = left if T - l - left >= 0 else 0
        s = min(s, T - l)
        mask[r, s : s + l] = True
        starts.append(s)
        if with_seq_idx:  # split the real tokens into two sequences (pads join the neighbouring ones)
            cut = s + max(1, l // 2)
            seq[r, cut:] = 1
    kw = {"chunk_size": 4, "D": t["D"], "dt_bias": t["dt_bias"], "dt_limit": (0.05, INF)}
    y, fin = ssd_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], seq_idx=seq if with_seq_idx else None,
                      token_mask=mask, initial_state=t["initial_state"], return_final_state=True, **kw)
    for r, (l, s) in enumerate(zip(lens, starts)):
        sl = slice(s, s + l)
        sq = seq[r : r + 1, sl] - seq[r, s] if with_seq_idx else None
        init = t["initial_state"][r : r + 1]
        if with_seq_idx and seq[r, s] != seq[r, 0]:
            init = None  # the pads before hold the row's first sequence, the real tokens start a new one
        y_c, fin_c = ssd_scan(t["x"][r : r + 1, sl], t["dt"][r : r + 1, sl], t["A"], t["B"][r : r + 1, sl],
                              t["C"][r : r + 1, sl], seq_idx=sq, initial_state=init, return_final_state=True, **kw)
        assert rel_err(y[r : r + 1, sl], y_c) < 1e-12
        if with_seq_idx and seq[r, -1] != seq[r, s + l - 1]:
            continue  # trailing pads form their own sequence: the row's final state is theirs
        assert rel_err(fin[r : r + 1], fin_c) < 1e-12


def test_mask_without_pipeline_zeroing_would_differ():
    """Right pads with dt != 0 decay the state; the mask is what keeps the final state right."""
    t = make(1, 12, 2, seed=2)
    mask = torch.ones(1, 12, dtype=torch.bool)
    mask[:, 8:] = False
    _, fin_masked = ssd_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], chunk_size=4, token_mask=mask,
                             initial_state=t["initial_state"], return_final_state=True)
    _, fin_real = ssd_scan(t["x"][:, :8], t["dt"][:, :8], t["A"], t["B"][:, :8], t["C"][:, :8], chunk_size=4,
                           initial_state=t["initial_state"], return_final_state=True)
    xz, Bz = t["x"].clone(), t["B"].clone()
    xz[:, 8:] = 0
    Bz[:, 8:] = 0
    _, fin_hf = ssd_scan(xz, t["dt"], t["A"], Bz, t["C"], chunk_size=4, initial_state=t["initial_state"],
                         return_final_state=True)  # HF's apply_mask_to_padding_states: x, B zeroed, dt kept
    assert rel_err(fin_masked, fin_real) < 1e-12
    assert rel_err(fin_hf, fin_real) > 1e-3


@pytest.mark.parametrize("rows", [pytest.param([[5, 1, 10]], id="1row"), pytest.param([[9, 7], [16]], id="2rows")])
@pytest.mark.parametrize("varlen", [pytest.param(True, id="varlen-autograd-path"), pytest.param(False, id="core-path")])
@pytest.mark.usefixtures("ssd_blocks")
def test_packed_grads_equal_per_sequence_grads(rows, varlen):
    seq = seq_idx_of(rows)
    Bsz, T = seq.shape
    t = make(Bsz, T, 2, seed=8)
    g = torch.Generator().manual_seed(99)
    gy = torch.randn(Bsz, T, H, P, generator=g, dtype=torch.float64)
    segs = split_rows(seq)
    gs = torch.randn(len(segs), H, P, N, generator=g, dtype=torch.float64)
    names = ["x", "dt", "A", "B", "C", "D", "dt_bias", "initial_state"]

    def leaves():
        return {k: t[k].clone().requires_grad_(True) for k in names}

    p = leaves()
    out = ssd_scan(p["x"], p["dt"], p["A"], p["B"], p["C"], chunk_size=4, D=p["D"], dt_bias=p["dt_bias"],
                   seq_idx=seq, initial_state=p["initial_state"], return_varlen_states=varlen,
                   return_final_state=not varlen)
    if varlen:  # every sequence's final state carries a gradient
        y, var = out
        ((y * gy).sum() + (var * gs).sum()).backward()
    else:  # the hand-written backward: only each row's last sequence has a returned state
        y, fin = out
        last = [i for i, (b, s, e) in enumerate(segs) if e == T]
        ((y * gy).sum() + (fin * gs[last]).sum()).backward()

    q = leaves()
    loss = 0
    for i, (b, s, e) in enumerate(segs):
        init = q["initial_state"][b : b + 1] if s == 0 else None
        ys, fs = ssd_scan(q["x"][b : b + 1, s:e], q["dt"][b : b + 1, s:e], q["A"], q["B"][b : b + 1, s:e],
                          q["C"][b : b + 1, s:e], chunk_size=4, D=q["D"], dt_bias=q["dt_bias"], initial_state=init,
                          return_final_state=True)
        if varlen or e == T:
            loss = loss + (fs[0] * gs[i]).sum()
        loss = loss + (ys * gy[b : b + 1, s:e]).sum()
    loss.backward()
    for k in names:
        assert rel_err(p[k].grad, q[k].grad) < 1e-10, k


@pytest.mark.usefixtures("ssd_blocks")
@pytest.mark.parametrize("rows", [pytest.param([[5, 1, 10]], id="packed"), pytest.param([[16], [16]], id="plain")])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_hand_written_backward_equals_autograd_form(rows, dtype):
    """_SSDCore (the default path) and _ssd_autograd (the varlen path) agree on outputs and every gradient."""
    from safepad.ops.ssd import _ssd_chunked

    seq = seq_idx_of(rows) if len(rows[0]) > 1 else None
    Bsz, T = len(rows), sum(rows[0])
    t = make(Bsz, T, 2, seed=21)
    g = torch.Generator().manual_seed(5)
    gy = torch.randn(Bsz, T, H, P, generator=g, dtype=torch.float64).to(dtype)
    gf = torch.randn(Bsz, H, P, N, generator=g, dtype=torch.float64).to(dtype)
    names = ["x", "dt", "A", "B", "C", "D", "initial_state"]
    grads = []
    for varlen in (False, True):
        p = {k: t[k].detach().clone().to(dtype).requires_grad_(True) for k in names}
        dtp = torch.nn.functional.softplus(p["dt"])
        y, fin, _ = _ssd_chunked(p["x"], dtp, p["A"], p["B"], p["C"], p["D"], seq, p["initial_state"], 4, varlen)
        ((y * gy).sum() + (fin * gf).sum()).backward()
        grads.append({"y": y.detach(), "fin": fin.detach(), **{k: p[k].grad for k in names}})
    for k in grads[0]:
        assert rel_err(grads[0][k], grads[1][k]) < TOL[dtype] * 10, k


def test_fp32_grads_close_to_fp64():
    seq = seq_idx_of([[6, 11, 3]])
    t = make(1, 20, 2, seed=4)
    grads = {}
    for dtype in (torch.float64, torch.float32):
        p = {k: t[k].detach().clone().to(dtype).requires_grad_(True) for k in ("x", "dt", "A", "B", "C", "D", "dt_bias")}
        y = ssd_scan(p["x"], p["dt"], p["A"], p["B"], p["C"], chunk_size=8, D=p["D"], dt_bias=p["dt_bias"],
                     seq_idx=seq)
        (y.double() * torch.linspace(-1, 1, y.numel(), dtype=torch.float64).view_as(y)).sum().backward()
        grads[dtype] = {k: v.grad for k, v in p.items()}
    for k in grads[torch.float64]:
        assert rel_err(grads[torch.float32][k], grads[torch.float64][k]) < 1e-5, k


@settings(max_examples=12, deadline=None)
@given(
    lens=st.lists(st.integers(1, 13), min_size=1, max_size=5),
    chunk=st.sampled_from([2, 4, 5, 8]),
    G=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 10_000),
)
def test_property_random_layouts(lens, chunk, G, seed):
    seq = seq_idx_of([lens])
    t = make(1, seq.shape[1], G, seed=seed)
    y_ref, fin_ref, var_ref = reference_packed(t, seq, (0.0, INF))
    y, fin, var = ssd_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], chunk_size=chunk, D=t["D"],
                           dt_bias=t["dt_bias"], seq_idx=seq, initial_state=t["initial_state"],
                           return_final_state=True, return_varlen_states=True)
    assert rel_err(y, y_ref) < 1e-10 and rel_err(fin, fin_ref) < 1e-10 and rel_err(var, var_ref) < 1e-10


def test_fp32_long_decays_stay_finite_and_accurate():
    """Strong decays (cumulative log-decay far below -100) exercise the subnormal flush."""
    t = make(1, 64, 2, seed=6, dtype=torch.float64)
    t["A"] = -torch.full((H,), 40.0, dtype=torch.float64)
    y_ref, fin_ref, _ = reference_packed(t, torch.zeros(1, 64, dtype=torch.int32), (0.0, INF))
    tt = {k: (v.float() if v is not None else None) for k, v in t.items()}
    y, fin = ssd_scan(tt["x"], tt["dt"], tt["A"], tt["B"], tt["C"], chunk_size=32, D=tt["D"],
                      dt_bias=tt["dt_bias"], initial_state=tt["initial_state"], return_final_state=True)
    assert torch.isfinite(y).all() and rel_err(y, y_ref) < 1e-5 and rel_err(fin, fin_ref) < 1e-5


def _base():
    return make(2, 6, 2, seed=0, dtype=torch.float32)


BAD = [
    pytest.param({"seq_idx": torch.tensor([[0, 0, 1, 1, 0, 0]] * 2, dtype=torch.int32)}, "seq_idx", id="seq-decreasing"),
    pytest.param({"seq_idx": torch.zeros(2, 6)}, "seq_idx", id="seq-float"),
    pytest.param({"seq_idx": torch.zeros(2, 5, dtype=torch.int32)}, "seq_idx", id="seq-shape"),
    pytest.param({"initial_state": torch.zeros(2, H, P, N + 1)}, "initial_state", id="init-shape"),
    pytest.param({"chunk_size": 0}, "chunk_size", id="chunk-0"),
    pytest.param({"chunk_size": -4}, "chunk_size", id="chunk-neg"),
    pytest.param({"token_mask": torch.ones(2, 7, dtype=torch.bool)}, "token_mask", id="mask-shape"),
    pytest.param({"token_mask": torch.ones(2, 6)}, "token_mask", id="mask-float"),
    pytest.param({"D": torch.zeros(H + 1)}, "D", id="D-shape"),
    pytest.param({"dt_bias": torch.zeros(H, 1)}, "dt_bias", id="dt_bias-shape"),
    pytest.param({"dt_limit": (0.5, 0.1)}, "dt_limit", id="dt_limit-order"),
    pytest.param({"backend": "cuda"}, "backend", id="backend-name"),
]


@pytest.mark.parametrize("kwargs,name", BAD)
def test_bad_input_raises_value_error_naming_the_argument(kwargs, name):
    t = _base()
    with pytest.raises(ValueError, match=name):
        ssd_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], **kwargs)


@pytest.mark.parametrize(
    "which,bad",
    [
        pytest.param("x", torch.zeros(2, 6, H), id="x-3d"),
        pytest.param("dt", torch.zeros(2, 6, H + 1), id="dt"),
        pytest.param("A", torch.zeros(H, 1), id="A"),
        pytest.param("B", torch.zeros(2, 6, 3, N), id="B-groups"),
        pytest.param("C", torch.zeros(2, 6, 2, N + 1), id="C"),
    ],
)
def test_bad_shapes_raise(which, bad):
    t = _base()
    args = {k: t[k] for k in ("x", "dt", "A", "B", "C")}
    args[which] = bad
    with pytest.raises(ValueError, match=which if which != "B" else "groups"):
        ssd_scan(args["x"], args["dt"], args["A"], args["B"], args["C"])


def test_step_bad_state_shape():
    t = _base()
    with pytest.raises(ValueError, match="state"):
        ssd_step(torch.zeros(2, H, P, N + 1), t["x"][:, 0], t["dt"][:, 0], t["A"], t["B"][:, 0], t["C"][:, 0])


def test_bf16_inputs_run_in_fp32():
    t = make(1, 16, 2, seed=9, dtype=torch.float64)
    y_ref, _, _ = reference_packed(t, torch.zeros(1, 16, dtype=torch.int32), (0.0, INF))
    tb = {k: (v.to(torch.bfloat16) if v is not None else None) for k, v in t.items()}
    y, fin = ssd_scan(tb["x"], tb["dt"], tb["A"], tb["B"], tb["C"], chunk_size=8, D=tb["D"], dt_bias=tb["dt_bias"],
                      initial_state=tb["initial_state"], return_final_state=True)
    assert y.dtype == torch.bfloat16 and fin.dtype == torch.float32
    assert rel_err(y, y_ref) < 5e-2 and math.isfinite(rel_err(y, y_ref))


@pytest.mark.usefixtures("ssd_blocks")
def test_gradcheck_against_finite_differences():
    """The hand-written intra-chunk backward (and the rest of the graph) vs numerical gradients."""
    seq = seq_idx_of([[3, 6, 1]])
    t = make(1, 10, 2, seed=12)
    names = ["x", "dt", "A", "B", "C", "D", "dt_bias", "initial_state"]
    leaves = [t[k].clone().requires_grad_(True) for k in names]

    def f(x, dt, A, B, C, D, dt_bias, init):
        y, fin = ssd_scan(x, dt, A, B, C, chunk_size=4, D=D, dt_bias=dt_bias, dt_limit=(0.05, 2.0), seq_idx=seq,
                          initial_state=init, return_final_state=True)
        return y, fin

    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)
