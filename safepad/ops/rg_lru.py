"""The RG-LRU (Real-Gated Linear Recurrent Unit of Griffin / RecurrentGemma) over packed / padded rows.

Per channel ``w`` of head ``h`` (block width ``P``, ``W = H * P`` channels), with ``x_t`` the (conv) input::

    i_t = sigmoid(x_t[h] @ Wi[h] + bi[h])            input gate      [H, P] -> [W]
    r_t = sigmoid(x_t[h] @ Wr[h] + br[h])            recurrence gate
    log a_t = -c * r_t * softplus(Λ)                 (c = 8 in RecurrentGemma)
    h_t = a_t * h_{t-1} + sqrt(1 - a_t²) * (i_t * x_t)
    at the first token of a sequence (a reset): h_t = i_t * x_t        (no carry, no sqrt(1 - a²) factor)

Layouts: ``x [B, T, W]``; states ``[B, W]`` float32 (as the stock module keeps them). ``seq_idx [B, T]``
puts sequence boundaries inside a row (each one a reset); a masked token (``token_mask`` False) leaves the
state untouched. The row's first real token is a reset unless ``initial_state`` is given, in which case the
row's first sequence continues from it (a chunked-prefill continuation).

The scan is a chunked Hillis-Steele scan of the affine maps ``h -> a h + b``: ``log2(chunk)`` doubling steps
inside each chunk (only between tokens of one segment, combined by selection, so a NaN never crosses a
boundary), then one carry per chunk. No division, no ``exp(-cumsum)``: it is stable for any ``a`` in
``[0, 1]``. ``sqrt(1 - a²)`` has its gradient clipped at 1000 as in the stock module.

Both gates are one ``baddbmm`` over the heads, on the two gates' block weights stacked side by side; those, the
biases and ``-c softplus(Λ)`` in the compute dtype are built once per ``generate`` call (:func:`_gate_params`).
A decode step (:func:`rg_lru_step`) then dispatches about 20 aten ops inside ``generate`` (each a kernel launch
on CUDA), where the stock module's step dispatches 37.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from ..layout.boundaries import validate_seq_idx
from .amp import fp32_core
from .prepared import prepared

logger = logging.getLogger(__name__)

__all__ = ["rg_lru", "rg_lru_gates", "rg_lru_step"]

_MAX_SQRT_GRADIENT = 1000.0
_CHUNK = 64


class _SqrtBoundGrad(torch.autograd.Function):
    """``sqrt(x)`` whose derivative ``1 / (2 sqrt(x))`` is capped at ``_MAX_SQRT_GRADIENT``."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return torch.sqrt(x)

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return g / torch.sqrt(torch.clamp(4.0 * x, min=1.0 / _MAX_SQRT_GRADIENT**2))


def _check_params(W: int, input_gate_weight: Tensor, input_gate_bias: Tensor, recurrent_gate_weight: Tensor,
                  recurrent_gate_bias: Tensor, recurrent_param: Tensor) -> tuple[int, int]:
    if input_gate_weight.dim() != 3 or input_gate_weight.shape[1] != input_gate_weight.shape[2]:
        raise ValueError(f"input_gate_weight must have shape [heads, P, P], got {tuple(input_gate_weight.shape)}")
    H, P = input_gate_weight.shape[0], input_gate_weight.shape[1]
    if H * P != W:
        raise ValueError(f"input_gate_weight [heads, P, P] = {tuple(input_gate_weight.shape)} does not match x's {W} channels")
    if tuple(recurrent_gate_weight.shape) != (H, P, P):
        raise ValueError(f"recurrent_gate_weight must have shape {(H, P, P)}, got {tuple(recurrent_gate_weight.shape)}")
    for name, b in (("input_gate_bias", input_gate_bias), ("recurrent_gate_bias", recurrent_gate_bias)):
        if tuple(b.shape) != (H, P):
            raise ValueError(f"{name} must have shape [heads, P] = {(H, P)}, got {tuple(b.shape)}")
    if tuple(recurrent_param.shape) != (W,):
        raise ValueError(f"recurrent_param must have shape [W] = [{W}], got {tuple(recurrent_param.shape)}")
    return H, P


