"""Helpers for running the example scripts as subprocesses: offline, single-threaded, with a timeout."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def example_env(**extra: str) -> dict[str, str]:
    """The caller's environment, offline (nothing may be downloaded) and one torch thread per process.

    One thread: on a shared 2-core box, intra-op threads of several processes only add contention.
    ``extra`` entries are set last.
    """
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    env.pop("WORLD_SIZE", None)  # never inherit a distributed launch from the test runner
    env.pop("LOCAL_WORLD_SIZE", None)
    env.update(extra)
    return env


def run_script(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` from the repo root; fail the test with its output on a non-zero exit or a timeout."""
    try:
        proc = subprocess.run(
            cmd,
            cwd=ROOT,
            env=example_env(**(env or {})),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        pytest.fail(f"{' '.join(cmd)} timed out after {timeout} s; output so far:\n{out[-3000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def train_packed(
    out_dir: Path,
    *flags: str,
    launcher: list[str] | None = None,
    timeout: float = 90.0,
    env: dict[str, str] | None = None,
) -> dict:
    """Run examples/train_packed.py (optionally under ``launcher``) and return its ``train_log.json``."""
    cmd = [
        *(launcher or [sys.executable]),
        str(EXAMPLES / "train_packed.py"),
        "--output-dir",
        str(out_dir),
        *flags,
    ]
    run_script(cmd, timeout, env)
    with open(out_dir / "train_log.json") as f:
        return json.load(f)


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it), for the rendezvous of a local launch."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
