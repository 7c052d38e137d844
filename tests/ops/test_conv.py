"""safepad.ops.conv (and the dt pipeline) against the float64 token-by-token oracle."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from reference import ref_conv, ref_dt, split_rows

import safepad.ops.conv as conv_mod
from safepad.ops import causal_conv1d, causal_conv1d_step, process_dt

D_ = 6
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def seq_idx_of(rows: list[list[int]]) -> torch.Tensor:
    return torch.stack(
        [torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(r)]) for r in rows]
    )


def make(Bsz: int, T: int, K: int, S: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(Bsz, T, D_, generator=g, dtype=torch.float64),
        "w": torch.randn(D_, K, generator=g, dtype=torch.float64) * 0.5,
        "b": torch.randn(D_, generator=g, dtype=torch.float64),
        "init": torch.randn(Bsz, D_, S, generator=g, dtype=torch.float64),
    }


def reference_packed(t, seq, activation, state_len, use_init, use_bias=True):
    y = torch.zeros_like(t["x"])
    states = []
    for b, s, e in split_rows(seq):
        hist = t["init"][b] if (use_init and s == 0) else None
        ys, st = ref_conv(t["x"][b, s:e], t["w"], t["b"] if use_bias else None, hist, activation, state_len)
        y[b, s:e] = ys
        states.append(st)
    var = torch.stack(states)
    last = [i for i, (b, s, e) in enumerate(split_rows(seq)) if e == seq.shape[1]]
    return y, var[last], var


@pytest.fixture(params=[pytest.param(None, id="blocks-default"), pytest.param(1, id="blocks-of-K-1")])
def conv_blocks(request, monkeypatch):
    """Run the conv over its default token blocks (one block at these sizes) and over the smallest ones."""
    if request.param is not None:
        monkeypatch.setattr(conv_mod, "_BLOCK_BYTES", request.param)


LAYOUTS = [
    pytest.param([[1]], id="len1"),
    pytest.param([[3]], id="len-K-1"),
    pytest.param([[2, 1, 5, 3, 9]], id="mixed-short"),
    pytest.param([[4, 16], [1, 1, 18], [20]], id="3-rows"),
]
OPTIONS = [  # K, S (init columns), state_len, activation, use_init, use_bias
    pytest.param(4, 3, None, "silu", True, True, id="K4-S3-silu-init"),
    pytest.param(4, 4, 4, None, True, False, id="K4-S4-hf-layout-nobias"),
    pytest.param(2, 5, 6, "swish", True, True, id="K2-S5-L6"),
    pytest.param(3, 2, 2, None, False, True, id="K3-noinit"),
    pytest.param(1, 1, 1, "silu", True, True, id="K1"),
]


@pytest.mark.parametrize("rows", LAYOUTS)
@pytest.mark.parametrize("K,S,state_len,activation,use_init,use_bias", OPTIONS)
@pytest.mark.usefixtures("conv_blocks")
def test_packed_matches_per_sequence_reference(rows, K, S, state_len, activation, use_init, use_bias):
    seq = seq_idx_of(rows)
    Bsz, T = seq.shape
    t = make(Bsz, T, K, S, seed=K * 100 + T)
    L = K - 1 if state_len is None else state_len
    if L < 1:
        pytest.skip("K=1 has no conv state")
    y_ref, fin_ref, var_ref = reference_packed(t, seq, activation, L, use_init, use_bias)
    for dtype in (torch.float64, torch.float32):
        y, fin, var = causal_conv1d(
            t["x"].to(dtype), t["w"].to(dtype), t["b"].to(dtype) if use_bias else None, activation=activation,
            seq_idx=seq, initial_state=t["init"].to(dtype) if use_init else None, return_final_state=True,
            state_len=state_len, return_varlen_states=True,
        )
        assert y.dtype == dtype and fin.shape == (Bsz, D_, L) and var.shape == (len(split_rows(seq)), D_, L)
        assert rel_err(y, y_ref) < TOL[dtype]
        assert rel_err(fin, fin_ref) < TOL[dtype] or fin_ref.abs().max() == 0
        assert rel_err(var, var_ref) < TOL[dtype]


def test_single_sequence_matches_plain_conv1d():
    t = make(2, 11, 4, 3, seed=1)
    y = causal_conv1d(t["x"], t["w"], t["b"])
    y_ref = F.conv1d(F.pad(t["x"].transpose(1, 2), (3, 0)), t["w"].unsqueeze(1), t["b"], groups=D_).transpose(1, 2)
    assert rel_err(y, y_ref) < 1e-12


def test_without_seq_idx_packed_rows_leak():
    seq = seq_idx_of([[5, 6]])
    t = make(1, 11, 4, 3, seed=2)
    y_ref, _, _ = reference_packed(t, seq, None, 3, False)
    y = causal_conv1d(t["x"], t["w"], t["b"])
    assert rel_err(y[:, 5:8], y_ref[:, 5:8]) > 1e-3  # the window crosses the boundary
    assert rel_err(y[:, :5], y_ref[:, :5]) < 1e-12 and rel_err(y[:, 8:], y_ref[:, 8:]) < 1e-12


@pytest.mark.parametrize("S,state_len", [(3, None), (4, 4)], ids=["S3", "hf-S4"])
def test_decode_after_prefix_equals_full_conv(S, state_len):
    T, prefix = 12, 7
    t = make(2, T, 4, S, seed=3)
    y_full = causal_conv1d(t["x"], t["w"], t["b"], activation="silu", initial_state=t["init"])
    y_pre, state = causal_conv1d(t["x"][:, :prefix], t["w"], t["b"], activation="silu", initial_state=t["init"],
                                 return_final_state=True, state_len=S)
    ys = [y_pre]
    for i in range(prefix, T):
        y_i, state = causal_conv1d_step(t["x"][:, i], state, t["w"], t["b"], activation="silu")
        ys.append(y_i.unsqueeze(1))
    assert rel_err(torch.cat(ys, 1), y_full) < 1e-12
    _, fin = causal_conv1d(t["x"], t["w"], t["b"], initial_state=t["init"], return_final_state=True, state_len=S)
    assert torch.equal(state, fin)


@pytest.mark.parametrize(
    "dtype,activation",
    [
        pytest.param(torch.bfloat16, "silu", id="bf16-silu"),
        pytest.param(torch.float16, "silu", id="fp16-silu"),
        pytest.param(torch.bfloat16, None, id="bf16-linear"),
        pytest.param(torch.float32, "silu", id="fp32-silu"),
    ],
)
def test_decode_step_rounds_as_the_full_conv(dtype, activation):
    """Each decode step returns, bitwise, the full conv's output at that token (rollout = trainer in half
    precision). Before: the step summed its window as ``(w * x).sum() + bias`` and applied ``F.silu``, the chunked
    conv as ``bias + w x_t + w x_{t-3} + ...`` and ``p * sigmoid(p)``: float32 results ~1 ulp apart, which bf16
    rounded to different neighbours (here 1 of 4096 in bf16; 2450 of 4096 differ in float32; GRPO rollout gap 1e-3
    on bf16 Bamba and Nemotron-H)."""
    g = torch.Generator().manual_seed(0)
    B, T, D, K, S, prefix = 4, 24, 64, 4, 4, 8  # D a multiple of the vector width: no scalar tail
    x = (torch.randn(B, T, D, generator=g) * 3).to(dtype)
    w, b = torch.randn(D, K, generator=g).to(dtype), torch.randn(D, generator=g).to(dtype)
    y_full = causal_conv1d(x, w, b, activation=activation)  # [B, T, D]
    _, state = causal_conv1d(x[:, :prefix], w, b, activation=activation, return_final_state=True, state_len=S)
    steps = []
    for i in range(prefix, T):
        y_i, state = causal_conv1d_step(x[:, i], state, w, b, activation=activation)  # [B, D]
        steps.append(y_i)
    steps = torch.stack(steps, 1)  # [B, T - prefix, D]
    differ = int((steps != y_full[:, prefix:]).sum())
    assert differ == 0, f"{differ} of {steps.numel()} decode outputs differ from the full conv's"


@pytest.mark.parametrize(
    "dtype,activation,K,S",
    [
        pytest.param(torch.float32, "silu", 4, 4, id="fp32-silu-S=K"),
        pytest.param(torch.bfloat16, "silu", 4, 4, id="bf16-silu-S=K"),
        pytest.param(torch.bfloat16, None, 3, 5, id="bf16-linear-S>K"),
        pytest.param(torch.float32, None, 4, 3, id="fp32-linear-S=K-1"),
    ],
)
def test_step_takes_a_one_token_chunk(dtype, activation, K, S):
    """``x [B, 1, D]`` (the token as a mixer holds it) gives ``y [B, 1, D]``: bitwise the ``[B, D]`` step's output
    and state, and bitwise the full conv's output at each decoded token."""
    g = torch.Generator().manual_seed(1)
    B, T, D, prefix = 3, 12, 64, 5  # D a multiple of the vector width: no scalar tail (as above)
    x = (torch.randn(B, T, D, generator=g) * 3).to(dtype)
    w, b = torch.randn(D, K, generator=g).to(dtype), torch.randn(D, generator=g).to(dtype)
    y_full = causal_conv1d(x, w, b, activation=activation)  # [B, T, D]
    _, state = causal_conv1d(x[:, :prefix], w, b, activation=activation, return_final_state=True, state_len=S)
    for i in range(prefix, T):
        y3, s3 = causal_conv1d_step(x[:, i : i + 1], state, w, b, activation=activation)  # [B, 1, D], [B, D, S]
        y2, s2 = causal_conv1d_step(x[:, i], state, w, b, activation=activation)  # [B, D]
        assert y3.shape == (B, 1, D) and y3.dtype == dtype
        assert torch.equal(y3[:, 0], y2) and torch.equal(s3, s2)
        assert torch.equal(y3[:, 0], y_full[:, i]), f"token {i}: the one-token chunk's step differs from the full conv"
        state = s3
    _, fin = causal_conv1d(x, w, b, return_final_state=True, state_len=S)
    assert torch.equal(state, fin)


