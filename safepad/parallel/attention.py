"""Attention over a sequence-sharded call: all-gather K/V within the group (the simple, exact first version).

Registered in transformers' ``AttentionInterface`` as ``"safepad_sp"``; :class:`~safepad.distributed.SequenceParallel`
points the model's configs at it and remembers each attention module's previous implementation, which
runs whenever no sequence-parallel call is in progress (evaluation on one process, generation).

Inside a sharded call, each rank's queries ``[B, Hq, T, d]`` attend to the keys / values of the whole row
``[B, Hk, W * T, d]`` (gathered in ONE differentiable all-gather, so the backward exchange order is the
same on every rank) under a causal, same-sequence mask built from global positions and the global
``seq_idx``. Sliding-window attention raises: its window is not expressed here.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import Tensor

from .collectives import all_gather_stack
from .context import resolve_sp

__all__ = ["SP_ATTENTION", "sp_attention_forward"]

#: the name under which the function is registered in transformers' AttentionInterface
SP_ATTENTION = "safepad_sp"


def _fallback(module: torch.nn.Module):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = getattr(module, "_safepad_sp_fallback", None) or "sdpa"
    if name == "eager":
        fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if fn is None:
            raise ValueError(f"{type(module).__name__}: its module defines no eager_attention_forward to fall back to")
        return fn
    return ALL_ATTENTION_FUNCTIONS[name]


def sp_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """``query`` ``[B, Hq, T, d]``, ``key`` / ``value`` ``[B, Hk, T, d | dv]`` -> (``[B, T, Hq, dv]``, None)."""
    B, Hq, T, d = query.shape
    sp = resolve_sp(module, (B, T))
    if sp is None:
        return _fallback(module)(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    if window:
        raise ValueError(
            f"{type(module).__name__}: sliding-window attention (window {window}) is not supported under sequence "
            "parallelism (only full causal attention is expressed); disable sequence parallelism for this model"
        )
    Hk, dk, dv = key.shape[1], key.shape[-1], value.shape[-1]
    kv = torch.cat([key, value], dim=-1)  # [B, Hk, T, dk + dv]
    full = all_gather_stack(kv, sp.group, sp.rank, sp.world)  # [W, B, Hk, T, dk + dv]
    full = full.permute(1, 2, 0, 3, 4).reshape(B, Hk, sp.world * T, dk + dv)  # [B, Hk, Tg, dk + dv]
    k_full, v_full = full.split([dk, dv], dim=-1)
    if Hq != Hk:
        k_full = k_full.repeat_interleave(Hq // Hk, dim=1)  # [B, Hq, Tg, dk] (query head h uses kv head h // rep)
        v_full = v_full.repeat_interleave(Hq // Hk, dim=1)
    qpos = torch.arange(sp.offset, sp.offset + T, device=query.device)  # [T] global positions
    kpos = torch.arange(sp.global_len, device=query.device)  # [Tg]
    allowed = (kpos[None, :] <= qpos[:, None]).expand(B, T, sp.global_len)  # [B, T, Tg] causal
    if sp.global_seq_idx is not None:
        g = sp.global_seq_idx.to(query.device)
        allowed = allowed & (g[:, sp.offset : sp.offset + T, None] == g[:, None, :])  # same sequence
    out = F.scaled_dot_product_attention(
        query, k_full, v_full, attn_mask=allowed[:, None], dropout_p=dropout if module.training else 0.0, scale=scaling
    )  # [B, Hq, T, dv]
    sp.attention_seen.add(id(module))
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register :func:`sp_attention_forward` in transformers' AttentionInterface (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(SP_ATTENTION, sp_attention_forward)
