"""``safepad audit --family F`` for the families added for transformers 5.23-5.24."""

from __future__ import annotations

import pytest

from safepad.cli.main import main
from safepad.testing.tiny import NEW_FAMILIES, family_available
from safepad.wrap import wrap


def _run(argv, capsys):
    code = main(["audit", "--no-progress", *argv], wrap_fn=lambda m: wrap(m, backend="torch"))
    out, err = capsys.readouterr()
    return code, out, err


def test_a_wrapped_vlm_wrapper_passes_its_audit_and_its_stock_model_fails(capsys):
    code, out, _ = _run(["--family", "lfm2_vl", "--scenarios", "packed_position_ids,right_pad_decode"], capsys)
    assert code == 0, out
    assert "PASS" in out and "tiny lfm2_vl" in out


def test_every_new_family_is_offered_and_an_absent_one_says_which_version_it_needs(capsys):
    absent = [f for f in NEW_FAMILIES if not family_available(f)[0]]
    if not absent:
        pytest.skip("every new family exists in this transformers")
    code, _, err = _run(["--family", absent[0], "--scenarios", "generate"], capsys)
    assert code == 2 and "needs transformers >=" in err
