"""The generic padding-correct Mamba1 mixer (Mamba, FalconMamba, Jamba).

The three transformers 5.23 mixers share one structure::

    in_proj(h) -> [x | z] -> causal conv(x) -> x_proj(x) -> [dt_low | B | C]
      -> (optional RMS norms on dt_low, B, C) -> dt_proj -> selective scan(x, dt, A, B, C, D, z) -> out_proj

and differ only in the optional norms (FalconMamba: weightless RMS norms; Jamba: RMS norms with weights),
which a :class:`~safepad.specs.MixerSpec` declares by attribute name. Zamba's multi-head variant
(``options["heads"] = True``) interleaves ``x`` and ``z`` in ``in_proj``'s output and gives each of its
``n_mamba_heads`` heads its own ``x_proj_weight [H, R + 2N, P]``, ``dt_proj_weight [H, P, R]``, ``A_log [H, P, N]``
and ``D [H, P]`` (``P = I / H``); each head is scanned on its own, with a ``[B, H, P, N]`` cached state.
This forward calls ``in_proj``,
``x_proj``, ``dt_proj``, the norms and ``out_proj`` as modules, so PEFT adapters and hooks on them stay
active. When ``dt_proj`` is a plain ``nn.Linear`` its bias goes into the scan as ``delta_bias`` in float32
(exactly the stock numerics, as mamba-ssm does); any other ``dt_proj`` (a LoRA layer, a quantized linear)
is called whole and its output used as the biased ``dt``.

What it fixes over the stock mixers:

* packed rows (``seq_idx`` / ``cu_seq_lens`` / restarting ``position_ids``, read from the call context): the
  conv window and the scan state reset at every boundary;
* padded prefill (left, right, holes): pads leave the SSM state untouched (dt := 0 at pads) and the cached
  conv state holds each row's last K real inputs;
* chunked prefill continues from the cached conv and SSM states (stock restarts from zero);
* a full-length 2-D mask (past + current tokens) is accepted on every path and means the same as no mask
  when it is all ones. ``MambaModel`` / ``FalconMambaModel`` hand the caller's untrimmed mask to every
  mixer, whose ``apply_mask_to_padding_states`` then raises on a chunked prefill and, on a single-token
  decode, broadcasts ``[B, 1, I] * [B, past + 1, 1]`` into a wrong-length input that corrupts the conv
  state; safepad reads only the mask's last ``T`` columns (Jamba trims it at model level already).

Shapes: ``B`` batch, ``T`` tokens, ``I`` intermediate size, ``N`` state size, ``R`` dt rank, ``K`` conv width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..cache import is_recording, read_states, write_states
from ..layout.facts import record
from ..ops.selective_scan import selective_scan, selective_state_step
from .common import cached_conv, cached_conv_step, hold_masked_rows, layout_op, pop_cache, prepare_layout
from .history import state_history, states_to_keep

__all__ = ["mamba1_mixer_forward"]


def _norm(module: nn.Module, name: str | None, x: Tensor) -> Tensor:
    """Apply the optional norm submodule ``module.<name>`` (called as a module) to ``x``."""
    return x if name is None else getattr(module, name)(x)


def _dt(module: nn.Module, dt_low: Tensor) -> tuple[Tensor, Tensor | None]:
    """``dt_low`` ``[..., R]`` -> (``dt`` ``[..., I]`` before the bias, ``delta_bias`` ``[I]`` float32 or None)."""
    proj = module.dt_proj
    if type(proj) is nn.Linear:  # stock numerics: W @ dt_low in the model dtype, bias added in float32 in the scan
        bias = proj.bias.float() if proj.bias is not None else None
        return F.linear(dt_low, proj.weight), bias
    return proj(dt_low), None  # adapters / quantized layers: the module's own output, bias included


def _split_xproj(module: nn.Module, x: Tensor, opts) -> tuple[Tensor, Tensor, Tensor]:
    """Conv output ``x`` ``[..., I]`` -> (dt_low ``[..., R]``, B ``[..., N]``, C ``[..., N]``) after the norms."""
    R, N = module.time_step_rank, module.ssm_state_size
    dt_low, Bm, Cm = module.x_proj(x).split([R, N, N], dim=-1)  # [..., R], [..., N], [..., N]
    dt_low = _norm(module, opts.get("dt_norm"), dt_low)
    Bm = _norm(module, opts.get("b_norm"), Bm)
    Cm = _norm(module, opts.get("c_norm"), Cm)
    return dt_low, Bm, Cm


def _head_params(module: nn.Module, xc: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Zamba heads: conv output ``xc [..., H, P]`` -> (raw dt ``[..., H, P]``, B ``[..., H, N]``, C ``[..., H, N]``)."""
    R, N = module.time_step_rank, module.ssm_state_size
    params = torch.einsum("...hp,hkp->...hk", xc, module.x_proj_weight)  # [..., H, R + 2N]
    dt_low, Bm, Cm = params.split([R, N, N], dim=-1)  # [..., H, R], [..., H, N], [..., H, N]
    dt = torch.einsum("...hr,hpr->...hp", dt_low, module.dt_proj_weight)  # [..., H, P]
    return dt, Bm, Cm


