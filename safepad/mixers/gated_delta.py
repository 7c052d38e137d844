"""The generic padding-correct gated-delta-rule mixer (Qwen3-Next, Qwen3.5, OLMo-Hybrid, Kimi-Linear).

The transformers 5.23 mixers share one structure::

    projections(x) -> [q | k | v] -> one causal conv (SiLU) -> q, k, v per head
    projections(x) -> beta (write strength), g (log-decay, per head or per key channel), gate
    gated delta rule(q, k, v, g, beta)  (q/k L2-normalised) -> gated RMS norm(o, gate) -> output projection

and differ only in how the projections are laid out, which a :class:`~safepad.specs.MixerSpec` declares
through ``options``:

``qkv``
    ``"qkvz_ba"``: Qwen3-Next's fused ``in_proj_qkvz`` / ``in_proj_ba`` regrouped by the module's own
    ``fix_query_key_value_ordering`` (``z`` is the output gate, ``b`` / ``a`` the beta / decay logits);
    otherwise a tuple of projections whose outputs, concatenated, are ``[q | k | v]``
    (``("q_proj", "k_proj", "v_proj")``, Qwen3.5's ``("in_proj_qkv",)``).
``beta``
    name of the beta-logit projection (``"b_proj"``) or ``None`` (taken from the fused ``ba`` projection).
    ``beta_scale_flag``: a boolean attribute that doubles beta (OLMo-Hybrid's ``allow_neg_eigval``).
``decay``
    ``"mamba"``: ``g = -exp(A_log) * softplus(a + dt_bias)`` per head, ``a`` from ``decay_proj`` (or from the
    fused ``ba`` projection when ``decay_proj`` is ``None``); ``"module"``: ``g = getattr(self, decay_module)(x)``,
    a per-key-channel gate ``[B, T, H, Dk]`` (Kimi Delta Attention).
``gate``
    a chain of projections applied to the hidden states (``("g_proj",)``, ``("g_a_proj", "g_b_proj")``), or
    ``None`` for Qwen3-Next's ``z`` (reshaped to ``[B, T, H, Dv]`` either way by the norm call).
``norm`` / ``out``
    attribute names of the gated RMS norm and the output projection.
``key_dim`` / ``key_head_dim`` / ``value_head_dim``
    attribute names of ``H_k * Dk`` / ``Dk`` / ``Dv``.

Every submodule is called as a module (PEFT adapters on any projection stay active). A masked token neither
writes nor decays: its conv input is zero, it is absent from the cached conv state, and the delta rule sees
``beta = g = 0`` and ``k = v = 0`` there (the stock mixers write pads into the recurrent state). Shapes: ``B``
batch, ``T`` tokens, ``H_k`` key heads, ``H`` value heads, ``Dk`` / ``Dv`` head dims, ``K`` conv width.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from ..cache import read_states, write_states
from ..ops.delta_rule import chunk_gated_delta_rule, gated_delta_rule_step
from ..ops.grad import contiguous_grad
from ..ops.precision import recurrence_input
from .common import cached_conv, layout_op, cached_conv_step, hold_masked_rows, pop_cache, prepare_layout
from .history import state_history, states_to_keep

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_CHUNK_SIZE", "gated_delta_mixer_forward"]

#: tokens per chunk of the chunked delta rule (transformers' torch path and FLA use 64).
DEFAULT_CHUNK_SIZE = 64


#: (class, sizes, device) -> the column indices that regroup ``in_proj_qkvz`` / ``in_proj_ba`` (see _qkvz_ba_index)
_QKVZ_BA_INDEX: dict[tuple, tuple[Tensor, Tensor, Tensor]] = {}


def _regroup_index(self, qkvz_dim: int, ba_dim: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """The module's own ``fix_query_key_value_ordering`` applied to column numbers: the indices of ``[q | k | v]``
    ``[2 * H_k * Dk + H * Dv]`` and of ``z`` ``[H * Dv]`` in ``in_proj_qkvz``'s output, and of ``[b | a]``
    ``[2 * H]`` in ``in_proj_ba``'s (int64)."""
    cols = torch.arange(qkvz_dim, device=device).view(1, 1, qkvz_dim)  # [1, 1, qkvz_dim]
    cols_ba = torch.arange(ba_dim, device=device).view(1, 1, ba_dim)  # [1, 1, 2 * H]
    q, k, v, z, b, a = self.fix_query_key_value_ordering(cols, cols_ba)
    qkv = torch.cat([x.reshape(-1) for x in (q, k, v)])  # [2 * H_k * Dk + H * Dv]
    return qkv, z.reshape(-1), torch.cat([b.reshape(-1), a.reshape(-1)])  # ..., [H * Dv], [2 * H]


