"""Every config option a stock mixer reads works wrapped, or ``wrap()`` raises naming it (issue 21, item 2).

Each case builds the tiny model of a family with one option changed (the activation the stock mixer applies
after its conv, biases on / off, ``n_groups`` from 1 to H, an odd head count, the dt rank, ``residual_in_fp32``,
tied / untied embeddings, gated-norm options, ...), wraps a copy and runs it against each sequence alone
through the stock model (``safepad.testing.scenarios``): packed rows (``seq_idx``) and a right-padded
prefill followed by cached decode. The options were read off each stock mixer's ``__init__`` / forward in
transformers 5.23 / 5.24 (``config.<name>`` reads); options that only pick between equivalent stock code
paths (``use_mambapy``, ``use_associative_scan``, ``use_mamba_kernels``) change no math and are left out.
"""

from __future__ import annotations

import copy

import pytest
import torch

import safepad
from safepad.testing.scenarios import PACKED_LENGTHS, _gen, _ModelIO, _packed_inputs, run_scenario
from safepad.testing.tiny import family_available, tiny_model

SCENARIOS = ("packed_seq_idx", "right_pad_decode")
#: the wrapped model's |Δ logits| may be this many times the stock model's own float32 rounding (measured on the
#: scenario's sequences against the same weights in float64): a packed or padded row rounds as differently from
#: the row alone as the float32 row alone does from float64, a few times over; a layout defect is ~1e-1 off
NOISE_FACTOR = 32


def _fp32_noise(stock) -> float:
    """The stock model's own float32 rounding, relative as the scenarios measure it: max |logits32 - logits64| /
    max(1, max |logits64|) over the packed scenario's sequences, each run alone through the model in float32 and
    through a float64 copy of it (at least 8 float32 ulps)."""
    stock64 = copy.deepcopy(stock).double()
    if callable(getattr(stock64, "set_experts_implementation", None)):
        try:
            stock64.set_experts_implementation("eager")  # grouped_mm has no float64
        except (ValueError, AttributeError):
            pass
    io32, io64 = _ModelIO(stock), _ModelIO(stock64)
    seqs, _, _ = _packed_inputs(io32.vocab, _gen(0, "packed"), PACKED_LENGTHS)
    err = scale = 0.0
    with torch.no_grad():
        for seq in seqs:
            pos = torch.arange(seq.numel())[None]
            a, _ = io32(seq[None], position_ids=pos, use_cache=False)
            b, _ = io64(seq[None], position_ids=pos, use_cache=False)
            err = max(err, (a.double() - b).abs().max().item())
            scale = max(scale, b.abs().max().item())
    return max(err / max(1.0, scale), 8 * torch.finfo(torch.float32).eps)


def _case(family: str, id_: str, **overrides):
    return pytest.param(family, overrides, id=f"{family}-{id_}")


# the activation each family's stock mixer applies after its conv (``ACT2FN[...]``), under its config name
_ACT = {
    "nemotron_h": "mamba_hidden_act",
    "mamba2": "hidden_act",
    "bamba": "hidden_act",
    "falcon_h1": "hidden_act",
    "granitemoehybrid": "hidden_act",
    "jamba": "hidden_act",
    "mamba": "hidden_act",
    "falcon_mamba": "hidden_act",
    "qwen3_next": "hidden_act",
    "olmo_hybrid": "hidden_act",
    "kimi_linear": "hidden_act",
}

