"""A NaN / inf in one packed sequence stays in that sequence, in every op (and a NaN at a masked token nowhere).

Reference: each sequence run alone through the same op (no ``seq_idx``). Packed, the sequences without
the non-finite value must equal their runs alone (and be finite); the one with it must still read
non-finite from the bad token on (a NaN is never hidden). Multiplying by a zero weight does not stop a
NaN (``0 * nan = nan``), so these fail wherever an op masks by multiplication.
"""

from __future__ import annotations

import pytest
import torch

from safepad.ops import causal_conv1d, chunk_gated_delta_rule, selective_scan, ssd_scan

LENS = (5, 9, 3)  # T = 17; chunk 4: boundaries fall inside chunks
CHUNK = 4
BAD_SEQ = 1

# (op, name of the per-token input that gets the non-finite value)
CASES = [
    pytest.param("conv", "x", id="conv-x"),
    pytest.param("ssd", "x", id="ssd-x"),
    pytest.param("ssd", "dt", id="ssd-dt"),
    pytest.param("ssd", "B", id="ssd-B"),
    pytest.param("ssd", "C", id="ssd-C"),
    pytest.param("selective", "u", id="selective-u"),
    pytest.param("selective", "delta", id="selective-delta"),
    pytest.param("selective", "B", id="selective-B"),
    pytest.param("delta", "v", id="delta_rule-v"),
    pytest.param("delta", "k", id="delta_rule-k"),
    pytest.param("delta", "g", id="delta_rule-g"),
    pytest.param("kda", "g", id="kda-per-channel-g"),
    pytest.param("kda", "beta", id="kda-beta"),
]


def _inputs(op: str, T: int, seed: int = 0) -> tuple[dict, dict]:
    """(per-token inputs ``[1, T, ...]``, shared parameters) of one op, float32."""
    g = torch.Generator().manual_seed(seed)

    def r(*s, scale=1.0):
        return torch.randn(*s, generator=g) * scale

    if op == "conv":
        return {"x": r(1, T, 6)}, {"weight": r(6, 4, scale=0.5), "bias": r(6)}
    if op == "ssd":
        H, P, G, N = 4, 3, 2, 5
        tok = {"x": r(1, T, H, P), "dt": r(1, T, H, scale=0.7) - 1.0, "B": r(1, T, G, N), "C": r(1, T, G, N)}
        return tok, {"A": -(torch.rand(H, generator=g) * 2 + 0.3), "D": r(H), "dt_bias": r(H, scale=0.5)}
    if op == "selective":
        Dm, N = 6, 4
        tok = {"u": r(1, T, Dm), "delta": r(1, T, Dm, scale=0.5), "B": r(1, T, N), "C": r(1, T, N), "z": r(1, T, Dm)}
        return tok, {"A": -(torch.rand(Dm, N, generator=g) + 0.2), "D": r(Dm), "delta_bias": r(Dm, scale=0.3)}
    H, Dk, Dv = 2, 4, 3
    tok = {
        "q": r(1, T, H, Dk),
        "k": r(1, T, H, Dk),
        "v": r(1, T, H, Dv),
        "g": -torch.rand(1, T, H, *((Dk,) if op == "kda" else ()), generator=g) * 0.5,
        "beta": torch.rand(1, T, H, generator=g),
    }
    return tok, {}


