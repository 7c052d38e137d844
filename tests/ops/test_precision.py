"""The precision policy of half-precision recurrences (safepad.ops.precision, docs/limits.md "Precision policy"),
and its proxy on CPU: the dtypes of every matmul-family op of a wrapped bf16 model's prefill and decode step, under
the CPU policy and under the CUDA one (the device type the policy reads asked to answer "cuda"; issue 38)."""

from __future__ import annotations

import copy

import pytest
import torch

import safepad
import safepad.ops.precision as precision
from safepad.ops.precision import recurrence_dtype, recurrence_input
from safepad.testing import tiny_model
from safepad.testing.matmul_dtypes import record_matmuls
from safepad.testing.scenarios import _ModelIO, cache_states

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64


@pytest.mark.parametrize(
    "dtype, device, recurrence, expected",
    [
        pytest.param(BF16, "cpu", "ssd", F64, id="bf16-cpu-ssd"),
        pytest.param(F16, "cpu", "delta_rule", F64, id="fp16-cpu-delta"),
        pytest.param(BF16, "cuda", "ssd", F32, id="bf16-cuda-ssd"),
        pytest.param(BF16, "cuda", "delta_rule", BF16, id="bf16-cuda-delta"),
        pytest.param(F16, "mps", "ssd", F32, id="fp16-mps-ssd"),
        pytest.param(F32, "cpu", "ssd", F32, id="fp32-cpu-ssd"),
        pytest.param(F32, "cuda", "delta_rule", F32, id="fp32-cuda-delta"),
        pytest.param(F64, "cuda", "ssd", F64, id="fp64-cuda-ssd"),
    ],
)
def test_policy(dtype, device, recurrence, expected):
    assert recurrence_dtype(dtype, device, recurrence) == expected


def test_unknown_recurrence_raises():
    with pytest.raises(ValueError, match="recurrence must be one of"):
        recurrence_dtype(BF16, "cpu", "rg_lru")


def test_recurrence_input_widens_exactly():
    x = torch.randn(3, 8).to(BF16)
    y = recurrence_input(x, "ssd")
    assert y.dtype == F64 and torch.equal(y.to(BF16), x)


def _run(family: str, device: str, monkeypatch):
    """A wrapped bf16 ``family`` model: a left-padded cached prefill and one decode step, each recorded, with the
    policy's device type ``device``. Returns (prefill's matmuls, the step's, the cached recurrent states)."""
    monkeypatch.setattr(precision, "device_type", lambda x: device)
    model = safepad.wrap(tiny_model(family, dtype=BF16))
    io = _ModelIO(model)
    ids = torch.randint(3, io.vocab, (3, 20), generator=torch.Generator().manual_seed(0))  # [B, T]
    mask = torch.ones(3, 20, dtype=torch.long)
    mask[1, :3] = mask[2, :7] = 0
    out = {}
    with torch.no_grad():
        out["prefill"] = record_matmuls(
            lambda: out.__setitem__("cache", io(ids, attention_mask=mask, cache=io.fresh_cache(), use_cache=True)[1])
        )
        states = cache_states(out["cache"])
        full = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)  # [B, T + 1]
        step = copy.deepcopy(out["cache"])
        out["decode"] = record_matmuls(lambda: io(ids[:, :1], attention_mask=full, cache=step, use_cache=True))
    return out["prefill"], out["decode"], states


# the recurrence's own matmuls: the chunked SSD (its einsums), the delta rule (chunked and step)
_RECURRENCE_SITES = {"nemotron_h": "ops/ssd.py", "qwen3_next": "ops/delta_rule.py"}


@pytest.mark.parametrize("family", [pytest.param("nemotron_h", id="ssd"), pytest.param("qwen3_next", id="delta_rule")])
@pytest.mark.parametrize(
    "device, recurrence_matmul",
    [pytest.param("cuda", F32, id="cuda_policy"), pytest.param("cpu", F64, id="cpu_policy")],
)
def test_matmul_dtypes_of_a_bf16_model(family, device, recurrence_matmul, monkeypatch):
    """bf16 projections (every ``nn.Linear`` of the model: bf16 inputs), the recurrence's matmuls in
    ``recurrence_matmul`` (CUDA policy: float32, CPU policy: float64), float32 recurrent states under the CUDA
    policy (float64 under the CPU one), and no float64 matmul under the CUDA policy but attention's (its CPU
    upcast, ``safepad.wrap.attention``, reads the tensors' real device)."""
    prefill, decode, states = _run(family, device, monkeypatch)
    site = _RECURRENCE_SITES[family]
    for phase, calls in (("prefill", prefill), ("decode", decode)):
        assert calls, phase
        rec = {c.dtypes for c in calls if c.site.startswith(site)}
        if phase == "prefill" or family == "qwen3_next":  # (the SSD step is elementwise: no matmul)
            assert rec == {(recurrence_matmul, recurrence_matmul)}, (phase, rec)
        linear = {c.dtypes for c in calls if c.op in ("aten.mm", "aten.addmm") and not c.site.startswith(site)}
        assert linear and all(set(d) <= {BF16} for d in linear), (phase, linear)
        if device == "cuda":
            wide = [c for c in calls if F64 in c.dtypes and not c.site.startswith("wrap/attention.py")]
            assert not wide, (phase, wide[:3])
    rstates = {k: v.dtype for k, v in states.items() if "recurrent" in k}
    assert rstates and set(rstates.values()) == {F32 if device == "cuda" else F64}, rstates
