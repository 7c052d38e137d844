"""Part ``fsdp2_accelerate`` (issue 13): FSDP2 through accelerate. Needs CUDA, not the kernels: accelerate cannot run
FSDP on CPU (it selects DistributedType.FSDP only for accelerator device types; see
tests/examples/test_train_packed.py), so this is where the docs' FSDP2 recipe runs: examples/train_packed.py under
`accelerate launch --use_fsdp --fsdp_version 2` with each NemotronHBlock an FSDP unit, against the same 4 packed
rows per step in one process."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from .common import Row

def check_fsdp2_accelerate(steps: int = 4) -> list[Row]:
    """Per-step losses of FSDP2 (min(2, #GPUs) processes) == one process; FSDP units and sharding verified.

    One row: max relative loss difference over the steps, tolerance 5e-6 (the DDP / FSDP2 CPU tests'); a run
    that did not shard (not FSDP, no NemotronHBlock unit, no DTensor parameter, or safepad's mixers lost)
    reports inf. With one GPU the FSDP2 world has one rank (units and DTensors, no cross-rank reduction).
    """
    import json
    import os
    import socket
    import subprocess
    import tempfile

    root = Path(__file__).resolve().parents[2]
    nproc = min(2, torch.cuda.device_count())
    small = ["--max-length", "128", "--max-docs", "120", "--logging-steps", "1", "--seed", "0",
             "--max-steps", str(steps), "--device", "auto"]  # fmt: skip
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    fsdp = [sys.executable, "-m", "accelerate.commands.launch", "--use_fsdp", "--fsdp_version", "2",
            "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP", "--fsdp_transformer_layer_cls_to_wrap",
            "NemotronHBlock", "--fsdp_reshard_after_forward", "true", "--fsdp_state_dict_type", "SHARDED_STATE_DICT",
            "--num_processes", str(nproc), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend",
            "no", "--main_process_ip", "127.0.0.1", "--main_process_port", str(port)]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "HF_HOME": os.path.join(tmp, "hf"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(root)}
        logs = {}
        for name, launcher, batch in (("fsdp", fsdp, 4 // nproc), ("one", [sys.executable], 4)):
            out = os.path.join(tmp, name)
            cmd = [*launcher, str(root / "examples" / "train_packed.py"), "--output-dir", out,
                   "--batch-size", str(batch), *small]  # fmt: skip
            proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600, check=False)
            if proc.returncode != 0:
                print(proc.stdout[-2000:], proc.stderr[-4000:])
                return [Row(f"fsdp2 accelerate: {name} run exited {proc.returncode}", "float32", float("inf"), 5e-6)]
            with open(os.path.join(out, "train_log.json")) as f:
                logs[name] = json.load(f)
    multi, single = logs["fsdp"], logs["one"]
    print(
        f"fsdp2 accelerate: {multi['distributed_type']} v{multi['fsdp_version']}, units {multi['fsdp_units']}, "
        f"{multi['sharded_params']} sharded params, {multi['wrapped_mixers']} wrapped mixers, {nproc} process(es)"
    )
    sharded = (multi["distributed_type"] == "FSDP" and multi["fsdp_version"] == 2 and multi["sharded_params"] > 0
               and "NemotronHBlock" in multi["fsdp_units"] and multi["wrapped_mixers"] == 2)  # fmt: skip
    one = [h["loss"] for h in single["log_history"] if "loss" in h]
    two = [h["loss"] for h in multi["log_history"] if "loss" in h]
    complete = sharded and len(one) == len(two) == steps
    err = max(abs(a - b) / abs(a) for a, b in zip(one, two)) if complete else float("inf")
    return [Row(f"fsdp2 accelerate ({nproc} proc) losses vs 1 proc", "float32", err, 5e-6)]


# ---------------------------------------------------------------------------------------------------------------


def run(device: str) -> tuple[list[Row], dict]:
    rows = check_fsdp2_accelerate()
    return rows, {"max_rel_loss_diff": rows[0].err if rows else None}
