"""Varlen Mamba1 selective scan: a parallel torch core plus exact CUDA-kernel dispatch.

The recurrence (mamba-ssm ``selective_scan_fn`` semantics, as HF ``MambaMixer`` uses it), per
channel ``d`` and state ``n``::

    dt_t  = softplus(delta_t + delta_bias)                      # the dt pipeline (process_dt)
    h_t   = exp(dt_t[d] * A[d, n]) * h_{t-1} + dt_t[d] * u_t[d] * B_t[n]
    y_t   = sum_n h_t[d, n] * C_t[n] + D[d] * u_t[d]
    y_t  *= silu(z_t[d])                                        # when z is given

Varlen layouts on top of it:

* ``seq_idx`` ``[B, T]``: the state is reset to zero at every boundary (the decay of a sequence's first
  token is 0), so packed sequences never see each other.
* ``initial_state`` ``[B, Dm, N]`` reaches only each row's first sequence.
* ``token_mask`` ``[B, T]`` (True = real token): ``dt := 0`` after the pipeline and ``u := 0``, so a
  masked token is the identity on the state (``exp(0 * A) = 1``, no input) wherever the pads sit.

The torch core (:class:`_SelectiveScanFn`) is a first-order linear recurrence ``h_t = a_t h_{t-1} + b_t``
solved by an in-place odd/even (Blelloch-style) parallel scan: ``log2(T)`` levels, ``O(T)`` work, and
only products of decays in ``[0, 1]`` -- never ``exp`` of a positive number, so it stays stable when
``sum(dt * A)`` reaches -1e3. Forward and backward are written by hand: the backward is the reverse
scan of the same form over the saved decays, and the ``[B, T, Dm, N]`` tensors kept for it are just
the decays and the states ``h`` (what autograd through the stock loop keeps as well).
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from safepad._tracing import require
from safepad.layout.boundaries import known_multi_sequence, validate_seq_idx
from safepad.layout.facts import fact
from safepad.ops import kernels
from safepad.ops.amp import fp32_core
from safepad.ops.dt import process_dt, widens_into
from safepad.ops.finite import isolate_nonfinite, poison, poison_rows

logger = logging.getLogger(__name__)

__all__ = ["SelectiveScanArgs", "check_selective_scan_args", "selective_scan", "selective_state_step"]

_NO_LIMIT = (-math.inf, math.inf)  # mamba-ssm applies no clamp, with or without softplus


# ----------------------------------------------------------------------------------------------
# Parallel first-order linear scan (in place on ``b``, ``a`` read-only), along dim 1.
# ----------------------------------------------------------------------------------------------


def _scan_(a: Tensor, b: Tensor) -> Tensor:
    """In place: ``b[:, t] <- a[:, t] * b[:, t-1] + b[:, t]`` for ``t = 1 .. T-1`` (inclusive scan).

    ``a``, ``b``: ``[B, T, ...]`` (strided views allowed); ``a`` is not modified. Odd/even recursion:
    pair ``(2k, 2k+1)`` into one element, scan the ``T // 2`` pairs (which yields the odd positions),
    then finish the even positions with one fused multiply-add. ``log2(T)`` levels, ``O(T)`` work.
    """
    T = b.shape[1]
    if T < 2:
        return b
    m = T // 2
    a_even, a_odd = a[:, 0 : 2 * m : 2], a[:, 1 : 2 * m : 2]  # [B, m, ...] each
    b_even, b_odd = b[:, 0 : 2 * m : 2], b[:, 1 : 2 * m : 2]  # [B, m, ...] each
    b_odd.addcmul_(a_odd, b_even)  # pair (2k, 2k+1) -> b = a_{2k+1} b_{2k} + b_{2k+1}
    _scan_(a_odd * a_even, b_odd)  # pair decays [B, m, ...]; b_odd now holds h at odd positions
    if T > 2:
        # h_{2k} = a_{2k} h_{2k-1} + b_{2k} for k >= 1 (includes the unpaired last one when T is odd)
        b[:, 2::2].addcmul_(a[:, 2::2], b[:, 1 : T - 1 : 2])
    return b


def _rscan_(a: Tensor, g: Tensor) -> Tensor:
    """In place, right to left: ``g[:, t] <- g[:, t] + a[:, t+1] * g[:, t+1]`` for ``t = T-2 .. 0``.

    ``a``: ``[B, T, ...]`` aligned with the *source* token (``a[:, t+1]`` carries ``t+1 -> t``, so the
    forward decays serve as they are; ``a[:, 0]`` is unused); not modified. The mirror of :func:`_scan_`.
    """
    T = g.shape[1]
    if T < 2:
        return g
    m = T // 2
    if T % 2:  # fold the unpaired last element into its left neighbour: it is final already
        g[:, T - 2].addcmul_(a[:, T - 1], g[:, T - 1])
    g_even, g_odd = g[:, 0 : 2 * m : 2], g[:, 1 : 2 * m : 2]  # [B, m, ...] each
    g_even.addcmul_(a[:, 1 : 2 * m : 2], g_odd)  # pair (2k, 2k+1) -> g = g_{2k} + a_{2k+1} g_{2k+1}
    if m > 1:
        a_pair = torch.empty_like(g_even)  # [B, m, ...]: pair k carries into pair k-1 with a_{2k} a_{2k-1}
        a_pair[:, 0].zero_()  # unused
        torch.mul(a[:, 2 : 2 * m : 2], a[:, 1 : 2 * m - 1 : 2], out=a_pair[:, 1:])
        _rscan_(a_pair, g_even)  # g_even now holds the result at even positions
        # G_{2k+1} = g_{2k+1} + a_{2k+2} G_{2k+2} for 2k+2 <= 2m-2 (the last pair's odd one is final)
        g[:, 1 : 2 * m - 2 : 2].addcmul_(a[:, 2 : 2 * m - 1 : 2], g[:, 2 : 2 * m - 1 : 2])
    return g


# ----------------------------------------------------------------------------------------------
# The torch core with a hand-written backward.
# ----------------------------------------------------------------------------------------------


class _SelectiveScanFn:
    """``y = C . h`` with ``h_t = exp(dt_t A) h_{t-1} + dt_t u_t B_t`` and resets at given tokens.

    Inputs (all in the compute dtype): ``u``, ``dt`` ``[B, T, Dm]`` (dt already processed and masked);
    ``A`` ``[Dm, N]``; ``Bm``, ``Cm`` ``[B, T, N]``; ``h0`` ``[B, Dm, N]`` or None; ``resets`` ``[B, T]`` bool:
    tokens whose decay is 0 (first tokens of sequences), or None.

    Forward returns ``y`` ``[B, T, Dm]``, the states after every token ``h`` and the decays ``dA``
    ``[B, T, Dm, N]`` (both kept for backward; states at chosen tokens are read from ``h`` by indexing).
    """

    @staticmethod
    def fwd(u, dt, A, Bm, Cm, h0, resets):
        # contiguous [B, T, *] inputs make every [B, T, Dm, N] product below contiguous (views in backward)
        u, dt, Bm, Cm = u.contiguous(), dt.contiguous(), Bm.contiguous(), Cm.contiguous()
        dA = torch.exp(dt.unsqueeze(-1) * A)  # [B, T, Dm, N], in (0, 1]
        if resets is not None:
            dA.masked_fill_(resets[:, :, None, None], 0.0)
        du = dt * u  # [B, T, Dm]
        h = du.unsqueeze(-1) * Bm.unsqueeze(2)  # [B, T, Dm, 1] * [B, T, 1, N] -> [B, T, Dm, N]
        if h0 is not None:
            h[:, 0].addcmul_(dA[:, 0], h0)
        _scan_(dA, h)  # h: [B, T, Dm, N], the state after every token
        y = torch.matmul(h, Cm.unsqueeze(-1)).squeeze(-1)  # [B, T, Dm, N] @ [B, T, N, 1] -> [B, T, Dm]
        return y, h, dA

    @staticmethod
    def bwd(gy, gh, u, dt, A, Bm, Cm, h0, h, dA):
        """Gradients ``(g_u, g_dt, g_A, g_B, g_C, g_h0 | None)`` for ``gy`` ``[B, T, Dm]`` and ``gh``
        ``[B, T, Dm, N]`` (the states read from ``h``), either None for zeros."""
        u, dt, Bm, Cm = u.contiguous(), dt.contiguous(), Bm.contiguous(), Cm.contiguous()
        Bsz, T, Dm = u.shape
        N = A.shape[1]
        gy = torch.zeros_like(u) if gy is None else gy.contiguous()
        # dL/dh_t from the output at t (and from the read states): [B, T, Dm, 1] * [B, T, 1, N]
        G = gy.unsqueeze(-1) * Cm.unsqueeze(2)  # [B, T, Dm, N]
        if gh is not None:
            G.add_(gh)
        _rscan_(dA, G)  # G_t = total dL/dh_t = g_t + a_{t+1} G_{t+1} (a = 0 at resets cuts the flow)

        du = dt * u  # [B, T, Dm]
        g_C = torch.matmul(h.transpose(-1, -2), gy.unsqueeze(-1)).squeeze(-1)  # [B,T,N,Dm] @ [B,T,Dm,1] -> [B,T,N]
        g_B = torch.matmul(G.transpose(-1, -2), du.unsqueeze(-1)).squeeze(-1)  # [B,T,N,Dm] @ [B,T,Dm,1] -> [B,T,N]
        g_du = torch.matmul(G, Bm.unsqueeze(-1)).squeeze(-1)  # [B,T,Dm,N] @ [B,T,N,1] -> [B,T,Dm]
        g_u = g_du * dt
        g_dt = g_du * u

        # q_t = dL/d(dt_t A) = G_t * a_t * h_{t-1}, in place in G (h_{-1} = h0; dL/dh0 = G_0 a_0)
        q = G.mul_(dA)
        g_h0 = q[:, 0].clone() if h0 is not None else None
        q[:, 1:].mul_(h[:, : T - 1])
        if h0 is not None:
            q[:, 0].mul_(h0)
        else:
            q[:, 0].zero_()
        q_d = q.view(Bsz * T, Dm, N).transpose(0, 1)  # [Dm, B*T, N]
        g_dt = g_dt + torch.matmul(q_d, A.unsqueeze(-1)).squeeze(-1).t().reshape(Bsz, T, Dm)  # sum_n q A
        dt_d = dt.reshape(Bsz * T, Dm).t().unsqueeze(1)  # [Dm, 1, B*T]
        g_A = torch.matmul(dt_d, q_d).squeeze(1)  # [Dm, 1, B*T] @ [Dm, B*T, N] -> [Dm, N]
        return g_u, g_dt, g_A, g_B, g_C, g_h0


# _SelectiveScanFn as custom ops with a registered autograd formula: opaque to torch.compile (the in-place
# odd/even scan runs as it is), the same code in eager.
@torch.library.custom_op("safepad::selective_scan", mutates_args=())
def _selective_scan_op(
    u: Tensor, dt: Tensor, A: Tensor, Bm: Tensor, Cm: Tensor, h0: Tensor | None, resets: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    return tuple(t.contiguous() for t in _SelectiveScanFn.fwd(u, dt, A, Bm, Cm, h0, resets))


@_selective_scan_op.register_fake
def _(u, dt, A, Bm, Cm, h0, resets):
    Bsz, T, Dm = u.shape
    N = A.shape[1]
    return u.new_empty(Bsz, T, Dm), u.new_empty(Bsz, T, Dm, N), u.new_empty(Bsz, T, Dm, N)


@torch.library.custom_op("safepad::selective_scan_bwd", mutates_args=())
def _selective_scan_bwd_op(
    gy: Tensor | None, gh: Tensor | None, u: Tensor, dt: Tensor, A: Tensor, Bm: Tensor, Cm: Tensor, h0: Tensor | None,
    h: Tensor, dA: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    g = _SelectiveScanFn.bwd(gy, gh, u, dt, A, Bm, Cm, h0, h, dA)
    return tuple(t.contiguous() for t in (*g[:5], u.new_empty(0) if g[5] is None else g[5]))


@_selective_scan_bwd_op.register_fake
def _(gy, gh, u, dt, A, Bm, Cm, h0, h, dA):
    g_h0 = h0.new_empty(h0.shape) if h0 is not None else u.new_empty(0)
    return (u.new_empty(u.shape), dt.new_empty(dt.shape), A.new_empty(A.shape), Bm.new_empty(Bm.shape),
            Cm.new_empty(Cm.shape), g_h0)


def _selective_scan_setup(ctx, inputs, output):
    u, dt, A, Bm, Cm, h0, resets = inputs
    _, h, dA = output
    ctx.mark_non_differentiable(dA)
    ctx.set_materialize_grads(False)
    ctx.has_h0 = h0 is not None
    ctx.save_for_backward(u, dt, A, Bm, Cm, h0, h, dA)


def _selective_scan_backward(ctx, gy, gh, _g_dA):
    u, dt, A, Bm, Cm, h0, h, dA = ctx.saved_tensors
    if gy is None and gh is None:
        return None, None, None, None, None, None, None
    g_u, g_dt, g_A, g_B, g_C, g_h0 = _selective_scan_bwd_op(gy, gh, u, dt, A, Bm, Cm, h0, h, dA)
    return g_u, g_dt, g_A, g_B, g_C, (g_h0 if ctx.has_h0 else None), None


_selective_scan_op.register_autograd(_selective_scan_backward, setup_context=_selective_scan_setup)


# ----------------------------------------------------------------------------------------------
# Validation helpers
# ----------------------------------------------------------------------------------------------


def _check_tensor(x: object, name: str, shape: tuple[int, ...], what: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape {what}, got {type(x).__name__}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {what} = {list(shape)}, got {list(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    return x


def _check_A(A: object, Dm: int) -> Tensor:
    if not isinstance(A, Tensor) or A.dim() != 2 or A.shape[0] != Dm:
        shape = list(A.shape) if isinstance(A, Tensor) else type(A).__name__
        raise ValueError(f"A must have shape [Dm, N] = [{Dm}, N], got {shape}")
    if not A.is_floating_point():
        raise ValueError(f"A must be a floating-point tensor, got {A.dtype}")
    message = "A must be non-positive (A = -exp(A_log)); a positive A makes the recurrence blow up"
    if A.numel() and not fact(A, "nonpositive", False):  # a recorded fact skips the host read (none while tracing)
        require(~(A > 0).any(), message)
    return A


def _check_backend(backend: object) -> None:
    if backend not in ("auto", "torch", "kernels"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'kernels', got {backend!r}")


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _gate(y: Tensor, u: Tensor, D: Tensor | None, z: Tensor | None) -> Tensor:
    """``(y + D u) * silu(z)`` in the compute dtype of ``y``; ``[..., Dm]``."""
    if D is not None:  # a narrower D (a bf16 parameter) is widened exactly inside the multiply, without a copy
        y = y + u.to(y.dtype) * (D if D.dtype in widens_into(y.dtype) else D.to(y.dtype))
    if z is not None:
        y = y * F.silu(z.to(y.dtype))
    return y


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


class SelectiveScanArgs(NamedTuple):
    """:func:`selective_scan`'s arguments once checked: the sizes, ``A`` as ``[Dm, N]``, the validated
    ``seq_idx`` and the boolean ``token_mask`` (``None`` when not given)."""

    Bsz: int
    T: int
    Dm: int
    N: int
    A: Tensor
    seq_idx: Tensor | None
    token_mask: Tensor | None


def check_selective_scan_args(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    *,
    D: Tensor | None,
    z: Tensor | None,
    delta_bias: Tensor | None,
    seq_idx: Tensor | None,
    initial_state: Tensor | None,
    token_mask: Tensor | None,
    backend: str,
) -> SelectiveScanArgs:
    """Validate :func:`selective_scan`'s arguments (shapes ``[B, T, Dm]`` etc., see there); raise ``ValueError``
    naming the first bad one. Shared with the sequence-parallel scan (``safepad.parallel.ops``)."""
    _check_backend(backend)
    if not isinstance(u, Tensor) or u.dim() != 3:
        raise ValueError(f"u must be a tensor of shape [B, T, Dm], got {getattr(u, 'shape', type(u).__name__)}")
    if not u.is_floating_point():
        raise ValueError(f"u must be a floating-point tensor, got {u.dtype}")
    Bsz, T, Dm = u.shape
    if T < 1 or Bsz < 1:
        raise ValueError(f"u must have at least one row and one token, got shape {list(u.shape)}")
    _check_tensor(delta, "delta", (Bsz, T, Dm), "[B, T, Dm]")
    A = _check_A(A, Dm)
    N = A.shape[1]
    _check_tensor(B, "B", (Bsz, T, N), "[B, T, N]")
    _check_tensor(C, "C", (Bsz, T, N), "[B, T, N]")
    if D is not None:
        _check_tensor(D, "D", (Dm,), "[Dm]")
    if z is not None:
        _check_tensor(z, "z", (Bsz, T, Dm), "[B, T, Dm]")
    if delta_bias is not None:
        _check_tensor(delta_bias, "delta_bias", (Dm,), "[Dm]")
    if initial_state is not None:
        _check_tensor(initial_state, "initial_state", (Bsz, Dm, N), "[B, Dm, N]")
    if seq_idx is not None:
        seq_idx = validate_seq_idx(seq_idx, (Bsz, T))
    if token_mask is not None:
        if not isinstance(token_mask, Tensor) or tuple(token_mask.shape) != (Bsz, T):
            shape = list(token_mask.shape) if isinstance(token_mask, Tensor) else type(token_mask).__name__
            raise ValueError(f"token_mask must be a bool tensor of shape [B, T] = [{Bsz}, {T}], got {shape}")
        if token_mask.dtype != torch.bool:
            message = "token_mask must be boolean (or 0/1 integers): True marks a real token"
            if token_mask.is_floating_point():
                raise ValueError(message)
            require(((token_mask == 0) | (token_mask == 1)).all(), message)
            token_mask = token_mask.bool()

    return SelectiveScanArgs(Bsz, T, Dm, N, A, seq_idx, token_mask)


@fp32_core
def selective_scan(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    *,
    D: Tensor | None = None,
    z: Tensor | None = None,
    delta_bias: Tensor | None = None,
    delta_softplus: bool = True,
    seq_idx: Tensor | None = None,
    initial_state: Tensor | None = None,
    token_mask: Tensor | None = None,
    return_final_state: bool = False,
    return_varlen_states: bool = False,
    backend: str = "auto",
) -> Tensor | tuple[Tensor, ...]:
    """Mamba1 selective scan over packed / padded rows.

    Args:
        u: inputs ``[B, T, Dm]`` (``Dm`` = intermediate channels).
        delta: raw step sizes ``[B, T, Dm]``; the pipeline ``+ delta_bias -> softplus`` runs in fp32
            (:func:`safepad.ops.dt.process_dt`, no clamp, as in mamba-ssm).
        A: ``[Dm, N]``, non-positive.
        B, C: ``[B, T, N]``.
        D: ``[Dm]`` skip connection, or None.
        z: ``[B, T, Dm]`` gate, or None: ``y * silu(z)``.
        delta_bias: ``[Dm]`` or None.
        delta_softplus: apply softplus to ``delta + delta_bias``.
        seq_idx: ``[B, T]`` int, non-decreasing per row; the state resets wherever it changes.
        initial_state: ``[B, Dm, N]``; reaches only each row's first sequence.
        token_mask: ``[B, T]`` bool (True = real token). Masked tokens leave the state unchanged;
            the outputs there are unspecified.
        return_final_state: also return the state after each row's last token ``[B, Dm, N]``.
        return_varlen_states: also return the state at the end of every sequence ``[S, Dm, N]``,
            row-major in order of appearance (the order of ``cu_seqlens_from_seq_idx``).
        backend: ``"auto"``, ``"torch"`` or ``"kernels"`` (see :func:`safepad.ops.kernels.use_kernels`).

    Returns:
        ``y`` ``[B, T, Dm]`` in ``u.dtype``, or a tuple ``(y, final_state?, varlen_states?)`` when
        states are requested. States are fp32 (fp64 when ``u`` is fp64).
    """
    Bsz, T, Dm, N, A, seq_idx, token_mask = check_selective_scan_args(
        u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias, seq_idx=seq_idx, initial_state=initial_state,
        token_mask=token_mask, backend=backend,
    )

    if torch.compiler.is_compiling():
        multi_seq = seq_idx is not None and T > 1  # no host sync while tracing: reset wherever seq_idx changes
    elif seq_idx is not None and T > 1 and known_multi_sequence(seq_idx) is not None:
        multi_seq = known_multi_sequence(seq_idx)  # decided once by the model call (safepad.wrap): no host read
    else:
        multi_seq = seq_idx is not None and T > 1 and bool((seq_idx[:, 1:] != seq_idx[:, :-1]).any())
    grads_to_state = return_final_state and torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (u, delta, A, B, C, D, z, delta_bias)
    )
    kernel_ok = (
        not multi_seq
        and token_mask is None
        and initial_state is None
        and not grads_to_state
        and u.dtype != torch.float64
        and N <= 256  # the CUDA scan's largest state
        # the kernel takes delta, B, C, z in u's dtype; casting them here would change the result
        and all(t is None or t.dtype == u.dtype for t in (delta, B, C, z))
    )
    if kernel_ok and kernels.use_kernels(u, delta, A, B, C, need=("selective_scan_fn",), backend=backend):
        logger.debug("selective_scan: mamba-ssm selective_scan_fn, shape %s", tuple(u.shape))
        return _selective_scan_kernel(
            u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_final_state, return_varlen_states
        )
    if backend == "kernels":
        raise ValueError(
            "backend='kernels' cannot express this call: mamba-ssm's selective_scan_fn has no seq_idx, token mask "
            "or initial state, gives no gradient through the final state, needs delta, B, C, z in u's dtype "
            "(fp32/fp16/bf16) and a state size N <= 256; use backend='auto'"
        )

    cdt = _compute_dtype(u)
    dt = process_dt(delta, delta_bias, _NO_LIMIT, delta_softplus).to(cdt)  # [B, T, Dm]
    uc = u.to(cdt)  # [B, T, Dm]
    Bc, Cc = B.to(cdt), C.to(cdt)  # [B, T, N]
    if token_mask is not None:
        keep = token_mask.unsqueeze(-1)  # [B, T, 1]
        dt = torch.where(keep, dt, 0.0)
        uc = torch.where(keep, uc, 0.0)
        Bc = torch.where(keep, Bc, 0.0)  # 0 * nan is nan: a masked token's B must not reach the state either
    h0 = initial_state.to(cdt) if initial_state is not None else None
    poisoned = None
    if multi_seq:
        # the zero decay at a reset would carry a NaN of one sequence into the next (0 * nan)
        # (z only gates its own token: a NaN there stays where it is without help)
        (uc, dt, Bc, Cc), h0, poisoned = isolate_nonfinite(seq_idx, [uc, dt, Bc, Cc], h0)
    resets = None
    if multi_seq:
        resets = torch.zeros(Bsz, T, dtype=torch.bool, device=u.device)  # [B, T]: first token of a sequence
        resets[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]

    y, h, _ = _selective_scan_op(uc, dt, A.to(cdt), Bc, Cc, h0, resets)  # h: [B, T, Dm, N]
    y = _gate(y, uc, D, z).to(u.dtype)
    if poisoned is not None:
        y = poison(y, poisoned)  # NaN back where its own sequence has it (and nowhere else)
    if not (return_final_state or return_varlen_states):
        return y
    out = [y]
    if return_final_state:
        final = h[:, T - 1].clone()  # [B, Dm, N] (a copy: a cached state must not keep h alive)
        out.append(final if poisoned is None else poison_rows(final, poisoned[:, T - 1]))
    if return_varlen_states:
        ends = torch.zeros(Bsz, T, dtype=torch.bool, device=u.device)  # [B, T]: last token of a sequence
        ends[:, T - 1] = True
        if seq_idx is not None and T > 1:
            ends[:, :-1] = seq_idx[:, 1:] != seq_idx[:, :-1]
        taps = ends.nonzero(as_tuple=True)  # row-major order of appearance
        states = h[taps]  # [S, Dm, N]
        out.append(states if poisoned is None else poison_rows(states, poisoned[taps]))
    return tuple(out)


def _selective_scan_kernel(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    z: Tensor | None,
    delta_bias: Tensor | None,
    delta_softplus: bool,
    return_final_state: bool,
    return_varlen_states: bool,
) -> Tensor | tuple[Tensor, ...]:
    """mamba-ssm ``selective_scan_fn`` on a call it expresses exactly: one sequence per row, no mask or initial state."""
    want_state = return_final_state or return_varlen_states
    res = kernels.selective_scan_fn(
        u.transpose(1, 2).contiguous(),  # [B, Dm, T]
        delta.transpose(1, 2).contiguous(),  # [B, Dm, T]
        A.float().contiguous(),  # [Dm, N]
        B.transpose(1, 2).contiguous(),  # [B, N, T]
        C.transpose(1, 2).contiguous(),  # [B, N, T]
        D=D.float() if D is not None else None,
        z=z.transpose(1, 2).contiguous() if z is not None else None,  # [B, Dm, T]
        delta_bias=delta_bias.float() if delta_bias is not None else None,
        delta_softplus=delta_softplus,
        return_last_state=want_state,
    )
    y, last = res if want_state else (res, None)
    y = y.transpose(1, 2).to(u.dtype)  # [B, T, Dm]
    if not want_state:
        return y
    last = last.float()  # [B, Dm, N]
    out = [y]
    if return_final_state:
        out.append(last)
    if return_varlen_states:
        out.append(last)  # one sequence per row: its final state
    return tuple(out)


@fp32_core
def selective_state_step(
    state: Tensor,
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    *,
    D: Tensor | None = None,
    z: Tensor | None = None,
    delta_bias: Tensor | None = None,
    delta_softplus: bool = True,
    token_mask: Tensor | None = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """Decode one token, out of place.

    Args:
        state: ``[B, Dm, N]``.
        u, delta, z: ``[B, Dm]`` (``delta`` raw; same pipeline as :func:`selective_scan`).
        A: ``[Dm, N]``; B, C: ``[B, N]``; D, delta_bias: ``[Dm]`` or None.
        token_mask: ``[B]`` (or a decode step's ``[B, 1]``) bool or None. A row whose token is masked (False) keeps
            its state exactly (its ``y`` is not meaningful): its processed ``delta``, ``u`` and ``B`` are selected to
            0 (a NaN there never reaches the state), so ``exp(0 * A) = 1`` and the input term is 0.

    Returns:
        ``(y [B, Dm] in u.dtype, new_state [B, Dm, N] fp32)`` (fp64 when ``u`` is fp64); ``state`` is
        not modified.
    """
    _check_backend(backend)
    if not isinstance(state, Tensor) or state.dim() != 3:
        raise ValueError(f"state must be a tensor of shape [B, Dm, N], got {getattr(state, 'shape', type(state).__name__)}")
    Bsz, Dm, N = state.shape
    if not state.is_floating_point():
        raise ValueError(f"state must be a floating-point tensor, got {state.dtype}")
    _check_tensor(u, "u", (Bsz, Dm), "[B, Dm]")
    _check_tensor(delta, "delta", (Bsz, Dm), "[B, Dm]")
    A = _check_A(A, Dm)
    if A.shape[1] != N:
        raise ValueError(f"A must have shape [Dm, N] = [{Dm}, {N}] to match state, got {list(A.shape)}")
    _check_tensor(B, "B", (Bsz, N), "[B, N]")
    _check_tensor(C, "C", (Bsz, N), "[B, N]")
    if D is not None:
        _check_tensor(D, "D", (Dm,), "[Dm]")
    if z is not None:
        _check_tensor(z, "z", (Bsz, Dm), "[B, Dm]")
    if delta_bias is not None:
        _check_tensor(delta_bias, "delta_bias", (Dm,), "[Dm]")

    cdt = _compute_dtype(u)
    dt = process_dt(delta, delta_bias, _NO_LIMIT, delta_softplus).to(cdt)  # [B, Dm]
    if token_mask is not None:
        if not isinstance(token_mask, Tensor) or tuple(token_mask.shape) not in ((Bsz,), (Bsz, 1)):
            got = getattr(token_mask, "shape", token_mask)
            raise ValueError(f"token_mask must have shape [B] = [{Bsz}] (or [B, 1]), got {got}")
        keep = token_mask.to(torch.bool)
        keep = keep if keep.dim() == 2 else keep[:, None]  # [B, 1]
        # select, not multiply: a NaN in a masked row's dt, u or B must not reach its state (0 * NaN is NaN)
        dt, u, B = torch.where(keep, dt, 0.0), torch.where(keep, u, 0.0), torch.where(keep, B, 0.0)
    if cdt == torch.float32 and kernels.use_kernels(
        state, u, dt, A, B, C, need=("selective_state_update",), backend=backend
    ):
        logger.debug("selective_state_step: mamba-ssm selective_state_update, shape %s", tuple(u.shape))
        new_state = state.float().clone(memory_format=torch.contiguous_format)  # the kernel updates in place
        y = kernels.state_update(new_state, u, dt, A.float(), B, C, D=D.float() if D is not None else None, z=z)
        return y.to(u.dtype), new_state
    if backend == "kernels":
        raise ValueError("backend='kernels' cannot run a float64 decode step; use backend='auto'")
    uc = u.to(cdt)
    dA = torch.exp(dt.unsqueeze(-1) * A.to(cdt))  # [B, Dm, N]
    Bw = B if B.dtype in widens_into(cdt) else B.to(cdt)  # widened exactly inside the multiply
    dBu = (dt * uc).unsqueeze(-1) * Bw.unsqueeze(1)  # [B, Dm, 1] * [B, 1, N] -> [B, Dm, N]
    new_state = torch.addcmul(dBu, dA, state.to(cdt))  # dA * state + dBu [B, Dm, N], as the scan's first token
    y = torch.bmm(new_state, C.to(cdt).unsqueeze(-1)).squeeze(-1)  # [B, Dm, N] @ [B, N, 1] -> [B, Dm]
    y = _gate(y, uc, D, z).to(u.dtype)
    return y, new_state
