"""``safepad audit --dtype bfloat16`` separates a layout defect from rounding: each scenario is also compared with
each sequence run alone through the same model in the same dtype, within a tolerance derived from that
reference's noise. The float64 rounding rule alone cannot: stock Bamba's decode past its dt floor is within the
stock model's own bf16 rounding of the float64 reference, as a correct wrapped bf16 decode is."""

from __future__ import annotations

import json

import pytest
import torch

from safepad.testing.scenarios import ROUNDING_FACTOR, SAME_DTYPE_FLOOR, default_tol, same_dtype_tol

from .helpers import run_audit


def _audit(tmp_path, capsys, *argv, wrap_fn=None):
    path = tmp_path / "audit.json"
    kw = {} if wrap_fn is None else {"wrap_fn": wrap_fn}
    code, out, _ = run_audit(
        ["--family", "bamba", "--dtype", "bfloat16", "--scenarios", "decode_dt_min", "--json", str(path), *argv],
        capsys,
        **kw,
    )
    return code, out, json.loads(path.read_text())


def test_stock_bamba_dt_limit_decode_fails_in_bf16(tmp_path, capsys):
    code, out, data = _audit(tmp_path, capsys, "--no-wrap")
    (r,) = data["stock"]
    assert code == 1 and r["status"] == "FAIL"
    # against float64 the error is within bf16 rounding (the rounding rule): the same-dtype check is what fails it
    assert r["max_abs_logits"] < default_tol(torch.bfloat16)
    assert r["rms_logits"] <= ROUNDING_FACTOR * r["rounding_rms"]
    assert r["same_dtype_error"] > 4 * r["same_dtype_tol"] * max(1.0, r["same_dtype_scale"])
    assert "against each sequence run alone through the same" in out  # the legend says what b is


def test_wrapped_bamba_bf16_decode_passes(tmp_path, capsys):
    import safepad

    code, out, data = _audit(tmp_path, capsys, wrap_fn=safepad.wrap)
    (r,) = data["wrapped"]
    assert code == 0 and r["status"] == "ok", out
    assert r["same_dtype_error"] <= r["same_dtype_tol"] * max(1.0, r["same_dtype_scale"])


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float64, id="fp64")])
def test_full_precision_has_no_same_dtype_check(dtype):
    assert same_dtype_tol(dtype) is None


def test_same_dtype_tol_grows_with_the_measured_noise():
    floor = SAME_DTYPE_FLOOR[torch.bfloat16]
    assert same_dtype_tol(torch.bfloat16) == floor == torch.finfo(torch.bfloat16).eps / 2
    assert same_dtype_tol(torch.bfloat16, noise=floor) == 4 * floor
