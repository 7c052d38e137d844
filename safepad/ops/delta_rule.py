"""Varlen chunked gated delta rule (Gated DeltaNet and Kimi Delta Attention), torch core + kernel dispatch.

The recurrence, per head, with state ``S`` of shape ``[Dk, Dv]`` (HF's ``recurrent_states`` layout
``[B, H, Dk, Dv]``)::

    S_t = exp(g_t) * S_{t-1}                        # g_t scalar (GDN) or per key channel (KDA: diag(exp(g_t)))
    S_t = S_t + k_t ⊗ beta_t * (v_t - S_t^T k_t)    # delta rule write
    o_t = S_t^T (scale * q_t)

which is exactly transformers' ``torch_recurrent_gated_delta_rule`` (qwen3_next, olmo_hybrid) and
``recurrent_kimi_delta_attention`` (kimi_linear). ``scale`` (default ``Dk ** -0.5``) is applied to ``q``
after the optional L2 normalisation, as HF does.

The chunked algorithm is the WY / UT-transform form: inside a chunk of ``C`` tokens, with ``Γ`` the
cumulative log-decay from the chunk start and ``S0`` the state entering the chunk,

    (I + A) δ = β v - β exp(Γ) k S0,      A[i, j] = β_i k_i·k_j exp(Γ_i - Γ_j)  (j < i)
    o_i      = exp(Γ_i) q_i S0 + Σ_{j≤i} exp(Γ_i - Γ_j) (q_i·k_j) δ_j
    S_C      = exp(Γ_C) S0 + Σ_j exp(Γ_C - Γ_j) k_j ⊗ δ_j

so ``δ = U - W S0`` with ``U, W`` from one unit-lower-triangular solve per chunk, and only two small
matmuls per chunk run sequentially. Packed sequences (``seq_idx``) are handled inside the chunks: the
intra-chunk matrices are masked to same-sequence pairs, the carried state reaches only the tokens of
the sequence it belongs to, and the chunk-end state only collects the sequence that is still open.
All exponentials are of non-positive log-decay differences.
"""

from __future__ import annotations

import logging
import numbers
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..layout.boundaries import cu_seqlens_from_seq_idx, validate_seq_idx
from . import kernels
from .amp import fp32_core
from .finite import isolate_nonfinite, poison, poison_rows
from .grad import contiguous_grad

logger = logging.getLogger(__name__)

__all__ = [
    "DeltaRuleArgs", "check_delta_rule_args", "chunk_gated_delta_rule", "gated_delta_rule_step", "l2norm",
]

_L2NORM_EPS = 1e-6  # transformers' (and FLA's) l2norm eps


