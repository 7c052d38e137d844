"""The precision policy of the recurrences of half-precision models: the dtype their inputs are widened to.

A decode step and the chunked scan (or chunked delta rule) evaluate the same recurrence in different orders. Every
difference that survives to a bf16 rounding of the output can flip it by one ulp, which the gated norm and
``out_proj`` carry to the logits (the rollout-vs-training log-prob gap under GRPO: ~1e-3 on bf16 Nemotron-H /
Bamba / Qwen3-Next). The policy, one function of the input dtype and the device type, decides how wide the
recurrence's inputs are (docs/limits.md, "Precision policy"):

* float32 / float64 inputs: unchanged (the ops compute in float32, or float64 for float64 inputs).
* half precision on CPU (the torch core): float64, for the SSD and for the gated delta rule. In float32 the two
  orders still differ by ~1e-7 relative and about 1 in 10^4 of the gated norm's outputs rounds to the other bf16
  neighbour (bf16 Bamba, GRPO seed 0: 1.0e-3 in log-prob); in float64 they agree to ~1e-16. As the float64 CPU
  attention of half-precision models (``safepad.wrap.attention``).
* half precision on CUDA (and any other device): float32 for the SSD (the precision of the Mamba2 kernels'
  recurrent state; the scan's matmuls then take float32 inputs), the model dtype for the gated delta rule (the
  rule computes in float32 itself: its torch core casts its inputs, FLA's kernels take bf16 inputs and accumulate
  in float32). bf16 SSD inputs with float32 accumulation are not the policy: that the chunked scan and the step
  then still agree within bf16 rounding after the gated norm has not been measured on a GPU (issue 38).

Recurrent states are float32 (float64 where the inputs are) whatever the policy: the ops keep them so.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["HALF_DTYPES", "RECURRENCES", "device_type", "recurrence_dtype", "recurrence_input"]

#: the half-precision dtypes the policy widens
HALF_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
#: the recurrences the policy covers: the Mamba2 SSD (scan and step) and the gated delta rule (chunked and step)
RECURRENCES: tuple[str, ...] = ("ssd", "delta_rule")


def recurrence_dtype(dtype: torch.dtype, device: str, recurrence: str) -> torch.dtype:
    """The dtype the inputs ``[..., D]`` of ``recurrence`` (one of :data:`RECURRENCES`) are given in, for a model
    computing in ``dtype`` on a device of type ``device`` (``"cpu"``, ``"cuda"``, ...). See the module docstring."""
    if recurrence not in RECURRENCES:
        raise ValueError(f"recurrence must be one of {RECURRENCES}, got {recurrence!r}")
    if dtype not in HALF_DTYPES:
        return dtype
    if device == "cpu":
        return torch.float64
    return torch.float32 if recurrence == "ssd" else dtype


def device_type(x: Tensor) -> str:
    """The device type the policy decides by (``x.device.type``; one place, so that a test can ask for another)."""
    return x.device.type


def recurrence_input(x: Tensor, recurrence: str) -> Tensor:
    """``x`` ``[..., D]`` in :func:`recurrence_dtype` for its dtype and device (exact: only ever widened)."""
    return x.to(recurrence_dtype(x.dtype, device_type(x), recurrence))
