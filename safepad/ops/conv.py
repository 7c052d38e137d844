"""Depthwise causal conv1d that respects packed-sequence boundaries, padding and cached states.

Layouts: sequence tensors are token-major ``x [B, T, D]``; the depthwise weight is ``[D, K]``; conv
states are ``[B, D, S]`` (``S >= K - 1``), the previous inputs of each row, oldest first — the HF cache
layout ``conv_states [B, D, K]`` works directly.

The torch core runs everywhere and is differentiable. On CUDA with ``causal-conv1d`` installed, the
calls that kernel can express exactly go to ``causal_conv1d_fn`` / ``causal_conv1d_update``; states are
always gathered by the torch code here (an exact gather, not a computation), so both paths agree.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from safepad.layout.boundaries import (
    cu_seqlens_from_seq_idx,
    sequence_ids,
    validate_seq_idx,
)
from safepad.layout.masks import pads_before_real

from .._tracing import device_check, tracing
from . import kernels
from .amp import fp32_core

logger = logging.getLogger(__name__)

__all__ = [
    "ConvArgs", "causal_conv1d", "causal_conv1d_step", "check_causal_conv1d_args", "conv_states_from_inputs",
]

#: the activations causal-conv1d's kernels implement (``None`` = identity); every other one runs on the torch core
_KERNEL_ACTIVATIONS = (None, "silu", "swish")


def _compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """float64 if any input is float64, else float32 (half types are computed in float32)."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def check_backend(backend: str) -> None:
    """``backend`` must be ``"auto"``, ``"torch"`` or ``"kernels"`` (checked even when no kernel is tried)."""
    if backend not in ("auto", "torch", "kernels"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'kernels', got {backend!r}")


def _check_activation(activation: str | Callable[[Tensor], Tensor] | None) -> None:
    """``None``, a callable, or a name of transformers' ``ACT2FN`` (what the stock mixers apply after their conv)."""
    if activation in _KERNEL_ACTIVATIONS or callable(activation):
        return
    if isinstance(activation, str):
        from transformers.activations import ACT2FN

        if activation in ACT2FN:
            return
        names = ", ".join(sorted(ACT2FN))
        raise ValueError(f"activation must be None, a callable or one of transformers' ACT2FN names ({names}), got {activation!r}")
    raise ValueError(f"activation must be None, a callable or an activation name, got {type(activation).__name__}")


def _activation_fn(activation: str | Callable[[Tensor], Tensor] | None) -> Callable[[Tensor], Tensor] | None:
    """The function the torch core applies after the conv: ``None`` for none and for silu (fused in the core)."""
    if activation in _KERNEL_ACTIVATIONS:
        return None
    if callable(activation):
        return activation
    from transformers.activations import ACT2FN

    return ACT2FN[activation]  # same math as the stock mixers' ``ACT2FN[self.activation]``


def _dilated(weight: Tensor, dilation: int) -> Tensor:
    """``weight`` ``[D, K]`` of a conv with ``dilation`` d as the undilated ``[D, (K - 1) d + 1]`` one (zeros
    between the taps); differentiable, so the gradient reaches the ``K`` real taps only."""
    if not isinstance(dilation, int) or isinstance(dilation, bool) or dilation < 1:
        raise ValueError(f"dilation must be an integer >= 1, got {dilation!r}")
    if dilation == 1:
        return weight
    D, K = weight.shape
    zeros = weight.new_zeros(D, K, dilation - 1)  # [D, K, d - 1]
    return torch.cat([weight.unsqueeze(-1), zeros], dim=-1).reshape(D, K * dilation)[:, : (K - 1) * dilation + 1]


def _activate(y: Tensor, activation: str | Callable[[Tensor], Tensor] | None) -> Tensor:
    if activation in ("silu", "swish"):
        return F.silu(y)
    fn = _activation_fn(activation)
    return y if fn is None else fn(y)


def _check_token_mask(token_mask: Tensor | None, B: int, T: int) -> Tensor | None:
    """``token_mask [B, T]`` bool/int -> bool, or ``None``."""
    if token_mask is None:
        return None
    if not isinstance(token_mask, Tensor) or tuple(token_mask.shape) != (B, T):
        shape = tuple(token_mask.shape) if isinstance(token_mask, Tensor) else type(token_mask).__name__
        raise ValueError(f"token_mask must have shape [batch, seqlen] = {(B, T)} (True/1 = real token), got {shape}")
    if token_mask.dtype.is_floating_point or token_mask.dtype.is_complex:
        raise ValueError(f"token_mask must be bool or integer (True/1 = real token), got {token_mask.dtype}")
    return token_mask.bool()


def conv_states_from_inputs(
    x: Tensor,
    state_len: int,
    *,
    seq_idx: Tensor | None = None,
    initial_state: Tensor | None = None,
    token_mask: Tensor | None = None,
    return_final_state: bool = True,
    return_varlen_states: bool = False,
) -> tuple[Tensor | None, Tensor | None]:
    """Gather conv states: the last ``state_len`` real inputs of each sequence.

    Args:
        x: conv inputs ``[B, T, D]`` (before the conv, not the outputs).
        state_len: number of columns ``L`` of each state.
        seq_idx: ``[B, T]`` int32 (validated by the caller) or ``None`` (one sequence per row).
        initial_state: ``[B, D, S]`` previous inputs of each row (oldest first); they precede the row's
            FIRST sequence only.
        token_mask: ``[B, T]`` bool or ``None``; masked tokens are not present.

    Returns:
        ``(final_state [B, D, L] | None, varlen_states [S_total, D, L] | None)``: a state per row (its last
        sequence) and per sequence (row-major order of appearance), zero-filled on the left when fewer
        than ``L`` inputs exist.
    """
    Bsz, T, D = x.shape
    L = state_len
    dev = x.device
    if seq_idx is None and token_mask is None and T >= L and not return_varlen_states:
        # one sequence per row, every token real, the row as long as the state: its last L inputs (a copy, so
        # the state does not keep the caller's larger input tensor alive)
        final = x[:, T - L :].transpose(1, 2).clone(memory_format=torch.contiguous_format)  # [B, D, L]
        return (final if return_final_state else None), None
    if seq_idx is None and not return_varlen_states and tracing():
        return (_row_states_right_padded(x, L, initial_state, token_mask) if return_final_state else None), None
    if seq_idx is None:
        seq_idx = torch.zeros(Bsz, T, dtype=torch.int32, device=dev)
    n_tok = Bsz * T
    sid = sequence_ids(seq_idx).reshape(-1)  # [N] global sequence id, row-major
    cu = cu_seqlens_from_seq_idx(seq_idx).long()  # [S + 1]
    n_seq = cu.numel() - 1
    starts, ends = cu[:-1], cu[1:]  # [S], [S] (exclusive end)
    valid = torch.ones(n_tok, dtype=torch.long, device=dev) if token_mask is None else token_mask.reshape(-1).long()
    rc = torch.flip(torch.cumsum(torch.flip(valid, (0,)), 0), (0,))  # [N] valid tokens at positions >= t
    rc = torch.cat([rc, rc.new_zeros(1)])  # [N + 1]
    after = rc[ends]  # [S] valid tokens after each sequence
    count = rc[starts] - after  # [S] valid tokens in each sequence
    rank = rc[:n_tok] - after[sid]  # [N] 1 = last valid token of its sequence
    S_init = 0 if initial_state is None else initial_state.shape[-1]
    zero_row = n_tok + Bsz * S_init
    idx = torch.full((n_seq, L), zero_row, dtype=torch.long, device=dev)  # [S, L] source rows
    take = (valid > 0) & (rank <= L)  # [N]
    pos = take.nonzero().squeeze(1)  # [n_take]
    idx[sid[pos], L - rank[pos]] = pos
    if initial_state is not None:
        first_of_row = (starts % T) == 0  # [S]
        row = starts // T  # [S]
        need = (L - count).clamp(min=0)  # [S] columns not filled by this sequence's own tokens
        j = torch.arange(L, device=dev)[None, :]  # [1, L]
        col = S_init - need[:, None] + j  # [S, L] column of initial_state feeding state column j
        use = first_of_row[:, None] & (j < need[:, None]) & (col >= 0)  # [S, L]
        init_rows = n_tok + row[:, None] * S_init + col  # [S, L]
        idx = torch.where(use, init_rows, idx)
    parts = [x.reshape(n_tok, D)]  # [N, D]
    if initial_state is not None:
        parts.append(initial_state.transpose(1, 2).reshape(Bsz * S_init, D).to(x.dtype))  # [B * S_init, D]
    parts.append(x.new_zeros(1, D))
    src = torch.cat(parts, 0)  # [N + B * S_init + 1, D]
    states = src[idx].transpose(1, 2)  # [S, L, D] -> [S, D, L]
    final = None
    if return_final_state:
        last = sid.reshape(Bsz, T)[:, -1]  # [B] id of each row's last sequence
        final = states[last]  # [B, D, L]
    return final, (states if return_varlen_states else None)


def _row_states_right_padded(x: Tensor, L: int, initial_state: Tensor | None, token_mask: Tensor | None) -> Tensor:
    """One sequence per row, real tokens first: the last ``L`` real inputs of ``[initial_state || x]`` of each row,
    ``[B, D, L]``, zero-filled on the left (the same values as the general gather, with static shapes)."""
    Bsz, T, D = x.shape
    if token_mask is not None and T > 1:
        device_check(
            ~pads_before_real(token_mask).any(),
            "under torch.compile, conv states are gathered from right-padded rows only (real tokens first); "
            "compact the rows first (safepad.layout.Compaction)",
        )
    S_init = 0 if initial_state is None else initial_state.shape[-1]
    parts = [x.new_zeros(Bsz, D, 1)]  # column 0: the zero fill
    if initial_state is not None:
        parts.append(initial_state.to(x.dtype))
    parts.append(x.transpose(1, 2))
    src = torch.cat(parts, dim=2)  # [B, D, 1 + S_init + T]
    n = torch.full((Bsz,), T, device=x.device) if token_mask is None else token_mask.sum(dim=1)  # [B] real tokens
    col = S_init + n[:, None] - L + torch.arange(L, device=x.device)  # [B, L] column in [init || x]
    col = torch.where(col >= 0, col + 1, torch.zeros_like(col))  # before the first input: the zero column
    return src.gather(2, col[:, None, :].expand(Bsz, D, L))  # [B, D, L]


# Tokens per block of the conv's forward and backward: each pass of the K shifted sums then reads and writes
# ~1 MiB slices that stay in cache between passes instead of streaming whole [B, T, D] tensors K times.
_BLOCK_BYTES = 1 << 20


class _CausalConv:
    """Depthwise causal conv (+ bias, + optional SiLU) as a sum of ``K`` shifted, weighted copies of ``x``.

    Token-major throughout (no transposes), over blocks of tokens, with a hand-written backward: on CPU this
    is much faster than ``F.conv1d(groups=D)`` (whose depthwise backward is slow there) and than letting
    autograd differentiate the shifted sums (one fresh full-size tensor per term, each streamed from memory).

    x ``[B, T, D]`` (any strides); weight ``[D, K]``; bias ``[D]`` | None; head ``[B, K-1, D]`` the inputs
    before the first token (zeros or the cached state); same ``[K-1, B, T, 1]`` bool | None: True where the input
    ``K-1-k`` tokens back belongs to the same sequence. Returns ``[B, T, D]``.
    """

    @staticmethod
    def _blocks(x: Tensor, head: Tensor):
        """(tokens per block, the first block's padded input ``[B, K-1+n, D]``).

        A block reads the ``K-1`` tokens before it, so blocks after the first must start at ``t0 >= K-1``.
        """
        Bsz, T, D = x.shape
        tb = max(head.shape[1], 1, _BLOCK_BYTES // max(1, Bsz * D * x.element_size()))  # batch 0: one empty block
        return tb, torch.cat([head, x[:, : min(T, tb)]], dim=1)

    @staticmethod
    def fwd(x: Tensor, weight: Tensor, bias: Tensor | None, head: Tensor, same: Tensor | None, silu: bool):
        """``(out [B, T, D], pre [B, T, D] before the SiLU | None without it)``."""
        Bsz, T, D = x.shape
        K = weight.shape[1]
        tb, first = _CausalConv._blocks(x, head)
        pre = x.new_empty(Bsz, T, D)  # [B, T, D] before the activation
        out = x.new_empty(Bsz, T, D) if silu else pre
        buf = x.new_empty(Bsz, min(tb, T), D) if same is not None else None
        zero = x.new_zeros(())
        for t0 in range(0, T, tb):
            t1 = min(t0 + tb, T)
            n = t1 - t0
            xb = first if t0 == 0 else x[:, t0 - (K - 1) : t1]  # [B, K-1+n, D] the block and its left context
            p = pre[:, t0:t1]
            if bias is not None:
                torch.addcmul(bias, xb[:, K - 1 :], weight[:, K - 1], out=p)  # the current token
            else:
                torch.mul(xb[:, K - 1 :], weight[:, K - 1], out=p)
            for k in range(K - 1):  # p[t] += w[:, k] * x[t - (K-1-k)]
                src = xb[:, k : k + n]  # [B, n, D]
                if same is not None:
                    src = torch.where(same[k][:, t0:t1], src, zero, out=buf[:, :n])  # same sequence only (a NaN
                    # across the boundary is dropped, not multiplied by zero)
                p.addcmul_(src, weight[:, k])
            if silu:
                torch.mul(p, torch.sigmoid(p), out=out[:, t0:t1])
        return out, (pre if silu else None)

    @staticmethod
    def bwd(g: Tensor, x: Tensor, head: Tensor, weight: Tensor, same: Tensor | None, pre: Tensor | None, silu: bool,
            has_bias: bool, need: tuple[bool, bool, bool, bool]):
        """``(g_xp [B, K-1+T, D] (g_head then g_x) | None, g_w [K, D] | None, g_b [D] | None)`` for ``g``
        ``[B, T, D]``; ``need`` = which of x, weight, bias, head want a gradient."""
        Bsz, T, D = x.shape
        K = weight.shape[1]
        need_x, need_w, need_b, need_head = need
        tb, first = _CausalConv._blocks(x, head)
        m = min(tb, T)
        g_xp = x.new_empty(Bsz, K - 1 + T, D) if (need_x or need_head) else None  # [B, K-1+T, D]
        g_w = x.new_zeros(K, D)  # [K, D] (transposed at the end)
        g_b = x.new_zeros(D)
        gp_ws, buf_ws = x.new_empty(Bsz, m, D), x.new_empty(Bsz, m, D)
        gm_ws = x.new_empty(Bsz, m, D) if same is not None else None
        zero = x.new_zeros(())
        for t0 in range(0, T, tb):
            t1 = min(t0 + tb, T)
            n = t1 - t0
            gp = gp_ws[:, :n]  # [B, n, D] gradient before the activation
            if silu:
                torch.ops.aten.silu_backward.grad_input(g[:, t0:t1], pre[:, t0:t1], grad_input=gp)
            else:
                gp.copy_(g[:, t0:t1])
            xb = first if t0 == 0 else x[:, t0 - (K - 1) : t1]  # [B, K-1+n, D]
            o = K - 1 + t0  # g_xp index of token t0
            if g_xp is not None:
                torch.mul(gp, weight[:, K - 1], out=g_xp[:, o : o + n])  # first write of this block's rows
                if t0 == 0:
                    g_xp[:, : K - 1].zero_()
            if need_w:
                g_w[K - 1] += torch.mul(gp, xb[:, K - 1 :], out=buf_ws[:, :n]).sum((0, 1))
            for k in range(K - 1):
                s = K - 1 - k  # this tap reads the input s tokens back
                gk = gp if same is None else torch.where(same[k][:, t0:t1], gp, zero, out=gm_ws[:, :n])
                if g_xp is not None:
                    g_xp[:, o - s : o - s + n].addcmul_(gk, weight[:, k])  # rows of this or the previous block
                if need_w:
                    g_w[k] += torch.mul(gk, xb[:, k : k + n], out=buf_ws[:, :n]).sum((0, 1))
            if need_b and has_bias:
                g_b += gp.sum((0, 1))
        return g_xp, (g_w if need_w else None), (g_b if need_b and has_bias else None)


# _CausalConv as custom ops with a registered autograd formula: opaque to torch.compile (the block loops with
# out= and in-place updates run as they are), the same code in eager.
@torch.library.custom_op("safepad::causal_conv", mutates_args=())
def _causal_conv_op(
    x: Tensor, weight: Tensor, bias: Tensor | None, head: Tensor, same: Tensor | None, silu: bool
) -> tuple[Tensor, Tensor]:
    out, pre = _CausalConv.fwd(x, weight, bias, head, same, silu)
    return out.contiguous(), (x.new_empty(0) if pre is None else pre.contiguous())


@_causal_conv_op.register_fake
def _(x, weight, bias, head, same, silu):
    Bsz, T, D = x.shape
    return x.new_empty(Bsz, T, D), (x.new_empty(Bsz, T, D) if silu else x.new_empty(0))


@torch.library.custom_op("safepad::causal_conv_bwd", mutates_args=())
def _causal_conv_bwd_op(
    g: Tensor, x: Tensor, head: Tensor, weight: Tensor, same: Tensor | None, pre: Tensor, silu: bool, has_bias: bool,
    need_x: bool, need_w: bool, need_b: bool, need_head: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    g_xp, g_w, g_b = _CausalConv.bwd(
        g, x, head, weight, same, pre if silu else None, silu, has_bias, (need_x, need_w, need_b, need_head)
    )
    return tuple(x.new_empty(0) if t is None else t.contiguous() for t in (g_xp, g_w, g_b))  # no two alike


@_causal_conv_bwd_op.register_fake
def _(g, x, head, weight, same, pre, silu, has_bias, need_x, need_w, need_b, need_head):
    Bsz, T, D = x.shape
    K = weight.shape[1]
    g_xp = x.new_empty(Bsz, K - 1 + T, D) if (need_x or need_head) else x.new_empty(0)
    g_w = x.new_empty(K, D) if need_w else x.new_empty(0)
    g_b = x.new_empty(D) if need_b and has_bias else x.new_empty(0)
    return g_xp, g_w, g_b


def _causal_conv_setup(ctx, inputs, output):
    x, weight, bias, head, same, silu = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.silu, ctx.has_bias = silu, bias is not None
    ctx.save_for_backward(x, head, weight, same, output[1])


def _causal_conv_backward(ctx, g, _g_pre):
    x, head, weight, same, pre = ctx.saved_tensors
    need_x, need_w, need_b, need_head = ctx.needs_input_grad[:4]
    need_b = need_b and ctx.has_bias
    if not (need_x or need_w or need_b or need_head):
        return None, None, None, None, None, None
    K = weight.shape[1]
    g_xp, g_w, g_b = _causal_conv_bwd_op(g, x, head, weight, same, pre, ctx.silu, ctx.has_bias, need_x, need_w, need_b,
                                         need_head)
    return (
        g_xp[:, K - 1 :] if need_x else None,
        g_w.t() if need_w else None,
        g_b if need_b else None,
        g_xp[:, : K - 1] if need_head else None,
        None,
        None,
    )


_causal_conv_op.register_autograd(_causal_conv_backward, setup_context=_causal_conv_setup)


def _conv_fla(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    seq_idx: Tensor | None,
    mask: Tensor | None,
    init_tail: Tensor | None,
    activation: str | None,
) -> Tensor:
    """The conv through FLA's Triton ``causal_conv1d`` (fwd and bwd); returns ``y [B, T, D]`` in x's dtype.

    FLA's initial state is ``[N, D, K]`` per sequence (its last ``K - 1`` columns feed the conv) and varlen input
    is one flat row with ``cu_seqlens``. Masked tokens are zeros, as on the torch core. FLA accumulates in fp32
    and rounds once to x's dtype, as the torch core does; the weight and bias go in as fp32.
    """
    Bsz, T, D = x.shape
    K = weight.shape[1]
    xk = x if mask is None else torch.where(mask.unsqueeze(-1), x, 0.0)  # [B, T, D]
    init = None
    if init_tail is not None:  # [B, D, K-1] -> [B, D, K] (column 0 is never read)
        init = torch.cat([init_tail.new_zeros(Bsz, D, 1), init_tail], dim=2)  # the torch core's dtype (fp32)
    w = weight.float()
    b = bias.float() if bias is not None else None
    if seq_idx is None:
        y, _ = kernels.fla_causal_conv1d(xk, w, b, initial_state=init, activation=activation, backend="triton")
        return y
    cu = cu_seqlens_from_seq_idx(seq_idx).long()  # [S + 1] over the flat B * T tokens
    if init is not None:
        starts = cu[:-1]
        first = (starts % T) == 0  # [S] the row's first sequence gets the row's state
        per_seq = init[starts // T]  # [S, D, K]
        init = torch.where(first[:, None, None], per_seq, 0.0)
    y, _ = kernels.fla_causal_conv1d(xk.reshape(1, Bsz * T, D), w, b, initial_state=init, activation=activation,
                                     backend="triton", cu_seqlens=cu, cu_seqlens_cpu=cu.cpu())  # fmt: skip
    return y.reshape(Bsz, T, D)


def _conv_torch(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    seq_idx: Tensor | None,
    init: Tensor | None,
    activation: str | Callable[[Tensor], Tensor] | None,
) -> Tensor:
    """Depthwise causal conv + activation. x ``[B, T, D]`` (already masked), init ``[B, D, K-1]`` | None."""
    Bsz, T, D = x.shape
    K = weight.shape[1]
    head = x.new_zeros(Bsz, K - 1, D) if init is None else init.transpose(1, 2)  # [B, K-1, D]
    same = None
    if seq_idx is not None and K > 1:
        seqp = torch.cat([seq_idx[:, :1].expand(Bsz, K - 1), seq_idx], dim=1)  # [B, K-1+T]; init = row's first seq
        same = torch.stack([seqp[:, k : k + T] == seq_idx for k in range(K - 1)])  # [K-1, B, T]
        same = same.unsqueeze(-1)  # [K-1, B, T, 1] bool (selection, not a multiply)
    silu = activation in ("silu", "swish")
    if tracing():
        y = _causal_conv_traced(x, weight, bias, head, same, silu)
    else:
        y = _causal_conv_op(x, weight, bias, head, same, silu)[0]
    fn = _activation_fn(activation)  # any other activation (gelu, relu, ...) after the fused conv
    return y if fn is None else fn(y)


def _causal_conv_traced(
    x: Tensor, weight: Tensor, bias: Tensor | None, head: Tensor, same: Tensor | None, silu: bool
) -> Tensor:
    """:class:`_CausalConv`'s math as plain torch ops, for ``torch.compile``: inductor fuses the ``K`` shifted
    sums (and the backward AOT autograd derives from them) into one loop each, where the opaque custom op would
    stream every term. Arguments as :meth:`_CausalConv.fwd`; returns ``[B, T, D]``."""
    T = x.shape[1]
    K = weight.shape[1]
    xp = torch.cat([head, x], dim=1)  # [B, K-1+T, D]
    pre = x * weight[:, K - 1]  # [B, T, D] the current token
    if bias is not None:
        pre = pre + bias
    for k in range(K - 1):  # pre[t] += w[:, k] * x[t - (K-1-k)], same sequence only
        src = xp[:, k : k + T]  # [B, T, D]
        if same is not None:
            src = torch.where(same[k], src, 0.0)  # selection: a NaN across the boundary is dropped
        pre = pre + src * weight[:, k]
    return F.silu(pre) if silu else pre


_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _kernel_conv_ok(x: Tensor, K: int) -> bool:
    """What causal-conv1d's CUDA forward takes (its C++ checks): width 2..4, channel-last channels % 8 == 0."""
    return 2 <= K <= 4 and x.shape[2] % 8 == 0 and x.dtype in _KERNEL_DTYPES


class ConvArgs(NamedTuple):
    """:func:`causal_conv1d`'s arguments once checked: the sizes, the validated ``seq_idx``, the boolean
    ``mask`` (``None`` without a token mask) and the resolved ``state_len``."""

    Bsz: int
    T: int
    D: int
    K: int
    seq_idx: Tensor | None
    mask: Tensor | None
    state_len: int


def check_causal_conv1d_args(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    *,
    activation: str | None,
    seq_idx: Tensor | None,
    initial_state: Tensor | None,
    token_mask: Tensor | None,
    return_final_state: bool,
    state_len: int | None,
    return_varlen_states: bool,
    backend: str,
) -> ConvArgs:
    """Validate :func:`causal_conv1d`'s arguments (shapes ``[B, T, D]`` etc., see there); raise ``ValueError``
    naming the first bad one. Shared with the sequence-parallel conv (``safepad.parallel.ops``)."""
    if not isinstance(x, Tensor) or x.dim() != 3:
        raise ValueError(f"x must have shape [batch, seqlen, dim], got {getattr(x, 'shape', type(x).__name__)}")
    Bsz, T, D = x.shape
    if T == 0:
        raise ValueError("x must have at least one token (seqlen >= 1)")
    if not isinstance(weight, Tensor) or weight.dim() != 2 or weight.shape[0] != D or weight.shape[1] < 1:
        raise ValueError(f"weight must have shape [dim, width] = [{D}, K], got {tuple(weight.shape)}")
    K = weight.shape[1]
    if bias is not None and tuple(bias.shape) != (D,):
        raise ValueError(f"bias must have shape [dim] = [{D}], got {tuple(bias.shape)}")
    _check_activation(activation)
    check_backend(backend)
    if seq_idx is not None:
        seq_idx = validate_seq_idx(seq_idx, (Bsz, T))
    mask = _check_token_mask(token_mask, Bsz, T)
    if initial_state is not None and (
        initial_state.dim() != 3 or initial_state.shape[:2] != (Bsz, D) or initial_state.shape[2] < K - 1
    ):
        raise ValueError(
            f"initial_state must have shape [batch, dim, S] = [{Bsz}, {D}, S >= {K - 1}] (previous inputs, "
            f"oldest first), got {tuple(initial_state.shape)}"
        )
    if state_len is None:
        state_len = K - 1
    if state_len < 1 and (return_final_state or return_varlen_states):
        raise ValueError(f"state_len must be >= 1 to return conv states, got {state_len}")
    return ConvArgs(Bsz, T, D, K, seq_idx, mask, state_len)


@fp32_core
def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    activation: str | None = None,
    seq_idx: Tensor | None = None,
    initial_state: Tensor | None = None,
    token_mask: Tensor | None = None,
    return_final_state: bool = False,
    state_len: int | None = None,
    return_varlen_states: bool = False,
    dilation: int = 1,
    backend: str = "auto",
):
    """Depthwise causal conv1d over packed / padded rows.

    Args:
        x: ``[B, T, D]``.
        weight: ``[D, K]``; bias: ``[D]`` or ``None``; activation: ``None``, ``"silu"`` / ``"swish"`` (the
            kernel's), any other name of transformers' ``ACT2FN`` or a callable (those two on the torch core).
        seq_idx: ``[B, T]`` int32, non-decreasing per row; the window never reaches across a boundary.
        initial_state: ``[B, D, S]`` with ``S >= K - 1``, the previous inputs of each row (oldest first);
            only its last ``K - 1`` columns feed the conv, and only the row's FIRST sequence sees them.
        token_mask: ``[B, T]`` bool/int, True = real token. Masked inputs are zeros in the conv and are
            not present for the returned states. With ``initial_state``, masked tokens must be trailing.
        return_final_state: also return ``final_state [B, D, state_len]``: the last ``state_len`` real
            inputs of each row's last sequence from ``[initial_state || x]`` (the initial state only when
            the last sequence is the first), zero-filled on the left.
        state_len: columns of the returned states (default ``K - 1``).
        return_varlen_states: also return ``varlen_states [S_total, D, state_len]``, one per sequence in
            row-major order of appearance, same rule.
        dilation: tap spacing ``d``: ``y_t = sum_j w_j x_{t - (K - 1 - j) d}``. The conv then reads the last
            ``(K - 1) d`` inputs, which is what ``initial_state`` must hold (and the default ``state_len``).
        backend: ``"auto"`` | ``"torch"`` | ``"kernels"`` (see ``safepad.ops.kernels.use_kernels``).

    Returns:
        ``y [B, T, D]`` (dtype of ``x``), then ``final_state`` and ``varlen_states`` when requested.
    """
    if isinstance(weight, Tensor) and weight.dim() == 2:  # (a wrong shape is reported by the check below)
        weight = _dilated(weight, dilation)  # [D, K] -> [D, (K - 1) d + 1]
    Bsz, T, D, K, seq_idx, mask, state_len = check_causal_conv1d_args(
        x, weight, bias, activation=activation, seq_idx=seq_idx, initial_state=initial_state, token_mask=token_mask,
        return_final_state=return_final_state, state_len=state_len, return_varlen_states=return_varlen_states,
        backend=backend,
    )

    ct = _compute_dtype(x.dtype, weight.dtype)
    xc = x.to(ct)
    if mask is not None:
        xc = torch.where(mask.unsqueeze(-1), xc, 0.0)  # [B, T, D] (a NaN at a masked token is dropped)
    init_tail = None
    if initial_state is not None and K > 1:
        init_tail = initial_state[:, :, initial_state.shape[2] - (K - 1) :].to(ct)  # [B, D, K-1]
    w, b = weight.to(ct), (bias.to(ct) if bias is not None else None)

    # causal_conv1d_fn takes seq_idx or an initial state, not both; its CUDA kernel takes widths 2..4, channels
    # in multiples of 8 (channel-last layout) and no float64
    # (and only the activations it implements: any other runs on the torch core, the same math)
    kernel_ok = (
        not (seq_idx is not None and init_tail is not None)
        and _kernel_conv_ok(x, K)
        and activation in _KERNEL_ACTIVATIONS
    )
    # without causal-conv1d, FLA's Triton conv takes every call in the kernel dtypes with the kernel activations:
    # packed rows as varlen sequences of one flat row, and per-sequence initial states (the row's state for its
    # first sequence, zeros for the others), which causal_conv1d_fn cannot combine with seq_idx
    fla_ok = (
        kernels.causal_conv1d_fn is None
        and x.dtype in _KERNEL_DTYPES
        and activation in _KERNEL_ACTIVATIONS
        and not tracing()
    )
    if fla_ok and kernels.use_kernels(x, weight, need=("fla_causal_conv1d",), backend=backend):
        y = _conv_fla(x, weight, bias, seq_idx, mask, init_tail, activation)
    elif kernel_ok and kernels.use_kernels(x, weight, need=("causal_conv1d_fn",), backend=backend):
        x_k = x.contiguous().transpose(1, 2)  # [B, D, T] channel-last view (stride(1) == 1, stride(2) == D)
        if mask is not None:
            x_k = torch.where(mask.unsqueeze(-1), x, 0.0).transpose(1, 2)
        init_k = None
        if init_tail is not None:
            init_k = initial_state[:, :, initial_state.shape[2] - (K - 1) :].to(x.dtype)
            init_k = init_k.transpose(1, 2).contiguous().transpose(1, 2)  # [B, D, K-1], channel-last
        y = kernels.causal_conv1d_fn(
            x_k,
            weight.to(x.dtype),
            bias.to(x.dtype) if bias is not None else None,
            seq_idx=seq_idx,
            initial_states=init_k,
            activation=activation,
        ).transpose(1, 2)  # [B, T, D]
    else:
        if backend == "kernels":  # use_kernels already raised unless kernel_ok is False
            raise ValueError(
                "backend='kernels': causal_conv1d_fn cannot take seq_idx together with initial_state, and takes "
                "only widths 2..4, channels in multiples of 8, float32/float16/bfloat16 and the activations None, "
                f"'silu' and 'swish' (got {activation!r}); use backend='auto' to route this call to the torch core"
            )
        y = _conv_torch(xc, w, b, seq_idx, init_tail, activation).to(x.dtype)

    out: list[Tensor] = [y]
    if return_final_state or return_varlen_states:
        final, varlen = conv_states_from_inputs(
            x,
            state_len,
            seq_idx=seq_idx,
            initial_state=initial_state,
            token_mask=mask,
            return_final_state=return_final_state,
            return_varlen_states=return_varlen_states,
        )
        if return_final_state:
            out.append(final)
        if return_varlen_states:
            out.append(varlen)
    return out[0] if len(out) == 1 else tuple(out)


@fp32_core
def causal_conv1d_step(
    x: Tensor,
    conv_state: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    activation: str | None = None,
    dilation: int = 1,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """One decode step.

    Args:
        x: ``[B, D]`` the new input, or ``[B, 1, D]`` (a one-token chunk, as a mixer holds it: ``y`` then comes
            back ``[B, 1, D]`` too, with no view ops to drop and restore the token dim);
            conv_state: ``[B, D, S]`` (``S >= (K - 1) * dilation``, oldest first).
        weight: ``[D, K]``; bias: ``[D]`` | None; dilation: tap spacing (see :func:`causal_conv1d`).

    Returns:
        ``(y [B, D] | [B, 1, D], new_state [B, D, S])``: ``new_state`` is ``conv_state`` rolled left by one with
        ``x`` appended (a new tensor; ``conv_state`` is not modified).
    """
    tokens = isinstance(x, Tensor) and x.dim() == 3 and x.shape[1] == 1  # [B, 1, D]
    if not isinstance(x, Tensor) or not (x.dim() == 2 or tokens):
        raise ValueError(
            f"x must have shape [batch, dim] or [batch, 1, dim], got {getattr(x, 'shape', type(x).__name__)}"
        )
    Bsz, D = x.shape[0], x.shape[-1]
    if not isinstance(weight, Tensor) or weight.dim() != 2 or weight.shape[0] != D:
        raise ValueError(f"weight must have shape [dim, width] = [{D}, K], got {tuple(weight.shape)}")
    weight = _dilated(weight, dilation)  # [D, (K - 1) d + 1]
    K = weight.shape[1]
    if conv_state.dim() != 3 or conv_state.shape[:2] != (Bsz, D) or conv_state.shape[2] < max(K - 1, 1):
        raise ValueError(
            f"conv_state must have shape [batch, dim, S] = [{Bsz}, {D}, S >= {max(K - 1, 1)}], got {tuple(conv_state.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (D,):
        raise ValueError(f"bias must have shape [dim] = [{D}], got {tuple(bias.shape)}")
    _check_activation(activation)
    check_backend(backend)
    S = conv_state.shape[2]
    expressible = (
        S >= K
        and 2 <= K <= 4
        and x.dtype in _KERNEL_DTYPES
        and conv_state.dtype == x.dtype == weight.dtype
        and not torch.is_grad_enabled()
        and activation in _KERNEL_ACTIVATIONS
    )
    fla_ok = (
        kernels.causal_conv1d_update is None
        and x.dtype in _KERNEL_DTYPES
        and conv_state.dtype in _KERNEL_DTYPES
        and not torch.is_grad_enabled()
        and activation in _KERNEL_ACTIVATIONS
        and K > 1
    )
    if fla_ok and kernels.use_kernels(x, conv_state, weight, need=("fla_causal_conv1d_update",), backend=backend):
        # FLA's update reads a cache of exactly K columns (column 0 unused) and writes it shifted in place: a copy
        # of the last K - 1 columns goes in; the new state is the exact shift, as on the torch core
        x2 = x[:, 0] if tokens else x  # [B, D]
        cache = torch.cat([conv_state.new_zeros(Bsz, D, 1), conv_state[:, :, S - (K - 1) :]], dim=2)
        b = bias.float() if bias is not None else None
        y, _ = kernels.fla_causal_conv1d_update(x2, cache, weight=weight.float(), bias=b, activation=activation)
        new_state = torch.cat([conv_state[:, :, 1:], x2.unsqueeze(-1).to(conv_state.dtype)], dim=2)  # [B, D, S]
        return (y.unsqueeze(1) if tokens else y), new_state
    if backend == "kernels" and not expressible:
        raise ValueError(
            "backend='kernels': causal_conv1d_update needs conv_state with S >= K columns, a width K of 2..4, one "
            "float32/float16/bfloat16 dtype for x, conv_state and weight, no autograd (torch.no_grad()) and the "
            f"activation None, 'silu' or 'swish' (got {activation!r}); use backend='auto' otherwise"
        )
    if expressible and kernels.use_kernels(x, conv_state, weight, need=("causal_conv1d_update",), backend=backend):
        x2 = x[:, 0] if tokens else x  # [B, D]
        new_state = conv_state.clone()
        y = kernels.causal_conv1d_update(x2, new_state, weight, bias, activation=activation)  # updates new_state
        return (y.unsqueeze(1) if tokens else y), new_state
    x_tok = x if tokens else x.unsqueeze(1)  # [B, 1, D]
    older = conv_state[:, :, 1:]  # [B, D, S - 1]: the columns the roll keeps
    new_state = torch.cat([older, x_tok.transpose(1, 2).to(conv_state.dtype)], dim=2)  # [B, D, S]
    ct = _compute_dtype(x.dtype, weight.dtype, conv_state.dtype)
    # the chunked conv's own code on a one-token chunk whose left context is the cached state: the same sums in
    # the same order and the same SiLU, so a decode step rounds exactly as the full forward does at that token
    # (a different summation order flipped bf16 outputs by one ulp: rollout-vs-training gap in GRPO). With the
    # cache's S == K columns, the left context is the roll's own slice (one view, not two). The op computes in x's
    # dtype (ct); the weight, bias and state columns go in as they are stored: its cat and multiply-adds promote
    # them to ct exactly (a widening, the values the separate casts gave), with no cast op of their own
    init = None if K == 1 else (older if S == K else conv_state[:, :, S - (K - 1) :])  # [B, D, K-1]
    y = _conv_torch(x_tok.to(ct), weight, bias, None, init, activation).to(x.dtype)  # [B, 1, D]
    return (y if tokens else y[:, 0]), new_state