def _qkvz_ba_index(self, qkvz_dim: int, ba_dim: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`_regroup_index`, made once per (class, sizes, device): a function of the module's sizes only (no
    parameter), so no training step or ``load_state_dict`` can make it stale. Inside a traced call it is computed
    in the graph (a module-level cache is no state for dynamo to trace)."""
    if torch.compiler.is_compiling():
        return _regroup_index(self, qkvz_dim, ba_dim, device)
    sizes = tuple(getattr(self, n) for n in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim"))
    key = (type(self), sizes, qkvz_dim, ba_dim, device)
    index = _QKVZ_BA_INDEX.get(key)
    if index is None:
        index = _QKVZ_BA_INDEX[key] = _regroup_index(self, qkvz_dim, ba_dim, device)
    return index


def _project_qkv(self, opts, hidden_states: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """``hidden_states [B, T, C]`` -> (conv input ``[B, T, 2 * H_k * Dk + H * Dv]`` as ``[q | k | v]``,
    Qwen3-Next's ``z [B, T, H * Dv]``, ``b [B, T, H]``, ``a [B, T, H]``; ``None`` for the others)."""
    layout = opts.get("qkv", ("q_proj", "k_proj", "v_proj"))
    if layout == "qkvz_ba":
        qkvz = self.in_proj_qkvz(hidden_states)  # [B, T, 2 * H_k * Dk + 2 * H * Dv]
        ba = self.in_proj_ba(hidden_states)  # [B, T, 2 * H]
        # the stock regrouping (views, splits, a copy per reshaped part, a cat) as one gather per output: the same
        # values, and gradients that come back as fresh tensors (index_select's backward), not views
        qkv_i, z_i, ba_i = _qkvz_ba_index(self, qkvz.shape[-1], ba.shape[-1], qkvz.device)
        b, a = ba.index_select(-1, ba_i).chunk(2, dim=-1)  # [B, T, H] each
        return qkvz.index_select(-1, qkv_i), qkvz.index_select(-1, z_i), b, a
    if isinstance(layout, tuple) and layout and all(isinstance(n, str) for n in layout):
        parts = [getattr(self, name)(hidden_states) for name in layout]
        return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)), None, None, None  # [B, T, conv_dim]
    raise ValueError(f"gated-delta spec option qkv must be 'qkvz_ba' or a tuple of projection names, got {layout!r}")


def _beta(self, opts, hidden_states: Tensor, b: Tensor | None) -> Tensor:
    """Write strength ``beta [B, T, H]`` in ``(0, 1)`` (``(0, 2)`` with negative eigenvalues)."""
    name = opts.get("beta")
    logits = getattr(self, name)(hidden_states) if name else b  # [B, T, H]
    beta = logits.sigmoid()
    flag = opts.get("beta_scale_flag")
    if flag and getattr(self, flag):
        beta = beta * 2.0
    return beta


