"""safepad.ops.delta_rule: chunked varlen gated delta rule vs a float64 token loop, HF, and itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from reference_delta import reference_delta_rule, reference_packed

from safepad.layout.boundaries import cu_seqlens_from_seq_idx
from safepad.ops.delta_rule import chunk_gated_delta_rule, gated_delta_rule_step

RTOL = {torch.float32: 1e-5, torch.float64: 1e-10}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (max-abs-relative)."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def make_inputs(bsz, t, h, dk, dv, *, per_channel, hk=None, dtype=torch.float32, seed=0, g_scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    hk = hk or h
    q = torch.randn(bsz, t, hk, dk, generator=gen, dtype=torch.float64)
    k = torch.randn(bsz, t, hk, dk, generator=gen, dtype=torch.float64) / dk**0.5  # |k| ~ 1: stable delta rule
    v = torch.randn(bsz, t, h, dv, generator=gen, dtype=torch.float64)
    gshape = (bsz, t, h, dk) if per_channel else (bsz, t, h)
    g = -F.softplus(torch.randn(*gshape, generator=gen, dtype=torch.float64)) * g_scale
    beta = torch.rand(bsz, t, h, generator=gen, dtype=torch.float64)
    return [x.to(dtype) for x in (q, k, v, g, beta)]


def seq_idx_from_lengths(rows: list[list[int]]) -> torch.Tensor:
    """[[3, 5], [8]] -> seq_idx [2, 8] int32."""
    out = [[i for i, n in enumerate(r) for _ in range(n)] for r in rows]
    if len({len(r) for r in out}) != 1:
        raise ValueError(f"rows must have equal total length, got {rows}")
    return torch.tensor(out, dtype=torch.int32)


GATES = [pytest.param(False, id="gdn"), pytest.param(True, id="kda")]

# (rows of sequence lengths, chunk_size): awkward lengths around the chunk size, several chunks, 1-4 seqs/row
LAYOUTS = [
    pytest.param([[1]], 8, id="len1"),
    pytest.param([[7]], 8, id="chunk-1"),
    pytest.param([[8]], 8, id="chunk"),
    pytest.param([[9]], 8, id="chunk+1"),
    pytest.param([[17], [17]], 16, id="2rows-chunk16+1"),
    pytest.param([[3, 8, 9, 1], [21], [1, 1, 19]], 8, id="3rows-1to4seqs"),
    pytest.param([[15, 17, 1, 7]], 16, id="boundaries-at-chunk-edges"),
]


@pytest.mark.parametrize("per_channel", GATES)
@pytest.mark.parametrize("rows, chunk_size", LAYOUTS)
@pytest.mark.parametrize("with_h0", [pytest.param(False, id="h0none"), pytest.param(True, id="h0")])
@pytest.mark.parametrize("l2", [pytest.param(False, id="nol2"), pytest.param(True, id="l2")])
def test_matches_float64_reference(rows, chunk_size, per_channel, with_h0, l2):
    seq_idx = seq_idx_from_lengths(rows)
    bsz, t = seq_idx.shape
    h, dk, dv = 2, 8, 5
    q, k, v, g, beta = make_inputs(bsz, t, h, dk, dv, per_channel=per_channel, seed=t)
    h0 = torch.randn(bsz, h, dk, dv, generator=torch.Generator().manual_seed(1)) if with_h0 else None
    o, final, varlen = chunk_gated_delta_rule(
        q, k, v, g, beta, chunk_size=chunk_size, initial_state=h0, seq_idx=seq_idx, use_qk_l2norm=l2,
        return_final_state=True, return_varlen_states=True,
    )
    ro, rf, rv = reference_packed(q, k, v, g, beta, seq_idx=seq_idx, initial_state=h0, use_qk_l2norm=l2)
    assert o.dtype == v.dtype and final.dtype == torch.float32 and varlen.dtype == torch.float32
    assert varlen.shape == (cu_seqlens_from_seq_idx(seq_idx).numel() - 1, h, dk, dv)
    assert rel_err(o, ro) < RTOL[torch.float32]
    assert rel_err(final, rf) < RTOL[torch.float32]
    assert rel_err(varlen, rv) < RTOL[torch.float32]


@pytest.mark.parametrize("per_channel", GATES)
def test_float64_inputs_match_reference_tightly(per_channel):
    seq_idx = seq_idx_from_lengths([[5, 12, 3], [20]])
    q, k, v, g, beta = make_inputs(2, 20, 2, 4, 3, per_channel=per_channel, dtype=torch.float64, seed=3)
    h0 = torch.randn(2, 2, 4, 3, dtype=torch.float64)
    o, final, varlen = chunk_gated_delta_rule(
        q, k, v, g, beta, chunk_size=4, initial_state=h0, seq_idx=seq_idx,
        return_final_state=True, return_varlen_states=True,
    )
    ro, rf, rv = reference_packed(q, k, v, g, beta, seq_idx=seq_idx, initial_state=h0)
    assert o.dtype == torch.float64 and final.dtype == torch.float64
    for got, want in ((o, ro), (final, rf), (varlen, rv)):
        assert rel_err(got, want) < RTOL[torch.float64]


@pytest.mark.parametrize("per_channel", GATES)
def test_strong_decay_is_stable(per_channel):
    """Log-decays down to about -40 per token inside a 64-token chunk: no overflow, still exact."""
    q, k, v, g, beta = make_inputs(1, 70, 2, 8, 4, per_channel=per_channel, seed=5, g_scale=30.0)
    o, final = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64, return_final_state=True)
    ro, rf = reference_delta_rule(q[0], k[0], v[0], g[0], beta[0])
    assert torch.isfinite(o).all() and torch.isfinite(final).all()
    assert rel_err(o[0], ro) < RTOL[torch.float32]
    assert rel_err(final[0], rf) < RTOL[torch.float32]


@pytest.mark.parametrize("per_channel", GATES)
def test_grouped_value_heads_match_reference(per_channel):
    """q/k with H_k = 1 head serving H = 4 value heads (repeat_interleave, as transformers)."""
    q, k, v, g, beta = make_inputs(1, 19, 4, 8, 3, per_channel=per_channel, hk=1, seed=7)
    o, final = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=8, use_qk_l2norm=True, return_final_state=True)
    ro, rf = reference_delta_rule(q[0], k[0], v[0], g[0], beta[0], use_qk_l2norm=True)
    assert rel_err(o[0], ro) < RTOL[torch.float32]
    assert rel_err(final[0], rf) < RTOL[torch.float32]


def _per_sequence(q, k, v, g, beta, seq_idx, h0, chunk_size, l2):
    """Run every sequence alone as its own [1, L] row. Returns (o [B, T, H, Dv], finals [B], varlen [S])."""
    cu = cu_seqlens_from_seq_idx(seq_idx).tolist()
    t = seq_idx.shape[1]
    rows: list[list[torch.Tensor]] = [[] for _ in range(seq_idx.shape[0])]
    finals, varlen = [], []
    for lo, hi in zip(cu[:-1], cu[1:]):
        b, s, e = lo // t, lo % t, lo % t + (hi - lo)
        init = h0[b : b + 1] if (h0 is not None and s == 0) else None
        ob, fb = chunk_gated_delta_rule(
            *(x[b : b + 1, s:e] for x in (q, k, v, g, beta)), chunk_size=chunk_size, initial_state=init,
            use_qk_l2norm=l2, return_final_state=True,
        )
        rows[b].append(ob[0])
        varlen.append(fb[0])
        if e == t:
            finals.append(fb[0])
    o = torch.stack([torch.cat(r) for r in rows])  # [B, T, H, Dv]
    return o, torch.stack(finals), torch.stack(varlen)


@pytest.mark.parametrize("per_channel", GATES)
@pytest.mark.parametrize("l2", [pytest.param(False, id="nol2"), pytest.param(True, id="l2")])
def test_packed_equals_per_sequence_with_gradients(per_channel, l2):
    seq_idx = seq_idx_from_lengths([[3, 8, 9, 1], [21], [1, 1, 19]])
    bsz, t = seq_idx.shape
    h, dk, dv = 2, 8, 4
    inputs = make_inputs(bsz, t, h, dk, dv, per_channel=per_channel, seed=11)
    h0 = torch.randn(bsz, h, dk, dv, generator=torch.Generator().manual_seed(2))
    gen = torch.Generator().manual_seed(3)
    w_o, w_f = torch.randn(bsz, t, h, dv, generator=gen), torch.randn(bsz, h, dk, dv, generator=gen)
    w_v = torch.randn(cu_seqlens_from_seq_idx(seq_idx).numel() - 1, h, dk, dv, generator=gen)

    def run(packed: bool):
        leaves = [x.clone().requires_grad_() for x in (*inputs, h0)]
        *xs, init = leaves
        if packed:
            o, final, varlen = chunk_gated_delta_rule(
                *xs, chunk_size=8, initial_state=init, seq_idx=seq_idx, use_qk_l2norm=l2,
                return_final_state=True, return_varlen_states=True,
            )
        else:
            o, final, varlen = _per_sequence(*xs, seq_idx, init, 8, l2)
        ((o * w_o).sum() + (final * w_f).sum() + (varlen * w_v).sum()).backward()
        return o, final, varlen, [x.grad for x in leaves]

    po, pf, pv, pg = run(True)
    so, sf, sv, sg = run(False)
    assert rel_err(po, so) < 1e-5 and rel_err(pf, sf) < 1e-5 and rel_err(pv, sv) < 1e-5
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial_state"), pg, sg):
        assert rel_err(a, b) < 1e-4, name


@pytest.mark.parametrize("per_channel", GATES)
@pytest.mark.parametrize("chunk_size", [pytest.param(4, id="c4"), pytest.param(32, id="c32-subchunked")])
def test_gradcheck_float64(per_channel, chunk_size):
    """Autograd through the chunked form is the true derivative (packed, masked, initial state)."""
    seq_idx = seq_idx_from_lengths([[7, 13], [20]])
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[0, [2, 15]] = False
    mask[1, [0, 19]] = False
    inputs = make_inputs(2, 20, 1, 3, 2, per_channel=per_channel, dtype=torch.float64, seed=13)
    h0 = torch.randn(2, 1, 3, 2, dtype=torch.float64)
    leaves = [x.clone().requires_grad_() for x in (*inputs, h0)]

    def fn(q, k, v, g, beta, init):
        o, f, vs = chunk_gated_delta_rule(
            q, k, v, g, beta, chunk_size=chunk_size, initial_state=init, seq_idx=seq_idx, token_mask=mask,
            use_qk_l2norm=True, return_final_state=True, return_varlen_states=True,
        )
        return o * mask[..., None, None], f, vs

    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-6, fast_mode=True)


@pytest.mark.parametrize("per_channel", GATES)
@pytest.mark.parametrize("hk", [pytest.param(2, id="hk=h"), pytest.param(1, id="grouped")])
def test_step_after_prefix_equals_full(per_channel, hk):
    q, k, v, g, beta = make_inputs(2, 13, 2, 8, 4, per_channel=per_channel, hk=hk, seed=17)
    h0 = torch.randn(2, 2, 8, 4)
    full, full_state = chunk_gated_delta_rule(
        q, k, v, g, beta, chunk_size=4, initial_state=h0, use_qk_l2norm=True, return_final_state=True
    )
    prefix = 9
    o, state = chunk_gated_delta_rule(
        *(x[:, :prefix] for x in (q, k, v, g, beta)), chunk_size=4, initial_state=h0, use_qk_l2norm=True,
        return_final_state=True,
    )
    outs = [o]
    for i in range(prefix, 13):
        ot, new_state = gated_delta_rule_step(state, q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i], use_qk_l2norm=True)
        assert new_state is not state and new_state.dtype == torch.float32
        state = new_state
        outs.append(ot[:, None])
    assert rel_err(torch.cat(outs, 1), full) < 1e-5
    assert rel_err(state, full_state) < 1e-5


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")])
@pytest.mark.parametrize("per_channel", GATES)
def test_step_rounds_output_like_the_chunked_op(per_channel, dtype):
    """Half-precision inputs: the step's ``o`` comes back in ``v``'s dtype, the float32 result rounded once, as the
    chunked op's ``o`` is. (It came back in float32, so a decode step fed the next layer an unrounded output
    while the training forward fed it the rounded one: a 4e-3 rollout-vs-training log-prob gap on bf16 Qwen3-Next.)"""
    q, k, v, g, beta = make_inputs(2, 9, 2, 8, 4, per_channel=per_channel, seed=23, dtype=dtype)
    g = g.float()  # the mixers hand the op a float32 decay
    _, state = chunk_gated_delta_rule(
        *(x[:, :8] for x in (q, k, v, g, beta)), use_qk_l2norm=True, return_final_state=True
    )
    step = [x[:, 8] for x in (q, k, v, g, beta)]
    o, new_state = gated_delta_rule_step(state, *step, use_qk_l2norm=True)
    o32, state32 = gated_delta_rule_step(state, *(x.float() for x in step), use_qk_l2norm=True)
    assert o.dtype == dtype and new_state.dtype == torch.float32
    assert torch.equal(o, o32.to(dtype)) and torch.equal(new_state, state32)
    full = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)
    assert full.dtype == dtype and (o.float() - full[:, 8].float()).abs().max() <= 2 * torch.finfo(dtype).eps


@pytest.mark.parametrize("per_channel", GATES)
def test_masked_layouts_equal_compacted(per_channel):
    """Left pads, right pads, interior pads and a packed row with pads: real tokens and states == compacted."""
    t, h, dk, dv = 14, 2, 8, 4
    q, k, v, g, beta = make_inputs(4, t, h, dk, dv, per_channel=per_channel, seed=19)
    mask = torch.ones(4, t, dtype=torch.bool)
    mask[0, :5] = False  # left pads
    mask[1, 9:] = False  # right pads
    mask[2, [0, 3, 4, 13]] = False  # scattered
    mask[3, [6, 7, 13]] = False  # pads at the end of sequence 0 and of the row
    seq_idx = torch.zeros(4, t, dtype=torch.int32)
    seq_idx[3, 8:] = 1
    h0 = torch.randn(4, h, dk, dv)
    # garbage at pads must not leak: inf/nan never reach the result
    pads = [~mask.view(4, t, *([1] * (x.dim() - 2))) for x in (q, k, v, g, beta)]
    q, k, v, g, beta = (x.masked_fill(p, float("nan")) for x, p in zip((q, k, v, g, beta), pads))
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    o, final, varlen = chunk_gated_delta_rule(
        *leaves, chunk_size=4, initial_state=h0, seq_idx=seq_idx, token_mask=mask, use_qk_l2norm=True,
        return_final_state=True, return_varlen_states=True,
    )
    ro, rf, rv = reference_packed(
        q, k, v, g, beta, seq_idx=seq_idx, token_mask=mask, initial_state=h0, use_qk_l2norm=True
    )
    m = mask[..., None, None]
    assert rel_err(torch.where(m, o, 0.0), ro) < 1e-5
    assert rel_err(final, rf) < 1e-5 and rel_err(varlen, rv) < 1e-5
    (torch.where(m, o, 0.0).sum() + final.sum() + varlen.sum()).backward()
    for x, p in zip(leaves, pads):
        assert torch.isfinite(x.grad).all() and not x.grad.masked_select(p).any()  # pads get exactly 0


def test_without_seq_idx_packed_output_differs():
    """The test above can fail: ignoring the boundaries changes the second sequence's output and state."""
    seq_idx = seq_idx_from_lengths([[6, 10]])
    q, k, v, g, beta = make_inputs(1, 16, 2, 8, 4, per_channel=False, seed=23)
    g = g * 0.05  # slow decay: the first sequence's state is still there at the boundary
    ro, rf, _ = reference_packed(q, k, v, g, beta, seq_idx=seq_idx)
    o_ok, f_ok = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=8, seq_idx=seq_idx, return_final_state=True)
    o_bad, f_bad = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=8, return_final_state=True)
    assert rel_err(o_ok, ro) < 1e-5 and rel_err(f_ok, rf) < 1e-5
    assert rel_err(o_bad[:, :6], ro[:, :6]) < 1e-5  # the first sequence is unaffected
    assert rel_err(o_bad[:, 6:], ro[:, 6:]) > 1e-2
    assert rel_err(f_bad, rf) > 1e-2


