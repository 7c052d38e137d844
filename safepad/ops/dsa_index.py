"""Top-k key selection of a k-pool DSA indexer (GLM-5 Next), pooled per sequence over real keys only.

The transformers indexer (``Glm5NextTextIndexer``) groups the keys of a row into pools of ``kp`` consecutive
*slots* starting at the row's first real key, scores each complete pool for every query, keeps the top
``topk // kp`` pools the query can see (the pool's last key at or before the query) and appends the query's
incomplete tail pool (the last ``visible % kp`` keys) as raw slots. Slots are the wrong unit whenever a row is
not one unpadded sequence: a packed row pools keys across sequence boundaries and lets a query see the earlier
sequences; pads in the middle of a row (a right-padded prefill, then decode) shift every later pool and drop real
keys from the pools that straddle them.

Here a pool is ``kp`` consecutive *real keys of one sequence*: key ``j`` of segment ``s`` has rank ``r_j`` (real
keys of ``s`` before it); pool ``p`` holds ranks ``p*kp .. p*kp + kp - 1``. Visibility, completeness and the tail
are counted in ranks, so a sequence packed in a row, or with pads between its tokens, selects exactly the keys it
selects alone. Exactly tied pool scores go to the earlier pool (a stable sort; the stock ``topk`` breaks them
arbitrarily).

Shapes: ``B`` batch, ``T`` queries, ``N`` key slots (cache plus current), ``H`` index heads, ``D`` index head dim.
Runs without autograd (the indices are integers), in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["kpool_topk_indices"]


def _ranks(valid: Tensor, seg: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(exclusive real-key count per slot ``[B, N]``, its value at each slot's segment start ``[B, N]``, inclusive)."""
    vi = valid.long()
    incl = vi.cumsum(1)  # [B, N]
    excl = incl - vi
    start = torch.ones_like(valid)
    start[:, 1:] = seg[:, 1:] != seg[:, :-1]
    base = torch.where(start, excl, torch.zeros_like(excl)).cummax(1).values  # excl is non-decreasing
    return excl, base, incl


