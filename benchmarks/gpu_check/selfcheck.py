"""The torch core's self-check, run before every part on CPU (seconds): a packed row == its sequences alone."""

from __future__ import annotations

from itertools import pairwise

import torch

from safepad.ops import ssd_scan

from .common import Row, rel_err, varlen_seq_idx


def ssd_inputs(Bsz, T, device, dtype, H, P, N):
    from safepad.testing.inputs import ssd_inputs as full

    return full(Bsz, T, device, dtype, heads=H, head_dim=P, groups=2, state=N, seed=0)


def cpu_self_check() -> list[Row]:
    """Torch core only: a packed row == its sequences run alone (fp32, small)."""
    t = ssd_inputs(1, 96, "cpu", torch.float32, H=4, P=8, N=8)
    seq = varlen_seq_idx(1, 96, 7, "cpu")
    y, v = ssd_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], chunk_size=16, seq_idx=seq, return_varlen_states=True)
    starts = [0] + (torch.nonzero(seq[0, 1:] != seq[0, :-1]).squeeze(1) + 1).tolist() + [96]
    err = 0.0
    for i, (s, e) in enumerate(pairwise(starts)):
        ys, fs = ssd_scan(
            t["x"][:, s:e],
            t["dt"][:, s:e],
            t["A"],
            t["B"][:, s:e],
            t["C"][:, s:e],
            chunk_size=16,
            return_final_state=True,
        )
        err = max(err, rel_err(y[:, s:e], ys), rel_err(v[i], fs[0]))
    return [Row("torch core: packed == per-sequence (cpu)", "float32", err, 1e-5)]


# ---------------------------------------------------------------------------------------------------------------
# FSDP2 through accelerate (issue 13). Needs CUDA, not the kernels. accelerate cannot run FSDP on CPU (it selects
# DistributedType.FSDP only for accelerator device types; see tests/examples/test_train_packed.py), so this is
# where the docs' FSDP2 recipe runs: examples/train_packed.py under `accelerate launch --use_fsdp --fsdp_version 2`
