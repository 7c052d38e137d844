"""Gated group RMSNorm, ``weight * rmsnorm_per_group(y * silu(gate))``, with a hand-written backward.

This is the exact math of transformers' ``MambaRMSNormGated`` and its copies (Mamba2, Bamba, Nemotron-H,
GraniteMoeHybrid, Zamba2): cast to float32, gate, normalise each group of ``group_size`` channels, cast
back to the input dtype, scale by ``weight``. The stock module runs it as ~10 full-size elementwise passes
(and autograd keeps several of them); here forward and backward run over cache-sized blocks of rows and
save only the ``[R, groups]`` inverse RMS. The mixers use it only for an unmodified stock norm module with no
hooks (see :func:`safepad.mixers.common.gated_norm`), so the result is the module's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .._tracing import tracing

__all__ = ["gated_rms_norm"]

# Rows per block: ~1 MiB of float32 per [rows, I] slice, so the passes of a block stay in cache.
_BLOCK_BYTES = 1 << 20


def _rows(I: int) -> int:  # noqa: E741
    return max(1, _BLOCK_BYTES // (4 * I))


class _GatedRMSNorm:
    """y, gate ``[R, I]`` (rows may be strided); weight ``[I]``. Forward returns ``([R, I], rstd [R, G])``."""

    @staticmethod
    def fwd(y: Tensor, gate: Tensor, weight: Tensor, group_size: int, eps: float) -> tuple[Tensor, Tensor]:
        R, I = y.shape  # noqa: E741
        G = I // group_size
        out_dtype = torch.promote_types(weight.dtype, y.dtype)
        out = torch.empty(R, I, dtype=out_dtype, device=y.device)  # [R, I]
        rstd = torch.empty(R, G, dtype=torch.float32, device=y.device)  # [R, G]
        rb = _rows(I)
        for r0 in range(0, R, rb):
            r1 = min(r0 + rb, R)
            u = y[r0:r1].float() * F.silu(gate[r0:r1].float())  # [rb, I]
            ug = u.view(r1 - r0, G, group_size)  # [rb, G, S]
            r = torch.rsqrt(ug.pow(2).mean(-1) + eps)  # [rb, G]
            rstd[r0:r1] = r
            n = (ug * r.unsqueeze(-1)).view(r1 - r0, I)  # [rb, I]
            torch.mul(weight, n.to(y.dtype), out=out[r0:r1])
        return out, rstd

    @staticmethod
    def bwd(g_out: Tensor, y: Tensor, gate: Tensor, weight: Tensor, rstd: Tensor, group_size: int):
        """``(g_y [R, I], g_gate [R, I], g_weight [I])``."""
        R, I = y.shape  # noqa: E741
        S = group_size
        G = I // S
        g_y = torch.empty(R, I, dtype=y.dtype, device=y.device)
        g_gate = torch.empty(R, I, dtype=gate.dtype, device=y.device)
        g_w = torch.zeros(I, dtype=torch.float32, device=y.device)
        w = weight.float()
        rb = _rows(I)
        for r0 in range(0, R, rb):
            r1 = min(r0 + rb, R)
            m = r1 - r0
            yb, gf = y[r0:r1].float(), gate[r0:r1].float()  # [rb, I]
            s = F.silu(gf)
            u = yb * s  # [rb, I] the gated input
            r = rstd[r0:r1].unsqueeze(-1)  # [rb, G, 1]
            n = u.view(m, G, S) * r  # [rb, G, S] normalised
            go = g_out[r0:r1].float()  # [rb, I]
            g_w += (go * n.view(m, I).to(y.dtype).float()).sum(0)
            g_n = (go * w).view(m, G, S)  # [rb, G, S]
            dot = (g_n * n).mean(-1, keepdim=True)  # [rb, G, 1]
            g_u = torch.addcmul(g_n, n, dot, value=-1.0).mul_(r).view(m, I)  # [rb, I] through the RMS normalisation
            torch.mul(g_u, s, out=g_y[r0:r1])  # written in (cast to) y's dtype
            torch.ops.aten.silu_backward.grad_input(g_u * yb, gf, grad_input=g_gate[r0:r1])
        return g_y, g_gate, g_w.to(weight.dtype)


# _GatedRMSNorm as custom ops with a registered autograd formula (opaque to torch.compile, same code in eager).
@torch.library.custom_op("safepad::gated_rms_norm", mutates_args=())
def _gated_rms_norm_op(y: Tensor, gate: Tensor, weight: Tensor, group_size: int, eps: float) -> tuple[Tensor, Tensor]:
    return tuple(t.contiguous() for t in _GatedRMSNorm.fwd(y, gate, weight, group_size, eps))


@_gated_rms_norm_op.register_fake
def _(y, gate, weight, group_size, eps):
    R, I = y.shape  # noqa: E741
    out = torch.empty(R, I, dtype=torch.promote_types(weight.dtype, y.dtype), device=y.device)
    return out, torch.empty(R, I // group_size, dtype=torch.float32, device=y.device)


@torch.library.custom_op("safepad::gated_rms_norm_bwd", mutates_args=())
def _gated_rms_norm_bwd_op(
    g_out: Tensor, y: Tensor, gate: Tensor, weight: Tensor, rstd: Tensor, group_size: int
) -> tuple[Tensor, Tensor, Tensor]:
    return tuple(t.contiguous() for t in _GatedRMSNorm.bwd(g_out, y, gate, weight, rstd, group_size))


@_gated_rms_norm_bwd_op.register_fake
def _(g_out, y, gate, weight, rstd, group_size):
    return y.new_empty(y.shape), gate.new_empty(gate.shape), weight.new_empty(weight.shape)


def _gated_rms_norm_setup(ctx, inputs, output):
    y, gate, weight, group_size, eps = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.group_size = group_size
    ctx.save_for_backward(y, gate, weight, output[1])


def _gated_rms_norm_backward(ctx, g_out, _g_rstd):
    y, gate, weight, rstd = ctx.saved_tensors
    return (*_gated_rms_norm_bwd_op(g_out, y, gate, weight, rstd, ctx.group_size), None, None)


_gated_rms_norm_op.register_autograd(_gated_rms_norm_backward, setup_context=_gated_rms_norm_setup)


def _gated_rms_norm_traced(y: Tensor, gate: Tensor, weight: Tensor, group_size: int, eps: float) -> Tensor:
    """The same math as plain torch ops, for ``torch.compile``: inductor fuses its forward and the backward that
    AOT autograd derives into a few loops (faster there than the opaque blocked op). ``[..., I]`` in, out."""
    I = y.shape[-1]  # noqa: E741
    u = y.float() * F.silu(gate.float())  # [..., I]
    ug = u.unflatten(-1, (I // group_size, group_size))  # [..., G, S]
    n = (ug * torch.rsqrt(ug.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)  # [..., I]
    return weight * n.to(y.dtype)


def gated_rms_norm(y: Tensor, gate: Tensor, weight: Tensor, group_size: int, eps: float) -> Tensor:
    """``weight * rmsnorm_per_group(y * silu(gate))``.

    Args:
        y, gate: ``[..., I]`` (the same shape; any strides along the leading dims are fine).
        weight: ``[I]``; group_size: channels per normalisation group (``I % group_size == 0``); eps: added
            to the mean square.

    Returns:
        ``[..., I]`` in ``promote(weight.dtype, y.dtype)``, as the transformers module returns it.
    """
    if y.shape != gate.shape:
        raise ValueError(f"y and gate must have the same shape, got {tuple(y.shape)} and {tuple(gate.shape)}")
    I = y.shape[-1]  # noqa: E741
    if tuple(weight.shape) != (I,) or group_size <= 0 or I % group_size:
        raise ValueError(f"weight must be [{I}] and group_size must divide {I}, got {tuple(weight.shape)}, {group_size}")
    if tracing():
        return _gated_rms_norm_traced(y, gate, weight, int(group_size), float(eps))
    if y.dim() == 2:  # [R, I] already (a decode step's rows): no reshapes
        return _gated_rms_norm_op(y, gate, weight, int(group_size), float(eps))[0]
    out, _ = _gated_rms_norm_op(y.reshape(-1, I), gate.reshape(-1, I), weight, int(group_size), float(eps))
    return out.view(*y.shape[:-1], I)