def test_step_refuses_a_chunk_of_several_tokens():
    t = make(2, 3, 4, 4, seed=4)
    with pytest.raises(ValueError, match=r"\[batch, 1, dim\]"):
        causal_conv1d_step(t["x"][:, :2], t["init"], t["w"], t["b"])


def test_step_is_out_of_place():
    t = make(2, 1, 4, 4, seed=4)
    s0 = t["init"].clone()
    _, s1 = causal_conv1d_step(t["x"][:, 0], t["init"], t["w"], t["b"])
    assert torch.equal(t["init"], s0) and torch.equal(s1[:, :, -1], t["x"][:, 0]) and torch.equal(s1[:, :, :-1], s0[:, :, 1:])


@pytest.mark.parametrize("lens", [[5, 9, 2], [1, 12, 0]], ids=["short", "with-empty-row"])
def test_right_pads_with_initial_state_equal_compacted(lens):
    """Trailing masked tokens: outputs of real tokens and the conv state == the real tokens alone."""
    T = 12
    t = make(3, T, 4, 4, seed=5)
    mask = torch.zeros(3, T, dtype=torch.bool)
    for r, l in enumerate(lens):
        mask[r, :l] = True
    y, fin = causal_conv1d(t["x"], t["w"], t["b"], initial_state=t["init"], token_mask=mask,
                           return_final_state=True, state_len=4)
    for r, l in enumerate(lens):
        y_c, fin_c = causal_conv1d(t["x"][r : r + 1, :l] if l else t["x"][r : r + 1, :1], t["w"], t["b"],
                                   initial_state=t["init"][r : r + 1], return_final_state=True, state_len=4,
                                   token_mask=None if l else torch.zeros(1, 1, dtype=torch.bool))
        if l:
            assert rel_err(y[r : r + 1, :l], y_c) < 1e-12
        assert torch.equal(fin[r : r + 1], fin_c)
    # stock HF keeps the last K columns of the padded row: different from the real state
    assert not torch.equal(fin[0], t["x"][0, -4:].T)