CASES = [
    # activations (transformers' own Jamba tester uses gelu); silu is the kernel's and the default
    *(_case(f, act, **{name: act}) for f, name in _ACT.items() for act in ("gelu", "relu")),
    # Mamba2 / SSD biases, groups (1 .. H) and odd head counts
    _case("mamba2", "no_conv_bias", use_conv_bias=False),
    _case("mamba2", "proj_bias", use_bias=True),
    _case("mamba2", "groups_1", n_groups=1),
    _case("mamba2", "groups_H", n_groups=8),
    _case("mamba2", "odd_heads", num_heads=5, hidden_size=40, n_groups=5),
    _case("mamba2", "dt_rank_4", time_step_rank=4),
    _case("mamba2", "residual_fp32_off", residual_in_fp32=False),
    _case("mamba2", "untied", tie_word_embeddings=False),
    _case("mamba2", "dt_limit", time_step_limit=(0.02, 0.2)),
    _case("nemotron_h", "no_conv_bias", use_conv_bias=False),
    _case("nemotron_h", "proj_bias", use_bias=True),
    _case("nemotron_h", "groups_1", n_groups=1),
    _case("nemotron_h", "groups_H", n_groups=8),
    _case("nemotron_h", "odd_heads", mamba_num_heads=5, n_groups=1),
    _case("nemotron_h", "residual_fp32", residual_in_fp32=True),
    _case("bamba", "no_conv_bias", mamba_conv_bias=False),
    _case("bamba", "proj_bias", mamba_proj_bias=True),
    _case("bamba", "groups_1", mamba_n_groups=1),
    _case("bamba", "groups_H", mamba_n_groups=8),
    _case("falcon_h1", "no_gated_norm", mamba_rms_norm=False),
    _case("falcon_h1", "norm_after_gate", mamba_rms_norm=True, mamba_norm_before_gate=False),
    _case("falcon_h1", "norm_before_gate", mamba_rms_norm=True, mamba_norm_before_gate=True),
    _case("falcon_h1", "no_conv_bias", mamba_conv_bias=False),
    _case("falcon_h1", "proj_bias", mamba_proj_bias=True, projectors_bias=True),
    _case("falcon_h1", "groups_1", mamba_n_groups=1),
    _case("granitemoehybrid", "no_conv_bias", mamba_conv_bias=False),
    _case("granitemoehybrid", "proj_bias", mamba_proj_bias=True),
    _case("granitemoehybrid", "groups_H", mamba_n_groups=8),
    _case("zamba2", "no_conv_bias", use_conv_bias=False),
    _case("zamba2", "proj_bias", add_bias_linear=True),
    _case("zamba2", "groups_1", mamba_ngroups=1),
    # Mamba1 selective scan
    _case("mamba", "no_conv_bias", use_conv_bias=False),
    _case("mamba", "proj_bias", use_bias=True),
    _case("mamba", "dt_rank_2", time_step_rank=2),
    _case("mamba", "residual_fp32_off", residual_in_fp32=False),
    _case("mamba", "untied", tie_word_embeddings=False),
    _case("falcon_mamba", "no_conv_bias", use_conv_bias=False),
    _case("falcon_mamba", "proj_bias", use_bias=True),
    _case("falcon_mamba", "dt_rank_2", time_step_rank=2),
    _case("jamba", "no_conv_bias", mamba_conv_bias=False),
    _case("jamba", "proj_bias", mamba_proj_bias=True),
    _case("jamba", "dt_rank_2", mamba_dt_rank=2),
    # gated delta / short conv
    _case("qwen3_next", "heads_equal", linear_num_key_heads=4, linear_num_value_heads=4),
    _case("olmo_hybrid", "neg_eigval", linear_allow_neg_eigval=True),
    _case("olmo_hybrid", "no_neg_eigval", linear_allow_neg_eigval=False),
    _case("kimi_linear", "odd_heads", linear_num_heads=3),
    _case("lfm2", "conv_bias", conv_bias=True),
    _case("lfm2", "conv_L_3", conv_L_cache=3),
]


@pytest.mark.parametrize(("family", "overrides"), CASES)
def test_config_option_wrapped_equals_each_sequence_alone(family, overrides):
    ok, why = family_available(family)
    if not ok:
        pytest.skip(why)
    stock = tiny_model(family, **overrides)
    for name, value in overrides.items():  # the option really reached the config (no silent default)
        got = getattr(stock.config, name)
        assert got == value or (isinstance(value, tuple) and tuple(got) == value), (name, got, value)
    try:
        wrapped = safepad.wrap(copy.deepcopy(stock))
    except ValueError as exc:  # refusing is allowed, at wrap() time and naming the option
        assert any(name in str(exc) for name in overrides), f"wrap() raised without naming {list(overrides)}: {exc}"
        return
    tol = NOISE_FACTOR * _fp32_noise(stock)  # from this machine's rounding, not a number tuned to one CPU
    for scenario in SCENARIOS:
        res = run_scenario(wrapped, copy.deepcopy(stock), scenario, tol=tol)
        assert res.passed, (scenario, tol, res.status, res.error, res.max_abs_logits, res.state_errors)


@pytest.mark.parametrize("name", ["gelu", "relu", "tanh"])
def test_conv_op_applies_any_transformers_activation_on_the_torch_core(name):
    """The op itself: ``ACT2FN[name]`` after the conv, packed and stepped, against a float64 loop."""
    from transformers.activations import ACT2FN

    from safepad.ops.conv import causal_conv1d, causal_conv1d_step

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 9, 8, generator=gen, dtype=torch.float64)
    w = torch.randn(8, 4, generator=gen, dtype=torch.float64) * 0.5
    b = torch.randn(8, generator=gen, dtype=torch.float64)
    seq_idx = torch.tensor([[0] * 4 + [1] * 5])
    act = ACT2FN[name]
    ref = torch.zeros_like(x)
    for t in range(9):
        start = 0 if t < 4 else 4
        acc = b.clone()
        for k in range(4):
            s = t - (3 - k)
            if s >= start:
                acc = acc + w[:, k] * x[0, s]
        ref[0, t] = act(acc)
    y = causal_conv1d(x, w, b, activation=name, seq_idx=seq_idx)
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-12)
    state = torch.cat([torch.zeros(1, 8, 1, dtype=torch.float64), x[:, 1:4].transpose(1, 2)], dim=2)  # [1, 8, 4]
    y_step, _ = causal_conv1d_step(x[:, 4] * 0 + x[0, 3], state[:, :, -3:], w, b, activation=name)
    assert y_step.shape == (1, 8)
    with pytest.raises(ValueError, match="activation must be None, a callable or one of transformers' ACT2FN"):
        causal_conv1d(x, w, b, activation="not_an_activation")
