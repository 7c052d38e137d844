"""Sequence-parallel versions of the torch-core ops: same signatures, plus the rank exchange.

Each rank holds a contiguous shard ``[offset, offset + T)`` of every row. The generic mixers call these
through :func:`sp_op` (``safepad.mixers.common.layout_op``) instead of the single-device ops:

* **conv** (:func:`sp_causal_conv1d`): the last ``K - 1`` inputs of the previous rank are the conv's
  initial state (its *halo*), zeroed where they belong to another sequence than this shard's first one.
* **recurrent scans**: the scan runs locally from a zero state; then the ranks all-gather, per row, their
  local final state ``F_r`` and the transition ``a_r`` of the sequence that crosses their shard (``0``
  unless one sequence spans the whole shard), and each rank chains them (LASP-2's affine-summary scan)::

      h_in(r + 1) = crosses(r + 1) * (F_r + a_r ∘ h_in(r))

  ``crosses(r)`` is the packing: a row whose sequence ends exactly at a shard edge passes nothing on. Only
  the row's first sequence of a shard receives ``h_in``, and the outputs are corrected for it:

  - Mamba2 / SSD (:func:`sp_ssd_scan`): ``a_r = exp(Σ dt·A)`` per head, and the correction is linear in
    ``h_in``: ``y_t += exp(Σ_{s≤t} dt_s A) · C_t h_in``.
  - gated delta rule (:func:`sp_chunk_gated_delta_rule`): the state map is affine, ``S ↦ M S + F`` with
    ``M = Π g_t (I - β_t k_t k_tᵀ)`` ``[Dk, Dk]``. One scan over ``[v | 0]`` from ``[0 | I]`` gives ``F``,
    ``M`` and, as the extra output columns, ``M_tᵀ q_t``, so the correction is ``o_t += h_inᵀ (M_tᵀ q_t)``.
  - Mamba1 (:func:`sp_selective_scan`): ``a_r = exp(Σ dt ⊗ A)`` per channel and state; the correction is
    the scan of a zero input from ``h_in`` (the scan is linear in ``(u, h0)``), gated afterwards.

Every exchange is a differentiable all-gather (one per op call: the summaries travel together), so
gradients flow back to the ranks that produced each state. The traffic per layer is one state per row
and rank, independent of the sequence length. Every rank joins every backward exchange (rank 0, which
uses no incoming state, feeds zeros back), otherwise the group would deadlock.
Shapes: ``B`` rows, ``T`` shard tokens, ``W`` ranks.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch
from torch import Tensor

from ..ops.conv import causal_conv1d, check_causal_conv1d_args
from ..ops.delta_rule import check_delta_rule_args, chunk_gated_delta_rule
from ..ops.dt import process_dt
from ..ops.selective_scan import _gate, check_selective_scan_args, selective_scan
from ..ops.ssd import check_ssd_scan_args, ssd_scan
from .collectives import all_gather_stack
from .context import SPContext

__all__ = ["sp_causal_conv1d", "sp_chunk_gated_delta_rule", "sp_op", "sp_selective_scan", "sp_ssd_scan"]


#: arguments of the single-device ops that a sharded call cannot honour (caches and padding masks are refused
#: earlier, by the entry point)
_REFUSED = ("initial_state", "token_mask", "return_final_state", "return_varlen_states")


def _arguments(op: Callable, check: Callable, args: tuple, kwargs: dict) -> tuple[dict[str, Any], Any]:
    """Bind a call to the single-device ``op``'s own signature (defaults applied), validate it with the op's
    own ``check`` helper, and refuse what a sharded call cannot honour.

    Returns (the arguments by name, ``check``'s result: sizes and normalised arguments). The sequence-parallel
    ops therefore take exactly the arguments of the op they stand for, and raise the same errors for them.
    """
    try:
        bound = _signature(op).bind(*args, **kwargs)
    except TypeError as err:
        raise TypeError(f"{op.__name__} (sequence parallel): {err}") from None
    bound.apply_defaults()
    a = dict(bound.arguments)
    bad = [k for k in _REFUSED if a.get(k) is not None and a.get(k) is not False]
    if bad:
        raise ValueError(
            f"{op.__name__} under sequence parallelism does not take {', '.join(bad)}: a sharded training call "
            "starts every row from a zero state on rank 0 and returns no cache; call without a cache and without "
            "padding"
        )
    return a, check(**{n: a[n] for n in _signature(check).parameters})


_signature = functools.lru_cache(maxsize=None)(inspect.signature)


class _Attach(torch.autograd.Function):
    """``y`` unchanged; backward also sends zeros to ``extra``, so that the collective that produced
    ``extra`` runs its backward on this rank too (every rank must join every backward exchange)."""

    @staticmethod
    def forward(ctx, y: Tensor, *extra: Tensor) -> Tensor:
        ctx.shapes = [(e.shape, e.dtype, e.device) for e in extra]
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g: Tensor):
        return (g, *(torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.shapes))


def _compute_dtype(x: Tensor) -> torch.dtype:
    """The torch core's compute dtype for inputs of ``x.dtype``: float64 stays, anything else is float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _first_sequence(seq_idx: Tensor | None, shape: tuple[int, int], device) -> tuple[Tensor | None, Tensor]:
    """(``[B, T]`` bool: token of the shard's first sequence, or None when the whole shard is one;
    ``[B]`` bool: that sequence reaches the shard's last token)."""
    if seq_idx is None:
        return None, torch.ones(shape[0], dtype=torch.bool, device=device)
    first = seq_idx == seq_idx[:, :1]  # [B, T]
    return first, first[:, -1]


def _gather_summaries(sp: SPContext, F_loc: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
    """All-gather ``(F_loc [B, ...], a [B, ...])`` of every rank in ONE collective: ``([W, B, ...], [W, B, ...])``.

    One exchange per layer, so its backward all-reduce has a single place in every rank's backward order
    (two independent gathers could run their backward exchanges in different orders on different ranks).
    """
    B = F_loc.shape[0]
    a = a.to(F_loc.dtype)
    flat = torch.cat([F_loc.reshape(B, -1), a.reshape(B, -1)], dim=1)  # [B, |F| + |a|]
    every = all_gather_stack(flat, sp.group, sp.rank, sp.world)  # [W, B, |F| + |a|]
    nF = F_loc[0].numel()
    F_all = every[..., :nF].reshape(sp.world, *F_loc.shape)
    a_all = every[..., nF:].reshape(sp.world, *a.shape)
    return F_all, a_all


def _incoming(sp: SPContext, F_all: Tensor, a_all: Tensor, apply: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """The state entering this rank's shard, ``[B, ...]``, chained over the ranks before it.

    ``F_all`` ``[W, B, ...]`` local final states (from zero); ``a_all`` ``[W, B, ...]`` transitions;
    ``apply(a, h)`` the transition applied to a state. Zero on rank 0 (and wherever a row's sequence starts
    at this shard's first token).
    """
    h = torch.zeros_like(F_all[0])
    for r in range(sp.rank):
        nxt = F_all[r] + apply(a_all[r], h)  # state after rank r's shard
        keep = sp.crosses[r + 1].to(nxt.device).view(-1, *([1] * (nxt.dim() - 1)))  # [B, 1, ...]
        h = torch.where(keep, nxt, 0.0)  # where, not a product: a NaN state stays in its own sequence
    return h


# ---------------------------------------------------------------------------------------------- conv halo


def sp_causal_conv1d(*args: Any, sp: SPContext, **kwargs: Any) -> Tensor:
    """:func:`safepad.ops.conv.causal_conv1d` on a shard (its arguments): ``x`` ``[B, T, D]``, ``weight`` ``[D, K]``
    -> ``[B, T, D]``.

    The previous rank's last ``K - 1`` inputs (of the sequence that crosses into this shard) feed the
    window of this shard's first tokens.
    """
    kw, c = _arguments(causal_conv1d, check_causal_conv1d_args, args, kwargs)
    x, weight, bias, activation, seq_idx, backend = (
        kw[n] for n in ("x", "weight", "bias", "activation", "seq_idx", "backend")
    )
    B, T, K = c.Bsz, c.T, c.K
    if K <= 1:
        return causal_conv1d(x, weight, bias, activation=activation, seq_idx=seq_idx, backend=backend)
    w = K - 1
    if T < w:
        raise ValueError(
            f"sequence parallelism: each rank's shard has {T} tokens but the conv (kernel {K}) needs a halo of {w} "
            f"tokens from one neighbour; use fewer ranks or longer rows (at least {w * sp.world} tokens)"
        )
    tails = all_gather_stack(x[:, T - w :], sp.group, sp.rank, sp.world)  # [W, B, K-1, D]
    halo = tails[sp.rank - 1] if sp.rank > 0 else torch.zeros_like(tails[0])  # [B, K-1, D]
    valid = sp.halo_valid(w).to(x.device)  # [B, K-1]
    halo = torch.where(valid[..., None], halo, 0.0)
    y = causal_conv1d(
        x, weight, bias, activation=activation, seq_idx=seq_idx,
        initial_state=halo.transpose(1, 2),  # [B, D, K-1] previous inputs, oldest first
        backend=backend,
    )
    return y if sp.rank > 0 else _Attach.apply(y, tails)


# ---------------------------------------------------------------------------------------------- Mamba2 / SSD


def sp_ssd_scan(*args: Any, sp: SPContext, **kwargs: Any) -> Tensor:
    """:func:`safepad.ops.ssd.ssd_scan` on a shard (its arguments): ``x`` ``[B, T, H, P]`` -> ``y`` ``[B, T, H, P]``."""
    kw, c = _arguments(ssd_scan, check_ssd_scan_args, args, kwargs)
    x, dt, A, B, C, D, dt_bias, dt_softplus, seq_idx = (
        kw[n] for n in ("x", "dt", "A", "B", "C", "D", "dt_bias", "dt_softplus", "seq_idx")
    )
    Bsz, T, H, P, G, N = c.Bsz, c.T, c.H, c.P, c.G, c.N
    y0, F_loc = ssd_scan(**{**kw, "return_final_state": True})  # [B, T, H, P], [B, H, P, N] (compute dtype)
    ct = F_loc.dtype
    dtp = process_dt(dt, dt_bias, c.dt_limit, dt_softplus).to(ct)  # [B, T, H]
    first, passes = _first_sequence(seq_idx, (Bsz, T), x.device)
    la = dtp * A.to(ct)  # [B, T, H] log-decay per token
    if first is not None:
        la = torch.where(first[..., None], la, 0.0)
    acs = torch.cumsum(la, dim=1)  # [B, T, H] log-decay from the shard start (first sequence)
    a = torch.where(passes[:, None], torch.exp(acs[:, -1]), 0.0)  # [B, H] transition of the crossing sequence
    F_all, a_all = _gather_summaries(sp, F_loc, a)  # [W, B, H, P, N], [W, B, H]
    if sp.rank == 0:
        return _Attach.apply(y0, F_all, a_all)
    h_in = _incoming(sp, F_all, a_all, lambda ar, h: ar[..., None, None] * h)  # [B, H, P, N]
    k = H // G
    corr = torch.einsum("btgn,bgkpn->btgkp", C.to(ct), h_in.view(Bsz, G, k, P, N)).reshape(Bsz, T, H, P)
    corr = corr * torch.exp(acs)[..., None]  # [B, T, H, P] decayed from the shard start to t
    if first is not None:
        corr = torch.where(first[:, :, None, None], corr, 0.0)  # only the first sequence receives h_in
    return (y0.to(ct) + corr).to(x.dtype)


# ---------------------------------------------------------------------------------------------- gated delta rule


def sp_chunk_gated_delta_rule(*args: Any, sp: SPContext, **kwargs: Any) -> Tensor:
    """:func:`safepad.ops.delta_rule.chunk_gated_delta_rule` on a shard (its arguments): ``v`` ``[B, T, H, Dv]``
    -> ``o`` same.

    The value columns are extended by ``Dk`` zero columns and the initial state by the identity, so the
    one scan also yields the shard's state map ``M`` ``[B, H, Dk, Dk]`` and ``M_tᵀ q_t`` per token.
    """
    kw, c = _arguments(chunk_gated_delta_rule, check_delta_rule_args, args, kwargs)
    q, k, v, seq_idx = kw["q"], kw["k"], kw["v"], kw["seq_idx"]
    Bsz, T, H, Dv, Dk = c.b, c.t, c.h, c.dv, c.dk
    ct = torch.float64 if torch.float64 in (q.dtype, k.dtype, v.dtype) else torch.float32
    v_ext = torch.cat([v, v.new_zeros(Bsz, T, H, Dk)], dim=-1)  # [B, T, H, Dv + Dk]
    init = torch.zeros(Bsz, H, Dk, Dv + Dk, dtype=ct, device=v.device)
    init[..., Dv:] = torch.eye(Dk, dtype=ct, device=v.device)  # [B, H, Dk, Dv + Dk] = [0 | I]
    o_ext, fin = chunk_gated_delta_rule(
        **{**kw, "v": v_ext, "initial_state": init, "return_final_state": True}
    )  # [B, T, H, Dv + Dk], [B, H, Dk, Dv + Dk]
    o0, qM = o_ext[..., :Dv], o_ext[..., Dv:]  # [B, T, H, Dv], [B, T, H, Dk] = M_tᵀ (scale q_t)
    F_loc, M = fin[..., :Dv], fin[..., Dv:]  # [B, H, Dk, Dv], [B, H, Dk, Dk] (0 unless one sequence spans the shard)
    F_all, M_all = _gather_summaries(sp, F_loc, M)  # [W, B, H, Dk, Dv], [W, B, H, Dk, Dk]
    if sp.rank == 0:
        return _Attach.apply(o0.contiguous(), F_all, M_all)
    h_in = _incoming(sp, F_all, M_all, torch.matmul)  # [B, H, Dk, Dv]
    corr = torch.einsum("bthk,bhkv->bthv", qM.to(ct), h_in)  # [B, T, H, Dv]
    first, _ = _first_sequence(seq_idx, (Bsz, T), v.device)
    if first is not None:
        corr = torch.where(first[:, :, None, None], corr, 0.0)  # qM is 0 there; where keeps a NaN h_in out
    return (o0.to(ct) + corr).to(v.dtype)


# ---------------------------------------------------------------------------------------------- Mamba1


def sp_selective_scan(*args: Any, sp: SPContext, **kwargs: Any) -> Tensor:
    """:func:`safepad.ops.selective_scan.selective_scan` on a shard (its arguments): ``u`` ``[B, T, Dm]`` -> ``y``
    same."""
    kw, c = _arguments(selective_scan, check_selective_scan_args, args, kwargs)
    u, delta, A, D, z, delta_bias, delta_softplus, seq_idx = (
        kw[n] for n in ("u", "delta", "A", "D", "z", "delta_bias", "delta_softplus", "seq_idx")
    )
    Bsz, T = c.Bsz, c.T
    y0, F_loc = selective_scan(
        **{**kw, "u": u.to(_compute_dtype(u)), "D": None, "z": None, "return_final_state": True}
    )  # [B, T, Dm] before D and the gate, in the compute dtype (rounded to u.dtype once, at the end), [B, Dm, N]
    ct = F_loc.dtype
    dtp = process_dt(delta, delta_bias, (float("-inf"), float("inf")), delta_softplus).to(ct)  # [B, T, Dm]
    first, passes = _first_sequence(seq_idx, (Bsz, T), u.device)
    if first is not None:
        dtp = torch.where(first[..., None], dtp, 0.0)
    a = torch.where(passes[:, None, None], torch.exp(dtp.sum(1)[..., None] * A.to(ct)), 0.0)  # [B, Dm, N]
    F_all, a_all = _gather_summaries(sp, F_loc, a)  # [W, B, Dm, N] each
    y = y0.to(ct)
    if sp.rank == 0:
        y = _Attach.apply(y, F_all, a_all)
    else:
        h_in = _incoming(sp, F_all, a_all, torch.mul)  # [B, Dm, N]
        corr = selective_scan(
            **{**kw, "u": torch.zeros_like(u, dtype=ct), "D": None, "z": None, "initial_state": h_in}
        )  # [B, T, Dm]: C_t · (decay ∘ h_in) on the first sequence, 0 elsewhere
        corr = corr.to(ct)
        if first is not None:
            corr = torch.where(first[..., None], corr, 0.0)
        y = y + corr
    return _gate(y, u.to(ct), D, z).to(u.dtype)


_SP_OPS: dict = {
    causal_conv1d: sp_causal_conv1d,
    ssd_scan: sp_ssd_scan,
    chunk_gated_delta_rule: sp_chunk_gated_delta_rule,
    selective_scan: sp_selective_scan,
}


def sp_op(fn: Callable, sp: SPContext) -> Callable:
    """The sequence-parallel version of the torch-core op ``fn``, bound to ``sp``; raises for any other op."""
    impl = _SP_OPS.get(fn)
    if impl is None:
        raise ValueError(
            f"sequence parallelism has no rank exchange for {getattr(fn, '__name__', fn)!r}; this layer would restart "
            "its state on every rank. Supported ops: " + ", ".join(f.__name__ for f in _SP_OPS)
        )
    return functools.partial(impl, sp=sp)
