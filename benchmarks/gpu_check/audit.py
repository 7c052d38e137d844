"""Part ``audit``: ``safepad audit`` of every family's tiny model on the device, fp32 and bf16.

The wrapped copy runs safepad's torch core by default (``--audit-backend torch``): no Triton compile, so this
part's result does not depend on a cold kernel cache; the ``routes`` and ``generate`` parts cover the kernels.
Each family and dtype is one row: ``err`` = the number of applicable scenarios that fail (tolerance 0); the
failing scenarios are listed under the ``failures`` figure.
"""

from __future__ import annotations

import torch

from .common import RUN, Row, dtype_name, emit

#: the families of the CPU smoke run (one per mixer kind)
SMALL_FAMILIES = ("nemotron_h", "jamba", "qwen3_next")
#: the scenarios of the CPU smoke run
SMALL_SCENARIOS = ("packed_seq_idx", "right_pad_decode", "generate")

OPTIONS = {"backend": "torch", "families": None}


def families() -> list[str]:
    from safepad.testing.tiny import EXTRA_FAMILIES, FAMILIES, family_available

    if OPTIONS["families"]:
        return list(OPTIONS["families"])
    names = SMALL_FAMILIES if RUN["small"] else (*FAMILIES, *EXTRA_FAMILIES)
    return [f for f in names if family_available(f)[0]]


def run(device: str) -> tuple[list[Row], dict]:
    import safepad
    from safepad.testing.scenarios import audit
    from safepad.testing.tiny import tiny_model

    backend = OPTIONS["backend"]
    names = SMALL_SCENARIOS if RUN["small"] else None
    rows: list[Row] = []
    failures: dict[str, list[str]] = {}
    fams = families()
    for dtype in (torch.float32, torch.bfloat16):
        for fam in fams:
            label = f"audit {fam}"
            try:
                rep = audit(
                    lambda fam=fam, dtype=dtype: tiny_model(fam, dtype=dtype).to(device),
                    lambda m: safepad.wrap(m, backend=backend),
                    names,
                    model_name=fam,
                )
                bad = [r.name + (f" ({r.error[:60]})" if r.error else "") for r in rep.subject
                       if r.applicable and not r.passed]  # fmt: skip
                secs = sum(r.seconds for r in rep.subject) * 1e3
                row = Row(label, dtype_name(dtype), float(len(bad)), 0.0, secs, route=f"wrap(backend={backend!r})")
            except Exception as e:  # noqa: BLE001 - one family's crash is a finding, not the end of the part
                bad = [f"{type(e).__name__}: {str(e)[:100]}"]
                row = Row(f"{label}: {type(e).__name__}", dtype_name(dtype), float("inf"), 0.0)
            if bad:
                failures[f"{fam} {dtype_name(dtype)}"] = bad
            rows.append(row)
            emit(row, failures=failures)
    return rows, {"models": len(rows), "failed": sum(not r.ok for r in rows), "failures": failures,
                  "backend": backend, "families": fams}  # fmt: skip
