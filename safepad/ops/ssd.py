"""Mamba2 SSD: a varlen, padding-aware chunked scan and the matching single-token step.

Recurrence, per head ``h`` (group ``g = h // (H / G)``), with ``dt`` after the shared pipeline
(:func:`safepad.ops.dt.process_dt`)::

    state_t = exp(dt_t * A) * state_{t-1} + dt_t * x_t B_t^T      state [P, N]
    y_t     = state_t C_t + D * x_t

The torch core is the chunked (SSD) form: inside a chunk of ``Q`` tokens everything is matmuls
(``C·Bᵀ`` once per GROUP, never repeated to heads) weighted by ``exp`` of masked segment sums of
``dt * A``; across chunks a short Python loop carries the ``[B, H, P, N]`` state (a loop over chunks,
never over tokens). ``seq_idx`` resets the state at every boundary — inside a chunk through the
same-sequence mask, across chunks by zeroing the carried state where the sequence changes.
``token_mask`` makes masked tokens the identity (``dt := 0`` after the pipeline, ``x, B := 0``).

On CUDA with mamba-ssm installed, ``ssd_scan`` calls ``mamba_chunk_scan_combined`` and ``ssd_step``
calls ``selective_state_update`` with dt already processed, so both paths share one dt pipeline.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from safepad.layout.boundaries import cu_seqlens_from_seq_idx, validate_seq_idx

from . import kernels
from .amp import fp32_core
from .conv import check_backend
from .dt import process_dt, validate_dt_limit

logger = logging.getLogger(__name__)

__all__ = ["ssd_scan", "ssd_step"]


def _shape(t: object) -> object:
    return tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__


def _check(name: str, t: object, shape: tuple[int, ...], what: str) -> None:
    if not isinstance(t, Tensor) or tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {what} = {list(shape)}, got {_shape(t)}")


def _check_D(D: Tensor | None, H: int, P: int) -> None:
    if D is not None and (not isinstance(D, Tensor) or tuple(D.shape) not in ((H,), (H, P))):
        raise ValueError(f"D must have shape [H] = [{H}] or [H, P] = [{H}, {P}], got {_shape(D)}")


# exp(-60) ~ 1e-26: in float32, decay weights below it are far under rounding (eps ~ 6e-8) next to the
# weight-1 diagonal terms, but they are subnormal or close to it, and subnormal arithmetic is ~100x slower
# on CPUs. Float32 flushes them to exact zeros; float64 keeps everything.
_FLUSH_BELOW = -60.0


def _exp(t: Tensor) -> Tensor:
    """``exp(t)`` for log-decays ``t <= 0`` (``-inf`` allowed), flushing float32 weights below ``exp(-60)``."""
    if t.dtype == torch.float32:
        t = t.masked_fill(t < _FLUSH_BELOW, float("-inf"))
    return torch.exp(t)


# Elements of one block of [H, Q, Q] work buffers (4 MiB in float32). The intra-chunk part runs over blocks of
# chunks that fit this budget: its [n, H, Q, Q] temporaries are the largest tensors of the scan, and building
# them whole costs more in page faults (fresh multi-MiB allocations) and cache misses than in arithmetic. On
# a 2-core CPU at T=4096, H=16, Q=128 the blocked form runs the intra-chunk forward+backward ~2x faster.
_BLOCK_ELEMS = 1 << 20


# Floor of the intra-chunk log-decays before exp: float32 keeps exp() out of the subnormal range (see _exp);
# float64 has none there. Weights below the floor are far under rounding next to the weight-1 diagonal.
_DECAY_FLOOR = {torch.float32: _FLUSH_BELOW, torch.float64: -700.0}


def _decay_into(out: Tensor, acs: Tensor, keep: Tensor) -> Tensor:
    """``out = exp(acs_l - acs_s)`` where kept, else 0: ``[m, H, Q, Q]`` written into ``out``.

    ``acs`` ``[m, H, Q]``; ``keep`` ``[Q, Q]`` or ``[m, 1, Q, Q]`` in ``out``'s dtype (1: causal and same
    sequence). The log-decays are clamped to ``[floor, 0]`` before ``exp`` (kept entries are ``<= 0``; the
    dropped ones are zeroed by the multiply), so ``exp`` never sees ``-inf``, overflow or subnormals — its
    slow paths on CPU.
    """
    torch.sub(acs.unsqueeze(-1), acs.unsqueeze(-2), out=out)  # [m, H, Q, Q] (l, s)
    return out.clamp_(_DECAY_FLOOR[out.dtype], 0.0).exp_().mul_(keep)


class _IntraChunk(torch.autograd.Function):
    """``y = (decay ⊙ C·Bᵀ) @ (dt x)`` inside each chunk, saving only the small inputs.

    The ``[n, H, Q, Q]`` decay and score matrices are the largest tensors of the scan. They never exist
    whole: forward and backward run over blocks of chunks (``_BLOCK_ELEMS``) in reused work buffers, and
    backward rebuilds them instead of keeping them alive between forward and backward.
    acs ``[b, c, H, Q]``; CB ``[b, c, G, Q, Q]``; xdt ``[b, c, H, Q, P]``; keep ``[Q, Q]`` or
    ``[b, c, 1, Q, Q]`` bool. Returns ``[b, c, H, Q, P]``.
    """

    @staticmethod
    def _flat(acs: Tensor, CB: Tensor, xdt: Tensor, keep: Tensor):
        b, c, H, Q, P = xdt.shape
        n = b * c
        keep_f = (keep if keep.dim() == 2 else keep.reshape(n, 1, Q, Q)).to(xdt.dtype)  # [Q, Q] | [n, 1, Q, Q]
        step = max(1, _BLOCK_ELEMS // (H * Q * Q))  # chunks per block
        return (
            acs.reshape(n, H, Q),  # [n, H, Q]
            CB.reshape(n, CB.shape[2], Q, Q),  # [n, G, Q, Q]
            xdt.flatten(0, 1),  # [n, H, Q, P] (a view: b and c merge)
            keep_f,
            step,
        )

    @staticmethod
    def forward(ctx, acs: Tensor, CB: Tensor, xdt: Tensor, keep: Tensor) -> Tensor:
        b, c, H, Q, P = xdt.shape
        G = CB.shape[2]
        acs_f, CB_f, xdt_f, keep_f, step = _IntraChunk._flat(acs, CB, xdt, keep)
        n = b * c
        y = xdt.new_empty(n, H, Q, P)  # [n, H, Q, P]
        scores_ws = xdt.new_empty(min(step, n), H, Q, Q)  # [m, H, Q, Q] reused by every block
        for i0 in range(0, n, step):
            i1 = min(i0 + step, n)
            m = i1 - i0
            kp = keep_f if keep_f.dim() == 2 else keep_f[i0:i1]
            scores = _decay_into(scores_ws[:m], acs_f[i0:i1], kp)  # [m, H, Q, Q]
            scores.view(m, G, H // G, Q, Q).mul_(CB_f[i0:i1].unsqueeze(2))  # ⊙ C·Bᵀ of the head's group
            torch.matmul(scores, xdt_f[i0:i1], out=y[i0:i1])  # [m, H, Q, P]
        ctx.save_for_backward(acs, CB, xdt, keep)
        return y.view(b, c, H, Q, P)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy: Tensor):
        acs, CB, xdt, keep = ctx.saved_tensors
        b, c, H, Q, P = xdt.shape
        G = CB.shape[2]
        k = H // G
        acs_f, CB_f, xdt_f, keep_f, step = _IntraChunk._flat(acs, CB, xdt, keep)
        n = b * c
        gy_f = gy.reshape(n, H, Q, P)  # [n, H, Q, P]
        g_xdt = xdt.new_empty(n, H, Q, P)
        g_acs = acs.new_empty(n, H, Q)
        g_CB = CB.new_empty(n, G, Q, Q)
        m0 = min(step, n)
        decay_ws, scores_ws, gs_ws = (xdt.new_empty(m0, H, Q, Q) for _ in range(3))  # [m, H, Q, Q] each
        for i0 in range(0, n, step):
            i1 = min(i0 + step, n)
            m = i1 - i0
            kp = keep_f if keep_f.dim() == 2 else keep_f[i0:i1]
            decay = _decay_into(decay_ws[:m], acs_f[i0:i1], kp)  # [m, H, Q, Q]
            scores = scores_ws[:m]
            torch.mul(decay.view(m, G, k, Q, Q), CB_f[i0:i1].unsqueeze(2), out=scores.view(m, G, k, Q, Q))
            g = gy_f[i0:i1]  # [m, H, Q, P]
            torch.matmul(scores.transpose(-1, -2), g, out=g_xdt[i0:i1])  # [m, H, Q, P]
            g_scores = torch.matmul(g, xdt_f[i0:i1].transpose(-1, -2), out=gs_ws[:m])  # [m, H, Q, Q]
            g_seg = scores.mul_(g_scores)  # [m, H, Q, Q] d/d(acs_l - acs_s); zero where masked
            torch.sub(g_seg.sum(-1), g_seg.sum(-2), out=g_acs[i0:i1])  # [m, H, Q]
            torch.sum(g_scores.mul_(decay).view(m, G, k, Q, Q), 2, out=g_CB[i0:i1])  # [m, G, Q, Q]
        return g_acs.view(b, c, H, Q), g_CB.view(b, c, G, Q, Q), g_xdt.view(b, c, H, Q, P), None


def _d_term(D: Tensor, x: Tensor) -> Tensor:
    """``D [H] | [H, P]`` times ``x [..., H, P]``."""
    Dd = D.to(x.dtype)
    return x * (Dd[:, None] if Dd.dim() == 1 else Dd)


def _ssd_chunked(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    seq_idx: Tensor | None,
    initial_state: Tensor | None,
    chunk_size: int,
    want_varlen: bool,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The torch core. All inputs already in the compute dtype; ``dt`` processed and masked.

    x ``[b, T, H, P]``; dt ``[b, T, H]``; A ``[H]``; B, C ``[b, T, G, N]``; seq_idx ``[b, T]`` | None;
    initial_state ``[b, H, P, N]`` | None. Returns ``(y [b, T, H, P] without the D term,
    final_state [b, H, P, N], varlen_states [S, H, P, N] | None)``.
    """
    b, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    k = H // G
    Q = chunk_size
    pad = (-T) % Q
    seq_full = seq_idx
    if pad:
        x = F.pad(x, (0, 0, 0, 0, 0, pad))  # [b, Tp, H, P]; padded tokens: dt = 0, x = B = 0 (identity)
        dt = F.pad(dt, (0, 0, 0, pad))  # [b, Tp, H]
        B = F.pad(B, (0, 0, 0, 0, 0, pad))  # [b, Tp, G, N]
        C = F.pad(C, (0, 0, 0, 0, 0, pad))  # [b, Tp, G, N]
        if seq_idx is not None:
            seq_idx = torch.cat([seq_idx, seq_idx[:, -1:].expand(b, pad)], dim=1)  # [b, Tp]
    c = (T + pad) // Q

    xdt = x * dt.unsqueeze(-1)  # [b, Tp, H, P]
    xdt_c = xdt.view(b, c, Q, H, P).transpose(2, 3)  # [b, c, H, Q, P]
    acs = torch.cumsum((dt * A).view(b, c, Q, H).transpose(2, 3), dim=-1)  # [b, c, H, Q] cumulative log-decay
    Bg = B.view(b, c, Q, G, N).transpose(2, 3)  # [b, c, G, Q, N]
    Cg = C.view(b, c, Q, G, N).transpose(2, 3)  # [b, c, G, Q, N]

    causal = torch.ones(Q, Q, dtype=torch.bool, device=x.device).tril()  # [Q, Q] (l, s): s <= l
    if seq_idx is not None:
        sq = seq_idx.view(b, c, Q)  # [b, c, Q]
        keep = causal & (sq.unsqueeze(-1) == sq.unsqueeze(-2))  # [b, c, Q, Q]
        keep = keep.unsqueeze(2)  # [b, c, 1, Q, Q]
    else:
        keep = causal

    # 1. intra-chunk (diagonal blocks): y_l = sum_{s<=l, same seq} (C_l·B_s) exp(acs_l - acs_s) dt_s x_s
    CB = torch.matmul(Cg, Bg.transpose(-1, -2))  # [b, c, G, Q, Q] per group
    y = _IntraChunk.apply(acs, CB, xdt_c, keep)  # [b, c, H, Q, P]

    # 2. chunk states: contribution of each chunk's tokens (of the chunk's last sequence) to its end state
    last = acs[..., -1:]  # [b, c, H, 1]
    w_end = _exp(last - acs)  # [b, c, H, Q], <= 1
    if seq_idx is not None:
        w_end = w_end * (sq == sq[..., -1:]).unsqueeze(2).to(w_end.dtype)  # [b, c, H, Q]
    xw = (xdt_c * w_end.unsqueeze(-1)).view(b, c, G, k, Q, P)  # [b, c, G, k, Q, P]
    xw = xw.transpose(-1, -2).reshape(b, c, G, k * P, Q)  # [b, c, G, kP, Q]
    states = torch.matmul(xw, Bg).view(b, c, H, P, N)  # [b, c, H, P, N]

    # 3. across chunks: the state entering chunk z (z = c: the final state) is a decayed sum over the
    #    states left by earlier chunks of the same sequence (e = 0 is the initial state, e = c' + 1 is
    #    chunk c'): W[z, e] = exp(sum of the log-decays of chunks e..z-1) for e <= z and the same
    #    sequence. The sums are taken directly (masked cumsum), not as differences of one long cumsum,
    #    so they stay exact for long rows. One small matmul instead of a Python loop over chunks.
    init = x.new_zeros(b, 1, H, P, N) if initial_state is None else initial_state.unsqueeze(1)
    states_ext = torch.cat([init, states], dim=1)  # [b, c+1, H, P, N]
    v = F.pad(last.squeeze(-1).transpose(1, 2), (1, 0))  # [b, H, c+1]; v[i] = log-decay of chunk i-1
    strict = torch.ones(c + 1, c + 1, dtype=torch.bool, device=x.device).tril(-1)  # i > e
    seg_c = v.unsqueeze(-1).expand(b, H, c + 1, c + 1).masked_fill(~strict, 0.0)  # [b, H, c+1 (i), c+1 (e)]
    seg_c = torch.cumsum(seg_c, dim=-2)  # [b, H, c+1 (z), c+1 (e)] = sum_{e < i <= z} v[i]
    keep_c = torch.ones(c + 1, c + 1, dtype=torch.bool, device=x.device).tril()  # e <= z
    if seq_idx is not None:
        seq_ext = torch.cat([sq[:, :1, 0], sq[:, :, -1]], dim=1)  # [b, c+1] sequence of each state
        keep_c = keep_c & (seq_ext.unsqueeze(-1) == seq_ext.unsqueeze(-2)).unsqueeze(1)  # [b, 1, c+1, c+1]
        prev_seq = seq_ext[:, :-1]  # [b, c] sequence of the state entering each chunk
    W = _exp(seg_c.masked_fill(~keep_c, float("-inf")))  # [b, H, c+1, c+1]
    flat = states_ext.permute(0, 2, 1, 3, 4).reshape(b, H, c + 1, P * N)  # [b, H, c+1, PN]
    entering = torch.matmul(W, flat).view(b, H, c + 1, P, N)  # [b, H, c+1, P, N]
    final_state = entering[:, :, c]  # [b, H, P, N]
    prev = entering[:, :, :c].transpose(1, 2)  # [b, c, H, P, N] state entering each chunk

    # 4. inter-chunk output: y_l += exp(acs_l) C_l · prev (only for tokens of the entering sequence)
    prev_g = prev.view(b, c, G, k, P, N).permute(0, 1, 2, 5, 3, 4).reshape(b, c, G, N, k * P)  # [b, c, G, N, kP]
    y_off = torch.matmul(Cg, prev_g)  # [b, c, G, Q, kP]
    y_off = y_off.view(b, c, G, Q, k, P).transpose(3, 4).reshape(b, c, H, Q, P)  # [b, c, H, Q, P]
    w_out = _exp(acs)  # [b, c, H, Q]
    if seq_idx is not None:
        w_out = w_out * (sq == prev_seq.unsqueeze(-1)).unsqueeze(2).to(w_out.dtype)  # [b, c, H, Q]
    y = y + y_off * w_out.unsqueeze(-1)  # [b, c, H, Q, P]
    y = y.transpose(2, 3).reshape(b, c * Q, H, P)[:, :T]  # [b, T, H, P]

    varlen = None
    if want_varlen:
        varlen = _varlen_states(xdt_c, acs, Bg, prev, seq_full, seq_idx, T, Q)
    return y, final_state, varlen


