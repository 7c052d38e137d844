"""``safepad audit --dtype bfloat16 / float16``: the rounding rule separates rounding from defects both ways.

Half precision is judged against a float64 reference (the same weights in float64, each sequence alone): a model's
RMS |Δ logits| from it must be within ``ROUNDING_FACTOR`` x the stock model's own RMS rounding in that dtype on the
same sequences. Before, a coarse float32-referenced tolerance (0.15 x scale in bf16) failed a correct wrapped bf16
Mamba (its logits round 0.52 from float32, as stock's do), and the same-dtype check compared the model with itself,
so a weight defect injected through ``wrap_fn`` (``dt_bias + 0.1``) sat on both sides and passed.
"""

from __future__ import annotations

import json

import pytest
import torch

import safepad
from safepad.testing.scenarios import ROUNDING_FACTOR
from safepad.testing.tiny import family_available

from .helpers import run_audit


def _wrap(model):
    return safepad.wrap(model, backend="torch")


def _wrap_with_dt_bias_defect(model):
    """A wrong wrap: every Mamba2 / gated-delta ``dt_bias`` (Mamba1 ``dt_proj.bias``) moved by +0.1."""
    model = _wrap(model)
    moved = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("dt_bias", "dt_proj.bias")):
                p.add_(0.1)
                moved += 1
    assert moved, "no dt bias to move"
    return model


def _audit(tmp_path, capsys, family, dtype, scenarios, wrap_fn):
    path = tmp_path / "audit.json"
    argv = ["--family", family, "--dtype", dtype, "--scenarios", scenarios, "--json", str(path)]
    code, out, _ = run_audit(argv, capsys, wrap_fn=wrap_fn)
    return code, out, json.loads(path.read_text())


def test_a_correct_wrapped_bf16_mamba_passes(tmp_path, capsys):
    """Old verdict FAIL: 0.52 from the float32 reference, above 0.15 x scale 2.97 (stock bf16 alone is as far)."""
    code, out, data = _audit(tmp_path, capsys, "mamba", "bfloat16", "right_pad_decode,left_pad_decode", _wrap)
    assert code == 0, out
    for r in data["wrapped"]:
        assert r["status"] == "ok"
        assert r["rms_logits"] <= ROUNDING_FACTOR * r["rounding_rms"]
        assert r["same_dtype_error"] == 0.0  # the wrapped layout equals the wrapped model's own one-shot forward
    (right, left) = data["stock"]
    assert right["status"] == "FAIL" and right["rms_logits"] > 2 * ROUNDING_FACTOR * right["rounding_rms"]
    assert left["rms_logits"] <= ROUNDING_FACTOR * left["rounding_rms"]  # stock left padding rounds as stock does


@pytest.mark.parametrize(
    "family,dtype,scenarios",
    [
        pytest.param(
            "nemotron_h", "bfloat16", "packed_position_ids,chunked_prefill,decode_default", id="nemotron_h-bf16"
        ),
        pytest.param("qwen3_next", "bfloat16", "packed_position_ids,packed_cu_seq_lens", id="qwen3_next-bf16"),
        pytest.param("mamba2", "bfloat16", "left_pad_decode,decode_default", id="mamba2-bf16"),
        pytest.param("qwen3_next", "float16", "right_pad_decode,left_pad_decode,generate", id="qwen3_next-fp16"),
    ],
)
def test_a_dt_bias_defect_fails_in_half_precision(tmp_path, capsys, family, dtype, scenarios):
    """Old verdict PASS: the defect moves the logits by less than the coarse tolerance, and the old same-dtype check
    compared the defective model with itself."""
    code, out, data = _audit(tmp_path, capsys, family, dtype, scenarios, _wrap_with_dt_bias_defect)
    assert code == 1, out
    for r in data["wrapped"]:
        assert r["status"] == "FAIL", r
        assert r["rms_logits"] > ROUNDING_FACTOR * r["rounding_rms"]
    code, out, data = _audit(tmp_path, capsys, family, dtype, scenarios, _wrap)  # the correct wrap passes
    assert code == 0, out


@pytest.mark.parametrize(
    "family",
    [
        pytest.param(f, id=f)
        for f in ("mamba", "mamba2", "nemotron_h", "bamba", "qwen3_next", "lfm2", "jamba", "falcon_h1", "zamba2")
    ]
    # Inkling2 computes its router in float32 by design: the float64 reference must keep it there
    + [pytest.param("inkling2_text", id="inkling2_text")],
)
def test_every_wrapped_family_passes_in_bf16_and_stock_right_padding_fails(tmp_path, capsys, family):
    available, why = family_available(family)
    if not available:
        pytest.skip(why)
    scenarios = "packed_position_ids,right_pad_decode,chunked_prefill_pad,decode_default,generate"
    code, out, data = _audit(tmp_path, capsys, family, "bfloat16", scenarios, _wrap)
    assert code == 0, out
    stock = {r["name"]: r for r in data["stock"]}
    assert stock["right_pad_decode"]["status"] == "FAIL"
    assert stock["right_pad_decode"]["rms_logits"] > 2 * ROUNDING_FACTOR * stock["right_pad_decode"]["rounding_rms"]
