"""examples/chunked_prefill.py: the wrapped model matches each conversation alone; the stock one does not."""

from __future__ import annotations

import re
import sys

import pytest

from .conftest import EXAMPLES, run_script

_ROW = re.compile(r"^(stock|safepad\.wrap)\s+(\S+)\s+(\S+)\s+(\d+)/(\d+)\s*$", re.MULTILINE)


@pytest.mark.parametrize(
    "family",
    [
        pytest.param("nemotron_h", id="nemotron_h"),
        pytest.param("mamba2", id="mamba2-cache_params"),
    ],
)
def test_chunked_prefill_wrapped_matches_alone(family):
    proc = run_script([sys.executable, str(EXAMPLES / "chunked_prefill.py"), "--family", family,
                       "--new-tokens", "3"], timeout=90.0)  # fmt: skip
    rows = {m[1]: (float(m[2]), float(m[3]), int(m[4]), int(m[5])) for m in _ROW.finditer(proc.stdout)}
    assert set(rows) == {"stock", "safepad.wrap"}, proc.stdout
    d_logits, d_state, agree, total = rows["safepad.wrap"]
    # fp32 against the fp32 per-conversation reference; logits and states are O(1-100) (strengthened mixers)
    assert d_logits < 1e-3 and d_state < 1e-2, proc.stdout
    assert agree == total == 9
    stock_logits, stock_state, _, _ = rows["stock"]
    assert stock_logits > 1e-2 and stock_state > 1e-1, proc.stdout  # the bug the example demonstrates
    assert "conversation 2:" in proc.stdout
