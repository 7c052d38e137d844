"""fp32 accuracy of safepad.ops.ssd at flagship geometry (state 256, chunk 256, one group) with large
cumulative ``dt * A`` inside a chunk, against the float64 token recurrence (tests/ops/reference.py).

Within a 256-token chunk the cumulative log-decay reaches thousands here; the decay between two near tokens
is a small difference of two such sums. A float32 cumulative sum followed by ``exp(acs_l - acs_s)`` loses
~1 ulp of the large sum in every exponent (relative errors ~3e-5 here); stock's per-pair segment sums stay
near 3e-7. The bounds below are what stock's segment-sum method reaches on the same inputs, with margin.
"""

from __future__ import annotations

import pytest
import torch
from reference import ref_ssd, split_rows

from safepad.ops import ssd_scan, ssd_step

H, G, P, N, Q = 4, 1, 8, 256, 256
FWD_TOL = 2e-6  # stock segment sums: ~3e-7; a float32 cumsum of dt*A: ~3e-5
GRAD_TOL = 2e-6  # stock: ~2e-7 (dA), before the fix ~2e-3


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def flagship(T: int, seed: int) -> dict:
    """Processed dt ~ U(0.05, 2) and A ~ -U(1, 32): cumulative log-decays of several thousand per chunk."""
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(1, T, H, P, generator=g, dtype=torch.float64),
        "dt": torch.rand(1, T, H, generator=g, dtype=torch.float64) * 1.95 + 0.05,
        "A": -(torch.rand(H, generator=g, dtype=torch.float64) * 31 + 1),
        "B": torch.randn(1, T, G, N, generator=g, dtype=torch.float64),
        "C": torch.randn(1, T, G, N, generator=g, dtype=torch.float64),
        "D": torch.randn(H, generator=g, dtype=torch.float64),
        "initial_state": torch.randn(1, H, P, N, generator=g, dtype=torch.float64),
    }


def reference(t: dict, seq: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Each sequence alone through the float64 recurrence: y [1, T, H, P] and every sequence's final state."""
    y, states = [], []
    for b, s, e in split_rows(seq):
        init = t["initial_state"][0] if s == 0 else None
        ys, hs = ref_ssd(t["x"][0, s:e], t["dt"][0, s:e], t["A"], t["B"][0, s:e], t["C"][0, s:e], t["D"],
                         None, (0.0, float("inf")), False, init)
        y.append(ys)
        states.append(hs)
    return torch.cat(y)[None], states


def fp32(t: dict) -> dict:
    return {k: v.float() for k, v in t.items()}


LAYOUTS = [
    pytest.param([512], id="one-seq-2chunks"),
    pytest.param([300, 212], id="packed-reset-inside-chunk"),
    pytest.param([256, 100, 156], id="packed-reset-at-chunk-edge"),
]


def _seq(lens: list[int]) -> torch.Tensor:
    return torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lens)])[None]


@pytest.mark.parametrize("lens", LAYOUTS)
@pytest.mark.parametrize("varlen", [pytest.param(False, id="core-path"), pytest.param(True, id="varlen-path")])
def test_fp32_forward_matches_fp64_recurrence_at_flagship_geometry(lens, varlen):
    seq = _seq(lens)
    t = flagship(seq.shape[1], seed=1)
    y_ref, states = reference(t, seq)
    f = fp32(t)
    out = ssd_scan(f["x"], f["dt"], f["A"], f["B"], f["C"], chunk_size=Q, D=f["D"], dt_softplus=False,
                   seq_idx=seq if len(lens) > 1 else None, initial_state=f["initial_state"],
                   return_final_state=True, return_varlen_states=varlen)
    assert rel_err(out[0], y_ref) < FWD_TOL
    assert rel_err(out[1][0], states[-1]) < FWD_TOL
    if varlen:
        assert rel_err(out[2], torch.stack(states)) < FWD_TOL


def test_fp32_decode_after_flagship_prefill_matches_fp64_recurrence():
    T, steps = 300, 4
    t = flagship(T + steps, seed=2)
    y_ref, _ = reference(t, torch.zeros(1, T + steps, dtype=torch.int32))
    f = fp32(t)
    y, state = ssd_scan(f["x"][:, :T], f["dt"][:, :T], f["A"], f["B"][:, :T], f["C"][:, :T], chunk_size=Q,
                        D=f["D"], dt_softplus=False, initial_state=f["initial_state"], return_final_state=True)
    outs = [y]
    for i in range(T, T + steps):
        yi, state = ssd_step(state, f["x"][:, i], f["dt"][:, i], f["A"], f["B"][:, i], f["C"][:, i], D=f["D"],
                             dt_softplus=False)
        outs.append(yi[:, None])
    assert rel_err(torch.cat(outs, 1), y_ref) < FWD_TOL


@pytest.mark.parametrize("varlen", [pytest.param(False, id="core-path"), pytest.param(True, id="varlen-path")])
def test_fp32_grads_match_fp64_recurrence_at_flagship_geometry(varlen):
    lens = [300, 212]
    seq = _seq(lens)
    T = seq.shape[1]
    t = flagship(T, seed=3)
    g = torch.Generator().manual_seed(7)
    gy = torch.randn(1, T, H, P, generator=g, dtype=torch.float64)
    names = ["x", "dt", "A", "B", "C", "D", "initial_state"]

    ref = {k: t[k].clone().requires_grad_(True) for k in names}
    y_ref, _ = reference(ref, seq)
    (y_ref * gy).sum().backward()

    p = {k: t[k].float().requires_grad_(True) for k in names}
    out = ssd_scan(p["x"], p["dt"], p["A"], p["B"], p["C"], chunk_size=Q, D=p["D"], dt_softplus=False,
                   seq_idx=seq, initial_state=p["initial_state"], return_varlen_states=varlen)
    y = out[0] if varlen else out
    (y.double() * gy).sum().backward()
    for k in names:
        assert rel_err(p[k].grad, ref[k].grad) < GRAD_TOL, (k, rel_err(p[k].grad, ref[k].grad))