def _varlen_states(
    xdt_c: Tensor, acs: Tensor, Bg: Tensor, prev: Tensor, seq_full: Tensor | None, seq_pad: Tensor | None, T: int, Q: int
) -> Tensor:
    """State at the last token of every sequence: ``[S, H, P, N]``, row-major order of appearance.

    xdt_c ``[b, c, H, Q, P]``; acs ``[b, c, H, Q]``; Bg ``[b, c, G, Q, N]``; prev ``[b, c, H, P, N]``.
    """
    b, c, H, _, P = xdt_c.shape
    G, N = Bg.shape[2], Bg.shape[4]
    k = H // G
    dev = xdt_c.device
    if seq_full is None:
        seq_full = torch.zeros(b, T, dtype=torch.int32, device=dev)
        seq_pad = torch.zeros(b, c * Q, dtype=torch.int32, device=dev)
    cu = cu_seqlens_from_seq_idx(seq_full).long()  # [S + 1] over the flattened [b * T] tokens
    end = cu[1:] - 1  # [S] flat index of each sequence's last token
    row, t = end // T, end % T  # [S], [S]
    ci, li = t // Q, t % Q  # [S], [S]
    S = end.numel()
    sq = seq_pad.view(b, c, Q)[row, ci]  # [S, Q]
    j = torch.arange(Q, device=dev)  # [Q]
    own = (j[None, :] <= li[:, None]) & (sq == sq.gather(1, li[:, None]))  # [S, Q] tokens of this sequence
    a = acs[row, ci]  # [S, H, Q]
    a_end = a.gather(2, li.view(S, 1, 1).expand(S, H, 1))  # [S, H, 1]
    w = _exp((a_end - a).masked_fill(~own.unsqueeze(1), float("-inf")))  # [S, H, Q]
    xw = (xdt_c[row, ci] * w.unsqueeze(-1)).view(S, G, k, Q, P)  # [S, G, k, Q, P]
    xw = xw.transpose(-1, -2).reshape(S, G, k * P, Q)  # [S, G, kP, Q]
    st = torch.matmul(xw, Bg[row, ci]).view(S, H, P, N)  # [S, H, P, N]
    prev_seq = torch.where(ci > 0, seq_pad.view(b, c * Q)[row, (ci * Q - 1).clamp(min=0)], seq_pad[row, 0])  # [S]
    enters = (prev_seq == sq.gather(1, li[:, None]).squeeze(1)).to(st.dtype)  # [S]
    w_prev = _exp(a_end.squeeze(-1)) * enters[:, None]  # [S, H]
    return st + w_prev[:, :, None, None] * prev[row, ci]  # [S, H, P, N]