def _run(op: str, tok: dict, par: dict, seq_idx=None, token_mask=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(output ``[1, T, ...]``, final state or None)."""
    if op == "conv":
        return causal_conv1d(tok["x"], par["weight"], par["bias"], activation="silu", seq_idx=seq_idx,
                             token_mask=token_mask), None
    if op == "ssd":
        return ssd_scan(tok["x"], tok["dt"], par["A"], tok["B"], tok["C"], chunk_size=CHUNK, D=par["D"],
                        dt_bias=par["dt_bias"], seq_idx=seq_idx, token_mask=token_mask, return_final_state=True)
    if op == "selective":
        return selective_scan(tok["u"], tok["delta"], par["A"], tok["B"], tok["C"], D=par["D"], z=tok["z"],
                              delta_bias=par["delta_bias"], seq_idx=seq_idx, token_mask=token_mask,
                              return_final_state=True)
    return chunk_gated_delta_rule(tok["q"], tok["k"], tok["v"], tok["g"], tok["beta"], chunk_size=CHUNK,
                                  use_qk_l2norm=True, seq_idx=seq_idx, token_mask=token_mask,
                                  return_final_state=True, backend="torch")


def _split(tok: dict, s: int, e: int) -> dict:
    return {k: v[:, s:e] for k, v in tok.items()}


@pytest.mark.parametrize("value", [pytest.param(float("nan"), id="nan"), pytest.param(float("inf"), id="inf")])
@pytest.mark.parametrize("where", [pytest.param(2, id="inside"), pytest.param(8, id="last-token")])
@pytest.mark.parametrize(("op", "name"), CASES)
def test_nonfinite_stays_in_its_sequence(op, name, where, value):
    T = sum(LENS)
    tok, par = _inputs(op, T)
    starts = [sum(LENS[:i]) for i in range(len(LENS))]
    bad_t = starts[BAD_SEQ] + where  # token of the middle sequence
    tok[name] = tok[name].clone()
    tok[name][0, bad_t] = value
    seq_idx = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(LENS)])[None]  # [1, T]
    y, final = _run(op, tok, par, seq_idx=seq_idx)
    for i, (s, n) in enumerate(zip(starts, LENS)):
        alone, alone_final = _run(op, _split(tok, s, s + n), par)
        if i == BAD_SEQ:
            assert not torch.isfinite(y[:, bad_t]).all(), f"{op}: the non-finite input was hidden at its own token"
            continue
        got = y[:, s : s + n]
        assert torch.isfinite(alone).all()
        assert torch.isfinite(got).all(), f"{op}: non-finite {name} of sequence {BAD_SEQ} leaked into sequence {i}"
        torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)
        if i == len(LENS) - 1 and final is not None:
            torch.testing.assert_close(final, alone_final, rtol=1e-5, atol=1e-5)


MASKED = ("conv-x", "ssd-x", "selective-u", "delta_rule-v")


@pytest.mark.parametrize(("op", "name"), [p for p in CASES if p.id in MASKED])
def test_nonfinite_at_a_masked_token_changes_nothing(op, name):
    """Right-padded rows: a NaN at a pad is dropped, not multiplied by zero."""
    T = 11
    tok, par = _inputs(op, T, seed=3)
    mask = torch.ones(1, T, dtype=torch.bool)
    mask[0, 8:] = False
    clean, clean_final = _run(op, tok, par, token_mask=mask)
    tok[name] = tok[name].clone()
    tok[name][0, 9] = float("nan")
    y, final = _run(op, tok, par, token_mask=mask)
    assert torch.isfinite(y[:, :8]).all()
    torch.testing.assert_close(y[:, :8], clean[:, :8], rtol=0, atol=0)
    if final is not None:
        torch.testing.assert_close(final, clean_final, rtol=0, atol=0)


def test_ssd_gradients_of_other_sequences_stay_finite():
    """The loss over the clean sequences only: their input gradients equal the runs alone, NaN-free."""
    T = sum(LENS)
    tok, par = _inputs("ssd", T, seed=5)
    tok["x"][0, 7] = float("nan")
    seq_idx = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(LENS)])[None]
    x = tok["x"].clone().requires_grad_(True)
    y, _ = _run("ssd", {**tok, "x": x}, par, seq_idx=seq_idx)
    keep = (seq_idx != BAD_SEQ)[..., None, None]  # [1, T, 1, 1]
    torch.where(keep, y, 0.0).sum().backward()
    for i, (s, n) in enumerate(zip([0, 5, 14], LENS)):
        if i == BAD_SEQ:
            continue
        xa = tok["x"][:, s : s + n].clone().requires_grad_(True)
        ya, _ = _run("ssd", {**_split(tok, s, s + n), "x": xa}, par)
        ya.sum().backward()
        assert torch.isfinite(x.grad[:, s : s + n]).all()
        torch.testing.assert_close(x.grad[:, s : s + n], xa.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", ["conv", "ssd", "selective", "delta", "kda"])
def test_isolation_reads_nothing_on_the_host(op):
    """The isolation runs on every device without a host read (one per op call was one per layer, issue 22),
    given boundaries that the model call already validated."""
    from safepad.layout.boundaries import mark_valid_seq_idx
    from safepad.layout.facts import record
    from safepad.testing.syncs import count_syncs

    T = sum(LENS)
    tok, par = _inputs(op, T, seed=7)
    seq_idx = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(LENS)])[None]
    mark_valid_seq_idx(seq_idx, multi_sequence=True)
    if op == "selective":
        record(par["A"], nonpositive=True)  # as the mixer does for A = -exp(A_log): the op's sign check is spared
    _, n, ops = count_syncs(lambda: _run(op, tok, par, seq_idx=seq_idx))
    assert n == 0, ops


def test_isolation_changes_nothing_for_finite_inputs():
    """Finite inputs come out of the selection bit-identical, and no token is poisoned."""
    from safepad.ops.finite import isolate_nonfinite

    T = sum(LENS)
    tok, _ = _inputs("ssd", T, seed=7)
    seq_idx = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(LENS)])[None]
    init = torch.randn(1, 4, 3, 5)
    clean, init_clean, poisoned = isolate_nonfinite(seq_idx, list(tok.values()), init)
    for a, b in zip(clean, tok.values()):
        assert torch.equal(a, b)
    assert torch.equal(init_clean, init) and not poisoned.any()