@pytest.mark.parametrize("left,right", [(3, 0), (0, 4), (2, 2)], ids=["left", "right", "both"])
def test_masked_without_initial_state_equals_compacted(left, right):
    T, l = 14, 14 - left - right
    seq = torch.zeros(1, T, dtype=torch.int32)
    t = make(1, T, 4, 3, seed=6)
    mask = torch.zeros(1, T, dtype=torch.bool)
    mask[:, left : left + l] = True
    y, fin = causal_conv1d(t["x"], t["w"], t["b"], activation="silu", seq_idx=seq, token_mask=mask,
                           return_final_state=True)
    y_c, fin_c = causal_conv1d(t["x"][:, left : left + l], t["w"], t["b"], activation="silu", return_final_state=True)
    assert rel_err(y[:, left : left + l], y_c) < 1e-12 and torch.equal(fin, fin_c)


@pytest.mark.usefixtures("conv_blocks")
def test_packed_grads_equal_per_sequence_grads():
    seq = seq_idx_of([[3, 1, 8], [6, 6]])
    t = make(2, 12, 4, 4, seed=7)
    g = torch.Generator().manual_seed(1)
    gy = torch.randn(2, 12, D_, generator=g, dtype=torch.float64)
    segs = split_rows(seq)
    gs = torch.randn(len(segs), D_, 4, generator=g, dtype=torch.float64)

    def leaves():
        return {k: v.clone().requires_grad_(True) for k, v in t.items()}

    p = leaves()
    y, var = causal_conv1d(p["x"], p["w"], p["b"], activation="silu", seq_idx=seq, initial_state=p["init"],
                           return_varlen_states=True, state_len=4)
    ((y * gy).sum() + (var * gs).sum()).backward()
    q = leaves()
    loss = 0
    for i, (b, s, e) in enumerate(segs):
        init = q["init"][b : b + 1] if s == 0 else None
        ys, fs = causal_conv1d(q["x"][b : b + 1, s:e], q["w"], q["b"], activation="silu", initial_state=init,
                               return_final_state=True, state_len=4)
        loss = loss + (ys * gy[b : b + 1, s:e]).sum() + (fs[0] * gs[i]).sum()
    loss.backward()
    for k in ("x", "w", "b", "init"):
        assert rel_err(p[k].grad, q[k].grad) < 1e-12, k