@pytest.mark.parametrize("per_channel", GATES)
def test_any_chunk_size_matches_reference(per_channel):
    """Chunk sizes 1 .. 64, including the sub-chunked per-channel path (C = 32, 48, 64) across boundaries."""
    seq_idx = seq_idx_from_lengths([[10, 40, 20], [70]])
    q, k, v, g, beta = make_inputs(2, 70, 2, 8, 4, per_channel=per_channel, seed=29)
    h0 = torch.randn(2, 2, 8, 4)
    ro, rf, rv = reference_packed(q, k, v, g, beta, seq_idx=seq_idx, initial_state=h0)
    for cs in (1, 5, 16, 32, 48, 64):
        o, f, vs = chunk_gated_delta_rule(
            q, k, v, g, beta, chunk_size=cs, seq_idx=seq_idx, initial_state=h0,
            return_final_state=True, return_varlen_states=True,
        )
        assert rel_err(o, ro) < 1e-5 and rel_err(f, rf) < 1e-5 and rel_err(vs, rv) < 1e-5, cs


def test_return_conventions_and_empty_sequence():
    q, k, v, g, beta = make_inputs(2, 5, 2, 4, 3, per_channel=False)
    o = chunk_gated_delta_rule(q, k, v, g, beta)
    assert isinstance(o, torch.Tensor) and o.shape == (2, 5, 2, 3)
    o2, vs = chunk_gated_delta_rule(q, k, v, g, beta, return_varlen_states=True)
    o3, f = chunk_gated_delta_rule(q, k, v, g, beta, return_final_state=True)
    assert torch.equal(o, o2) and torch.equal(o, o3) and torch.allclose(vs, f)  # one sequence per row
    bf = [x.to(torch.bfloat16) for x in (q, k, v, g, beta)]
    ob, fb = chunk_gated_delta_rule(*bf, return_final_state=True)
    assert ob.dtype == torch.bfloat16 and fb.dtype == torch.float32
    h0 = torch.randn(2, 2, 4, 3)
    oe, fe, ve = chunk_gated_delta_rule(
        *(x[:, :0] for x in (q, k, v, g, beta)), initial_state=h0, return_final_state=True, return_varlen_states=True
    )
    assert oe.shape == (2, 0, 2, 3) and torch.equal(fe, h0) and ve.shape == (0, 2, 4, 3)