def l2norm(x: Tensor, dim: int = -1, eps: float = _L2NORM_EPS) -> Tensor:
    """``x / sqrt(sum(x**2) + eps)`` along ``dim``: HF's (and FLA's) q/k normalisation, same eps."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


# --------------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------------


def _check_tensor(x: object, name: str, dim: int) -> Tensor:
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must have a floating dtype, got {x.dtype}")
    if x.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(x.shape)}")
    return x


def _check_scale(scale: float | None, dk: int) -> float:
    if scale is None:
        return dk**-0.5
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise ValueError(f"scale must be a real number or None (default Dk ** -0.5), got {type(scale).__name__}")
    return float(scale)


def _check_qkv_gates(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, batch_dims: tuple[str, ...]
) -> tuple[int, int, int, int, bool]:
    """Shared shape checks. Returns (H_k, Dk, H, Dv, per_channel)."""
    lead = len(batch_dims)
    dims = ", ".join(batch_dims)
    _check_tensor(q, "q", lead + 2)
    _check_tensor(k, "k", lead + 2)
    _check_tensor(v, "v", lead + 2)
    _check_tensor(beta, "beta", lead + 1)
    if not isinstance(g, Tensor) or not g.is_floating_point():
        got = g.dtype if isinstance(g, Tensor) else type(g).__name__
        raise ValueError(f"g must be a floating torch.Tensor, got {got}")
    if k.shape != q.shape:
        raise ValueError(f"k must have the shape of q [{dims}, H_k, Dk] = {tuple(q.shape)}, got {tuple(k.shape)}")
    hk, dk = q.shape[-2:]
    h, dv = v.shape[-2:]
    if v.shape[:lead] != q.shape[:lead]:
        raise ValueError(f"v must be [{dims}, H, Dv] with [{dims}] = {tuple(q.shape[:lead])}, got {tuple(v.shape)}")
    if hk == 0 or h % hk != 0:
        raise ValueError(
            f"v has {h} heads and q/k have {hk}: the value heads must be a multiple of the key heads "
            "(each q/k head serves H // H_k consecutive value heads, as in transformers)"
        )
    if tuple(beta.shape) != (*q.shape[:lead], h):
        raise ValueError(f"beta must have shape [{dims}, H] = {(*q.shape[:lead], h)}, got {tuple(beta.shape)}")
    if tuple(g.shape) == (*q.shape[:lead], h):
        per_channel = False
    elif tuple(g.shape) == (*q.shape[:lead], h, dk):
        per_channel = True
    else:
        raise ValueError(
            f"g must be the log-decay per head [{dims}, H] = {(*q.shape[:lead], h)} (Gated DeltaNet) or per key "
            f"channel [{dims}, H, Dk] = {(*q.shape[:lead], h, dk)} (Kimi Delta Attention), got {tuple(g.shape)}"
        )
    devices = {t.device for t in (q, k, v, g, beta)}
    if len(devices) != 1:
        raise ValueError(f"q, k, v, g and beta must be on one device, got {sorted(str(d) for d in devices)}")
    return hk, dk, h, dv, per_channel


def _check_state(state: Tensor | None, name: str, shape: tuple[int, ...], device: torch.device) -> None:
    if state is None:
        return
    _check_tensor(state, name, 4)
    if tuple(state.shape) != shape:
        raise ValueError(f"{name} must have shape [B, H, Dk, Dv] = {shape}, got {tuple(state.shape)}")
    if state.device != device:
        raise ValueError(f"{name} is on {state.device} but the inputs are on {device}")


def _compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


# --------------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------------


class DeltaRuleArgs(NamedTuple):
    """:func:`chunk_gated_delta_rule`'s arguments once checked: the sizes, whether the gate is per key
    channel, the resolved ``scale``, the validated ``seq_idx`` and the boolean ``token_mask``."""

    b: int
    t: int
    hk: int
    dk: int
    h: int
    dv: int
    per_channel: bool
    scale: float
    seq_idx: Tensor | None
    token_mask: Tensor | None


def check_delta_rule_args(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    chunk_size: int,
    scale: float | None,
    initial_state: Tensor | None,
    seq_idx: Tensor | None,
    token_mask: Tensor | None,
) -> DeltaRuleArgs:
    """Validate :func:`chunk_gated_delta_rule`'s arguments (shapes ``[B, T, H, D]`` etc., see there); raise
    ``ValueError`` naming the first bad one. Shared with the sequence-parallel op (``safepad.parallel.ops``)."""
    hk, dk, h, dv, per_channel = _check_qkv_gates(q, k, v, g, beta, ("B", "T"))
    b, t = q.shape[:2]
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    scale = _check_scale(scale, dk)
    _check_state(initial_state, "initial_state", (b, h, dk, dv), q.device)
    if seq_idx is not None:
        seq_idx = validate_seq_idx(seq_idx, (b, t))
        if seq_idx.device != q.device:
            raise ValueError(f"seq_idx is on {seq_idx.device} but the inputs are on {q.device}")
    if token_mask is not None:
        if not isinstance(token_mask, Tensor) or tuple(token_mask.shape) != (b, t):
            got = tuple(token_mask.shape) if isinstance(token_mask, Tensor) else type(token_mask).__name__
            raise ValueError(f"token_mask must be a [B, T] = {(b, t)} tensor (True = real token), got {got}")
        if token_mask.is_floating_point() or token_mask.is_complex():
            raise ValueError(f"token_mask must be bool (True = real token), got {token_mask.dtype}")
        if token_mask.device != q.device:
            raise ValueError(f"token_mask is on {token_mask.device} but the inputs are on {q.device}")
        token_mask = token_mask.to(torch.bool)
    return DeltaRuleArgs(b, t, hk, dk, h, dv, per_channel, scale, seq_idx, token_mask)


@fp32_core
def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    chunk_size: int = 64,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    seq_idx: Tensor | None = None,
    token_mask: Tensor | None = None,
    use_qk_l2norm: bool = False,
    return_final_state: bool = False,
    return_varlen_states: bool = False,
    backend: str = "auto",
) -> Tensor | tuple[Tensor, ...]:
    """Gated delta rule over packed / padded rows, chunked (WY form), differentiable.

    Args:
        q, k: ``[B, T, H_k, Dk]`` queries and keys; ``H_k`` divides ``H`` (each q/k head serves
            ``H // H_k`` consecutive value heads, as in transformers). Usually ``H_k == H``.
        v: ``[B, T, H, Dv]`` values.
        g: log-decay, ``[B, T, H]`` per head (Gated DeltaNet: ``S *= exp(g_t)``) or ``[B, T, H, Dk]`` per
            key channel (Kimi Delta Attention: ``S *= exp(g_t)[:, None]``). Entries should be ``<= 0``.
        beta: ``[B, T, H]`` write strength, usually in ``(0, 1)`` (``(0, 2)`` with negative eigenvalues).
        chunk_size: tokens per chunk; any positive value gives the same result up to rounding.
        scale: query scale, default ``Dk ** -0.5``, applied after the optional L2 normalisation (as HF).
        initial_state: ``[B, H, Dk, Dv]``; it reaches only each row's first sequence.
        seq_idx: ``[B, T]`` int sequence index; the state resets wherever it changes inside a row.
        token_mask: ``[B, T]`` bool, True = real token. A masked token neither writes nor decays
            (``beta, g, k, v := 0``); its output is unspecified (zero on the torch path, where ``q := 0``
            too, so that garbage at pads cannot reach any gradient).
        use_qk_l2norm: L2-normalise ``q`` and ``k`` per head (``eps=1e-6``, as HF's ``l2norm``).
        return_final_state: also return the state after each row's last token, ``[B, H, Dk, Dv]``.
        return_varlen_states: also return the state at the end of every sequence,
            ``[S_total, H, Dk, Dv]``, row-major in order of appearance (the order of
            ``safepad.layout.cu_seqlens_from_seq_idx``; one sequence per row without ``seq_idx``).
        backend: ``"auto"`` (FLA's triton kernel when on CUDA, installed and exactly expressible),
            ``"torch"`` or ``"kernels"`` (raise ``ValueError`` if the kernel cannot run this call).

    Returns:
        ``o`` ``[B, T, H, Dv]`` in ``v``'s dtype when no state is requested; otherwise a tuple of ``o``
        followed by the requested ``final_state`` and ``varlen_states`` (in that order), both float32
        (float64 when any input is float64).
    """
    b, t, hk, dk, h, dv, per_channel, scale, seq_idx, token_mask = check_delta_rule_args(
        q, k, v, g, beta, chunk_size=chunk_size, scale=scale, initial_state=initial_state, seq_idx=seq_idx,
        token_mask=token_mask,
    )

    if kernels.use_kernels(q, k, v, g, beta, initial_state, need=("fla_chunk_gated_delta_rule",), backend=backend):
        why = _fla_inexpressible(q, k, v, per_channel)
        if why is None:
            o, final, varlen = _fla_chunk(
                q, k, v, g, beta, scale, initial_state, seq_idx, token_mask, use_qk_l2norm,
                return_final_state, return_varlen_states,
            )
            return _pack_outputs(o, final, varlen, return_final_state, return_varlen_states)
        if backend == "kernels":
            raise ValueError(f"backend='kernels' cannot run this call: {why}; use backend='auto' or 'torch'")
        logger.debug("chunk_gated_delta_rule: torch core (%s)", why)

    o, final, varlen = _torch_chunk(
        q, k, v, g, beta, scale, initial_state, seq_idx, token_mask, use_qk_l2norm, chunk_size,
        per_channel, return_varlen_states,
    )
    return _pack_outputs(o, final, varlen, return_final_state, return_varlen_states)


@fp32_core
def gated_delta_rule_step(
    state: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    token_mask: Tensor | None = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """One decode token of the gated delta rule, out of place.

    Args:
        state: ``[B, H, Dk, Dv]`` (HF's ``recurrent_states`` layout).
        q, k: ``[B, H_k, Dk]``; v: ``[B, H, Dv]``; g: ``[B, H]`` or ``[B, H, Dk]``; beta: ``[B, H]``.
        scale, use_qk_l2norm: as in :func:`chunk_gated_delta_rule`.
        token_mask: ``[B]`` bool or None. A row whose token is masked (False) keeps a finite state exactly (its
            ``o`` is not meaningful): its ``q``, ``k`` and ``g`` and its correction ``beta * (v - k^T S)`` are
            zeroed (a NaN there never reaches the state), so the decay is ``exp(0) = 1`` and the write 0, with no
            extra pass over the state.
        backend: accepted for symmetry; the step is a handful of elementwise ops and batched matmuls and always
            runs the torch core (``"kernels"`` raises).

    A decode step is launch-bound, so each pass is one op: ``q`` and ``k`` are masked, L2-normalised and grouped
    as one stacked tensor, and the recurrence runs over ``[B * H]``: ``k^T S`` and ``q^T S`` as batched matmuls, the
    rank-one write ``S + k ⊗ delta`` as one ``addcmul``.

    Returns:
        ``(o [B, H, Dv] in v's dtype, new_state [B, H, Dk, Dv] float32 (float64 for float64 inputs))``.
    """
    hk, dk, h, dv, per_channel = _check_qkv_gates(q, k, v, g, beta, ("B",))
    scale = _check_scale(scale, dk)
    if backend not in ("auto", "torch", "kernels"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'kernels', got {backend!r}")
    if backend == "kernels":
        raise ValueError("gated_delta_rule_step has no kernel path; use backend='auto' or 'torch'")
    if state is None:
        raise ValueError("state must be a [B, H, Dk, Dv] tensor (zeros for an empty cache), got None")
    _check_state(state, "state", (q.shape[0], h, dk, dv), q.device)

    cdt = _compute_dtype(q, k, v, g, beta, state)
    out_dtype = v.dtype  # o comes back in the input's dtype, rounded as the chunked path rounds it
    bsz = q.shape[0]
    bh = bsz * h
    # one op per pass, written for a launch-bound decode step: q and k go through the mask, the L2 norm and the
    # head grouping as one tensor; the recurrence runs as three batched matmuls over [B * H] (no einsum re-lay)
    qk = torch.stack((q, k)).to(cdt)  # [2, B, H_k, Dk]
    v, g, beta = (x.to(cdt) for x in (v, g, beta))
    drop = None
    if token_mask is not None:
        if not isinstance(token_mask, Tensor) or tuple(token_mask.shape) != (bsz,):
            got = getattr(token_mask, "shape", token_mask)
            raise ValueError(f"token_mask must have shape [batch] = [{bsz}], got {got}")
        drop = (~token_mask.to(torch.bool)).view(bsz, 1, 1)  # [B, 1, 1]: True = masked row
        qk = qk.masked_fill(drop, 0.0)  # [2, B, H_k, Dk]
        g = g.masked_fill(drop if per_channel else drop[:, 0], 0.0)  # exp(0) = 1: no decay
    if use_qk_l2norm:
        qk = l2norm(qk)
    if hk != h:
        qk = qk.repeat_interleave(h // hk, dim=2)  # [2, B, H, Dk]
    q, k = qk.unbind(0)  # [B, H, Dk] each, contiguous
    q = q * scale
    decay = g.exp().reshape(bh, -1, 1)  # [B * H, Dk|1, 1]
    s = state.to(cdt).reshape(bh, dk, dv) * decay  # [B * H, Dk, Dv]
    pred = torch.bmm(k.view(bh, 1, dk), s).view(bsz, h, dv)  # k^T S  [B, H, Dv]
    delta = (v - pred) * beta[..., None]  # [B, H, Dv]
    if drop is not None:
        delta = delta.masked_fill(drop, 0.0)  # with k = 0 and g = 0 above: the row's state is left exactly
    s = torch.addcmul(s, k.view(bh, dk, 1), delta.view(bh, 1, dv))  # S + k ⊗ delta, one pass  [B * H, Dk, Dv]
    o = torch.bmm(q.view(bh, 1, dk), s).view(bsz, h, dv)  # [B, H, Dv]
    return o.to(out_dtype), s.view(bsz, h, dk, dv)


def _pack_outputs(
    o: Tensor, final: Tensor | None, varlen: Tensor | None, want_final: bool, want_varlen: bool
) -> Tensor | tuple[Tensor, ...]:
    if not want_final and not want_varlen:
        return o
    out: list[Tensor] = [o]
    if want_final:
        out.append(final)
    if want_varlen:
        out.append(varlen)
    return tuple(out)


# --------------------------------------------------------------------------------------------------
# torch core
# --------------------------------------------------------------------------------------------------


def _to_chunks(x: Tensor, n: int, c: int) -> Tensor:
    """``[B, T_pad, H, *D]`` -> ``[N, B, H, C, *D]`` contiguous.

    The gradient of ``x`` comes back contiguous (:mod:`safepad.ops.grad`): the permute's backward is a permuted
    view, and under AOT autograd with dynamic shapes the strides predicted for it and for the ops after it can
    differ from the real ones (bailing_hybrid, compiled backward)."""
    x = contiguous_grad(x)
    bsz, _, h = x.shape[:3]
    rest = x.shape[3:]
    x = x.reshape(bsz, n, c, h, *rest)  # [B, N, C, H, *D]
    perm = (1, 0, 3, 2, *range(4, x.dim()))
    return x.permute(*perm).contiguous()  # [N, B, H, C, *D]


def _torch_chunk(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float,
    initial_state: Tensor | None,
    seq_idx: Tensor | None,
    token_mask: Tensor | None,
    use_qk_l2norm: bool,
    chunk_size: int,
    per_channel: bool,
    want_varlen: bool,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Returns ``(o [B, T, H, Dv], final [B, H, Dk, Dv], varlen [S, H, Dk, Dv] | None)``."""
    bsz, t, hk, dk = q.shape
    h, dv = v.shape[-2:]
    out_dtype = v.dtype
    cdt = _compute_dtype(q, k, v, g, beta, initial_state)
    q, k, v, g, beta = (x.to(cdt) for x in (q, k, v, g, beta))

    if token_mask is not None:
        # zero the raw inputs (q too): garbage at pads (inf / nan) never reaches a result or a gradient
        m = token_mask
        q = torch.where(m[:, :, None, None], q, 0.0)  # [B, T, H_k, Dk]
        k = torch.where(m[:, :, None, None], k, 0.0)  # [B, T, H_k, Dk]
        v = torch.where(m[:, :, None, None], v, 0.0)  # [B, T, H, Dv]
        beta = torch.where(m[:, :, None], beta, 0.0)  # [B, T, H]
        g = torch.where(m[:, :, None, None] if per_channel else m[:, :, None], g, 0.0)
    poisoned = None
    if seq_idx is not None:
        # the zero cross-sequence weights of the chunk matmuls would carry a NaN of one sequence into the next
        (q, k, v, g, beta), initial_state, poisoned = isolate_nonfinite(seq_idx, [q, k, v, g, beta], initial_state)

    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)  # [B, T, H_k, Dk]
    if hk != h:
        q, k = (x.repeat_interleave(h // hk, dim=2) for x in (q, k))  # [B, T, H, Dk]
    q = q * scale
    s0 = (
        torch.zeros(bsz, h, dk, dv, dtype=cdt, device=q.device)
        if initial_state is None
        else initial_state.to(cdt)
    )  # [B, H, Dk, Dv]
    if t == 0:
        empty = torch.zeros(0, h, dk, dv, dtype=cdt, device=q.device) if want_varlen else None
        return v.new_zeros(bsz, 0, h, dv).to(out_dtype), s0, empty

    c = chunk_size
    pad = (-t) % c
    n = (t + pad) // c
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))  # [B, T_pad, H, D]
        beta = F.pad(beta, (0, 0, 0, pad))  # [B, T_pad, H]
        g = F.pad(g, (0, 0, 0, 0, 0, pad) if per_channel else (0, 0, 0, pad))

    qc, kc, vc = (_to_chunks(x, n, c) for x in (q, k, v))  # [N, B, H, C, D]
    bc = _to_chunks(beta[..., None], n, c)  # [N, B, H, C, 1]
    gc = _to_chunks(g if per_channel else g[..., None], n, c)  # [N, B, H, C, Dk|1]
    gcum = gc.cumsum(dim=3)  # [N, B, H, C, Dk|1] log-decay from the chunk start, inclusive
    glast = gcum[:, :, :, -1:]  # [N, B, H, 1, Dk|1]

    # Which pairs / tokens may interact. Without seq_idx: causal only.
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()  # [C, C]
    if seq_idx is not None:
        seqp = F.pad(seq_idx, (0, pad), mode="replicate") if pad else seq_idx  # [B, T_pad]
        seqc = seqp.reshape(bsz, n, c).transpose(0, 1)  # [N, B, C]
        prev = torch.cat([seqc[:1, :, :1], seqc[:-1, :, -1:]], dim=0)  # [N, B, 1]: sequence carried into the chunk
        pair = causal & (seqc[..., :, None] == seqc[..., None, :])  # [N, B, C, C]
        pair = pair[:, :, None]  # [N, B, 1, C, C]
        carry = (seqc == prev)[:, :, None, :, None].to(cdt)  # [N, B, 1, C, 1]: token continues the carried state
        tail = (seqc == seqc[..., -1:])[:, :, None, :, None].to(cdt)  # [N, B, 1, C, 1]: same seq as chunk end
    else:
        pair = causal
        carry = tail = None

    # Intra-chunk decayed products (exp of non-positive differences only; masked entries are exp(-inf) = 0).
    if per_channel:
        kk, qk = _per_channel_products(qc, kc, gcum)  # [N, B, H, C, C] each, causal
        kk = kk.masked_fill(~pair, 0.0)
        qk = qk.masked_fill(~pair, 0.0)
    else:
        gs = gcum[..., 0]  # [N, B, H, C]
        diff = gs[..., :, None] - gs[..., None, :]  # [N, B, H, C, C]
        decay = diff.masked_fill(~pair, float("-inf")).exp()  # [N, B, H, C, C]
        kk = (kc @ kc.transpose(-1, -2)) * decay  # [N, B, H, C, C]
        qk = (qc @ kc.transpose(-1, -2)) * decay  # [N, B, H, C, C]

    eg = gcum.exp()  # [N, B, H, C, Dk|1]
    k_carry = kc * eg if carry is None else kc * eg * carry  # [N, B, H, C, Dk]
    rhs = torch.cat([vc, k_carry], dim=-1) * bc  # [N, B, H, C, Dv + Dk]
    # (I + strictly-lower(β k k^T decay)) [U | W] = β [v | exp(Γ) k]
    uw = torch.linalg.solve_triangular(kk * bc, rhs, upper=False, unitriangular=True)  # [N, B, H, C, Dv + Dk]
    u, w = uw[..., :dv], uw[..., dv:]  # [N, B, H, C, Dv], [N, B, H, C, Dk]

    q_carry = qc * eg if carry is None else qc * eg * carry  # [N, B, H, C, Dk]
    k_state = kc * (glast - gcum).exp()  # [N, B, H, C, Dk]: k_j exp(Γ_C - Γ_j)
    if tail is not None:
        k_state = k_state * tail
    s_decay = glast.exp().transpose(-1, -2)  # [N, B, H, Dk|1, 1]
    if carry is not None:
        # the carried state survives the chunk only if the chunk-end token continues it
        s_decay = s_decay * carry[:, :, :, -1:]  # [N, B, H, Dk|1, 1]
    k_state_t = k_state.transpose(-1, -2)  # [N, B, H, Dk, C]

    # Sequential part: two matmuls per chunk. unbind (not u[i]) keeps the backward linear in the chunk count.
    s = s0  # [B, H, Dk, Dv]
    states: list[Tensor] = []
    v_new: list[Tensor] = []
    for u_i, w_i, kt_i, dec_i in zip(u.unbind(0), w.unbind(0), k_state_t.unbind(0), s_decay.unbind(0)):
        states.append(s)
        vn = u_i - w_i @ s  # [B, H, C, Dv]
        v_new.append(vn)
        s = s * dec_i + kt_i @ vn  # [B, H, Dk, Dv]
    hs = torch.stack(states, dim=0)  # [N, B, H, Dk, Dv]: state entering each chunk
    vns = torch.stack(v_new, dim=0)  # [N, B, H, C, Dv]

    o = q_carry @ hs + qk @ vns  # [N, B, H, C, Dv]
    o = o.permute(1, 0, 3, 2, 4).reshape(bsz, n * c, h, dv)[:, :t]  # [B, T, H, Dv]
    o = o.to(out_dtype)

    varlen = None
    if want_varlen:
        if seq_idx is None:
            varlen = s.clone()  # one sequence per row: [B, H, Dk, Dv], not aliasing final_state
        else:
            varlen = _sequence_end_states(seq_idx, t, c, gcum, kc, vns, hs, carry, pair)
    if poisoned is not None:  # NaN back where its own sequence has it, and nowhere else
        o = poison(o, poisoned)
        s = poison_rows(s, poisoned[:, -1])
        if varlen is not None:
            ends = torch.ones_like(poisoned)  # [B, T]: last token of a sequence
            ends[:, :-1] = seq_idx[:, 1:] != seq_idx[:, :-1]
            varlen = poison_rows(varlen, poisoned[ends])
    return o, s, varlen


_SUB = 16  # sub-chunk size of the per-channel (KDA) intra-chunk products


def _per_channel_products(qc: Tensor, kc: Tensor, gcum: Tensor) -> tuple[Tensor, Tensor]:
    """Causal ``kk[i, j] = Σ_d k_id k_jd exp(Γ_id - Γ_jd)`` and ``qk`` (same with ``q_i``), ``j <= i``.

    qc, kc, gcum ``[N, B, H, C, Dk]`` -> two ``[N, B, H, C, C]`` (zero above the diagonal).

    A per-channel decay does not factor into one matmul stably, so the chunk is cut into sub-chunks of
    ``_SUB`` tokens. Pairs inside a diagonal sub-chunk use the explicit ``[s, s, Dk]`` decay; a query in
    sub-chunk ``a`` and a key in an earlier one are split at ``r = a * s - 1`` (``j <= r < i``):
    ``exp(Γ_i - Γ_j) = exp(Γ_i - Γ_r) * exp(Γ_r - Γ_j)``, both factors <= 1. Memory is
    ``O(C * (s + C / s) * Dk)`` per chunk instead of ``O(C^2 * Dk)``.
    """
    c = qc.shape[-2]
    s = _SUB if (c % _SUB == 0 and c > _SUB) else c
    m = c // s
    lead = qc.shape[:-2]
    qb, kb, gb = (x.unflatten(-2, (m, s)) for x in (qc, kc, gcum))  # [N, B, H, m, s, Dk]

    # diagonal sub-chunks: explicit decay tensor
    causal = torch.ones(s, s, dtype=torch.bool, device=qc.device).tril()  # [s, s]
    diff = gb[..., :, None, :] - gb[..., None, :, :]  # [N, B, H, m, s(i), s(j), Dk]
    kdec = diff.masked_fill(~causal[..., None], float("-inf")).exp() * kb[..., None, :, :]  # [.., m, s, s, Dk]
    diag = kdec @ torch.stack([kb, qb], dim=-1)  # [N, B, H, m, s(i), s(j), 2]
    eye_m = torch.eye(m, dtype=qc.dtype, device=qc.device)  # [m, m]
    full = diag[..., :, :, None, :, :] * eye_m[:, None, :, None, None]  # [N, B, H, m, s, m, s, 2]
    full = full.reshape(*lead, c, c, 2)  # [N, B, H, C, C, 2]: block diagonal

    if m > 1:
        g_ref = gb[..., :-1, -1:, :]  # [N, B, H, m-1, 1, Dk]: Γ at r_a = a*s - 1, for a = 1..m-1
        pos = torch.arange(c, device=qc.device)  # [C]
        before = pos[None, :] < (torch.arange(1, m, device=qc.device) * s)[:, None]  # [m-1, C]: j <= r_a
        k_ref = (g_ref - gcum[..., None, :, :]).masked_fill(~before[..., None], float("-inf"))  # [.., m-1, C, Dk]
        k_t = kc[..., None, :, :] * k_ref.exp()  # [N, B, H, m-1, C, Dk]: k_j exp(Γ_r - Γ_j), 0 for j > r
        x_dec = (gb[..., 1:, :, :] - g_ref).exp()  # [N, B, H, m-1, s, Dk]: exp(Γ_i - Γ_r)
        x = torch.cat([kb[..., 1:, :, :] * x_dec, qb[..., 1:, :, :] * x_dec], dim=-2)  # [N, B, H, m-1, 2s, Dk]
        off = x @ k_t.transpose(-1, -2)  # [N, B, H, m-1, 2s, C]
        off = torch.stack([off[..., :s, :], off[..., s:, :]], dim=-1)  # [N, B, H, m-1, s, C, 2]
        off = F.pad(off.reshape(*lead, (m - 1) * s, c, 2), (0, 0, 0, 0, s, 0))  # [N, B, H, C, C, 2]
        full = full + off
    return full[..., 0], full[..., 1]


def _sequence_end_states(
    seq_idx: Tensor,
    t: int,
    c: int,
    gcum: Tensor,
    kc: Tensor,
    vns: Tensor,
    hs: Tensor,
    carry: Tensor,
    pair: Tensor,
) -> Tensor:
    """State after the last token of every sequence: ``[S, H, Dk, Dv]`` in row-major order.

    ``S_e = carry_e exp(Γ_e) S_in + Σ_{j ≤ e, same seq} exp(Γ_e - Γ_j) k_j ⊗ δ_j`` inside ``e``'s chunk.
    """
    last = torch.ones_like(seq_idx, dtype=torch.bool)  # [B, T]: token ends a sequence
    if t > 1:
        last[:, :-1] = seq_idx[:, 1:] != seq_idx[:, :-1]
    rows, pos = last.nonzero(as_tuple=True)  # [S] each, row-major order
    ci, pi = pos // c, pos % c  # [S]: chunk and position inside it
    g_chunk = gcum[ci, rows]  # [S, H, C, Dk|1]
    idx = pi[:, None, None, None].expand(-1, g_chunk.shape[1], 1, g_chunk.shape[3])  # [S, H, 1, Dk|1]
    g_end = g_chunk.gather(2, idx)  # [S, H, 1, Dk|1]: Γ at the sequence end
    rowmask = pair.squeeze(2)[ci, rows, pi]  # [S, C]: j <= e and same sequence
    w = (g_end - g_chunk).masked_fill(~rowmask[:, None, :, None], float("-inf")).exp()  # [S, H, C, Dk|1]
    kw = kc[ci, rows] * w  # [S, H, C, Dk]
    states = kw.transpose(-1, -2) @ vns[ci, rows]  # [S, H, Dk, Dv]
    car = carry[ci, rows, 0, pi]  # [S, 1]: the sequence continues the state carried into its chunk
    in_decay = g_end.exp().transpose(-1, -2) * car[:, :, None, None]  # [S, H, Dk|1, 1]
    return states + in_decay * hs[ci, rows]  # [S, H, Dk, Dv]


# --------------------------------------------------------------------------------------------------
# FLA kernel path
# --------------------------------------------------------------------------------------------------


def _fla_inexpressible(q: Tensor, k: Tensor, v: Tensor, per_channel: bool) -> str | None:
    """Why FLA's ``chunk_gated_delta_rule`` cannot compute this call exactly, or None."""
    if per_channel:
        return "per-channel gates (KDA) are not FLA's gated-delta-rule kernel"
    if q.shape[1] == 0:
        return "empty sequence dimension"
    if q.shape[-1] > 256:
        return f"FLA's kernel takes Dk <= 256, got {q.shape[-1]}"
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16):
        return f"FLA's kernel takes matching float16/bfloat16 q, k, v (got {q.dtype}, {k.dtype}, {v.dtype})"
    return None


def _fla_chunk(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float,
    initial_state: Tensor | None,
    seq_idx: Tensor | None,
    token_mask: Tensor | None,
    use_qk_l2norm: bool,
    want_final: bool,
    want_varlen: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Flatten to one ``[1, B*T]`` varlen row with per-sequence initial states and call FLA."""
    bsz, t, hk, dk = q.shape
    h, dv = v.shape[-2:]
    if hk != h:
        q, k = (x.repeat_interleave(h // hk, dim=2) for x in (q, k))  # [B, T, H, Dk]
    g = g.float()
    if token_mask is not None:
        m = token_mask
        q = torch.where(m[:, :, None, None], q, 0.0)
        k = torch.where(m[:, :, None, None], k, 0.0)
        v = torch.where(m[:, :, None, None], v, 0.0)
        beta = torch.where(m[:, :, None], beta, 0.0)
        g = torch.where(m[:, :, None], g, 0.0)
    seq = seq_idx if seq_idx is not None else torch.zeros(bsz, t, dtype=torch.int32, device=q.device)
    cu = cu_seqlens_from_seq_idx(seq).long()  # [S + 1] over the flattened [B * T] tokens
    starts, ends = cu[:-1], cu[1:] - 1  # [S]
    first = (starts % t == 0).nonzero().squeeze(1)  # [B]: each row's first sequence
    last = (ends % t == t - 1).nonzero().squeeze(1)  # [B]: each row's last sequence
    n_seq = starts.numel()
    h0 = q.new_zeros(n_seq, h, dk, dv, dtype=torch.float32)  # [S, H, Dk, Dv]
    if initial_state is not None:
        h0 = h0.index_copy(0, first, initial_state.float())
    flat = [x.reshape(1, bsz * t, *x.shape[2:]) for x in (q, k, v, g, beta)]  # [1, B*T, ...]
    o, states = kernels.fla_chunk_gated_delta_rule(
        *flat,
        scale=scale,
        initial_state=h0,
        output_final_state=True,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
        cu_seqlens=cu,
    )
    o = o.reshape(bsz, t, h, dv).to(v.dtype)  # [B, T, H, Dv]
    final = states.index_select(0, last) if want_final else None  # [B, H, Dk, Dv]
    return o, final, (states if want_varlen else None)