@fp32_core
def ssd_scan(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    *,
    chunk_size: int = 256,
    D: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    dt_softplus: bool = True,
    seq_idx: Tensor | None = None,
    initial_state: Tensor | None = None,
    token_mask: Tensor | None = None,
    return_final_state: bool = False,
    return_varlen_states: bool = False,
    backend: str = "auto",
):
    """Mamba2 SSD chunked scan over packed / padded rows.

    Args:
        x: ``[B, T, H, P]``.
        dt: ``[B, T, H]`` raw; the pipeline (bias -> softplus -> clamp) is applied inside.
        A: ``[H]`` (negative).
        B, C: ``[B, T, G, N]`` with ``H % G == 0``.
        chunk_size: tokens per chunk (> 0). Results do not depend on it beyond rounding.
        D: ``[H]`` or ``[H, P]`` skip connection, or ``None``.
        dt_bias: ``[H]`` | None; dt_limit: ``(lo, hi)``; dt_softplus: see ``process_dt``.
        seq_idx: ``[B, T]`` int32, non-decreasing per row; the state resets at every boundary.
        initial_state: ``[B, H, P, N]``; reaches only each row's FIRST sequence.
        token_mask: ``[B, T]`` bool/int, True = real token. Masked tokens leave the state unchanged
            (``dt := 0`` after the pipeline, ``x, B := 0``); their outputs are unspecified.
        return_final_state: also return the state after each row's last token ``[B, H, P, N]``.
        return_varlen_states: also return the state at the end of every sequence ``[S_total, H, P, N]``
            (row-major order of appearance, as ``safepad.layout.cu_seqlens_from_seq_idx``).
        backend: ``"auto"`` | ``"torch"`` | ``"kernels"``.

    Returns:
        ``y [B, T, H, P]`` (dtype of ``x``), then the requested states, float32 (float64 when ``x`` is
        float64).
    """
    if not isinstance(x, Tensor) or x.dim() != 4:
        raise ValueError(f"x must have shape [batch, seqlen, H, P], got {_shape(x)}")
    Bsz, T, H, P = x.shape
    if T == 0:
        raise ValueError("x must have at least one token (seqlen >= 1)")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    _check("dt", dt, (Bsz, T, H), "[batch, seqlen, H]")
    _check("A", A, (H,), "[H]")
    if not isinstance(B, Tensor) or B.dim() != 4 or B.shape[:2] != (Bsz, T):
        raise ValueError(f"B must have shape [batch, seqlen, G, N] = [{Bsz}, {T}, G, N], got {_shape(B)}")
    G, N = B.shape[2], B.shape[3]
    if G == 0 or H % G != 0:
        raise ValueError(f"B has {G} groups but the number of heads H={H} must be a multiple of it")
    _check("C", C, (Bsz, T, G, N), "[batch, seqlen, G, N]")
    _check_D(D, H, P)
    if dt_bias is not None:
        _check("dt_bias", dt_bias, (H,), "[H]")
    dt_limit = validate_dt_limit(dt_limit)
    check_backend(backend)
    if seq_idx is not None:
        seq_idx = validate_seq_idx(seq_idx, (Bsz, T))
    if initial_state is not None:
        _check("initial_state", initial_state, (Bsz, H, P, N), "[batch, H, P, N]")
    mask = None
    if token_mask is not None:
        if not isinstance(token_mask, Tensor) or tuple(token_mask.shape) != (Bsz, T):
            raise ValueError(
                f"token_mask must have shape [batch, seqlen] = {[Bsz, T]} (True/1 = real token), got {_shape(token_mask)}"
            )
        if token_mask.dtype.is_floating_point or token_mask.dtype.is_complex:
            raise ValueError(f"token_mask must be bool or integer (True/1 = real token), got {token_mask.dtype}")
        mask = token_mask.bool()

    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    dtp = process_dt(dt, dt_bias, dt_limit, dt_softplus).to(ct)  # [B, T, H]
    xk, Bk = x, B
    if mask is not None:
        m = mask.to(ct)
        dtp = dtp * m.unsqueeze(-1)  # [B, T, H]: masked tokens are the identity
        xk = x * m[:, :, None, None].to(x.dtype)  # [B, T, H, P]
        Bk = B * m[:, :, None, None].to(B.dtype)  # [B, T, G, N]

    need_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, dt, A, B, C, D, dt_bias, initial_state)
    )
    varlen_ok = not return_varlen_states or (Bsz == 1 and not need_grad)
    if backend == "kernels" and not (varlen_ok and ct == torch.float32):
        raise ValueError(
            "backend='kernels': mamba_chunk_scan_combined returns varlen states only for batch 1 without "
            "gradients, and has no float64 path; use backend='auto' to run this call on the torch core"
        )
    if (
        varlen_ok
        and ct == torch.float32
        and kernels.use_kernels(x, dt, A, B, C, need=("mamba_chunk_scan_combined",), backend=backend)
    ):
        return _ssd_kernel(xk, dtp, A, Bk, C, chunk_size, D, seq_idx, initial_state, return_final_state, return_varlen_states)
    if return_varlen_states and x.is_cuda and backend == "auto" and kernels.mamba_chunk_scan_combined is not None:
        logger.debug("ssd_scan: varlen states need batch 1 and no grad on the kernel; using the torch core")

    y, final, varlen = _ssd_chunked(
        xk.to(ct),
        dtp,
        A.to(ct),
        Bk.to(ct),
        C.to(ct),
        seq_idx,
        None if initial_state is None else initial_state.to(ct),
        chunk_size,
        return_varlen_states,
    )
    if D is not None:
        y = y + _d_term(D.to(ct), x.to(ct))
    out: list[Tensor] = [y.to(x.dtype)]
    if return_final_state:
        out.append(final)
    if return_varlen_states:
        out.append(varlen)
    return out[0] if len(out) == 1 else tuple(out)


