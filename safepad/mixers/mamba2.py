"""The generic padding-correct Mamba2 mixer (Nemotron-H, Mamba2, Bamba, Falcon-H1, GraniteMoeHybrid, Zamba2).

All six transformers 5.23 mixers share one structure::

    in_proj(x) -> [z | xBC | dt] -> causal conv(xBC) -> [x | B | C] -> SSD scan -> gated norm(y, z) -> out_proj

and differ only in details a :class:`~safepad.specs.MixerSpec` declares (Falcon-H1's multipliers and
optional norm). This forward reads the module's own attributes at call time (``time_step_limit``,
``chunk_size``, ...) and calls ``in_proj``, ``norm`` and ``out_proj`` as modules, so PEFT adapters on them
stay active. Shapes: ``B`` batch, ``T`` tokens, ``I`` intermediate size ``= H * P``, ``H`` heads, ``P`` head
dim, ``G`` groups, ``N`` state size, ``K`` conv width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..cache import is_recording, read_states, write_states
from ..ops.precision import recurrence_input
from ..ops.ssd import ssd_scan, ssd_step
from .common import cached_conv, cached_conv_step, gated_norm, hold_masked_rows, layout_op, pop_cache, prepare_layout
from .history import state_history, states_to_keep

__all__ = ["mamba2_mixer_forward"]


def _scan_inputs(xBC: Tensor) -> Tensor:
    """The conv output ``[..., conv_dim]`` as the SSD op's input: wider than the model dtype in half precision.

    Its values are exact in the wider type, so the op computes the same math, but its output ``y`` then comes
    back wide and is rounded to the model dtype once, after the gated norm (which computes in float32 either
    way), instead of before it as well. A decode step and the chunked scan evaluate the recurrence in different
    orders; every difference that survives to a bf16 rounding can flip it by one ulp, which the norm and
    ``out_proj`` carry to the logits (rollout-vs-training log-prob gap under GRPO: 1e-3 on bf16 Nemotron-H with
    an extra rounding of ``y``).

    * On CUDA: float32, the CUDA kernels' precision (their recurrent state is float32 too).
    * On CPU (torch core): float64, so the SSD and its cached state are float64. In float32 the two orders
      still differ by ~1e-7 relative (1 float32 ulp in the median), and about 1 in 10^4 of the gated norm's
      outputs then rounds to the other bf16 neighbour (bf16 Bamba, GRPO seed 0: 1.0e-3 in log-prob from one such
      flip); in float64 the two orders agree to ~1e-16 and the rounding to bf16 agrees. As the float64 CPU
      attention of half-precision models (docs/limits.md, "Half precision on CPU").
    """
    return recurrence_input(xBC, "ssd")  # the policy: safepad.ops.precision


def mamba2_mixer_forward(self, hidden_states: Tensor, cache_params=None, attention_mask: Tensor | None = None, **kwargs):
    """Padding/packing-correct forward of a Mamba2-style mixer. ``hidden_states`` ``[B, T, hidden]``."""
    opts = self._safepad_spec.options
    backend = self._safepad.backend
    cache = pop_cache(cache_params, kwargs)
    hidden_states, layout = prepare_layout(self, hidden_states, attention_mask, cache, kwargs)
    Bsz, T, _ = hidden_states.shape
    mask = layout.mask
    past = read_states(cache, self.layer_idx)
    if past.has_previous and T == 1:
        out = _decode_step(self, hidden_states[:, 0], mask, cache, past, backend)  # [B, hidden]
        return layout.restore(out.view(Bsz, 1, -1))  # [B, 1, hidden]

    H, P, G, N = self.num_heads, self.head_dim, self.n_groups, self.ssm_state_size
    I = H * P  # noqa: E741 - intermediate size
    if mask is not None:
        hidden_states = torch.where(mask[..., None], hidden_states, 0.0)  # pads contribute nothing (even a NaN)
    gate, xBC, dt = _project(self, hidden_states, opts)  # [B,T,I], [B,T,conv_dim], [B,T,H]
    A = -torch.exp(self.A_log.float())  # [H]
    want_state = cache is not None
    conv_in = xBC
    xBC, conv_final = cached_conv(
        xBC, self.conv1d, layout, past, activation=self.activation, want_state=want_state, backend=backend
    )  # [B, T, conv_dim], [B, conv_dim, K]
    x, Bm, Cm = _scan_inputs(xBC).split([I, G * N, G * N], dim=-1)

    def scan(token_mask: Tensor | None, final_state: bool):
        return layout_op(layout, ssd_scan)(
            x.reshape(Bsz, T, H, P),  # [B, T, H, P]
            dt,  # [B, T, H]
            A,
            Bm.reshape(Bsz, T, G, N),  # [B, T, G, N]
            Cm.reshape(Bsz, T, G, N),  # [B, T, G, N]
            chunk_size=self.chunk_size,
            D=self.D,
            dt_bias=self.dt_bias,
            dt_limit=tuple(self.time_step_limit),
            seq_idx=layout.seq_idx,
            initial_state=past.recurrent,
            token_mask=token_mask,
            return_final_state=final_state,
            backend=backend,
        )

    scan_out = scan(mask, want_state)
    y, ssm_final = scan_out if want_state else (scan_out, None)  # [B, T, H, P], [B, H, P, N]
    if want_state:
        keep = states_to_keep(cache, self.layer_idx, T)
        ssm_final = state_history(layout, T, keep, ssm_final, lambda m: scan(m, True)[1])
        write_states(
            cache, self.layer_idx, tokens=T, conv=conv_final, recurrent=ssm_final, inputs=conv_in, token_mask=mask
        )
    out = _gate_out(self, y.reshape(Bsz, T, I), gate, opts, hidden_states.dtype)  # [B, T, hidden]
    return layout.restore(out)


def _project(self, hidden_states: Tensor, opts: dict) -> tuple[Tensor, Tensor, Tensor]:
    """``in_proj`` (with Falcon-H1's multipliers): ``[..., hidden]`` -> gate ``[..., I]``, xBC ``[..., conv_dim]``,
    raw dt ``[..., H]``."""
    if opts.get("in_multiplier"):
        hidden_states = _scale(hidden_states, getattr(self, opts["in_multiplier"]))
    projected = self.in_proj(hidden_states)  # [..., I + conv_dim + H]
    if opts.get("proj_multiplier"):
        projected = _scale(projected, getattr(self, opts["proj_multiplier"]))
    return projected.split([self.num_heads * self.head_dim, self.conv_dim, self.num_heads], dim=-1)


def _scale(t: Tensor, multiplier) -> Tensor:
    """``t * multiplier`` (a number or a tensor broadcast against ``t`` ``[..., D]``), keeping ``t``'s rank: a
    multiplier with more, leading size-1 dims (Falcon-H1's ``mup_vector`` ``[1, 1, D]`` against a decode step's
    ``[B, D]``) is viewed down to it."""
    if isinstance(multiplier, Tensor) and multiplier.dim() > t.dim():
        lead = multiplier.shape[: multiplier.dim() - t.dim()]
        if all(n == 1 for n in lead):
            multiplier = multiplier.view(multiplier.shape[len(lead) :])
    return t * multiplier


def _gate_out(self, y: Tensor, gate: Tensor, opts: dict, dtype: torch.dtype) -> Tensor:
    """The gated norm of the SSD output ``y`` ``[..., I]`` (SSD precision) by ``gate`` ``[..., I]``, then
    ``out_proj``: ``[..., hidden]`` in ``dtype``."""
    if opts.get("optional_norm_attr") and not getattr(self, opts["optional_norm_attr"]):
        y = y * F.silu(gate.float()).to(y.dtype)  # Falcon-H1 without mamba_rms_norm: plain SiLU gate
    else:
        y = gated_norm(self.norm, y, gate, opts.get("gated_norm"))
    return self.out_proj(y.to(dtype))


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
    Bsz = hidden_states.shape[0]
    H, P, G, N = self.num_heads, self.head_dim, self.n_groups, self.ssm_state_size
    I = H * P  # noqa: E741 - intermediate size
    dtype = hidden_states.dtype
    if mask is not None:
        hidden_states = torch.where(mask, hidden_states, 0.0)  # [B, hidden]: pads contribute nothing (even a NaN)
    gate, xBC, dt = _project(self, hidden_states, opts)  # [B, I], [B, conv_dim], [B, H]
    A = -torch.exp(self.A_log.float())  # [H]
    xBC_t, conv_new = cached_conv_step(xBC, self.conv1d, past, activation=self.activation, backend=backend)
    x, Bm, Cm = _scan_inputs(xBC_t).split([I, G * N, G * N], dim=-1)  # [B, I], [B, G*N], [B, G*N]
    y, ssm_new = ssd_step(
        past.recurrent,
        x.view(Bsz, H, P),  # [B, H, P]
        dt,  # [B, H]
        A,
        Bm.view(Bsz, G, N),  # [B, G, N]
        Cm.view(Bsz, G, N),  # [B, G, N]
        D=self.D,
        dt_bias=self.dt_bias,
        dt_limit=tuple(self.time_step_limit),
        token_mask=mask,  # [B, 1]: a masked decode token leaves its row's state
        backend=backend,
    )  # [B, H, P], [B, H, P, N]
    write_states(
        cache,
        self.layer_idx,
        tokens=1,
        conv=hold_masked_rows(mask, conv_new, past.conv),  # a masked decode token leaves its row untouched
        recurrent=ssm_new,  # held in ssd_step (token_mask): no pass over the state here
        # the conv inputs [B, 1, conv_dim], kept only by a cache that records its past (assisted generation)
        inputs=xBC[:, None] if is_recording(cache, self.layer_idx) else None,
        token_mask=mask,
    )
    return _gate_out(self, y.view(Bsz, I), gate, opts, dtype)  # [B, hidden]
