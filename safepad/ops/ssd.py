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
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from safepad._tracing import tracing
from safepad.layout.boundaries import cu_seqlens_from_seq_idx, validate_seq_idx

from . import kernels
from .amp import fp32_core
from .conv import check_backend
from .dt import process_dt, validate_dt_limit, widens_into
from .finite import isolate_nonfinite, poison, poison_rows

logger = logging.getLogger(__name__)

__all__ = ["SSDArgs", "check_ssd_scan_args", "ssd_scan", "ssd_step"]


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


def _log_decays(dt: Tensor, A: Tensor, b: int, c: int, Q: int, H: int) -> Tensor:
    """``acs`` ``[b, c, H, Q]``: the cumulative sum of ``dt * A`` inside each chunk, in float64.

    dt ``[b, c*Q, H]`` processed, A ``[H]``. Float64 whatever the compute dtype (float32 only on devices
    without float64, where the precision below is not reached). Within a chunk the sum reaches tens of
    thousands at flagship geometry (chunk 256, ``dt * A`` up to ~-100 per token), where one float32 ulp is
    ~2e-3; the decay between two tokens is a difference of two such sums. Stock's per-pair ``segment_sum``
    sums only the terms between them. Here every difference is taken from the float64 sums: directly where
    the result is per token (:func:`_chunk_weights`), and through :func:`_split_log_decays` in the
    ``[Q, Q]`` intra-chunk part.
    """
    acc = torch.float32 if dt.device.type == "mps" else torch.float64
    return torch.cumsum(dt.reshape(b, c, Q, H).to(acc) * A.to(acc), dim=2).transpose(2, 3).contiguous()


def _split_log_decays(acs: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``(hi, e, f)``: ``hi = acs`` rounded to ``dtype`` ``[..., H, Q]``, and the row / column factors
    ``e = exp(lo)``, ``f = exp(-lo)`` ``[..., H, Q, 1]`` of its rounding ``lo = acs - hi`` (None, None when
    ``acs`` is already in ``dtype``).

    ``exp(acs_l - acs_s) = e_l * exp(hi_l - hi_s) * f_s``, and ``hi_l - hi_s`` is exact in ``dtype``
    wherever the decay is not negligible (two values rounded from one monotone sum, within a factor 2 of
    each other: Sterbenz). So the ``[Q, Q]`` work stays one float32 subtraction per entry; ``f`` scales the
    input ``x·dt`` rows and ``e`` the output rows.
    """
    hi = acs.detach().to(dtype)
    if acs.dtype == dtype:
        return acs, None, None
    lo = (acs.detach() - hi.to(acs.dtype)).to(dtype)  # |lo| <= half an ulp of hi
    return hi, torch.exp(lo).unsqueeze(-1), torch.exp(-lo).unsqueeze(-1)


def _decay_into(out: Tensor, acs: Tensor, keep: Tensor) -> Tensor:
    """``out = exp(acs_l - acs_s)`` where kept, else 0: ``[m, H, Q, Q]`` written into ``out``.

    ``acs`` ``[m, H, Q]``; ``keep`` ``[Q, Q]`` or ``[m, 1, Q, Q]`` in ``out``'s dtype (1: causal and same
    sequence). The log-decays are clamped to ``[floor, 0]`` before ``exp`` (kept entries are ``<= 0``; the
    dropped ones are zeroed by the multiply), so ``exp`` never sees ``-inf``, overflow or subnormals — its
    slow paths on CPU.
    """
    torch.sub(acs.unsqueeze(-1), acs.unsqueeze(-2), out=out)  # [m, H, Q, Q] (l, s)
    return out.clamp_(_DECAY_FLOOR[out.dtype], 0.0).exp_().mul_(keep)


def _intra_flat(acs: Tensor, CB: Tensor, xdt: Tensor, keep: Tensor):
    """Flattened ``[n = b*c, ...]`` views of the intra-chunk inputs, the float keep mask and chunks per block."""
    b, c, H, Q, _ = xdt.shape
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


def _intra_fwd(acs: Tensor, CB: Tensor, xdt: Tensor, keep: Tensor) -> Tensor:
    """``y = (decay ⊙ C·Bᵀ) @ (dt x)`` inside each chunk, over blocks of chunks in one reused work buffer.

    acs ``[b, c, H, Q]`` (float64, see :func:`_log_decays`); CB ``[b, c, G, Q, Q]``; xdt ``[b, c, H, Q, P]``;
    keep ``[Q, Q]`` or ``[b, c, 1, Q, Q]`` bool. Returns ``[b, c, H, Q, P]`` (contiguous).
    """
    b, c, H, Q, P = xdt.shape
    G = CB.shape[2]
    hi, e, f = _split_log_decays(acs, xdt.dtype)
    acs_f, CB_f, xdt_f, keep_f, step = _intra_flat(hi, CB, xdt if f is None else xdt * f, keep)
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
    y = y.view(b, c, H, Q, P)
    return y if e is None else y.mul_(e)


def _intra_bwd(acs: Tensor, CB: Tensor, xdt: Tensor, keep: Tensor, gy: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`_intra_fwd` for ``gy`` ``[b, c, H, Q, P]`` (any strides): ``(g_acs, g_CB, g_xdt)``,
    ``g_acs`` in the dtype of ``acs``.

    The decay and score matrices are rebuilt block by block instead of being kept from the forward.

    The gradient reaching the log-decay increment ``dt_t * A`` is the sum over the pairs it lies between,
    ``g_a[t] = sum_{s < t <= l} g_seg[l, s]``; it is summed pair by pair (a prefix sum along ``s``, then the
    column sums below the diagonal), as stock's autograd through ``segment_sum`` does. Row sums minus column
    sums of ``g_seg`` per token, reverse-cumsummed by the caller, cancel to it only up to ~Q roundings of the
    larger partial sums (fp32 ``dA`` gradients ~1e-4 off at chunk 256). ``g_acs`` is returned as the exact
    differences ``g_a[q] - g_a[q+1]`` in the dtype of ``acs``, so the caller's reverse cumsum gives ``g_a``
    back.
    """
    b, c, H, Q, P = xdt.shape
    G = CB.shape[2]
    k = H // G
    hi, e, f = _split_log_decays(acs, xdt.dtype)
    if e is not None:
        xdt, gy = xdt * f, gy * e  # [b, c, H, Q, P] each: the column and row factors
    acs_f, CB_f, xdt_f, keep_f, step = _intra_flat(hi, CB, xdt, keep)
    n = b * c
    gy_f = gy.flatten(0, 1)  # [n, H, Q, P] (a view; may be strided, e.g. token-major underneath)
    g_xdt = xdt.new_empty(n, H, Q, P)
    g_cross = xdt.new_empty(n, H, Q)  # [n, H, Q]: at t, the pairs s <= t < l, i.e. g_a[t + 1]
    g_CB = CB.new_empty(n, G, Q, Q)
    below = torch.ones(Q, Q, dtype=xdt.dtype, device=xdt.device).tril(-1)  # [Q, Q] (l, t): l > t
    m0 = min(step, n)
    decay_ws, scores_ws, gs_ws = (xdt.new_empty(m0, H, Q, Q) for _ in range(3))  # [m, H, Q, Q] each
    gy_ws = None if gy_f.is_contiguous() else xdt.new_empty(m0, H, Q, P)  # block copy of a strided gy
    for i0 in range(0, n, step):
        i1 = min(i0 + step, n)
        m = i1 - i0
        kp = keep_f if keep_f.dim() == 2 else keep_f[i0:i1]
        decay = _decay_into(decay_ws[:m], acs_f[i0:i1], kp)  # [m, H, Q, Q]
        scores = scores_ws[:m]
        torch.mul(decay.view(m, G, k, Q, Q), CB_f[i0:i1].unsqueeze(2), out=scores.view(m, G, k, Q, Q))
        g = gy_f[i0:i1] if gy_ws is None else gy_ws[:m].copy_(gy_f[i0:i1])  # [m, H, Q, P]
        torch.matmul(scores.transpose(-1, -2), g, out=g_xdt[i0:i1])  # [m, H, Q, P]
        g_scores = torch.matmul(g, xdt_f[i0:i1].transpose(-1, -2), out=gs_ws[:m])  # [m, H, Q, Q]
        g_seg = scores.mul_(g_scores)  # [m, H, Q, Q] d/d(acs_l - acs_s); zero where masked
        torch.sum(g_scores.mul_(decay).view(m, G, k, Q, Q), 2, out=g_CB[i0:i1])  # [m, G, Q, Q]
        pre = torch.cumsum(g_seg, -1, out=decay)  # [m, H, Q, Q] (l, t): sum_{s <= t} g_seg[l, s]
        torch.sum(pre.mul_(below), -2, out=g_cross[i0:i1])  # [m, H, Q]
    g_xdt = g_xdt.view(b, c, H, Q, P)
    if f is not None:
        g_xdt.mul_(f)
    g_a = F.pad(g_cross.view(b, c, H, Q)[..., :-1], (1, 0)).to(acs.dtype)  # [b, c, H, Q]: g_a[0] = 0
    g_acs = g_a - F.pad(g_a[..., 1:], (0, 1))  # exact in float64: g_a[q] - g_a[q + 1]
    return g_acs, g_CB.view(b, c, G, Q, Q), g_xdt


