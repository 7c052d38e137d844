"""``"safepad_sdpa"``: float64 attention on bf16 / fp16 CPU tensors.

The rollout-parity consequences are tested in ``tests/rl/test_rollout_parity.py``, which configs point at it (and
when) in ``test_attention_implementation.py``; here: that float32 runs stock sdpa unchanged (bitwise), that a bf16
attention output is the float64 attention of its inputs rounded once (stock's fused bf16 kernel is not), and that an
uncached left-padded call of a hybrid rotates at the rollout's positions (eager and compiled).
"""

from __future__ import annotations

import importlib

import pytest
import torch

import safepad
from safepad.testing.tiny import tiny_model

attention = importlib.import_module("safepad.wrap.attention")


def _ids(B: int = 3, T: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 256, (B, T), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :4] = 0  # a left-padded row
    return ids, mask


def test_float32_inputs_run_stock_sdpa_bitwise():
    """float32 tensors handed to "safepad_sdpa" (a config still pointing there) get stock sdpa's output bitwise."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = tiny_model("bamba").model.layers[1].self_attn
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 9, 16, generator=g) for h in (4, 2, 2))  # [B, H, T, d]
    ours, _ = attention.upcast_sdpa_forward(module, q, k, v, None, scaling=0.25, is_causal=True)
    stock, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.25, is_causal=True)
    assert torch.equal(ours, stock)


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")])
def test_half_precision_attention_is_float64_rounded_once(dtype):
    """bf16 / fp16 on CPU: the output is float64 sdpa of the same inputs, rounded once (stock's fused kernel,
    which rounds the softmax probabilities to the input dtype, is not: checked as the negative control)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = tiny_model("bamba").model.layers[1].self_attn
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(4, 4, 40, 16, generator=g) * 2).to(dtype)  # [B, Hq, T, d]
    k = (torch.randn(4, 2, 40, 16, generator=g) * 2).to(dtype)  # [B, Hk, T, d]
    v = torch.randn(4, 2, 40, 16, generator=g).to(dtype)
    keep = torch.ones(40, 40, dtype=torch.bool).tril()[None, None].repeat(4, 1, 1, 1)  # [B, 1, T, T]
    keep[1, ..., :7] = False  # a left-padded row
    keep[1, :, :7, 0] = True  # (its pad queries see one key: no fully masked row)
    out, _ = attention.upcast_sdpa_forward(module, q, k, v, keep, scaling=0.25)  # [B, T, Hq, d]
    ref, _ = sdpa_attention_forward(module, q.double(), k.double(), v.double(), keep, scaling=0.25)
    assert out.dtype == dtype
    assert torch.equal(out, ref.to(dtype))
    fused, _ = sdpa_attention_forward(module, q, k, v, keep, scaling=0.25)
    assert not torch.equal(fused, ref.to(dtype)), "stock's fused kernel now rounds once too: the upcast may go"


@pytest.mark.parametrize("compiled", [pytest.param(False, id="eager"), pytest.param(True, id="compiled")])
def test_uncached_left_padded_call_uses_rollout_positions(compiled):
    """bf16 Bamba (RoPE): an uncached left-padded call without ``position_ids`` gives the logits of the same call
    with ``position_ids = cumsum(mask) - 1`` (each token's position in its sequence, as generate's cached steps
    use), eager and under ``torch.compile``. Before, it rotated at ``arange(T)``: other bf16 logits."""
    model = safepad.wrap(tiny_model("bamba", dtype=torch.bfloat16))
    ids, mask = _ids()
    real_positions = (mask.cumsum(1) - 1).clamp(min=0)  # [B, T]
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, position_ids=real_positions, use_cache=False).logits
        run = torch.compile(model, backend="eager", dynamic=False) if compiled else model
        got = run(input_ids=ids, attention_mask=mask, use_cache=False).logits
        slots = model(input_ids=ids, attention_mask=mask, position_ids=torch.arange(ids.shape[1]).expand_as(ids),
                      use_cache=False).logits  # fmt: skip
    real = mask.bool()
    assert torch.equal(got[real], ref[real])
    assert not torch.equal(slots[1][real[1]], ref[1][real[1]]), "slot positions round alike: the test shows nothing"


def _inkling_pair():
    """The tiny Inkling (attention with a learned ``position_bias`` and sliding layers) wrapped in bf16, and the same
    weights wrapped in float64 (experts ``eager``: grouped_mm has no float64) as the reference."""
    ref = tiny_model("inkling_text").double()
    ref.set_experts_implementation("eager")
    return safepad.wrap(tiny_model("inkling_text", dtype=torch.bfloat16)), safepad.wrap(ref)


def test_inkling_bf16_position_bias_padded_batch_equals_each_row_alone():
    """bf16 Inkling: its ``position_bias`` (a kwarg of the attention call, which transformers' sdpa turns into the
    additive mask) joins the float64 attention; before, it stayed bf16 next to float64 queries and sdpa raised
    "Expected attn_mask dtype to be bool or float or to match query dtype". A left-padded batch forward and a greedy
    ``generate`` give each row the logits of that row alone through the same model, within the bf16 model's own
    error against float64 (measured here; a padding defect is orders above it)."""
    model, ref = _inkling_pair()
    assert model.config._attn_implementation == attention.UPCAST_SDPA
    ids, mask = _ids(B=2, T=9)
    gen = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        batch = model(input_ids=ids, attention_mask=mask).logits.double()  # [B, T, V]
        out = model.generate(input_ids=ids, attention_mask=mask, **gen)
        for b in range(2):
            row = ids[b][mask[b].bool()][None]  # [1, n]
            alone = model(input_ids=row).logits[0].double()  # [n, V]
            noise = (alone - ref(input_ids=row).logits[0]).abs().max()
            assert 0 < noise < 0.05, noise  # bf16 rounding, not a layout error
            assert (batch[b][mask[b].bool()] - alone).abs().max() <= noise
            alone_gen = model.generate(input_ids=row, **gen)
            ref_gen = ref.generate(input_ids=row, **gen)
            got = torch.stack([step[b] for step in out.logits]).double()  # [new, V]
            want = torch.stack([step[0] for step in alone_gen.logits]).double()
            gen_noise = (want - torch.stack([step[0] for step in ref_gen.logits])).abs().max()
            assert torch.equal(out.sequences[b, ids.shape[1]:], alone_gen.sequences[0, row.shape[1]:])
            assert (got - want).abs().max() <= gen_noise