# ---------------------------------------------------------------------------------------------- transformers


def test_matches_hf_qwen3_next_recurrence():
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    q, k, v, g, beta = make_inputs(1, 37, 4, 16, 8, per_channel=False, hk=2, seed=31)
    q, k = q * 4, k * 4  # l2norm in the op makes the scale irrelevant
    h0 = torch.randn(1, 4, 16, 8)
    ho, hs = torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0.clone(), output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    o, s = chunk_gated_delta_rule(
        q, k, v, g, beta, chunk_size=16, initial_state=h0, use_qk_l2norm=True, return_final_state=True
    )
    assert rel_err(o, ho) < 1e-5 and rel_err(s, hs) < 1e-5
    co, cs = torch_chunk_gated_delta_rule(
        q, k, v, g, beta, chunk_size=16, initial_state=h0.clone(), output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    assert rel_err(o, co) < 1e-5 and rel_err(s, cs) < 1e-5
    so, ss = gated_delta_rule_step(h0, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], use_qk_l2norm=True)
    assert rel_err(so, ho[:, 0]) < 1e-5


def test_matches_hf_kimi_linear_recurrence():
    from transformers.models.kimi_linear.modeling_kimi_linear import recurrent_kimi_delta_attention

    q, k, v, g, beta = make_inputs(1, 29, 2, 16, 8, per_channel=True, seed=37)
    h0 = torch.randn(1, 2, 16, 8)
    ho, hs = recurrent_kimi_delta_attention(
        q, k, v, g, beta, initial_state=h0.clone(), output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    o, s = chunk_gated_delta_rule(
        q, k, v, g, beta, chunk_size=8, initial_state=h0, use_qk_l2norm=True, return_final_state=True
    )
    assert rel_err(o, ho) < 1e-5 and rel_err(s, hs) < 1e-5


# ---------------------------------------------------------------------------------------------- validation


def _good():
    q, k, v, g, beta = make_inputs(2, 6, 2, 4, 3, per_channel=False)
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta}