def _multi_head_forward(self, x: Tensor, gate: Tensor, layout, cache, past, backend: str) -> Tensor:
    """Zamba's per-head Mamba1: ``x``, ``gate`` ``[B, T, I]`` -> ``y`` ``[B, T, I]`` (cache written in place)."""
    Bsz, T, I = x.shape  # noqa: E741
    H = self.n_mamba_heads
    P = I // H
    mask = layout.mask
    A = -torch.exp(self.A_log.float())  # [H, P, N]; -exp(.) <= 0: each head's slice is recorded so (no sign check)
    D = self.D.float()  # [H, P]
    bias = self.dt_proj_bias.float() if self.dt_proj_bias is not None else None  # [H, P]
    if past.has_previous and T == 1:
        xc, conv_new = cached_conv_step(x[:, 0], self.conv1d, past, activation=self.activation, backend=backend)
        xh = xc.view(Bsz, H, P)  # [B, I] -> [B, H, P]
        dt, Bm, Cm = _head_params(self, xh)  # [B, H, P], [B, H, N], [B, H, N]
        zh = gate[:, 0].view(Bsz, H, P)  # [B, H, P]
        ys, states = [], []
        for h in range(H):
            y_h, s_h = selective_state_step(
                past.recurrent[:, h], xh[:, h], dt[:, h], record(A[h], nonpositive=True), Bm[:, h], Cm[:, h], D=D[h],
                z=zh[:, h],
                delta_bias=None if bias is None else bias[h], delta_softplus=True,
                token_mask=None if mask is None else mask[:, 0],  # a masked decode token leaves its row's state
                backend=backend,
            )  # [B, P], [B, P, N]
            ys.append(y_h)
            states.append(s_h)
        ssm_new = torch.stack(states, dim=1)  # [B, H, P, N]
        write_states(
            cache,
            self.layer_idx,
            tokens=1,
            conv=hold_masked_rows(mask, conv_new, past.conv),
            recurrent=ssm_new,  # held in selective_state_step (token_mask)
            inputs=x,  # kept by a cache that records its past (assisted generation)
            token_mask=mask,
        )
        return torch.cat(ys, dim=-1)[:, None]  # [B, 1, I]
    want_state = cache is not None
    xc, conv_final = cached_conv(
        x, self.conv1d, layout, past, activation=self.activation, want_state=want_state, backend=backend
    )  # [B, T, I], [B, I, K]
    xh = xc.view(Bsz, T, H, P)  # [B, T, I] -> [B, T, H, P]
    dt, Bm, Cm = _head_params(self, xh)  # [B, T, H, P], [B, T, H, N], [B, T, H, N]
    zh = gate.view(Bsz, T, H, P)  # [B, T, H, P]
    scan = layout_op(layout, selective_scan)  # one rank's shard: the scan state crosses the ranks

    def heads(token_mask: Tensor | None, final_state: bool) -> tuple[list[Tensor], list[Tensor | None]]:
        ys, states = [], []
        for h in range(H):
            out = scan(
                xh[:, :, h], dt[:, :, h], record(A[h], nonpositive=True), Bm[:, :, h], Cm[:, :, h], D=D[h],
                z=zh[:, :, h], delta_bias=None if bias is None else bias[h], delta_softplus=True,
                seq_idx=layout.seq_idx, initial_state=None if past.recurrent is None else past.recurrent[:, h],
                token_mask=token_mask, return_final_state=final_state, backend=backend,
            )
            y_h, s_h = out if final_state else (out, None)  # [B, T, P], [B, P, N]
            ys.append(y_h)
            states.append(s_h)
        return ys, states

    ys, states = heads(mask, want_state)
    if want_state:
        keep = states_to_keep(cache, self.layer_idx, T)
        rec = state_history(
            layout, T, keep, torch.stack(states, dim=1), lambda m: torch.stack(heads(m, True)[1], dim=1)
        )  # [B, H, P, N] (or the list of the last states a recording cache keeps)
        write_states(cache, self.layer_idx, tokens=T, conv=conv_final, recurrent=rec, inputs=x, token_mask=mask)
    return torch.cat(ys, dim=-1)  # [B, T, I]


