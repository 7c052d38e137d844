"""Attention whose cached one-query step rounds like the full causal forward, in bf16 / fp16 on CPU.

torch's fused CPU attention kernel (the ``scaled_dot_product_attention`` path transformers' ``"sdpa"`` takes on
CPU) rounds the softmax probabilities to the input dtype before multiplying them with the values, in blocks
sized by the query length. In bf16 / fp16, a cached decode step (one query ``[B, H, 1, d]`` against the cache)
and the full causal forward over the same tokens (``[B, H, T, d]``) therefore give the same row with different
roundings: outputs one ulp apart on a few elements, which the later layers amplify to log-prob gaps of ~2e-3
between generation and the training forward (``tests/rl/test_rollout_parity.py``).

:func:`upcast_sdpa_forward` (registered in transformers' ``AttentionInterface`` as ``"safepad_sdpa"``, with
``"sdpa"``'s mask function) runs transformers' own ``sdpa_attention_forward`` on float64 copies of ``query``,
``key`` and ``value`` when they are bf16 / fp16 CPU tensors and rounds its output once to their dtype. float32
is not enough: with identical inputs, the float32 kernel's one-query step and its full forward still differ by
~1e-7 (another blocking of the sums), which flips the bf16 rounding of about one output row in 270 on a GRPO
batch; float64's ~1e-16 does not. float32 inputs and every non-CPU tensor go to ``"sdpa"`` unchanged.
:func:`safepad.wrap` points every config that uses ``"sdpa"`` at it, and :func:`safepad.unwrap` points it back.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

__all__ = ["UPCAST_SDPA", "register", "restore_sdpa", "upcast_sdpa_forward", "use_upcast_sdpa"]

#: the name under which :func:`upcast_sdpa_forward` is registered in transformers' AttentionInterface
UPCAST_SDPA = "safepad_sdpa"
_HALF = (torch.bfloat16, torch.float16)


def upcast_sdpa_forward(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, **kwargs
) -> tuple[Tensor, Tensor | None]:
    """transformers' ``sdpa_attention_forward``, computed in float64 for bf16 / fp16 CPU inputs.

    ``query`` ``[B, Hq, T, d]``, ``key`` / ``value`` ``[B, Hk, S, d | dv]``, ``attention_mask`` ``[B, 1, T, S]``
    (bool or additive) or ``None`` -> (``[B, T, Hq, dv]`` in ``query``'s dtype, ``None``).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dtype = query.dtype
    if dtype not in _HALF or query.device.type != "cpu":
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.double()
    q, k, v = query.double(), key.double(), value.double()
    out, weights = sdpa_attention_forward(module, q, k, v, attention_mask, **kwargs)
    return out.to(dtype), weights


def register() -> None:
    """Register :func:`upcast_sdpa_forward` and ``"sdpa"``'s mask function under :data:`UPCAST_SDPA` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(UPCAST_SDPA, upcast_sdpa_forward)
    AttentionMaskInterface.register(UPCAST_SDPA, sdpa_mask)


def _configs(model: nn.Module) -> Iterator:
    """Every distinct config of ``model``'s modules and of their sub-configs."""
    seen: set[int] = set()
    stack = [getattr(m, "config", None) for m in model.modules()]
    while stack:
        cfg = stack.pop()
        if cfg is None or id(cfg) in seen or not hasattr(cfg, "_attn_implementation"):
            continue
        seen.add(id(cfg))
        yield cfg
        stack.extend(getattr(cfg, key, None) for key in getattr(cfg, "sub_configs", {}) or {})


def _set(cfg, impl: str) -> None:
    """Set ``cfg``'s own attention implementation, leaving its sub-configs' as they are."""
    if hasattr(cfg, "_attn_implementation_internal"):
        cfg._attn_implementation_internal = impl
    else:  # pragma: no cover - a config without transformers' recursive setter
        cfg._attn_implementation = impl


def use_upcast_sdpa(model: nn.Module) -> int:
    """Point every config of ``model`` whose attention implementation is ``"sdpa"`` at :data:`UPCAST_SDPA`.

    Returns how many configs were changed. Other implementations (eager, flash, flex, a sequence-parallel one)
    are left as they are.
    """
    register()
    changed = 0
    for cfg in _configs(model):
        if cfg._attn_implementation == "sdpa":
            _set(cfg, UPCAST_SDPA)
            changed += 1
    return changed


def restore_sdpa(model: nn.Module) -> None:
    """Undo :func:`use_upcast_sdpa`: every config at :data:`UPCAST_SDPA` goes back to ``"sdpa"``."""
    for cfg in _configs(model):
        if cfg._attn_implementation == UPCAST_SDPA:
            _set(cfg, "sdpa")


register()  # at import: a wrapped model unpickled in a fresh process finds its attention implementation