BAD = [
    pytest.param({"q": torch.randn(2, 6, 4)}, {}, "q", id="q-3d"),
    pytest.param({"k": torch.randn(2, 6, 2, 5)}, {}, "k", id="k-shape"),
    pytest.param({"v": torch.randn(2, 5, 2, 3)}, {}, "v", id="v-seqlen"),
    pytest.param({"v": torch.randn(2, 6, 3, 3)}, {}, "heads", id="v-heads-not-multiple"),
    pytest.param({"g": torch.randn(2, 6, 3)}, {}, "g", id="g-shape"),
    pytest.param({"beta": torch.rand(2, 6)}, {}, "beta", id="beta-shape"),
    pytest.param({"q": torch.ones(2, 6, 2, 4, dtype=torch.long)}, {}, "q", id="q-int"),
    pytest.param({}, {"initial_state": torch.zeros(2, 2, 3, 4)}, "initial_state", id="h0-shape"),
    pytest.param({}, {"seq_idx": torch.zeros(2, 5, dtype=torch.int32)}, "seq_idx", id="seq-shape"),
    pytest.param({}, {"seq_idx": torch.tensor([[0, 1, 0, 1, 1, 1]] * 2)}, "seq_idx", id="seq-decreasing"),
    pytest.param({}, {"seq_idx": torch.zeros(2, 6)}, "seq_idx", id="seq-float"),
    pytest.param({}, {"token_mask": torch.ones(2, 5, dtype=torch.bool)}, "token_mask", id="mask-shape"),
    pytest.param({}, {"token_mask": torch.ones(2, 6)}, "token_mask", id="mask-float"),
    pytest.param({}, {"chunk_size": 0}, "chunk_size", id="chunk-0"),
    pytest.param({}, {"chunk_size": 8.0}, "chunk_size", id="chunk-float"),
    pytest.param({}, {"scale": "x"}, "scale", id="scale-str"),
    pytest.param({}, {"backend": "cuda"}, "backend", id="backend-name"),
    pytest.param({}, {"backend": "kernels"}, "kernels", id="kernels-on-cpu"),
]


