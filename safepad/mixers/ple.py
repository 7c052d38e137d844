"""The generic padding-correct Per-Layer Embedding (PLE) of Qwen4-Exp (``Qwen4ExpTextPLELayer``).

Structure (transformers 5.23 / 5.24)::

    e   = ngram_embedding(hashed n-grams of the token ids)        n-gram state: the last ngram_size - 1 ids
    g   = sigmoid(signed sqrt(<norm_key(key_proj e), norm_query(x)>)) * value_proj(e)     per hyper-connection stream
    out = g + silu(dilated depthwise causal conv(norm_conv(g)))     conv state: the last (K - 1) * ngram_size inputs

Two states per layer, kept by the stock code in the layer's recurrent cache entry next to the Gated DeltaNet's
(``state_idx`` 1: the conv inputs, ``state_idx`` 2: the token ids). The stock n-gram history restarts only at an
EOS token, so packed sequences without EOS between them hash each other's tokens, and the stock model turns pads
into EOS before the layer, so after a right-padded prefill the cached history is all EOS; its conv caches the last
columns of the padded row and reads across packed boundaries. Here the n-gram history also restarts at every
packed boundary and holds each row's last *real* ids, and the conv runs on
:func:`safepad.ops.conv.causal_conv1d` (``dilation = ngram_size``) with ``seq_idx``, the token mask and the
cached inputs, so its state is each row's last real inputs.

Shapes: ``B`` batch, ``T`` tokens, ``C = ngram_size - 1`` n-gram context, ``E`` = ``ple_embed_dim``,
``D`` = ``hc_count * hidden_size`` (conv channels), ``S = (K - 1) * ngram_size``.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import Tensor

from ..cache import read_states, write_states
from ..ops.conv import causal_conv1d, causal_conv1d_step
from .common import hold_masked_rows, pop_cache, prepare_layout

logger = logging.getLogger(__name__)

__all__ = ["ngram_embedding", "ple_forward"]


def _segment_starts(history: Tensor, eos: int, seq_start: Tensor | None) -> Tensor:
    """``[B, L]`` position where each history token's n-gram segment starts: after the last EOS before it, and
    not before its own packed sequence's first token (``seq_start`` ``[B, L]`` | None)."""
    B, L = history.shape
    pos = torch.arange(L, device=history.device).expand(B, L)  # [B, L]
    eos_pos = torch.where(history == eos, pos, -1)
    prev_eos = torch.cat([eos_pos.new_full((B, 1), -1), torch.cummax(eos_pos, dim=1).values[:, :-1]], dim=1)
    start = prev_eos + 1  # [B, L]
    if seq_start is not None:
        start = torch.maximum(start, seq_start)
    return start


