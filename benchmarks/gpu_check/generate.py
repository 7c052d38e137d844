"""Part ``generate``: wrapped models on the kernels (``backend="auto"``) in the decode scenarios: right-padded
cached prefill + greedy decode (with and without ``position_ids``), chunked prefill with a pad inside the last
chunk, decode past the dt ceiling, and left-padded ``generate``, each against the stock model's per-sequence runs
(one tiny model per mixer kind, fp32, tolerance 1e-3: the kernels' TF32 ``tl.dot``)."""

from __future__ import annotations

from .common import RUN, Row, emit

FAMILIES = ("nemotron_h", "mamba2", "jamba", "qwen3_next")
SCENARIOS = ("right_pad_decode", "right_pad_decode_no_pos", "chunked_prefill_pad", "decode_dt_max", "generate")
SMALL_FAMILIES = ("nemotron_h", "qwen3_next")
SMALL_SCENARIOS = ("right_pad_decode", "generate")


def run(device: str) -> tuple[list[Row], dict]:
    import copy

    import safepad
    from safepad.ops import kernels
    from safepad.testing.scenarios import run_scenario
    from safepad.testing.tiny import tiny_model

    rows: list[Row] = []
    n_na = 0
    avail = sorted(n for n, ok in kernels.kernels_available().items() if ok)
    fams, scen = (SMALL_FAMILIES, SMALL_SCENARIOS) if RUN["small"] else (FAMILIES, SCENARIOS)
    for family in fams:
        stock = tiny_model(family).to(device)
        wrapped = safepad.wrap(copy.deepcopy(stock), backend="auto")
        for scenario in scen:
            res = run_scenario(wrapped, copy.deepcopy(stock), scenario, tol=1e-3)
            if not res.applicable:
                n_na += 1
                continue
            err = float("inf") if res.max_error is None or not res.passed else res.max_error
            name = f"{family}: {scenario}" + (f" raises {res.error[:50]}" if res.error else "")
            row = Row(name, "float32", err, 1e-3, res.seconds * 1e3, route="auto")
            rows.append(row)
            emit(row)
    return rows, {"scenarios": len(rows), "failed": sum(not r.ok for r in rows), "not_applicable": n_na,
                  "kernels": avail}  # fmt: skip