def _decay(self, opts, hidden_states: Tensor, a: Tensor | None) -> Tensor:
    """Log-decay ``g``: ``[B, T, H]`` (``"mamba"``) or ``[B, T, H, Dk]`` (``"module"``), float32, ``<= 0``."""
    kind = opts.get("decay", "mamba")
    if kind == "mamba":
        proj = opts.get("decay_proj")
        logits = getattr(self, proj)(hidden_states) if proj else a  # [B, T, H]
        return -self.A_log.float().exp() * F.softplus(logits.float() + self.dt_bias)  # [B, T, H]
    if kind == "module":
        return getattr(self, opts["decay_module"])(hidden_states).float()  # [B, T, H, Dk]
    raise ValueError(f"gated-delta spec option decay must be 'mamba' or 'module', got {kind!r}")


def _output_gate(self, opts, hidden_states: Tensor, z: Tensor | None) -> Tensor:
    """The gate of the output norm, ``[B, T, H * Dv]`` (Qwen3-Next's ``z`` too)."""
    chain = opts.get("gate")
    if not chain:
        return z
    gate = hidden_states
    for name in chain:
        gate = getattr(self, name)(gate)
    return gate  # [B, T, H * Dv]


def _rule_inputs(mixed: Tensor) -> Tensor:
    """The conv output ``[..., conv_dim]`` as the delta rule's input: float64 for half precision on CPU.

    A decode step and the chunked rule evaluate the recurrence in different orders; in float32 they differ by
    ~1e-7 relative, and where the output is then rounded to bf16 a few values fall on either side of a rounding
    boundary (one-ulp flips; bf16 Qwen3-Next, GRPO seed 2: 2.0e-3 in log-prob). In float64 (the rule and its
    cached state) they agree to ~1e-16, and the output is rounded to the model dtype once, after the gated norm.
    As the Mamba2 mixer's SSD and the CPU attention of half-precision models (docs/limits.md). Elsewhere: as is
    (the rule computes in float32 and returns the model dtype).
    """
    return recurrence_input(mixed, "delta_rule")  # the policy: safepad.ops.precision