def ngram_embedding(emb_module, ids: Tensor, previous: Tensor, seq_idx: Tensor | None) -> Tensor:
    """Hashed n-gram embeddings of ``ids`` ``[B, T]`` after ``previous`` ``[B, C]`` ids (EOS = none) -> ``[B, T, E]``.

    The math of ``Qwen4ExpTextNGramEmbedding`` (``emb_module``: its multipliers, head vocab sizes and table), with
    the history restarting at EOS as there and also at every ``seq_idx`` ``[B, T]`` boundary.
    """
    n = emb_module.ngram_size
    C = emb_module.context_len
    eos = emb_module.eos_token_id
    B, T = ids.shape
    history = torch.cat([previous.to(ids.dtype), ids], dim=1)  # [B, C + T]
    L = C + T
    seq_start = None
    if seq_idx is not None:
        change = torch.ones(B, T, dtype=torch.bool, device=ids.device)
        change[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
        pos = torch.arange(C, L, device=ids.device).expand(B, T)  # [B, T] history positions of the new tokens
        first = torch.cummax(torch.where(change, pos, torch.zeros_like(pos)), dim=1).values  # [B, T]
        seq_start = torch.cat([first.new_zeros(B, C), first], dim=1)  # [B, L]
    start = _segment_starts(history, eos, seq_start)  # [B, L]
    p = torch.arange(L, device=ids.device)  # [L]
    shifted = [history]
    for s in range(1, n):
        src = (p - s).clamp_min(0).expand(B, L)  # [B, L]
        valid = (p - s >= 0) & (p - s >= start)
        shifted.append(torch.where(valid, history.gather(1, src), history.new_full((), eos)))
    mult = emb_module.layer_multipliers
    hpn = emb_module.heads_per_ngram
    blocks = []
    for ngram in range(2, n + 1):
        lo = (ngram - 2) * hpn
        mixed = shifted[0] * mult[0]
        for k in range(1, ngram):
            mixed = torch.bitwise_xor(mixed, shifted[k] * mult[k])
        sizes = emb_module.ngram_heads_vocab_sizes[lo : lo + hpn]
        offsets = emb_module.ngram_heads_offsets[lo : lo + hpn]
        blocks.append(torch.remainder(mixed.unsqueeze(-1), sizes.view(1, 1, -1)) + offsets.view(1, 1, -1))
    ngram_ids = torch.cat(blocks, dim=-1)[:, -T:]  # [B, T, heads]
    table = emb_module.ngram_embedding
    return table(ngram_ids.to(table.weight.device)).to(ids.device).flatten(-2)  # [B, T, E]


def _last_real_ids(previous: Tensor, ids: Tensor, mask: Tensor | None) -> Tensor:
    """Each row's last ``C`` real ids of ``[previous ‖ ids]`` (pads trailing after compaction): ``[B, C]``."""
    C = previous.shape[1]
    history = torch.cat([previous.to(ids.dtype), ids], dim=1)  # [B, C + T]
    n = torch.full((ids.shape[0],), ids.shape[1], device=ids.device) if mask is None else mask.sum(1)  # [B]
    cols = n[:, None] + torch.arange(C, device=ids.device)[None, :]  # [B, C]
    return history.gather(1, cols)


def ple_forward(self, hidden_states: Tensor, input_ids: Tensor, cache=None, conv_mask: Tensor | None = None, **kwargs):
    """Padding/packing-correct PLE. ``hidden_states [B, T, D]``, ``input_ids [B, T]`` -> ``[B, T, D]``."""
    backend = self._safepad.backend
    cache = pop_cache(cache, kwargs)
    B, T = hidden_states.shape[:2]
    hidden, layout = prepare_layout(self, hidden_states, conv_mask, cache, kwargs)
    if layout.sp is not None:
        raise ValueError(f"{type(self).__name__}: sequence parallelism (safepad.distributed) does not cover PLE yet")
    ids = input_ids.long()
    if layout.compaction is not None:
        ids = layout.compaction.gather(ids[..., None]).squeeze(-1)  # [B, T] real tokens first
    mask = layout.mask
    if mask is not None:
        hidden = torch.where(mask[..., None], hidden, 0.0)
    emb_mod = self.ple_embedding
    C = emb_mod.context_len
    eos = emb_mod.eos_token_id
    idx = self.layer_idx
    ctx = read_states(cache, idx, state_idx=2, recurrent=False).conv if cache is not None else None
    previous = ctx.to(ids.device).long() if ctx is not None else ids.new_full((B, C), eos)  # [B, C]
    emb = ngram_embedding(emb_mod, ids, previous, layout.seq_idx)  # [B, T, E]

    H, n_hc = self.hidden_size, self.hc_count
    key = self.norm_key(self.key_proj(emb)).unflatten(-1, (n_hc, H))  # [B, T, hc, H]
    value = self.value_proj(emb)  # [B, T, H]
    query = self.norm_query(hidden).unflatten(-1, (n_hc, H))  # [B, T, hc, H]
    gate = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(H)  # [B, T, hc, 1]
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
    gated = torch.sigmoid(gate) * value.unsqueeze(-2)  # [B, T, hc, H]
    gated_normed = self.norm_conv(gated.flatten(-2))  # [B, T, D]
    gated = gated.flatten(-2)  # [B, T, D]
    if mask is not None:
        gated = torch.where(mask[..., None], gated, 0.0)
        gated_normed = torch.where(mask[..., None], gated_normed, 0.0)

    conv = self.conv1d
    weight = conv.weight.squeeze(1)  # [D, 1, K] -> [D, K]
    d = conv.dilation[0]
    S = self.short_conv_state_len  # (K - 1) * d
    past = read_states(cache, idx, state_idx=1, recurrent=False) if cache is not None else None
    past_conv = past.conv if past is not None and past.has_previous else None
    if past_conv is not None and T == 1:
        y, conv_new = causal_conv1d_step(
            gated_normed[:, 0], past_conv, weight, conv.bias, activation="silu", dilation=d, backend=backend
        )  # [B, D], [B, D, S]
        conv_new = hold_masked_rows(mask, conv_new, past_conv)
        y = y[:, None]
    else:
        want = cache is not None
        out = causal_conv1d(
            gated_normed, weight, conv.bias, activation="silu", seq_idx=layout.seq_idx, initial_state=past_conv,
            token_mask=mask, return_final_state=want, state_len=S, dilation=d, backend=backend,
        )
        y, conv_new = out if want else (out, None)  # [B, T, D], [B, D, S]
    if cache is not None:
        write_states(cache, idx, tokens=T, conv=conv_new.to(gated.dtype), state_idx=1)
        write_states(cache, idx, tokens=T, conv=_last_real_ids(previous, ids, mask).to(previous.dtype), state_idx=2)
    return layout.restore(gated + y.to(gated.dtype))