def _prepare(input_gate_weight: Tensor, input_gate_bias: Tensor, recurrent_gate_weight: Tensor,
             recurrent_gate_bias: Tensor, recurrent_param: Tensor, ct: torch.dtype,
             c: float) -> tuple[Tensor, Tensor, Tensor]:
    """The gate parameters in ``ct`` as :func:`_gates` takes them: ``(w [H, P, 2P]`` both gates' blocks side by side
    (input gate first), ``b [H, 1, 2P]`` their biases, ``k [H, P] = -c softplus(Λ)``)."""
    H, P = input_gate_bias.shape
    # (stacked, then widened: one cast of each stack, exact, not one per parameter)
    w = torch.cat([input_gate_weight, recurrent_gate_weight], dim=-1).to(ct)  # [H, P, 2P]
    b = torch.cat([input_gate_bias, recurrent_gate_bias], dim=-1).to(ct).unsqueeze(1)  # [H, 1, 2P]
    k = F.softplus(recurrent_param.to(ct)).reshape(H, P) * -c  # [H, P]
    return w, b, k


def _gate_params(params: tuple[Tensor, Tensor, Tensor, Tensor, Tensor], ct: torch.dtype,
                 c: float) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`_prepare` of ``params`` (``input_gate_weight, input_gate_bias, recurrent_gate_weight,
    recurrent_gate_bias, recurrent_param``): built once per ``generate`` call (:mod:`safepad.ops.prepared`), not
    on every decode step (two ``cat``, five casts of a half-precision model's parameters, the softplus and its
    scaling, per layer); built on every call outside ``generate``."""
    return prepared(("rg_lru_gates", id(params[0])), params, (ct, c), lambda: _prepare(*params, ct, c))


def _gates(xv: Tensor, w: Tensor, b: Tensor, k: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Gates of ``xv [N, H, P]`` with the :func:`_prepare` d ``w, b, k``: ``(gated i * x, a, sqrt(1 - a²))``, each
    ``[N, H, P]``. Both gates are one ``baddbmm`` over the heads; ``gated`` is laid out as ``xv`` (token by token),
    ``a`` and ``sqrt(1 - a²)`` head by head (a ``reshape`` to ``[..., W]`` copies them)."""
    P = xv.shape[-1]
    g = torch.sigmoid(torch.baddbmm(b, xv.transpose(0, 1), w)).transpose(0, 1)  # [H, N, 2P] -> [N, H, 2P]
    log_a = g[..., P:] * k  # [N, H, P]: log a = -c r softplus(Λ)
    a = torch.exp(log_a)
    mult = _SqrtBoundGrad.apply(1 - torch.exp(2 * log_a))
    return xv * g[..., :P], a, mult


