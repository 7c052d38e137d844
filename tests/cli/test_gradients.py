"""``safepad audit --gradients``: no gradient crosses a packed boundary in any wrapped family; stock leaks.

The reference is structural: in one packed row, ``loss_B`` of a later sequence has no path to an earlier
sequence ``A`` (causal and per-sequence), so ``d loss_B / d x_A`` of a correct model is 0 up to rounding of
masked terms; the stock models (each leaks in its forward, README table) must show a leak of the kind that
carries state, or, where transformers refuses the packed row, raise (a stock that does not serve it).
"""

from __future__ import annotations

import json

import pytest
import transformers

import safepad
from safepad.cli.gradients import gradient_leaks, gradient_tol
from safepad.cli.main import main
from safepad.testing.tiny import MODEL_TYPE_FAMILIES, family_available, family_names, tiny_model

FAMILIES = [f for f in family_names() if f not in MODEL_TYPE_FAMILIES and family_available(f)[0]]
_TF525 = tuple(int(p) for p in transformers.__version__.split(".")[:2]) >= (5, 25)
#: stock families that refuse the packed row instead of leaking: from transformers 5.25 the op dispatch
#: (``use_kernel_func_from_hub_with_fallback``) raises when ``seq_idx`` reaches a torch-path op (no CUDA kernels),
#: and stock Mamba2 hands its ``seq_idx`` to the conv / scan (tests/testing/test_scenarios.py: mamba2-seq_idx)
STOCK_REFUSES = {"mamba2"} if _TF525 else set()
_REFUSAL = "can't keep packed sequences apart"


@pytest.mark.slow
@pytest.mark.parametrize("family", [pytest.param(f, id=f) for f in FAMILIES])
def test_wrapped_has_no_gradient_leak_and_stock_leaks(family):
    model = tiny_model(family)
    stock = gradient_leaks(model, "stock")
    if family in STOCK_REFUSES:  # does not serve the packed row: raises, which the report records
        assert stock.error is not None and _REFUSAL in stock.error and not stock.passed, stock.error
    else:
        assert stock.error is None, stock.error
        assert stock.embeddings > 100 * stock.tol and not stock.passed  # a leak, far above rounding
        assert max(stock.kinds.values()) > 100 * stock.tol
    wrapped = gradient_leaks(safepad.wrap(model), "wrapped")
    assert wrapped.error is None, wrapped.error
    assert wrapped.passed, (wrapped.embeddings, wrapped.kinds)
    if stock.error is None:
        assert set(wrapped.kinds) == set(stock.kinds)  # the same layer kinds are reported, Safepad prefix dropped
    else:
        assert wrapped.kinds and all(not k.startswith("Safepad") for k in wrapped.kinds)


@pytest.fixture
def scan_ignoring_seq_idx():
    """A broken op route: the wrapped Mamba2 scan called without ``seq_idx`` (the conv still gets it)."""
    import safepad.mixers.mamba2 as m2

    good = m2.ssd_scan

    def broken(*args, **kwargs):
        kwargs["seq_idx"] = None
        return good(*args, **kwargs)

    m2.ssd_scan = broken
    yield
    m2.ssd_scan = good


def test_broken_scan_route_leaks_in_the_mixer_kind_only(scan_ignoring_seq_idx):
    report = gradient_leaks(safepad.wrap(tiny_model("nemotron_h")), "wrapped, broken scan")
    assert not report.passed
    assert report.kinds["NemotronHMamba2Mixer"] > 100 * report.tol
    assert report.kinds["NemotronHAttention"] == 0.0 and report.kinds["NemotronHMLP"] == 0.0


def test_tolerance_by_dtype():
    import torch

    assert gradient_tol(torch.float32) == 1e-5 and gradient_tol(torch.bfloat16) > gradient_tol(torch.float32)


@pytest.mark.parametrize(
    ("extra", "code", "verdict"),
    [
        pytest.param([], 0, "PASS: no gradient crosses a packed boundary (wrapped tiny mamba)", id="wrapped"),
        pytest.param(["--no-wrap"], 1, "FAIL: gradients leak across packed boundaries (stock tiny mamba)", id="stock"),
    ],
)
def test_cli(tmp_path, capsys, extra, code, verdict):
    out_json = tmp_path / "audit.json"
    argv = ["audit", "--no-progress", "--family", "mamba", "--scenarios", "packed_seq_idx", "--gradients",
            "--json", str(out_json), *extra]  # fmt: skip
    assert main(argv) == code
    out = capsys.readouterr().out
    assert verdict in out and "layers: MambaMixer" in out
    data = json.loads(out_json.read_text())
    assert data["exit_code"] == code
    assert [r["label"] for r in data["gradients"]] == [
        "stock tiny mamba",
        *(["wrapped tiny mamba"] if not extra else []),
    ]
    assert data["gradients"][-1]["passed"] == (code == 0)


@pytest.mark.skipif(not STOCK_REFUSES, reason="this transformers' stock Mamba2 leaks on a packed row (test above)")
def test_cli_stock_refusing_the_packed_row(capsys):
    argv = ["audit", "--no-progress", "--family", "mamba2", "--scenarios", "packed_seq_idx", "--gradients",
            "--no-wrap"]  # fmt: skip
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "FAIL: the model raises on a packed row" in out and "raises ValueError" in out