@torch.no_grad()
def kpool_topk_indices(
    keys: Tensor,
    gate_scores: Tensor,
    valid: Tensor,
    q: Tensor,
    weights: Tensor,
    q_slots: Tensor,
    q_valid: Tensor,
    ape: Tensor,
    *,
    kpool: int,
    topk: int,
    select_tail: bool,
    scale: float,
    seg: Tensor | None = None,
) -> Tensor:
    """Selected key slots per query: ``[B, T, topk (+ kpool - 1 with the tail)]`` int32, ``-1`` = nothing.

    Args:
        keys: ``[B, N, D]`` indexer keys of every slot; gate_scores: ``[B, N, D]`` their pool-compression logits.
        valid: ``[B, N]`` bool, real key slots.
        q: ``[B, T, H, D]`` indexer queries; weights: ``[B, T, H]`` per-head weights (already scaled).
        q_slots: ``[T]`` long, the slot of each query (causality: a query sees slots ``<= q_slots``).
        q_valid: ``[B, T]`` bool, real queries (pad queries select nothing).
        ape: ``[kpool, D]`` positional logits added per pool member.
        seg: ``[B, N]`` long, non-decreasing sequence id of each slot (packed rows), or None (one per row).
    """
    B, N, D = keys.shape
    T = q.shape[1]
    device = keys.device
    valid = valid.to(torch.bool)
    if seg is None:
        seg = torch.zeros(B, N, dtype=torch.long, device=device)
    seg = seg.long()
    excl, base, incl = _ranks(valid, seg)
    rank = excl - base  # [B, N] rank of a real key within its segment
    n_valid = valid.sum(1)  # [B]
    # slot of the v-th real key of each row (global real-key order; a segment's ranks are contiguous in it)
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices  # [B, N]: real slots first, in order
    offs = torch.arange(kpool, device=device)
    starts = valid & (rank % kpool == 0)  # [B, N]: slots that start a pool
    # a pool is complete when its last member (kp - 1 real keys later) exists and is of the same sequence; only
    # complete pools are ever selected, and a row holds at most N // kp of them (disjoint sets of kp real keys):
    # a static bound, so the number of pools is no host read (no graph break under torch.compile)
    last_v = excl + (kpool - 1)  # [B, N]: global real-key index of the last member of a pool starting here
    last_slot = order.gather(1, last_v.clamp(max=N - 1))  # [B, N]
    starts = starts & (last_v < n_valid[:, None]) & (seg.gather(1, last_slot) == seg)
    A = max(N // kpool, 1)
    anchor = torch.sort((~starts).to(torch.int8), dim=1, stable=True).indices[:, :A]  # [B, A] pool starts first
    is_start = starts.gather(1, anchor)  # [B, A] (False: filler of a row with fewer pools)
    member_v = excl.gather(1, anchor)[:, :, None] + offs  # [B, A, kp]: global real-key index of each member
    members = order.gather(1, member_v.clamp(max=N - 1).view(B, -1)).view(B, A, kpool)  # [B, A, kp] slots
    last = members[:, :, -1]  # [B, A]
    a_seg = seg.gather(1, anchor)  # [B, A]
    complete = is_start & (member_v[:, :, -1] < n_valid[:, None]) & (seg.gather(1, last) == a_seg)  # [B, A]
    # pool keys: per channel softmax over the members of gate logits + ape
    bidx = torch.arange(B, device=device)[:, None, None]
    m_keys = keys[bidx, members].float()  # [B, A, kp, D]
    logits = gate_scores[bidx, members].float() + ape.float()[None, None]
    logits = logits.masked_fill(~complete[:, :, None, None], 0.0)
    pool_keys = (logits.softmax(dim=2) * m_keys).sum(2)  # [B, A, D]
    # scores [B, T, A]
    s = torch.einsum("bthd,bad->btha", q.float(), pool_keys)
    s = F.relu(s * scale)
    scores = torch.einsum("bth,btha->bta", weights.float(), s)
    q_seg = seg[:, N - T :]  # [B, T]: queries are the last T slots
    cand = (
        complete[:, None, :]
        & (last[:, None, :] <= q_slots[None, :, None])
        & (a_seg[:, None, :] == q_seg[:, :, None])
    )  # [B, T, A]
    scores = scores.masked_fill(~cand, float("-inf"))
    K = topk // kpool
    picks = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :K]  # [B, T, <=K]
    picked_ok = cand.gather(-1, picks)  # [B, T, <=K]
    sel = members[bidx, picks]  # [B, T, <=K, kp]
    sel = sel.masked_fill(~picked_ok[..., None], -1).flatten(-2)  # [B, T, <=K * kp]
    sel = F.pad(sel, (0, K * kpool - sel.shape[-1]), value=-1)  # [B, T, K * kp]: the tail at a fixed column
    parts = [sel]
    width = topk
    if select_tail and kpool > 1:
        # visible real keys of the query's segment: inclusive count at the query slot, minus the segment base
        qs = q_slots.clamp(max=N - 1)[None].expand(B, T)  # [B, T]
        visible = incl.gather(1, qs) - base.gather(1, qs)  # [B, T]
        tail_count = visible % kpool
        t_offs = torch.arange(kpool - 1, device=device)
        tail_v = base.gather(1, qs)[..., None] + visible[..., None] - tail_count[..., None] + t_offs  # [B, T, kp-1]
        tail = order.gather(1, tail_v.clamp(0, N - 1).view(B, -1)).view(B, T, kpool - 1)
        tail = tail.masked_fill(t_offs[None, None] >= tail_count[..., None], -1)
        parts.append(tail)
        width += kpool - 1
    out = torch.cat(parts, dim=-1)
    out = F.pad(out, (0, max(0, width - out.shape[-1])), value=-1)[..., :width]
    out = out.masked_fill(~q_valid.to(torch.bool)[..., None], -1)
    return out.to(torch.int32)