def rg_lru_gates(
    x: Tensor,
    input_gate_weight: Tensor,
    input_gate_bias: Tensor,
    recurrent_gate_weight: Tensor,
    recurrent_gate_bias: Tensor,
    recurrent_param: Tensor,
    c: float = 8.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gates of ``x [..., W]``: ``(gated input i * x, a, sqrt(1 - a²))``, each ``[..., W]``, in x's dtype.

    ``input_gate_weight`` / ``recurrent_gate_weight`` ``[H, P, P]`` (block-diagonal, applied as ``x[h] @ W[h]``),
    biases ``[H, P]``, ``recurrent_param`` (Λ) ``[W]``; the parameters are cast to x's dtype.
    """
    W = x.shape[-1]
    H, P = _check_params(W, input_gate_weight, input_gate_bias, recurrent_gate_weight, recurrent_gate_bias,
                         recurrent_param)
    params = (input_gate_weight, input_gate_bias, recurrent_gate_weight, recurrent_gate_bias, recurrent_param)
    gated, a, mult = _gates(x.reshape(-1, H, P), *_gate_params(params, x.dtype, c))  # [N, H, P] each
    return gated.reshape(x.shape), a.reshape(x.shape), mult.reshape(x.shape)


def _shift(t: Tensor, d: int, fill: float | int) -> Tensor:
    """``t`` ``[B, n, C, ...]`` shifted by ``d`` along the chunk axis (dim 2), ``fill`` entering on the left."""
    pad = t.new_full((*t.shape[:2], d, *t.shape[3:]), fill)
    return torch.cat([pad, t[:, :, : t.shape[2] - d]], dim=2)


def _linear_scan(a: Tensor, b: Tensor, seg: Tensor, h0: Tensor | None, chunk: int) -> tuple[Tensor, Tensor]:
    """``h_t = a_t h_{t-1} + b_t`` restarting (no carry) wherever ``seg`` ``[B, T]`` changes.

    ``a``, ``b`` ``[B, T, W]`` float; ``seg`` non-decreasing int64, the row's first segment 0; ``h0`` ``[B, W]``
    feeds segment 0 only. Returns ``(h [B, T, W], h at the last token [B, W])``.
    """
    B, T, W = a.shape
    n = -(-T // chunk)
    pad = n * chunk - T
    if pad:
        a = torch.cat([a, a.new_ones(B, pad, W)], dim=1)  # identity maps after the row
        b = torch.cat([b, b.new_zeros(B, pad, W)], dim=1)
        seg = torch.cat([seg, seg[:, -1:].expand(B, pad)], dim=1)
    A = a.reshape(B, n, chunk, W)  # [B, n, C, W]
    Bv = b.reshape(B, n, chunk, W)
    S = seg.reshape(B, n, chunk)  # [B, n, C]
    d = 1
    while d < chunk:
        same = (_shift(S, d, -1) == S).unsqueeze(-1)  # [B, n, C, 1]: t - d is in t's segment and chunk
        A_prev = torch.where(same, _shift(A, d, 1.0), 1.0)  # selection: a NaN of another segment never enters
        B_prev = torch.where(same, _shift(Bv, d, 0.0), 0.0)
        Bv = A * B_prev + Bv
        A = A * A_prev
        d *= 2
    # carry across chunks: tokens still in the segment the chunk started with take the previous chunk's last h
    first = (S == S[:, :, :1]).unsqueeze(-1)  # [B, n, C, 1]
    outs = []
    h_prev = h0
    for j in range(n):
        if h_prev is None:
            hj = Bv[:, j]
        else:
            cont = first[:, j]
            if j > 0:
                cont = cont & (S[:, j, :1] == S[:, j - 1, -1:]).unsqueeze(-1)  # [B, C, 1]
            else:
                cont = cont & (S[:, 0, :1] == 0).unsqueeze(-1)
            hj = torch.where(cont, Bv[:, j] + A[:, j] * torch.where(cont, h_prev[:, None], 0.0), Bv[:, j])
        outs.append(hj)
        h_prev = hj[:, -1]
    h = torch.stack(outs, dim=1).reshape(B, n * chunk, W)[:, :T]  # [B, T, W]
    return h, h_prev


@fp32_core
def rg_lru(
    x: Tensor,
    input_gate_weight: Tensor,
    input_gate_bias: Tensor,
    recurrent_gate_weight: Tensor,
    recurrent_gate_bias: Tensor,
    recurrent_param: Tensor,
    *,
    c: float = 8.0,
    seq_idx: Tensor | None = None,
    initial_state: Tensor | None = None,
    token_mask: Tensor | None = None,
    return_final_state: bool = False,
    chunk_size: int = _CHUNK,
    started: Tensor | None = None,
):
    """The RG-LRU over ``x [B, T, W]`` -> ``y [B, T, W]`` (x's dtype) [, ``final_state [B, W]`` float32].

    Args:
        x: the recurrence input (RecurrentGemma: the conv output).
        input_gate_weight, recurrent_gate_weight: ``[H, P, P]``; input_gate_bias, recurrent_gate_bias: ``[H, P]``;
            recurrent_param: Λ ``[W]``; c: the constant of ``log a = -c r softplus(Λ)``.
        seq_idx: ``[B, T]`` int, non-decreasing per row; each new sequence starts from a reset.
        initial_state: ``[B, W]`` each row's state before this call; only the row's first sequence continues
            from it. ``None``: the row's first real token is a reset.
        token_mask: ``[B, T]`` bool/int, True = real token; a masked token holds the state (its output is the
            held state and means nothing). A NaN at a masked token goes nowhere.
        return_final_state: also return each row's state after its last real token ``[B, W]`` float32.
        chunk_size: tokens per doubling-scan chunk (a power of two).
        started: ``[B]`` bool, with ``initial_state``: whether the row's state has read a real token. A row that
            has not (a row of pads only so far) starts its first sequence from a reset, as a row without a state.
    """
    if not isinstance(x, Tensor) or x.dim() != 3:
        raise ValueError(f"x must have shape [batch, seqlen, width], got {getattr(x, 'shape', type(x).__name__)}")
    Bsz, T, W = x.shape
    if T == 0:
        raise ValueError("x must have at least one token (seqlen >= 1)")
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two, got {chunk_size}")
    if seq_idx is not None:
        seq_idx = validate_seq_idx(seq_idx, (Bsz, T))
    mask = None
    if token_mask is not None:
        if not isinstance(token_mask, Tensor) or tuple(token_mask.shape) != (Bsz, T):
            shape = tuple(token_mask.shape) if isinstance(token_mask, Tensor) else type(token_mask).__name__
            raise ValueError(f"token_mask must have shape [batch, seqlen] = {(Bsz, T)} (True = real token), got {shape}")
        if token_mask.dtype.is_floating_point or token_mask.dtype.is_complex:
            raise ValueError(f"token_mask must be bool or integer (True/1 = real token), got {token_mask.dtype}")
        mask = token_mask.bool()
    if initial_state is not None and tuple(initial_state.shape) != (Bsz, W):
        raise ValueError(f"initial_state must have shape [batch, width] = {(Bsz, W)}, got {tuple(initial_state.shape)}")
    ct = torch.float64 if torch.float64 in (x.dtype, input_gate_weight.dtype) else torch.float32
    xc = x.to(ct)
    if mask is not None:
        xc = torch.where(mask.unsqueeze(-1), xc, 0.0)  # [B, T, W]: a NaN at a pad never reaches a gate
    params = (input_gate_weight, input_gate_bias, recurrent_gate_weight, recurrent_gate_bias, recurrent_param)
    H, P = _check_params(W, *params)
    gated, a, mult = _gates(xc.reshape(Bsz * T, H, P), *_gate_params(params, ct, c))  # [B * T, H, P] each
    gated_mult = (gated * mult).reshape(Bsz, T, W)  # laid out as gated: a view
    gated, a = gated.reshape(Bsz, T, W), a.reshape(Bsz, T, W)  # [B, T, W]; a is copied (laid out head by head)
    dev = x.device
    # segments: a new one at every sequence start; the reset token is the first REAL token of each segment
    if seq_idx is None:
        seg_start = torch.zeros(Bsz, T, dtype=torch.bool, device=dev)
        seg_start[:, 0] = True
    else:
        seg_start = torch.ones(Bsz, T, dtype=torch.bool, device=dev)
        seg_start[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    seg_no = torch.cumsum(seg_start.long(), dim=1) - 1  # [B, T] 0 for the row's first sequence
    real = torch.ones(Bsz, T, dtype=torch.bool, device=dev) if mask is None else mask
    # real tokens before t in t's segment: cumulative count minus the count at the segment start
    cum = torch.cumsum(real.long(), dim=1)  # [B, T]
    before = cum - real.long()  # real tokens strictly before t in the row
    start_before = torch.cummax(torch.where(seg_start, before, torch.zeros_like(before)), dim=1).values
    first_real = real & (before == start_before)  # [B, T]
    if initial_state is None:
        reset = first_real
    elif started is None:
        reset = first_real & (seg_no > 0)
    else:  # a row whose state has read no real token yet: its first real token is a reset too
        reset = first_real & ((seg_no > 0) | ~started.to(device=dev, dtype=torch.bool)[:, None])
    b = torch.where(reset.unsqueeze(-1), gated, gated_mult)  # [B, T, W]
    b = torch.where(real.unsqueeze(-1), b, 0.0)
    a = torch.where(real.unsqueeze(-1), a, 1.0)
    # a reset token opens a segment of its own for the scan (no carry into it)
    scan_seg = torch.cumsum(reset.long(), dim=1)  # [B, T]; 0 before the first reset (h0's segment)
    h0 = None if initial_state is None else initial_state.to(ct)
    h, final = _linear_scan(a, b, scan_seg, h0, chunk_size)
    y = h.to(x.dtype)
    if not return_final_state:
        return y
    return y, final.to(torch.float32 if ct == torch.float32 else ct)


@fp32_core
def rg_lru_step(
    x: Tensor,
    state: Tensor,
    input_gate_weight: Tensor,
    input_gate_bias: Tensor,
    recurrent_gate_weight: Tensor,
    recurrent_gate_bias: Tensor,
    recurrent_param: Tensor,
    *,
    c: float = 8.0,
    token_mask: Tensor | None = None,
    started: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """One decode token: ``x [B, W]``, ``state [B, W]`` -> ``(y [B, W]`` x's dtype, ``new_state [B, W])``.

    ``token_mask`` ``[B]`` (or a decode step's ``[B, 1]``) bool (True = real): a masked row keeps its state (its
    ``y`` means nothing).
    ``started`` ``[B]`` bool: whether the row's state has read a real token; a row that has not starts from a reset
    (``h = i * x``, as the row's first token alone).
    """
    if not isinstance(x, Tensor) or x.dim() != 2:
        raise ValueError(f"x must have shape [batch, width], got {getattr(x, 'shape', type(x).__name__)}")
    if not isinstance(state, Tensor) or tuple(state.shape) != tuple(x.shape):
        raise ValueError(f"state must have shape [batch, width] = {tuple(x.shape)}, got {getattr(state, 'shape', None)}")
    N, W = x.shape
    params = (input_gate_weight, input_gate_bias, recurrent_gate_weight, recurrent_gate_bias, recurrent_param)
    H, P = _check_params(W, *params)
    if token_mask is not None and tuple(token_mask.shape) not in ((N,), (N, 1)):
        raise ValueError(f"token_mask must have shape [batch] = [{N}] or [{N}, 1], got {tuple(token_mask.shape)}")
    if started is not None and tuple(started.shape) != (N,):
        raise ValueError(f"started must have shape [batch] = [{N}], got {tuple(started.shape)}")
    ct = torch.float64 if torch.float64 in (x.dtype, input_gate_weight.dtype, state.dtype) else torch.float32
    xc = x.to(ct)
    keep = None
    if token_mask is not None:
        keep = token_mask.bool()
        keep = keep if keep.dim() == 2 else keep[:, None]  # [B, 1]
        xc = torch.where(keep, xc, 0.0)  # a NaN at a masked row reaches no gate (nor a gradient)
    gated, a, mult = _gates(xc.reshape(N, H, P), *_gate_params(params, ct, c))  # [B, H, P] each
    s = state.to(ct)
    # laid out as gated (token by token, the first operand), so the reshape to [B, W] is a view
    new = torch.addcmul(gated * mult, a, s.reshape(N, H, P))  # a h + sqrt(1 - a²) i x  [B, H, P]
    if started is not None:  # a row whose state has read no real token starts from a reset: h = i x
        new = torch.where(started.to(device=new.device, dtype=torch.bool).view(N, 1, 1), new, gated)
    new = new.reshape(N, W)
    if keep is not None:
        new = torch.where(keep, new, s)
    return new.to(x.dtype), new.to(state.dtype)
