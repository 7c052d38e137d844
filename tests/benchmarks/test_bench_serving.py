"""benchmarks/bench_serving.py --quick: the continuous-batching vs padded-generate benchmark runs end to end, both
sides serve the whole load, and every request's greedy tokens are the same on both sides (float32)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_serving import make_load  # noqa: E402


def test_the_load_is_lognormal_seeded_and_clipped():
    a, b = make_load(64, seed=0), make_load(64, seed=0)
    assert a.prompts == b.prompts and a.outputs == b.outputs
    assert make_load(64, seed=1).outputs != a.outputs
    plens = [len(p) for p in a.prompts]
    assert 1 <= min(plens) and max(plens) <= 256 and 1 <= min(a.outputs) and max(a.outputs) <= 64
    assert len(set(plens)) > 20 and len(set(a.outputs)) > 10  # spread, not a constant


def test_quick_run_prints_both_sides_and_the_ratio():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "benchmarks/bench_serving.py", "--quick"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for label in ("continuous batching (manager)", "generate, left-padded batches"):
        line = next(line for line in out.splitlines() if label in line)
        rps, tps = (float(x) for x in re.findall(r"([\d.]+) (?:requests|tokens)/s", line))
        assert rps > 0 and tps > 0, line
    assert "requests with the same greedy tokens on both sides: 8/8" in out
    assert re.search(r"continuous batching throughput / padded generate:\s+[\d.]+x", out.splitlines()[-1]), out