def _ssd_kernel(
    x: Tensor,
    dtp: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    D: Tensor | None,
    seq_idx: Tensor | None,
    initial_state: Tensor | None,
    return_final_state: bool,
    return_varlen_states: bool,
):
    """mamba_chunk_scan_combined with dt ALREADY processed (and masked): no bias, no softplus, no limit."""
    cu = None
    if return_varlen_states:
        sq = seq_idx if seq_idx is not None else torch.zeros(x.shape[:2], dtype=torch.int32, device=x.device)
        cu = cu_seqlens_from_seq_idx(sq)  # [S + 1]
    res = kernels.mamba_chunk_scan_combined(
        x,
        dtp,
        A.float(),
        B,
        C,
        chunk_size,
        D=D,
        initial_states=None if initial_state is None else initial_state.float(),
        seq_idx=None if seq_idx is None else seq_idx.contiguous(),
        cu_seqlens=cu,
        dt_softplus=False,
        return_final_states=return_final_state,
        return_varlen_states=return_varlen_states,
    )
    if not (return_final_state or return_varlen_states):
        return res
    out = list(res)
    out[1:] = [s.float() for s in out[1:]]
    return tuple(out)


@fp32_core
def ssd_step(
    state: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    *,
    D: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    dt_softplus: bool = True,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """One decode token, with exactly the dt pipeline of :func:`ssd_scan`.

    Args:
        state: ``[B, H, P, N]``; x: ``[B, H, P]``; dt: ``[B, H]`` raw; A: ``[H]``; B, C: ``[B, G, N]``.

    Returns:
        ``(y [B, H, P] (dtype of x), new_state [B, H, P, N] float32)`` (float64 when ``x`` is float64);
        ``state`` is not modified.
    """
    if not isinstance(x, Tensor) or x.dim() != 3:
        raise ValueError(f"x must have shape [batch, H, P], got {_shape(x)}")
    Bsz, H, P = x.shape
    if not isinstance(B, Tensor) or B.dim() != 3 or B.shape[0] != Bsz:
        raise ValueError(f"B must have shape [batch, G, N] = [{Bsz}, G, N], got {_shape(B)}")
    G, N = B.shape[1], B.shape[2]
    if G == 0 or H % G != 0:
        raise ValueError(f"B has {G} groups but the number of heads H={H} must be a multiple of it")
    _check("state", state, (Bsz, H, P, N), "[batch, H, P, N]")
    _check("dt", dt, (Bsz, H), "[batch, H]")
    _check("A", A, (H,), "[H]")
    _check("C", C, (Bsz, G, N), "[batch, G, N]")
    _check_D(D, H, P)
    if dt_bias is not None:
        _check("dt_bias", dt_bias, (H,), "[H]")
    check_backend(backend)
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    dtp = process_dt(dt, dt_bias, dt_limit, dt_softplus).to(ct)  # [B, H]
    need_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (state, x, dt, A, B, C, D, dt_bias)
    )
    expressible = ct == torch.float32 and not need_grad
    if backend == "kernels" and not expressible:
        raise ValueError(
            "backend='kernels': selective_state_update is forward-only and has no float64 path; "
            "use backend='auto' for float64 inputs or when gradients are needed"
        )
    if expressible and kernels.use_kernels(state, x, need=("selective_state_update",), backend=backend):
        new_state = state.float().clone()  # the kernel updates in place
        A_k = A.float()[:, None, None].expand(H, P, N)  # [H, P, N] (tied over P, N)
        dt_k = dtp[:, :, None].expand(Bsz, H, P)  # [B, H, P]
        D_k = None
        if D is not None:
            D_k = D[:, None].expand(H, P) if D.dim() == 1 else D  # [H, P]
        y = kernels.selective_state_update(new_state, x, dt_k, A_k, B, C, D=D_k, dt_softplus=False)
        return y.to(x.dtype), new_state
    k = H // G
    s = state.to(ct).view(Bsz, G, k, P, N)  # [B, G, k, P, N]
    decay = torch.exp(dtp * A.to(ct)).view(Bsz, G, k, 1, 1)  # [B, G, k, 1, 1]
    xdt = (x.to(ct) * dtp.unsqueeze(-1)).view(Bsz, G, k, P, 1)  # [B, G, k, P, 1]
    new = decay * s + xdt * B.to(ct).view(Bsz, G, 1, 1, N)  # [B, G, k, P, N]
    y = (new * C.to(ct).view(Bsz, G, 1, 1, N)).sum(-1).reshape(Bsz, H, P)  # [B, H, P]
    if D is not None:
        y = y + _d_term(D.to(ct), x.to(ct))
    return y.to(x.dtype), new.reshape(Bsz, H, P, N)