@pytest.mark.parametrize("override, kwargs, match", BAD)
def test_bad_input_raises(override, kwargs, match):
    args = {**_good(), **override}
    with pytest.raises(ValueError, match=match):
        chunk_gated_delta_rule(args["q"], args["k"], args["v"], args["g"], args["beta"], **kwargs)


def test_step_bad_input_raises():
    q, k, v, g, beta = make_inputs(2, 1, 2, 4, 3, per_channel=False)
    state = torch.zeros(2, 2, 4, 3)
    with pytest.raises(ValueError, match="state"):
        gated_delta_rule_step(torch.zeros(2, 2, 3, 4), q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
    with pytest.raises(ValueError, match="g"):
        gated_delta_rule_step(state, q[:, 0], k[:, 0], v[:, 0], g[:, 0, :1], beta[:, 0])
    with pytest.raises(ValueError, match="q"):
        gated_delta_rule_step(state, q, k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
    with pytest.raises(ValueError, match="kernel"):
        gated_delta_rule_step(state, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], backend="kernels")


def test_kernel_path_is_only_taken_when_exact():
    from safepad.ops.delta_rule import _fla_inexpressible

    q, k, v, g, beta = (x.to(torch.bfloat16) for x in make_inputs(1, 4, 2, 8, 4, per_channel=False))
    assert _fla_inexpressible(q, k, v, per_channel=False) is None
    assert "per-channel" in _fla_inexpressible(q, k, v, per_channel=True)
    assert "float16/bfloat16" in _fla_inexpressible(q.float(), k.float(), v.float(), per_channel=False)
    assert "empty" in _fla_inexpressible(q[:, :0], k[:, :0], v[:, :0], per_channel=False)
    wide = torch.zeros(1, 4, 2, 320, dtype=torch.bfloat16)
    assert "Dk <= 256" in _fla_inexpressible(wide, wide, v, per_channel=False)


@pytest.mark.parametrize("per_channel", GATES)
@pytest.mark.parametrize("hk", [pytest.param(None, id="mha"), pytest.param(1, id="gqa")])
def test_step_token_mask_keeps_masked_rows_bitwise(per_channel, hk):
    """A masked row keeps its state exactly, even with NaN inputs; the other rows equal the unmasked step."""
    q, k, v, g, beta = make_inputs(3, 2, 2, 8, 4, per_channel=per_channel, hk=hk, seed=29)
    _, state = chunk_gated_delta_rule(*(x[:, :1] for x in (q, k, v, g, beta)), use_qk_l2norm=True,
                                      return_final_state=True)
    step = [x[:, 1].clone() for x in (q, k, v, g, beta)]
    for x in step:
        x[1] = float("nan")  # the masked row's token
    keep = torch.tensor([True, False, True])
    o, s1 = gated_delta_rule_step(state, *step, use_qk_l2norm=True, token_mask=keep)
    o_ref, s_ref = gated_delta_rule_step(state, *step, use_qk_l2norm=True)
    assert torch.equal(s1[1], state[1].to(s1.dtype))
    assert torch.equal(s1[keep], s_ref[keep]) and torch.equal(o[keep], o_ref[keep])
    assert s_ref[1].isnan().all()  # without the mask the NaN token reaches the state
    with pytest.raises(ValueError, match="token_mask"):
        gated_delta_rule_step(state, *step, use_qk_l2norm=True, token_mask=keep[:2])


@pytest.mark.parametrize(
    "per_channel, hk",
    [
        pytest.param(False, None, id="gdn"),
        pytest.param(False, 2, id="gdn-grouped"),
        pytest.param(True, None, id="kda"),
    ],
)
def test_step_dispatches_no_more_ops_than_hf_recurrence(per_channel, hk):
    """Issue 38: a decode step is launch-bound. The step dispatches no more aten ops (views included) than
    transformers' own one-token recurrence for the same call, and its token mask costs at most 6 more (one
    negation, a view, three masked_fills and a select). Before: 44 / 52 / 43 unmasked against HF's 43 / 51 / 36,
    and 12 ops for the mask."""
    from transformers.models.kimi_linear.modeling_kimi_linear import recurrent_kimi_delta_attention
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

    from safepad.testing.launches import count_ops

    q, k, v, g, beta = make_inputs(3, 1, 4, 16, 8, per_channel=per_channel, hk=hk, seed=3)
    h0 = torch.randn(3, 4, 16, 8, generator=torch.Generator().manual_seed(4))
    hf_rule = recurrent_kimi_delta_attention if per_channel else torch_recurrent_gated_delta_rule
    hf = count_ops(
        lambda: hf_rule(q, k, v, g, beta, initial_state=h0.clone(), output_final_state=True, use_qk_l2norm_in_kernel=True)
    )
    step = [x[:, 0] for x in (q, k, v, g, beta)]
    ours = count_ops(lambda: gated_delta_rule_step(h0, *step, use_qk_l2norm=True))
    keep = torch.tensor([True, False, True])
    masked = count_ops(lambda: gated_delta_rule_step(h0, *step, use_qk_l2norm=True, token_mask=keep))
    # the counted calls compute the same step: the op count is of a correct step, not of a shortcut
    ho, hs = hf.result
    assert rel_err(ours.result[0], ho[:, 0]) < 1e-5 and rel_err(ours.result[1], hs) < 1e-5
    assert torch.equal(masked.result[1][keep], ours.result[1][keep]) and torch.equal(masked.result[1][1], h0[1])
    assert ours.count <= hf.count, (ours.ops, hf.ops)
    assert masked.count - ours.count <= 6, masked.ops - ours.ops
