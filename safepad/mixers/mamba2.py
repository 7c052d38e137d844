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

from ..cache import read_states, write_states
from ..ops.precision import recurrence_input
from ..ops.ssd import ssd_scan, ssd_step
from .common import cached_conv, layout_op, cached_conv_step, gated_norm, hold_masked_rows, pop_cache, prepare_layout
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
    dtype = hidden_states.dtype
    mask = layout.mask
    H, P, G, N = self.num_heads, self.head_dim, self.n_groups, self.ssm_state_size
    I = H * P  # noqa: E741 - intermediate size
    conv_dim = self.conv_dim

    if mask is not None:
        hidden_states = torch.where(mask[..., None], hidden_states, 0.0)  # pads contribute nothing (even a NaN)
    if opts.get("in_multiplier"):
        hidden_states = hidden_states * getattr(self, opts["in_multiplier"])
    projected = self.in_proj(hidden_states)  # [B, T, I + conv_dim + H]
    if opts.get("proj_multiplier"):
        projected = projected * getattr(self, opts["proj_multiplier"])
    gate, xBC, dt = projected.split([I, conv_dim, H], dim=-1)  # [B,T,I], [B,T,conv_dim], [B,T,H]

    A = -torch.exp(self.A_log.float())  # [H]
    past = read_states(cache, self.layer_idx)

    if past.has_previous and T == 1:
        # decode: one token per row, continuing from the cache
        xBC_t, conv_new = cached_conv_step(xBC[:, 0], self.conv1d, past, activation=self.activation, backend=backend)
        x, Bm, Cm = _scan_inputs(xBC_t).split([I, G * N, G * N], dim=-1)  # [B, I], [B, G*N], [B, G*N]
        y, ssm_new = ssd_step(
            past.recurrent,
            x.reshape(Bsz, H, P),  # [B, H, P]
            dt[:, 0],  # [B, H]
            A,
            Bm.reshape(Bsz, G, N),  # [B, G, N]
            Cm.reshape(Bsz, G, N),  # [B, G, N]
            D=self.D,
            dt_bias=self.dt_bias,
            dt_limit=tuple(self.time_step_limit),
            token_mask=None if mask is None else mask[:, 0],  # a masked decode token leaves its row's state
            backend=backend,
        )  # [B, H, P], [B, H, P, N]
        write_states(
            cache,
            self.layer_idx,
            tokens=1,
            conv=hold_masked_rows(mask, conv_new, past.conv),  # a masked decode token leaves its row untouched
            recurrent=ssm_new,  # held in ssd_step (token_mask): no pass over the state here
            inputs=xBC,  # kept by a cache that records its past (assisted generation)
            token_mask=mask,
        )
        y = y.reshape(Bsz, 1, I)  # [B, 1, I]
    else:
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
        y = y.reshape(Bsz, T, I)  # [B, T, I]

    if opts.get("optional_norm_attr") and not getattr(self, opts["optional_norm_attr"]):
        y = y * F.silu(gate.float()).to(y.dtype)  # Falcon-H1 without mamba_rms_norm: plain SiLU gate
    else:
        y = gated_norm(self.norm, y, gate, opts.get("gated_norm"))
    out = self.out_proj(y.to(dtype))  # [B, T, hidden]
    return layout.restore(out)