# :func:`_intra_fwd` as a custom op (opaque to torch.compile: its in-place block loop and hand-written backward
# run as they are) saving only its small inputs; the autograd path of the scan (varlen states) uses it.
@torch.library.custom_op("safepad::ssd_intra_chunk", mutates_args=())
def _intra_chunk(acs: Tensor, CB: Tensor, xdt: Tensor, keep: Tensor) -> Tensor:
    return _intra_fwd(acs, CB, xdt, keep).contiguous()


@_intra_chunk.register_fake
def _(acs, CB, xdt, keep):
    return xdt.new_empty(xdt.shape)


@torch.library.custom_op("safepad::ssd_intra_chunk_bwd", mutates_args=())
def _intra_chunk_bwd(acs: Tensor, CB: Tensor, xdt: Tensor, keep: Tensor, gy: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return tuple(t.contiguous() for t in _intra_bwd(acs, CB, xdt, keep, gy))


@_intra_chunk_bwd.register_fake
def _(acs, CB, xdt, keep, gy):
    return acs.new_empty(acs.shape), CB.new_empty(CB.shape), xdt.new_empty(xdt.shape)


def _intra_chunk_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _intra_chunk_backward(ctx, gy):
    acs, CB, xdt, keep = ctx.saved_tensors
    return (*_intra_chunk_bwd(acs, CB, xdt, keep, gy), None)


_intra_chunk.register_autograd(_intra_chunk_backward, setup_context=_intra_chunk_setup)


def _widened(t: Tensor, ct: torch.dtype) -> Tensor:
    """``t`` for an op computing in ``ct`` (float32 or float64): as it is when it is a float type no wider than
    ``ct`` (type promotion then computes in ``ct``, widening it exactly as the op reads it: the same values as
    ``t.to(ct)`` without a copy), else ``t.to(ct)``."""
    return t if t.dtype in widens_into(ct) else t.to(ct)


def _d_scale(D: Tensor, x: Tensor) -> Tensor:
    """``D [H] | [H, P]`` broadcast against ``x [..., H, P]``."""
    Dd = D.to(x.dtype)
    return Dd[:, None] if Dd.dim() == 1 else Dd


def _chunk_masks(seq_idx: Tensor | None, b: int, c: int, Q: int, device: torch.device):
    """Sequence masks of a padded layout (``seq_idx`` ``[b, c*Q]`` or None).

    Returns ``(keep, seq_ext, same_last, same_prev)``: ``keep`` ``[Q, Q]`` or ``[b, c, 1, Q, Q]`` bool (causal
    and same sequence); ``seq_ext`` ``[b, c+1]`` the sequence of the initial state and of each chunk's end;
    ``same_last`` / ``same_prev`` ``[b, c, 1, Q]`` bool: the token belongs to the chunk's last sequence / to
    the sequence entering the chunk. All but ``keep`` are None without ``seq_idx``.
    """
    causal = torch.ones(Q, Q, dtype=torch.bool, device=device).tril()  # [Q, Q] (l, s): s <= l
    if seq_idx is None:
        return causal, None, None, None
    sq = seq_idx.reshape(b, c, Q)  # [b, c, Q]
    keep = (causal & (sq.unsqueeze(-1) == sq.unsqueeze(-2))).unsqueeze(2)  # [b, c, 1, Q, Q]
    seq_ext = torch.cat([sq[:, :1, 0], sq[:, :, -1]], dim=1)  # [b, c+1]
    same_last = (sq == sq[..., -1:]).unsqueeze(2)  # [b, c, 1, Q]
    same_prev = (sq == seq_ext[:, :-1, None]).unsqueeze(2)  # [b, c, 1, Q]
    return keep, seq_ext, same_last, same_prev


def _chunk_weights(
    acs: Tensor, same_last: Tensor | None, same_prev: Tensor | None, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """``(w_end, w_out)`` ``[b, c, H, Q]`` in ``dtype``: each token's decay to its chunk's end (tokens of the
    chunk's last sequence) and from the chunk's start (tokens of the entering sequence). Both ``<= 1``.
    ``acs`` float64 (:func:`_log_decays`): the differences are taken there."""
    w_end = _exp((acs[..., -1:] - acs).to(dtype))
    w_out = _exp(acs.to(dtype))
    if same_last is not None:
        w_end = w_end * same_last.to(dtype)
        w_out = w_out * same_prev.to(dtype)
    return w_end, w_out


def _inter_chunk(last: Tensor, states: Tensor, init: Tensor | None, seq_ext: Tensor | None) -> tuple[Tensor, Tensor]:
    """States entering each chunk and the final state, from each chunk's own end state.

    last ``[b, c, H]`` each chunk's total log-decay; states ``[b, c, H, P, N]``; init ``[b, H, P, N]`` | None;
    seq_ext ``[b, c+1]`` | None (see :func:`_chunk_masks`). Returns ``(prev [b, c, H, P, N], final [b, H, P, N])``.

    The state entering chunk z (z = c: the final state) is a decayed sum over the states left by earlier
    chunks of the same sequence (e = 0 is the initial state, e = c' + 1 is chunk c'): W[z, e] = exp(sum of
    the log-decays of chunks e..z-1) for e <= z and the same sequence. The sums are taken directly (masked
    cumsum), not as differences of one long cumsum, so they stay exact for long rows. One small matmul
    instead of a Python loop over chunks.
    """
    b, c, H, P, N = states.shape
    dev = states.device
    flat = states.new_empty(b, H, c + 1, P * N)  # [b, H, c+1, PN]: the initial state, then each chunk's state
    flat[:, :, 1:] = states.view(b, c, H, P * N).transpose(1, 2)
    if init is None:
        flat[:, :, 0] = 0.0
    else:
        flat[:, :, 0] = init.reshape(b, H, P * N)
    v = F.pad(last.transpose(1, 2), (1, 0))  # [b, H, c+1]; v[i] = log-decay of chunk i-1
    strict = torch.ones(c + 1, c + 1, dtype=torch.bool, device=dev).tril(-1)  # i > e
    seg_c = v.unsqueeze(-1).expand(b, H, c + 1, c + 1).masked_fill(~strict, 0.0)  # [b, H, c+1 (i), c+1 (e)]
    seg_c = torch.cumsum(seg_c, dim=-2)  # [b, H, c+1 (z), c+1 (e)] = sum_{e < i <= z} v[i]
    keep_c = torch.ones(c + 1, c + 1, dtype=torch.bool, device=dev).tril()  # e <= z
    if seq_ext is not None:
        keep_c = keep_c & (seq_ext.unsqueeze(-1) == seq_ext.unsqueeze(-2)).unsqueeze(1)  # [b, 1, c+1, c+1]
    W = _exp(seg_c.masked_fill(~keep_c, float("-inf")))  # [b, H, c+1, c+1]
    entering = torch.matmul(W, flat).view(b, H, c + 1, P, N)  # [b, H, c+1, P, N]
    return entering[:, :, :c].transpose(1, 2), entering[:, :, c]


def _chunk_decays(last: Tensor, seq_ext: Tensor | None) -> Tensor:
    """``d`` ``[b, c, H]``: the factor carrying the state entering chunk j into chunk j+1 (its total decay, 0
    where chunk j+1 starts a new sequence)."""
    d = _exp(last)
    if seq_ext is not None:
        d = d * (seq_ext[:, 1:] == seq_ext[:, :-1]).to(d.dtype).unsqueeze(-1)
    return d


def _carry_states(states: Tensor, d: Tensor, init: Tensor | None) -> tuple[Tensor, Tensor]:
    """States entering each chunk, as a short loop over chunks: ``enter[j+1] = states[j] + d[j] * enter[j]``.

    Same values as :func:`_inter_chunk` (which the autograd path keeps), in O(c) work on ``[b, H, P, N]``
    slices instead of a ``[c+1, c+1]`` matmul. states ``[b, c, H, P, N]``; d ``[b, c, H]``; init
    ``[b, H, P, N]`` | None. Returns ``(prev [b, c, H, P, N], final [b, H, P, N])``.
    """
    b, c, H, P, N = states.shape
    prev = states.new_empty(b, c, H, P, N)
    state = states.new_zeros(b, H, P, N) if init is None else init
    for j in range(c):
        prev[:, j] = state
        state = torch.addcmul(states[:, j], state, d[:, j, :, None, None])  # [b, H, P, N]
    return prev, state


def _carry_states_bwd(
    prev: Tensor, d: Tensor, g_prev: Tensor, g_final: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`_carry_states`: ``(g_states [b, c, H, P, N], g_d [b, c, H], g_init [b, H, P, N])``."""
    b, c, H, P, N = prev.shape
    g_states = prev.new_empty(b, c, H, P, N)
    g_d = prev.new_empty(b, c, H)
    g = prev.new_zeros(b, H, P, N) if g_final is None else g_final  # d loss / d enter[j+1]
    for j in reversed(range(c)):
        g_states[:, j] = g
        g_d[:, j] = (g * prev[:, j]).sum((-1, -2))
        g = torch.addcmul(g_prev[:, j], g, d[:, j, :, None, None])  # d loss / d enter[j]
    return g_states, g_d, g


class _SSDCore:
    """The chunked scan over padded rows with a hand-written backward (the fast path of the torch core).

    Inputs (compute dtype, ``Tp = c * Q`` tokens, dt processed and masked): x ``[b, Tp, H, P]``, dt
    ``[b, Tp, H]``, A ``[H]``, B, C ``[b, Tp, G, N]``, D ``[H]`` | ``[H, P]`` | None, init ``[b, H, P, N]`` | None,
    seq ``[b, Tp]`` | None. Returns ``(y [b, Tp, H, P] with the D term, final [b, H, P, N])``.

    Same math as :func:`_ssd_autograd`, with every large tensor in the layout its consumer wants: ``x·dt``
    is written once head-major for the matmuls, ``y`` is assembled token-major in one pass, and backward
    rebuilds the cheap intermediates instead of saving them (it keeps the states entering each chunk and the
    inter-chunk output ``C·prev``). Across chunks the state is carried by a short loop over chunks.
    """

    @staticmethod
    def _prep(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, seq: Tensor | None, Q: int) -> dict:
        b, Tp, H, P = x.shape
        G, N = B.shape[2], B.shape[3]
        c = Tp // Q
        xdt = x.new_empty(b, c, H, Q, P)  # [b, c, H, Q, P] head-major inside each chunk
        torch.mul(x.reshape(b, c, Q, H, P).transpose(2, 3), dt.reshape(b, c, Q, H).transpose(2, 3).unsqueeze(-1), out=xdt)
        acs = _log_decays(dt, A, b, c, Q, H)  # [b, c, H, Q] float64
        Bg = B.reshape(b, c, Q, G, N).transpose(2, 3).contiguous()  # [b, c, G, Q, N]
        Cg = C.reshape(b, c, Q, G, N).transpose(2, 3).contiguous()  # [b, c, G, Q, N]
        keep, seq_ext, same_last, same_prev = _chunk_masks(seq, b, c, Q, x.device)
        w_end, w_out = _chunk_weights(acs, same_last, same_prev, x.dtype)  # [b, c, H, Q] each
        CB = torch.matmul(Cg, Bg.transpose(-1, -2))  # [b, c, G, Q, Q] per group
        return {"xdt": xdt, "acs": acs, "Bg": Bg, "Cg": Cg, "keep": keep, "seq_ext": seq_ext,
                "w_end": w_end, "w_out": w_out, "CB": CB}

    @staticmethod
    def _b_end(p: dict) -> Tensor:
        """``B_s * w_end[h, s]``: ``[b, c, H, Q, N]`` (the chunk-state matmul's right operand, per head)."""
        b, c, G, Q, N = p["Bg"].shape
        H = p["w_end"].shape[2]
        Bw = p["Bg"].unsqueeze(3) * p["w_end"].view(b, c, G, H // G, Q, 1)  # [b, c, G, k, Q, N]
        return Bw.view(b, c, H, Q, N)

    @staticmethod
    def fwd(x, dt, A, B, C, D, init, seq, Q: int):
        """Returns ``(y, final)`` and what backward keeps: ``d [b, c, H]``, ``prev [b, c, H, P, N]``,
        ``y_off [b*c*G, Q, k*P]``."""
        b, Tp, H, P = x.shape
        G, N = B.shape[2], B.shape[3]
        k, c = H // G, Tp // Q
        bcG = b * c * G
        p = _SSDCore._prep(x, dt, A, B, C, seq, Q)
        y_h = _intra_fwd(p["acs"], p["CB"], p["xdt"], p["keep"])  # [b, c, H, Q, P]
        Bw = _SSDCore._b_end(p)  # [b, c, H, Q, N] B scaled by each head's decay to the chunk end
        states = torch.matmul(p["xdt"].transpose(-1, -2), Bw)  # [b, c, H, P, N]
        del Bw
        d = _chunk_decays(p["acs"][..., -1].to(x.dtype), p["seq_ext"])  # [b, c, H]
        prev, final = _carry_states(states, d, init)  # [b, c, H, P, N], [b, H, P, N]
        del states
        y_off = torch.matmul(p["Cg"].view(bcG, Q, N), prev.view(bcG, k * P, N).transpose(1, 2))  # [bcG, Q, kP]
        y = x.new_empty(b, c, Q, H, P)  # token-major output
        torch.addcmul(
            y_h.view(b, c, G, k, Q, P).permute(0, 1, 4, 2, 3, 5),  # [b, c, Q, G, k, P]
            y_off.view(b, c, G, Q, k, P).permute(0, 1, 3, 2, 4, 5),  # [b, c, Q, G, k, P]
            p["w_out"].view(b, c, G, k, Q).permute(0, 1, 4, 2, 3).unsqueeze(-1),  # [b, c, Q, G, k, 1]
            out=y.view(b, c, Q, G, k, P),
        )
        y = y.view(b, Tp, H, P)
        if D is not None:
            y.addcmul_(x, _d_scale(D, x))
        return y, final, d, prev, y_off

    @staticmethod
    def bwd(gy, g_final, x, dt, A, B, C, D, init, seq, d, prev, y_off, Q: int, need_D: bool, need_init: bool):
        """Gradients ``(g_x, g_dt, g_A, g_B, g_C, g_D | None, g_init | None)`` for ``gy [b, Tp, H, P]`` (None:
        zeros) and ``g_final [b, H, P, N]`` | None."""
        b, Tp, H, P = x.shape
        G, N = B.shape[2], B.shape[3]
        k, c = H // G, Tp // Q
        bcG = b * c * G
        p = _SSDCore._prep(x, dt, A, B, C, seq, Q)
        gy = torch.zeros_like(x) if gy is None else gy.contiguous()  # [b, Tp, H, P]
        gy_q = gy.view(b, c, Q, G, k, P).permute(0, 1, 3, 2, 4, 5)  # [b, c, G, Q, k, P] (view)

        g_D = None
        if D is not None and need_D:
            prod = gy * x  # [b, Tp, H, P]
            g_D = prod.sum((0, 1)) if D.dim() == 2 else prod.sum((0, 1, 3))

        # 4. inter-chunk output y += w_out * (C · prev)
        w_out_q = p["w_out"].view(b, c, G, k, Q).transpose(3, 4).unsqueeze(-1)  # [b, c, G, Q, k, 1]
        g_yoff = x.new_empty(b, c, G, Q, k, P)
        torch.mul(gy_q, w_out_q, out=g_yoff)
        g_prev = torch.matmul(g_yoff.view(bcG, Q, k * P).transpose(1, 2), p["Cg"].view(bcG, Q, N))  # [bcG, kP, N]
        g_Cg = torch.matmul(g_yoff.view(bcG, Q, k * P), prev.view(bcG, k * P, N)).view(b, c, G, Q, N)
        del g_yoff
        g_wout = (gy_q * y_off.view(b, c, G, Q, k, P)).sum(-1)  # [b, c, G, Q, k]
        g_acs = g_wout.transpose(3, 4).reshape(b, c, H, Q) * p["w_out"]  # [b, c, H, Q] (d w_out / d acs = w_out)
        g_acs = g_acs.to(p["acs"].dtype)  # float64: the reverse cumsum below telescopes the intra part exactly

        # 3. across chunks
        g_states, g_d, g_init = _carry_states_bwd(prev, d, g_prev.view(b, c, H, P, N), g_final)
        g_last = g_d * d  # d = exp(last) (or 0): d d / d last = d
        if init is None or not need_init:
            g_init = None

        # 2. chunk states = (x dt w_end)ᵀ B
        g_states = g_states.contiguous()  # [b, c, H, P, N]
        g_Bw = torch.matmul(p["xdt"], g_states).view(b, c, G, k, Q, N)  # [b, c, G, k, Q, N]
        g_Bg = (g_Bw * p["w_end"].view(b, c, G, k, Q, 1)).sum(3)  # [b, c, G, Q, N]
        g_wend = (g_Bw * p["Bg"].unsqueeze(3)).sum(-1).view(b, c, H, Q)  # [b, c, H, Q]
        del g_Bw
        gw = g_wend * p["w_end"]  # d w_end / d acs_q = -w_end, d w_end / d acs_last = +w_end
        g_acs = g_acs - gw
        g_acs[..., -1] += gw.to(g_acs.dtype).sum(-1) + g_last

        # 1. intra-chunk
        gy_h = gy.view(b, c, Q, H, P).transpose(2, 3)  # [b, c, H, Q, P] head-major view, copied block by block
        g_acs_i, g_CB, g_xdt = _intra_bwd(p["acs"], p["CB"], p["xdt"], p["keep"], gy_h)
        g_acs += g_acs_i
        g_Cg += torch.matmul(g_CB, p["Bg"])  # [b, c, G, Q, N]
        g_Bg += torch.matmul(g_CB.transpose(-1, -2), p["Cg"])
        Bw = _SSDCore._b_end(p)
        g_xdt.view(-1, Q, P).baddbmm_(Bw.view(-1, Q, N), g_states.view(-1, P, N).transpose(1, 2))  # + state path
        del Bw

        # back to x, dt (token-major) and A
        g_xdt_t = g_xdt.transpose(2, 3)  # [b, c, Q, H, P] (view)
        g_x = x.new_empty(b, c, Q, H, P)
        torch.mul(g_xdt_t, dt.reshape(b, c, Q, H, 1), out=g_x)
        g_x = g_x.view(b, Tp, H, P)
        if D is not None:
            g_x.addcmul_(gy, _d_scale(D, x))
        g_dt = (g_xdt_t * x.reshape(b, c, Q, H, P)).sum(-1)  # [b, c, Q, H]
        g_a = g_acs.flip(-1).cumsum(-1).flip(-1).transpose(2, 3)  # [b, c, Q, H] through acs = cumsum(dt A)
        g_dt = (g_dt + g_a * A.to(g_a.dtype)).to(x.dtype).view(b, Tp, H)
        g_A = (g_a * dt.reshape(b, c, Q, H).to(g_a.dtype)).sum((0, 1, 2)).to(A.dtype)
        g_B = g_Bg.transpose(2, 3).reshape(b, Tp, G, N)
        g_C = g_Cg.transpose(2, 3).reshape(b, Tp, G, N)
        return g_x, g_dt, g_A, g_B, g_C, g_D, g_init


# _SSDCore as a pair of custom ops with a registered autograd formula: torch.compile sees one opaque node per
# direction (their out= / in-place block loops and views never reach inductor), and eager runs the same code.
@torch.library.custom_op("safepad::ssd_core", mutates_args=())
def _ssd_core_op(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None, init: Tensor | None, seq: Tensor | None,
    Q: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return tuple(t.contiguous() for t in _SSDCore.fwd(x, dt, A, B, C, D, init, seq, Q))  # the fake's strides


@_ssd_core_op.register_fake
def _(x, dt, A, B, C, D, init, seq, Q):
    b, Tp, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    c = Tp // Q
    return (
        x.new_empty(b, Tp, H, P),  # y
        x.new_empty(b, H, P, N),  # final
        x.new_empty(b, c, H),  # d
        x.new_empty(b, c, H, P, N),  # prev
        x.new_empty(b * c * G, Q, (H // G) * P),  # y_off
    )


@torch.library.custom_op("safepad::ssd_core_bwd", mutates_args=())
def _ssd_core_bwd_op(
    gy: Tensor | None, g_final: Tensor | None, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
    D: Tensor | None, init: Tensor | None, seq: Tensor | None, d: Tensor, prev: Tensor, y_off: Tensor, Q: int,
    need_D: bool, need_init: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    g = _SSDCore.bwd(gy, g_final, x, dt, A, B, C, D, init, seq, d, prev, y_off, Q, need_D, need_init)
    g = (*g[:5], x.new_empty(0) if g[5] is None else g[5], x.new_empty(0) if g[6] is None else g[6])
    return tuple(t.contiguous() for t in g)  # the fake's strides


@_ssd_core_bwd_op.register_fake
def _(gy, g_final, x, dt, A, B, C, D, init, seq, d, prev, y_off, Q, need_D, need_init):
    g_D = x.new_empty(D.shape) if D is not None and need_D else x.new_empty(0)
    g_init = x.new_empty(init.shape) if init is not None and need_init else x.new_empty(0)
    return (x.new_empty(x.shape), dt.new_empty(dt.shape), A.new_empty(A.shape), B.new_empty(B.shape),
            C.new_empty(C.shape), g_D, g_init)


def _ssd_core_setup(ctx, inputs, output):
    x, dt, A, B, C, D, init, seq, Q = inputs
    _, _, d, prev, y_off = output
    ctx.mark_non_differentiable(d, prev, y_off)
    ctx.set_materialize_grads(False)
    ctx.Q = Q
    ctx.has_D, ctx.has_init = D is not None, init is not None
    ctx.save_for_backward(x, dt, A, B, C, D, init, seq, d, prev, y_off)


def _ssd_core_backward(ctx, gy, g_final, *_unused):
    x, dt, A, B, C, D, init, seq, d, prev, y_off = ctx.saved_tensors
    need_D = ctx.has_D and ctx.needs_input_grad[5]
    need_init = ctx.has_init and ctx.needs_input_grad[6]
    g_x, g_dt, g_A, g_B, g_C, g_D, g_init = _ssd_core_bwd_op(
        gy, g_final, x, dt, A, B, C, D, init, seq, d, prev, y_off, ctx.Q, need_D, need_init
    )
    return g_x, g_dt, g_A, g_B, g_C, (g_D if need_D else None), (g_init if need_init else None), None, None


_ssd_core_op.register_autograd(_ssd_core_backward, setup_context=_ssd_core_setup)


def _ssd_core(x, dt, A, B, C, D, init, seq, Q: int) -> tuple[Tensor, Tensor]:
    """:class:`_SSDCore` through its custom op: ``(y [b, Tp, H, P], final [b, H, P, N])``."""
    y, final, _, _, _ = _ssd_core_op(x, dt, A, B, C, D, init, seq, Q)
    return y, final


def _ssd_chunked(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    seq_idx: Tensor | None,
    initial_state: Tensor | None,
    chunk_size: int,
    want_varlen: bool,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The torch core. All inputs already in the compute dtype; ``dt`` processed and masked.

    x ``[b, T, H, P]``; dt ``[b, T, H]``; A ``[H]``; B, C ``[b, T, G, N]``; D ``[H]`` | ``[H, P]`` | None;
    seq_idx ``[b, T]`` | None; initial_state ``[b, H, P, N]`` | None. Returns ``(y [b, T, H, P],
    final_state [b, H, P, N], varlen_states [S, H, P, N] | None)``. Runs :class:`_SSDCore`, or the autograd
    form :func:`_ssd_autograd` when varlen states are requested (they need its intermediates).
    """
    b, T, H, P = x.shape
    Q = chunk_size
    pad = (-T) % Q
    seq_full = seq_idx
    # while tracing, pad even by 0 tokens: branching on a symbolic T % Q would recompile per residue (dynamic=True)
    if tracing() or pad:
        x = F.pad(x, (0, 0, 0, 0, 0, pad))  # [b, Tp, H, P]; padded tokens: dt = 0, x = B = 0 (identity)
        dt = F.pad(dt, (0, 0, 0, pad))  # [b, Tp, H]
        B = F.pad(B, (0, 0, 0, 0, 0, pad))  # [b, Tp, G, N]
        C = F.pad(C, (0, 0, 0, 0, 0, pad))  # [b, Tp, G, N]
        if seq_idx is not None:  # the pads continue the last sequence (no expand: it guards on pad == 1)
            last = seq_idx[:, -1:]  # [b, 1]
            seq_idx = F.pad(seq_idx - last, (0, pad)) + last  # [b, Tp]
    if want_varlen:
        return _ssd_autograd(x, dt, A, B, C, D, seq_idx, seq_full, initial_state, Q, T)
    y, final = _ssd_core(x, dt, A, B, C, D, initial_state, seq_idx, Q)
    return y[:, :T], final, None


def _ssd_autograd(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    seq_idx: Tensor | None,
    seq_full: Tensor | None,
    initial_state: Tensor | None,
    Q: int,
    T: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """The chunked scan written with autograd ops (padded inputs, as :class:`_SSDCore`), plus varlen states."""
    b, Tp, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    k, c = H // G, Tp // Q
    xdt = x * dt.unsqueeze(-1)  # [b, Tp, H, P]
    xdt_c = xdt.view(b, c, Q, H, P).transpose(2, 3)  # [b, c, H, Q, P]
    acs = _log_decays(dt, A, b, c, Q, H)  # [b, c, H, Q] cumulative log-decay, float64
    Bg = B.view(b, c, Q, G, N).transpose(2, 3)  # [b, c, G, Q, N]
    Cg = C.view(b, c, Q, G, N).transpose(2, 3)  # [b, c, G, Q, N]
    keep, seq_ext, same_last, same_prev = _chunk_masks(seq_idx, b, c, Q, x.device)

    # 1. intra-chunk (diagonal blocks): y_l = sum_{s<=l, same seq} (C_l·B_s) exp(acs_l - acs_s) dt_s x_s
    CB = torch.matmul(Cg, Bg.transpose(-1, -2))  # [b, c, G, Q, Q] per group
    y = _intra_chunk(acs, CB, xdt_c, keep)  # [b, c, H, Q, P]

    # 2. chunk states: contribution of each chunk's tokens (of the chunk's last sequence) to its end state
    w_end, w_out = _chunk_weights(acs, same_last, same_prev, x.dtype)  # [b, c, H, Q] each
    xw = (xdt_c * w_end.unsqueeze(-1)).view(b, c, G, k, Q, P)  # [b, c, G, k, Q, P]
    xw = xw.transpose(-1, -2).reshape(b, c, G, k * P, Q)  # [b, c, G, kP, Q]
    states = torch.matmul(xw, Bg).view(b, c, H, P, N)  # [b, c, H, P, N]

    # 3. across chunks
    prev, final_state = _inter_chunk(acs[..., -1].to(x.dtype), states, initial_state, seq_ext)  # [b, c, H, P, N], [b, H, P, N]

    # 4. inter-chunk output: y_l += exp(acs_l) C_l · prev (only for tokens of the entering sequence)
    prev_g = prev.reshape(b, c, G, k, P, N).permute(0, 1, 2, 5, 3, 4).reshape(b, c, G, N, k * P)  # [b, c, G, N, kP]
    y_off = torch.matmul(Cg, prev_g)  # [b, c, G, Q, kP]
    y_off = y_off.view(b, c, G, Q, k, P).transpose(3, 4).reshape(b, c, H, Q, P)  # [b, c, H, Q, P]
    y = y + y_off * w_out.unsqueeze(-1)  # [b, c, H, Q, P]
    y = y.transpose(2, 3).reshape(b, c * Q, H, P)  # [b, Tp, H, P]
    if D is not None:
        y = y + x * _d_scale(D, x)
    varlen = _varlen_states(xdt_c, acs, Bg, prev, seq_full, seq_idx, T, Q)
    return y[:, :T], final_state, varlen


def _varlen_states(
    xdt_c: Tensor, acs: Tensor, Bg: Tensor, prev: Tensor, seq_full: Tensor | None, seq_pad: Tensor | None, T: int, Q: int
) -> Tensor:
    """State at the last token of every sequence: ``[S, H, P, N]``, row-major order of appearance.

    xdt_c ``[b, c, H, Q, P]``; acs ``[b, c, H, Q]`` (float64, :func:`_log_decays`); Bg ``[b, c, G, Q, N]``; prev ``[b, c, H, P, N]``.
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
    w = _exp((a_end - a).masked_fill(~own.unsqueeze(1), float("-inf")).to(xdt_c.dtype))  # [S, H, Q]
    xw = (xdt_c[row, ci] * w.unsqueeze(-1)).view(S, G, k, Q, P)  # [S, G, k, Q, P]
    xw = xw.transpose(-1, -2).reshape(S, G, k * P, Q)  # [S, G, kP, Q]
    st = torch.matmul(xw, Bg[row, ci]).view(S, H, P, N)  # [S, H, P, N]
    prev_seq = torch.where(ci > 0, seq_pad.view(b, c * Q)[row, (ci * Q - 1).clamp(min=0)], seq_pad[row, 0])  # [S]
    enters = (prev_seq == sq.gather(1, li[:, None]).squeeze(1)).to(st.dtype)  # [S]
    w_prev = _exp(a_end.squeeze(-1).to(st.dtype)) * enters[:, None]  # [S, H]
    return st + w_prev[:, :, None, None] * prev[row, ci]  # [S, H, P, N]


class SSDArgs(NamedTuple):
    """:func:`ssd_scan`'s arguments once checked: the sizes, and the normalised ``dt_limit`` / ``seq_idx`` /
    boolean ``mask`` (``None`` without a token mask)."""

    Bsz: int
    T: int
    H: int
    P: int
    G: int
    N: int
    dt_limit: tuple[float, float]
    seq_idx: Tensor | None
    mask: Tensor | None


def check_ssd_scan_args(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    *,
    chunk_size: int,
    D: Tensor | None,
    dt_bias: Tensor | None,
    dt_limit: tuple[float, float],
    seq_idx: Tensor | None,
    initial_state: Tensor | None,
    token_mask: Tensor | None,
    backend: str,
) -> SSDArgs:
    """Validate :func:`ssd_scan`'s arguments (shapes ``[B, T, H, P]`` etc., see there); raise ``ValueError``
    naming the first bad one. Shared with the sequence-parallel scan (``safepad.parallel.ops``)."""
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

    return SSDArgs(Bsz, T, H, P, G, N, dt_limit, seq_idx, mask)


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
    Bsz, T, H, P, G, N, dt_limit, seq_idx, mask = check_ssd_scan_args(
        x, dt, A, B, C, chunk_size=chunk_size, D=D, dt_bias=dt_bias, dt_limit=dt_limit, seq_idx=seq_idx,
        initial_state=initial_state, token_mask=token_mask, backend=backend,
    )
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    dtp = process_dt(dt, dt_bias, dt_limit, dt_softplus).to(ct)  # [B, T, H]
    xk, Bk, Ck = x, B, C
    if mask is not None:  # selection, not a multiply: a NaN / inf at a masked token must not survive
        m3 = mask[:, :, None]  # [B, T, 1]
        dtp = torch.where(m3, dtp, 0.0)  # [B, T, H]: masked tokens are the identity
        xk = torch.where(m3[..., None], x, 0.0)  # [B, T, H, P]
        Bk = torch.where(m3[..., None], B, 0.0)  # [B, T, G, N]
        Ck = torch.where(m3[..., None], C, 0.0) if seq_idx is not None else C  # (only read by its own token)
    poisoned = None
    init = initial_state
    if seq_idx is not None:
        # the zero cross-sequence weights of the chunked scan would carry a NaN of one sequence into the next
        (xk, dtp, Bk, Ck), init, poisoned = isolate_nonfinite(seq_idx, [xk, dtp, Bk, Ck], initial_state)

    need_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, dt, A, B, C, D, dt_bias, initial_state)
    )
    # the kernel's varlen states need batch 1, no grad, and no initial state (mamba-ssm 2.3.2.post1 leaves the
    # initial state out of the first sequence's varlen state)
    varlen_ok = not return_varlen_states or (Bsz == 1 and not need_grad and initial_state is None)
    if backend == "kernels" and not (varlen_ok and ct == torch.float32):
        raise ValueError(
            "backend='kernels': mamba_chunk_scan_combined returns varlen states only for batch 1 without "
            "gradients or an initial state, and has no float64 path; use backend='auto' to run this call on the "
            "torch core"
        )
    if (
        varlen_ok
        and ct == torch.float32
        and kernels.use_kernels(x, dt, A, B, C, need=("mamba_chunk_scan_combined",), backend=backend)
    ):
        res = _ssd_kernel(xk, dtp, A, Bk, Ck, chunk_size, D, seq_idx, init, return_final_state, return_varlen_states)
        return res if poisoned is None else _poison_outputs(res, poisoned, seq_idx, return_final_state, return_varlen_states)
    if return_varlen_states and backend == "auto" and kernels.on_kernel_device(x):
        logger.debug("ssd_scan: kernel varlen states need batch 1, no grad, no initial state; using the torch core")

    y, final, varlen = _ssd_chunked(
        xk.to(ct),
        dtp,
        A.to(ct),
        Bk.to(ct),
        Ck.to(ct),
        None if D is None else D.to(ct),
        seq_idx,
        None if init is None else init.to(ct),
        min(chunk_size, T),  # a row shorter than a chunk is one chunk of its own length, not padded to chunk_size
        return_varlen_states,
    )
    out: list[Tensor] = [y.to(x.dtype)]
    if return_final_state:
        out.append(final)
    if return_varlen_states:
        out.append(varlen)
    res = out[0] if len(out) == 1 else tuple(out)
    return res if poisoned is None else _poison_outputs(res, poisoned, seq_idx, return_final_state, return_varlen_states)


def _poison_outputs(res, poisoned: Tensor, seq_idx: Tensor, want_final: bool, want_varlen: bool):
    """NaN back at the outputs (and states) that a non-finite input reaches in its own sequence."""
    if not (want_final or want_varlen):
        return poison(res, poisoned)
    out = list(res)
    out[0] = poison(out[0], poisoned)
    i = 1
    if want_final:
        out[i] = poison_rows(out[i], poisoned[:, -1])  # [B, H, P, N]: state after each row's last token
        i += 1
    if want_varlen:
        ends = torch.ones_like(poisoned)  # [B, T]: last token of a sequence
        ends[:, :-1] = seq_idx[:, 1:] != seq_idx[:, :-1]
        out[i] = poison_rows(out[i], poisoned[ends])  # [S, H, P, N], row-major order of appearance
    return tuple(out)


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
        # the kernel gives the initial state to sequence id 0 only: number each row's sequences from 0
        seq_idx=None if seq_idx is None else (seq_idx - seq_idx[:, :1]).to(torch.int32).contiguous(),
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
    token_mask: Tensor | None = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """One decode token, with exactly the dt pipeline of :func:`ssd_scan`.

    Args:
        state: ``[B, H, P, N]``; x: ``[B, H, P]``; dt: ``[B, H]`` raw; A: ``[H]``; B, C: ``[B, G, N]``.
        token_mask: ``[B]`` (or a decode step's ``[B, 1]``) bool or None. A row whose token is masked (False)
            keeps its state exactly (its ``y`` is not meaningful): its processed ``dt`` and its ``x`` and ``B`` are
            selected to 0 (a NaN there never reaches the state), so the decay is ``exp(0) = 1`` and the input term
            0, with no pass over the ``[B, H, P, N]`` state beyond the update itself.

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
    dtp = process_dt(dt, dt_bias, dt_limit, dt_softplus).to(ct).unsqueeze(-1)  # [B, H, 1]
    if token_mask is not None:
        if not isinstance(token_mask, Tensor) or tuple(token_mask.shape) not in ((Bsz,), (Bsz, 1)):
            raise ValueError(f"token_mask must have shape [batch] = [{Bsz}] (or [batch, 1]), got {_shape(token_mask)}")
        keep = token_mask.to(torch.bool).view(Bsz, 1, 1)  # [B, 1, 1], broadcast against dt, x and B
        # select, not multiply: a NaN in a masked row's dt, x or B must not reach its state (0 * NaN is NaN).
        # All three: dt = 0 makes the decay exp(0) = 1, x = 0 and B = 0 make the input term x dt B^T zero.
        dtp = torch.where(keep, dtp, 0.0)  # after the limits: a clamp would move 0 off 0
        x = torch.where(keep, x, 0.0)  # [B, H, P]
        B = torch.where(keep, B, 0.0)  # [B, G, N]
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
        dt_k = dtp.expand(Bsz, H, P)  # [B, H, P]
        D_k = None
        if D is not None:
            D_k = D[:, None].expand(H, P) if D.dim() == 1 else D  # [H, P]
        y = kernels.state_update(new_state, x, dt_k, A_k, B, C, D=D_k)
        return y.to(x.dtype), new_state
    # torch core. Heads share B, C in G groups of k = H / G heads: with G > 1 the per-head tensors are viewed as
    # [B, G, k, ...] against B, C [B, G, 1, 1, N]; with G = 1 they broadcast as they are ([B, H, ...] against
    # [B, 1, 1, N]), without those views.
    k = H // G
    lead = (Bsz, G, k) if G > 1 else (Bsz, H)  # the per-head leading dims
    s = state.to(ct)  # [B, H, P, N]
    if G > 1:
        s = s.view(*lead, P, N)  # [B, G, k, P, N]
    decay = torch.exp(dtp * _widened(A, ct)[:, None]).view(*lead, 1, 1)  # [B, H, 1, 1] | [B, G, k, 1, 1]
    xdt = (_widened(x, ct) * dtp).view(*lead, P, 1)  # [B, H, P, 1] | [B, G, k, P, 1]
    group = (Bsz, G, 1, 1, N) if G > 1 else (Bsz, 1, 1, N)
    new = torch.addcmul(decay * s, xdt, _widened(B, ct).view(group))  # decay * s + x dt B^T  [B, (G, k | H), P, N]
    y = (new * _widened(C, ct).view(group)).sum(-1)  # [B, (G, k | H), P]
    if G > 1:
        y, new = y.view(Bsz, H, P), new.view(Bsz, H, P, N)
    if D is not None:
        D = _widened(D, ct)
        y = torch.addcmul(y, _widened(x, ct), D[:, None] if D.dim() == 1 else D)  # y + D x  [B, H, P]
    return y.to(x.dtype), new
