"""Block-diagonal causal attention masks for packed calls of hybrids whose own mask construction ignores packing."""

from __future__ import annotations

import torch
from torch import nn

from ..cache import cache_argument
from ..layout.normalize import position_ids_from_seq_idx

__all__ = ["packed_mask_mapping"]


def packed_mask_mapping(module: nn.Module, seq_idx: torch.Tensor, keys: tuple[str, ...]) -> dict:
    """Block-diagonal causal masks for hybrids whose own mask construction ignores packing."""
    from transformers.masking_utils import create_causal_mask

    config = module.config
    B, T = seq_idx.shape
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    shape_only = torch.empty(B, T, 0, dtype=dtype, device=seq_idx.device)  # create_causal_mask reads shape/dtype
    positions = position_ids_from_seq_idx(seq_idx)
    cache_kw = cache_argument(create_causal_mask) or "past_key_values"  # 5.23: past_key_values, 5.24: cache
    full = create_causal_mask(
        config=config, inputs_embeds=shape_only, attention_mask=None, position_ids=positions, **{cache_kw: None}
    )
    mapping: dict = {k: full for k in keys}
    mapping.setdefault("linear_attention", None)
    return mapping