def mamba1_mixer_forward(self, hidden_states: Tensor, cache_params=None, attention_mask: Tensor | None = None, **kwargs):
    """Padding/packing-correct forward of a Mamba1-style mixer.

    Args:
        hidden_states: ``[B, T, hidden]``.
        cache_params: a transformers ``DynamicCache`` (``past_key_values`` is accepted too) or None.
        attention_mask: ``[B, T]`` or the full-length ``[B, past + T]`` 2-D padding mask, or None.

    Returns:
        ``[B, T, hidden]`` in the dtype of ``hidden_states``.
    """
    opts = self._safepad_spec.options
    backend = self._safepad.backend
    cache = pop_cache(cache_params, kwargs)
    hidden_states, layout = prepare_layout(self, hidden_states, attention_mask, cache, kwargs)
    Bsz, T = hidden_states.shape[:2]
    dtype = hidden_states.dtype
    mask = layout.mask
    I = self.intermediate_size  # intermediate size
    past = read_states(cache, self.layer_idx)
    if not opts.get("heads") and past.has_previous and T == 1:
        out = _decode_step(self, hidden_states[:, 0], mask, cache, past, backend)  # [B, hidden]
        return layout.restore(out.view(Bsz, 1, -1))  # [B, 1, hidden]

    if mask is not None:
        hidden_states = torch.where(mask[..., None], hidden_states, 0.0)  # pads contribute nothing (even a NaN)
    projected = self.in_proj(hidden_states)  # [B, T, 2I]
    if opts.get("heads"):
        x, gate = projected.unflatten(-1, (I, 2)).unbind(-1)  # interleaved [x_0, z_0, x_1, z_1, ...] -> [B, T, I] x2
        y = _multi_head_forward(self, x, gate, layout, cache, past, backend)  # [B, T, I]
        return layout.restore(self.out_proj(y.to(dtype)))
    x, gate = projected.split([I, I], dim=-1)  # [B, T, I], [B, T, I]

    A = record(-torch.exp(self.A_log.float()), nonpositive=True)  # [I, N]; -exp(.) <= 0: no sign check needed
    D = self.D.float()  # [I]
    want_state = cache is not None
    xc, conv_final = cached_conv(
        x, self.conv1d, layout, past, activation=self.activation, want_state=want_state, backend=backend
    )  # [B, T, I], [B, I, K]
    dt_low, Bm, Cm = _split_xproj(self, xc, opts)  # [B, T, R], [B, T, N], [B, T, N]
    dt, delta_bias = _dt(self, dt_low)  # [B, T, I]

    def scan(token_mask: Tensor | None, final_state: bool):
        return layout_op(layout, selective_scan)(
            xc,
            dt,
            A,
            Bm,
            Cm,
            D=D,
            z=gate,
            delta_bias=delta_bias,
            delta_softplus=True,
            seq_idx=layout.seq_idx,
            initial_state=past.recurrent,
            token_mask=token_mask,
            return_final_state=final_state,
            backend=backend,
        )

    scan_out = scan(mask, want_state)
    y, ssm_final = scan_out if want_state else (scan_out, None)  # [B, T, I], [B, I, N]
    if want_state:
        keep = states_to_keep(cache, self.layer_idx, T)
        ssm_final = state_history(layout, T, keep, ssm_final, lambda m: scan(m, True)[1])
        write_states(
            cache, self.layer_idx, tokens=T, conv=conv_final, recurrent=ssm_final, inputs=x, token_mask=mask
        )

    out = self.out_proj(y.to(dtype))  # [B, T, hidden]
    return layout.restore(out)


def _decode_step(self, hidden_states: Tensor, mask: Tensor | None, cache, past, backend: str) -> Tensor:
    """One cached decode token per row, on ``[B, ...]`` tensors without the token axis (a linear layer on a 2-D
    input is one matmul, without the views a ``[B, 1, ...]`` input takes).

    Args:
        hidden_states: ``[B, hidden]``; mask: ``[B, 1]`` bool (False: the row's token is a pad, which leaves its
            states untouched) or None; past: the layer's cached states.

    Returns:
        ``[B, hidden]`` in the dtype of ``hidden_states``.
    """
    opts = self._safepad_spec.options
    I = self.intermediate_size  # intermediate size
    dtype = hidden_states.dtype
    if mask is not None:
        hidden_states = torch.where(mask, hidden_states, 0.0)  # [B, hidden]: pads contribute nothing (even a NaN)
    x, gate = self.in_proj(hidden_states).split([I, I], dim=-1)  # [B, I], [B, I]
    A = record(-torch.exp(self.A_log.float()), nonpositive=True)  # [I, N]; -exp(.) <= 0: no sign check needed
    xc, conv_new = cached_conv_step(x, self.conv1d, past, activation=self.activation, backend=backend)
    dt_low, Bm, Cm = _split_xproj(self, xc, opts)  # [B, R], [B, N], [B, N]
    dt, delta_bias = _dt(self, dt_low)  # [B, I]
    y, ssm_new = selective_state_step(
        past.recurrent, xc, dt, A, Bm, Cm, D=self.D, z=gate, delta_bias=delta_bias, delta_softplus=True,
        token_mask=mask,  # [B, 1]: a masked decode token leaves its row's state
        backend=backend,
    )  # [B, I], [B, I, N]
    write_states(
        cache,
        self.layer_idx,
        tokens=1,
        conv=hold_masked_rows(mask, conv_new, past.conv),  # a masked decode token leaves its row untouched
        recurrent=ssm_new,  # held in selective_state_step (token_mask): no pass over the state here
        # the conv inputs [B, 1, I], kept only by a cache that records its past (assisted generation)
        inputs=x[:, None] if is_recording(cache, self.layer_idx) else None,
        token_mask=mask,
    )
    return self.out_proj(y.to(dtype))  # [B, hidden]
