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

Only where it is needed: a config keeps the user's ``"sdpa"`` unless the model's attention will see bf16 / fp16
CPU tensors (:func:`upcast_needed`: the input embedding's dtype / device, or CPU autocast to half precision). The
decision is taken at :func:`safepad.wrap` and again at every call of the wrapped model (its pre-hook, from host
facts: no sync; a compiled call sees the same strings every time, no recompile), so a model cast to bf16 after
wrapping, or moved to CUDA, follows. Each switch is logged (``logging.getLogger("safepad.wrap.attention")``,
INFO); :func:`safepad.unwrap` points every config back at ``"sdpa"``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
from torch import Tensor, nn

__all__ = [
    "UPCAST_SDPA",
    "attention_configs",
    "register",
    "restore_sdpa",
    "sync_upcast_sdpa",
    "upcast_needed",
    "upcast_sdpa_forward",
    "use_upcast_sdpa",
]

logger = logging.getLogger(__name__)

#: the name under which :func:`upcast_sdpa_forward` is registered in transformers' AttentionInterface
UPCAST_SDPA = "safepad_sdpa"
_HALF = (torch.bfloat16, torch.float16)


def upcast_sdpa_forward(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, **kwargs
) -> tuple[Tensor, Tensor | None]:
    """transformers' ``sdpa_attention_forward``, computed in float64 for bf16 / fp16 CPU inputs.

    ``query`` ``[B, Hq, T, d]``, ``key`` / ``value`` ``[B, Hk, S, d | dv]``, ``attention_mask`` ``[B, 1, T, S]``
    (bool or additive) or ``None`` -> (``[B, T, Hq, dv]`` in ``query``'s dtype, ``None``). Floating-point tensors
    among ``kwargs`` (a ``position_bias`` ``[B, Hq, T, S]``) are computed in float64 too.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dtype = query.dtype
    if dtype not in _HALF or query.device.type != "cpu":
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.double()
    # every floating tensor argument joins the float64 computation: Inkling's ``position_bias`` [B, H, T, S] (which
    # sdpa_attention_forward turns into the additive mask), a sink's logits, ...; float32 ones too (autocast)
    kwargs = {k: _double(v) for k, v in kwargs.items()}
    q, k, v = query.double(), key.double(), value.double()
    out, weights = sdpa_attention_forward(module, q, k, v, attention_mask, **kwargs)
    return out.to(dtype), weights


def _double(value):
    """A floating-point tensor as float64; anything else (ints, flags, integer position tensors) as it is."""
    return value.double() if isinstance(value, Tensor) and value.is_floating_point() else value


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


def attention_configs(model: nn.Module) -> tuple:
    """Every distinct config of ``model`` (and sub-config) that carries an attention implementation, once."""
    return tuple(_configs(model))


def upcast_needed(model: nn.Module, inputs: Tensor | None = None) -> bool:
    """Will ``model``'s sdpa attention see bf16 / fp16 CPU tensors on this call? Host facts only (no sync).

    ``inputs``: the call's ``inputs_embeds`` ``[B, T, D]`` when given (its dtype / device), else the input
    embedding's weight is read (``input_ids`` ``[B, T]`` is integer). Half precision is the dtype of that tensor,
    or CPU autocast to bf16 / fp16 around the call. Without either (a model with no input embedding), the first
    floating-point parameter decides.
    """
    ref = inputs if isinstance(inputs, Tensor) and inputs.is_floating_point() else _embedding_weight(model)
    if ref is None or ref.device.type != "cpu":
        return False
    if ref.dtype in _HALF:
        return True
    return torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") in _HALF


def _embedding_weight(model: nn.Module) -> Tensor | None:
    """The input embedding's weight of ``model``, else its first floating-point parameter, else None."""
    get = getattr(model, "get_input_embeddings", None)
    try:
        emb = get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        emb = None
    weight = getattr(emb, "weight", None)
    if isinstance(weight, Tensor):
        return weight
    return next((p for p in model.parameters() if p.is_floating_point()), None)


def sync_upcast_sdpa(configs: tuple, upcast: bool) -> int:
    """Point each of ``configs`` at :data:`UPCAST_SDPA` (``upcast``) or back at ``"sdpa"`` (not ``upcast``).

    Only configs at ``"sdpa"`` or :data:`UPCAST_SDPA` change (eager, flash, flex, paged or a sequence-parallel
    implementation are the user's and stay); each change is logged. Returns how many configs changed: 0 on every
    call after the first of a given dtype / device (a compiled call then sees constant strings, no recompile).
    """
    want, other = (UPCAST_SDPA, "sdpa") if upcast else ("sdpa", UPCAST_SDPA)
    changed = 0
    for cfg in configs:
        if cfg._attn_implementation == other:
            _set(cfg, want)
            changed += 1
    if changed:
        logger.info(
            "safepad: config._attn_implementation of %s now %r (%s)",
            ", ".join(sorted({str(getattr(c, "model_type", "?")) for c in configs if c._attn_implementation == want})),
            want,
            "bf16 / fp16 on CPU: sdpa in float64, rounded once; safepad.unwrap restores 'sdpa'"
            if upcast
            else "the model is not half precision on CPU: stock sdpa",
        )
    return changed


def use_upcast_sdpa(model: nn.Module) -> int:
    """At wrap time: point ``model``'s ``"sdpa"`` configs at :data:`UPCAST_SDPA` iff :func:`upcast_needed` now.

    Returns how many configs were changed. The model hooks repeat the decision on every call
    (:func:`sync_upcast_sdpa`), so a model cast or moved after :func:`safepad.wrap` follows.
    """
    register()
    return sync_upcast_sdpa(attention_configs(model), upcast_needed(model))


def restore_sdpa(model: nn.Module) -> None:
    """Undo :func:`use_upcast_sdpa`: every config at :data:`UPCAST_SDPA` goes back to ``"sdpa"``."""
    sync_upcast_sdpa(attention_configs(model), upcast=False)


register()  # at import: a wrapped model unpickled in a fresh process finds its attention implementation
