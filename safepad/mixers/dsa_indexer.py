"""The generic padding/packing-correct forward of a k-pool DSA indexer (GLM-5 Next's indexed attention).

transformers 5.23-5.24 ``Glm5NextTextIndexer`` computes its queries / keys / compression logits, appends
``[keys ‖ gate logits ‖ valid]`` of the new tokens to the cache layer's indexer state (``update_indexer``), and
selects per query the key slots the indexed attention may attend to; the attention then attends to exactly those
(causality and padding live in the selection only). This forward computes the same projections and state, and
selects with :func:`safepad.ops.dsa_index.kpool_topk_indices`, which pools and counts real keys per sequence: packed
rows (``seq_idx`` from the call context) never see or pool across their boundaries, and pads anywhere in a row
(a right-padded prefill, pads in a continuation chunk, a padded decode step) shift nothing.
Shapes: ``B`` batch, ``T`` tokens, ``C`` hidden, ``H`` index heads, ``D`` index head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..context import context_decode_mask, context_token_mask, resolve_seq_idx
from ..layout.masks import normalize_mask
from ..ops.dsa_index import kpool_topk_indices
from .common import pop_cache

__all__ = ["dsa_indexer_forward"]


def _token_mask(attention_mask: Tensor | None, B: int, T: int, device) -> Tensor:
    """``[B, T]`` bool real-token mask of this call (context overrides first, then the mask given)."""
    override = context_token_mask((B, T))
    if override is not None:
        return override.to(device=device, dtype=torch.bool)
    if T == 1:
        step = context_decode_mask((B, T))  # transformers hands the indexer ones on a one-token step
        if step is not None:
            return step.to(device=device, dtype=torch.bool)
    m = normalize_mask(attention_mask, (B, T))
    return torch.ones(B, T, dtype=torch.bool, device=device) if m is None else m.to(device)


@torch.no_grad()
def dsa_indexer_forward(
    self,
    hidden_states: Tensor,
    q_resid: Tensor,
    attention_mask: Tensor | None = None,
    cache=None,
    **kwargs,
) -> Tensor:
    """Selected key slots ``[B, T, index_topk (+ index_kpool - 1)]`` int32 (``-1``: none), as the stock indexer."""
    cache = pop_cache(cache, kwargs)
    B, T = hidden_states.shape[:2]
    D = self.head_dim
    q = self.wq_b(q_resid).view(B, T, -1, D)  # [B, T, H, D]
    k = self.k_norm(self.wk(hidden_states)).view(B, T, -1, D).squeeze(2)  # [B, T, D]
    gate = F.linear(hidden_states, self.index_kpool_compress_gate)  # [B, T, D]
    mask = _token_mask(attention_mask, B, T, hidden_states.device)  # [B, T]
    seq_idx = resolve_seq_idx(self, (B, T), kwargs)  # [B, T] packed rows (never with a cache), or None
    packed = torch.cat([k, gate, mask.to(k.dtype)[..., None]], dim=-1)  # [B, T, 2D + 1]
    slots = None  # [T] the cache slots of this call's queries
    if cache is not None:
        layer = cache.layers[self.layer_idx]
        names = {c.__name__ for c in type(layer).__mro__}
        if not names & {"DynamicIndexedLayer", "StaticIndexedLayer"}:
            raise ValueError(
                f"{type(self).__name__} (layer {self.layer_idx}): safepad's indexer keeps its state in an indexed "
                f"cache layer (DynamicIndexedLayer / StaticIndexedLayer), got a {type(layer).__name__}: build the "
                "cache with DynamicCache(config=model.config) or cache_implementation='static'"
            )
        packed = cache.update_indexer(packed, self.layer_idx)  # [B, N, 2D + 1] (N: max_cache_len when static)
        filled = getattr(layer, "indexer_cumulative_length", None)
        if "StaticIndexedLayer" in names and isinstance(filled, torch.Tensor):
            # the whole preallocated buffer comes back; unfilled slots hold zeros (valid = 0: never selected)
            slots = torch.arange(T, device=hidden_states.device) + (filled.to(hidden_states.device) - T)
    N = packed.shape[1]
    keys, gate_all, valid = packed.split([D, D, 1], dim=-1)
    weights = self.weights_proj(hidden_states.to(self.weights_proj.weight.dtype)).float() * (self.n_heads**-0.5)
    seg = None
    if seq_idx is not None:
        seg = seq_idx.long()
    return kpool_topk_indices(
        keys,
        gate_all,
        valid[..., 0] > 0.5,
        q,
        weights,
        torch.arange(N - T, N, device=hidden_states.device) if slots is None else slots,
        mask,
        self.index_kpool_compress_ape,
        kpool=self.index_kpool,
        topk=self.index_topk,
        select_tail=self.index_kpool_always_select_tail,
        scale=self.softmax_scale,
        seg=seg,
    )