def gated_delta_mixer_forward(
    self, hidden_states: Tensor, cache_params=None, attention_mask: Tensor | None = None, **kwargs
) -> Tensor:
    """Padding/packing-correct forward of a gated-delta-rule mixer. ``hidden_states [B, T, hidden]`` -> same."""
    opts = self._safepad_spec.options
    backend = self._safepad.backend
    cache = pop_cache(cache_params, kwargs)
    hidden_states, layout = prepare_layout(self, hidden_states, attention_mask, cache, kwargs)
    Bsz, T, _ = hidden_states.shape
    dtype = hidden_states.dtype
    mask = layout.mask
    Dk = getattr(self, opts.get("key_head_dim", "head_k_dim"))
    Dv = getattr(self, opts.get("value_head_dim", "head_v_dim"))

    if mask is not None:
        hidden_states = torch.where(mask[..., None], hidden_states, 0.0)  # pads contribute nothing (even a NaN)
    mixed, z, b, a = _project_qkv(self, opts, hidden_states)  # [B, T, conv_dim]
    conv_dim = mixed.shape[-1]
    key_dim = getattr(self, opts.get("key_dim", "key_dim"))  # H_k * Dk
    # the gradients of beta and g leave the delta rule as slices of its padded chunks (or, before the rule made
    # them contiguous, permuted), and under AOT autograd the backward of the projection they came from replays a
    # ``view`` (qwen4_exp: softplus_backward viewed as [B * T, H] failed under torch.compile(model,
    # backend="aot_eager")). See safepad.ops.grad
    beta = contiguous_grad(_beta(self, opts, hidden_states, b))  # [B, T, H]
    g = contiguous_grad(_decay(self, opts, hidden_states, a))  # [B, T, H] or [B, T, H, Dk]

    past = read_states(cache, self.layer_idx)
    decode = past.has_previous and T == 1

    if decode:
        conv_t, conv_new = cached_conv_step(
            mixed[:, 0], self.conv1d, past, activation=self.activation, backend=backend
        )  # [B, conv_dim], [B, conv_dim, K]
        q, k, v = _rule_inputs(conv_t).split([key_dim, key_dim, conv_dim - 2 * key_dim], dim=-1)
        state = past.recurrent
        if state is None:
            H = beta.shape[-1]
            state = mixed.new_zeros(Bsz, H, Dk, Dv, dtype=torch.float32 if q.dtype != torch.float64 else q.dtype)
        o, rec_new = gated_delta_rule_step(
            state,
            q.reshape(Bsz, -1, Dk),  # [B, H_k, Dk]
            k.reshape(Bsz, -1, Dk),  # [B, H_k, Dk]
            v.reshape(Bsz, -1, Dv),  # [B, H, Dv]
            g[:, 0],  # [B, H] or [B, H, Dk]
            beta[:, 0],  # [B, H]
            use_qk_l2norm=True,
            token_mask=None if mask is None else mask[:, 0],  # a masked decode token leaves its row's state
            # the step is a few elementwise ops with no kernel (it refuses "kernels"); same math either way
            backend="torch" if backend == "kernels" else backend,
        )  # [B, H, Dv], [B, H, Dk, Dv]
        write_states(
            cache,
            self.layer_idx,
            tokens=1,
            conv=hold_masked_rows(mask, conv_new, past.conv),  # a masked decode token leaves its row untouched
            recurrent=rec_new,  # held in gated_delta_rule_step (token_mask): no pass over the state here
            inputs=mixed,  # kept by a cache that records its past (assisted generation)
            token_mask=mask,
        )  # o stays [B, H, Dv]: T = 1 (reshaped below, no extra view)
    else:
        want_state = cache is not None
        conv_in = mixed
        mixed, conv_final = cached_conv(
            mixed, self.conv1d, layout, past, activation=self.activation, want_state=want_state, backend=backend
        )  # [B, T, conv_dim], [B, conv_dim, K]
        q, k, v = _rule_inputs(mixed).split([key_dim, key_dim, conv_dim - 2 * key_dim], dim=-1)

        def rule(token_mask: Tensor | None, final_state: bool):
            return layout_op(layout, chunk_gated_delta_rule)(
                q.reshape(Bsz, T, -1, Dk),  # [B, T, H_k, Dk]
                k.reshape(Bsz, T, -1, Dk),  # [B, T, H_k, Dk]
                v.reshape(Bsz, T, -1, Dv),  # [B, T, H, Dv]
                g,
                beta,
                chunk_size=int(opts.get("chunk_size", DEFAULT_CHUNK_SIZE)),
                initial_state=past.recurrent,
                seq_idx=layout.seq_idx,
                token_mask=token_mask,
                use_qk_l2norm=True,
                return_final_state=final_state,
                backend=backend,
            )

        rule_out = rule(mask, want_state)
        o, rec_final = rule_out if want_state else (rule_out, None)  # [B, T, H, Dv], [B, H, Dk, Dv]
        if want_state:
            keep = states_to_keep(cache, self.layer_idx, T)
            rec_final = state_history(layout, T, keep, rec_final, lambda m: rule(m, True)[1])
            write_states(
                cache, self.layer_idx, tokens=T, conv=conv_final, recurrent=rec_final, inputs=conv_in, token_mask=mask
            )
        if mask is not None:
            o = torch.where(mask[:, :, None, None], o, 0.0)  # pad outputs are unspecified by the op: make them 0

    gate = _output_gate(self, opts, hidden_states, z)
    o = o.reshape(-1, Dv)  # [B * T * H, Dv]
    gate = gate.reshape(-1, Dv)  # [B * T * H, Dv]
    y = getattr(self, opts.get("norm", "norm"))(o, gate)  # [B * T * H, Dv]
    y = y.reshape(Bsz, T, -1)  # [B, T, H * Dv]
    out = getattr(self, opts.get("out", "out_proj"))(y.to(dtype))  # [B, T, hidden]
    return layout.restore(out)