@pytest.mark.parametrize(
    "K,activation,use_seq,use_init,use_bias",
    [
        pytest.param(4, "silu", True, True, True, id="K4-silu-packed-init"),
        pytest.param(4, None, False, False, False, id="K4-linear-plain"),
        pytest.param(3, "silu", True, False, True, id="K3-packed"),
        pytest.param(1, None, False, True, True, id="K1"),
    ],
)
@pytest.mark.usefixtures("conv_blocks")
def test_grads_match_autograd_through_the_reference(K, activation, use_seq, use_init, use_bias):
    """The hand-written conv backward equals autograd through the token-by-token float64 oracle."""
    rows = [[2, 5, 1, 4]] if use_seq else [[12]]
    seq = seq_idx_of(rows)
    t = make(1, 12, K, K - 1 if K > 1 else 1, seed=11)
    gy = torch.randn(1, 12, D_, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def leaves():
        return {k: v.clone().requires_grad_(True) for k, v in t.items()}

    p = leaves()
    y = causal_conv1d(p["x"], p["w"], p["b"] if use_bias else None, activation=activation,
                      seq_idx=seq if use_seq else None, initial_state=p["init"] if use_init else None)
    (y * gy).sum().backward()
    q = leaves()
    y_ref, _, _ = reference_packed(q, seq, activation, max(K - 1, 1), use_init, use_bias)
    (y_ref * gy).sum().backward()
    for k in ("x", "w") + (("b",) if use_bias else ()) + (("init",) if use_init and K > 1 else ()):
        assert rel_err(p[k].grad, q[k].grad) < 1e-12, k
    if use_seq:  # the boundaries matter for the gradients: without them the same loss differentiates differently
        r = leaves()
        y_leak = causal_conv1d(r["x"], r["w"], r["b"] if use_bias else None, activation=activation,
                               initial_state=r["init"] if use_init else None)
        (y_leak * gy).sum().backward()
        assert rel_err(r["w"].grad, q["w"].grad) > 1e-3


@pytest.mark.usefixtures("conv_blocks")
def test_gradcheck_against_finite_differences():
    seq = seq_idx_of([[3, 1, 5]])
    t = make(1, 9, 4, 3, seed=12)
    leaves = tuple(t[k].clone().requires_grad_(True) for k in ("x", "w", "b", "init"))

    def f(x, w, b, init):
        return causal_conv1d(x, w, b, activation="silu", seq_idx=seq, initial_state=init)

    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("T", [1, 3, 4, 9], ids=["T1", "T-K-1", "T-K", "T9"])
@pytest.mark.parametrize("use_init", [False, True], ids=["noinit", "init"])
def test_one_sequence_states_equal_the_general_gather(T, use_init):
    """Rows without seq_idx / mask (the fast path) give the states of the general varlen gather."""
    t = make(2, T, 4, 3, seed=13)
    init = t["init"] if use_init else None
    _, fin = causal_conv1d(t["x"], t["w"], t["b"], initial_state=init, return_final_state=True, state_len=4)
    _, fin_gen = causal_conv1d(t["x"], t["w"], t["b"], initial_state=init, return_final_state=True, state_len=4,
                               seq_idx=torch.zeros(2, T, dtype=torch.int32))
    assert torch.equal(fin, fin_gen)
    assert fin.untyped_storage().data_ptr() != t["x"].untyped_storage().data_ptr()  # not a view of x


def test_fp32_grads_close_to_fp64():
    seq = seq_idx_of([[4, 9, 3]])
    t = make(1, 16, 4, 3, seed=8)
    grads = {}
    for dtype in (torch.float64, torch.float32):
        p = {k: v.detach().clone().to(dtype).requires_grad_(True) for k, v in t.items()}
        y = causal_conv1d(p["x"], p["w"], p["b"], activation="silu", seq_idx=seq, initial_state=p["init"])
        (y.double() * torch.linspace(-1, 1, y.numel(), dtype=torch.float64).view_as(y)).sum().backward()
        grads[dtype] = {k: v.grad for k, v in p.items()}
    for k in grads[torch.float64]:
        assert rel_err(grads[torch.float32][k], grads[torch.float64][k]) < 1e-5, k


@pytest.mark.parametrize(
    "dt_limit,softplus",
    [((0.0, float("inf")), True), ((0.05, float("inf")), True), ((0.0, 0.01), True), ((0.1, 2.0), False)],
    ids=["default", "lo", "hi", "no-softplus"],
)
def test_process_dt_matches_reference(dt_limit, softplus):
    g = torch.Generator().manual_seed(0)
    dt = torch.randn(3, 7, 5, generator=g) * 3
    bias = torch.randn(5, generator=g)
    out = process_dt(dt, bias, dt_limit, softplus)
    assert out.dtype == torch.float32
    assert rel_err(out, ref_dt(dt, bias, dt_limit, softplus)) < 1e-6
    assert process_dt(dt.bfloat16()).dtype == torch.float32


def test_process_dt_bad_inputs():
    with pytest.raises(ValueError, match="dt_bias"):
        process_dt(torch.zeros(2, 3), torch.zeros(4))
    with pytest.raises(ValueError, match="dt_limit"):
        process_dt(torch.zeros(2, 3), dt_limit=(1.0, 0.5))


def _base():
    return make(2, 6, 4, 3, seed=0)


BAD = [
    pytest.param({"seq_idx": torch.tensor([[0, 1, 1, 0, 2, 2]] * 2, dtype=torch.int32)}, "seq_idx", id="seq-decreasing"),
    pytest.param({"seq_idx": torch.zeros(2, 6)}, "seq_idx", id="seq-float"),
    pytest.param({"seq_idx": torch.zeros(1, 6, dtype=torch.int32)}, "seq_idx", id="seq-shape"),
    pytest.param({"initial_state": torch.zeros(2, D_, 2)}, "initial_state", id="init-too-short"),
    pytest.param({"initial_state": torch.zeros(2, D_ + 1, 3)}, "initial_state", id="init-dim"),
    pytest.param({"token_mask": torch.ones(2, 5, dtype=torch.bool)}, "token_mask", id="mask-shape"),
    pytest.param({"activation": "not_an_activation"}, "activation", id="activation"),
    pytest.param({"return_final_state": True, "state_len": 0}, "state_len", id="state_len"),
    pytest.param({"backend": "triton"}, "backend", id="backend"),
]


@pytest.mark.parametrize("kwargs,name", BAD)
def test_bad_input_raises_value_error_naming_the_argument(kwargs, name):
    t = _base()
    with pytest.raises(ValueError, match=name):
        causal_conv1d(t["x"], t["w"], t["b"], **kwargs)


def test_bad_weight_and_step_state():
    t = _base()
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d(t["x"], torch.zeros(D_ + 1, 4), t["b"])
    with pytest.raises(ValueError, match="bias"):
        causal_conv1d(t["x"], t["w"], torch.zeros(D_ + 1))
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d_step(t["x"][:, 0], torch.zeros(2, D_, 2), t["w"], t["b"])


def test_backend_name_checked_on_every_route():
    t = _base()
    seq = torch.zeros(2, 6, dtype=torch.int32)
    with pytest.raises(ValueError, match="backend"):  # seq_idx + initial_state never tries a kernel
        causal_conv1d(t["x"], t["w"], t["b"], seq_idx=seq, initial_state=t["init"], backend="gpu")
    with pytest.raises(ValueError, match="backend"):
        causal_conv1d_step(t["x"][:, 0], t["init"], t["w"], t["b"], backend="gpu")


def test_kernels_backend_on_cpu_raises():
    t = _base()
    with pytest.raises(ValueError, match="kernels"):
        causal_conv1d(t["x"], t["w"], t["b"], backend="kernels")
