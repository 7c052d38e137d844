"""The MoE router load-balancing loss of a packed batch with a pad tail (issue 28, item 4).

``pad_to_length`` / buckets / ``pad_to_multiple_of`` add a pad tail (its own sequence, labels -100). It must stay
out of the router loss as it stays out of the LM loss. Reference: each sequence run ALONE through the stock model
(no padding, no cache), its router logits concatenated over the sequences, and transformers' own
``load_balancing_loss_func`` of the family over them; its gradient with respect to the router weights too.
Old: the pad tail's tokens counted (Jamba / Qwen3-Next / Qwen3.5-MoE), and GraniteMoeHybrid crashed inside that function on
any packed batch (``'dict' object has no attribute 'reshape'``).
"""

from __future__ import annotations

import importlib

import pytest
import torch

import safepad
from safepad.collators import DataCollatorForPackedSSM
from safepad.testing import tiny_model

LENGTHS = (7, 12, 5)
ROUTER_OVERRIDES = {"jamba": {"num_experts": 4}, "qwen3_next": {}, "granitemoehybrid": {}, "qwen3_5_moe_text": {}}

FAMILIES = [pytest.param(f, id=f) for f in ROUTER_OVERRIDES]
LAYOUTS = [
    pytest.param({"pad_to_length": 40}, id="pad_to_length"),
    pytest.param({"pad_to_length": (16, 32, 64)}, id="buckets"),
    pytest.param({"pad_to_multiple_of": 16}, id="pad_to_multiple_of"),
    pytest.param({}, id="no-pad"),
]


def _model(family: str):
    model = tiny_model(family, output_router_logits=True, **ROUTER_OVERRIDES[family])
    model.train()  # the router loss is a training loss (routers: no jitter / dropout in these tiny configs)
    return model


def _router_params(model) -> dict[str, torch.Tensor]:
    """The routers' weights (the load-balancing loss's only parameters): ``...mlp.gate`` / ``...router``."""
    return {n: p for n, p in model.named_parameters() if n.split(".")[-2] in ("gate", "router")}


def _balancing(model):
    module = importlib.import_module(type(model).__module__)
    cfg = model.config.get_text_config()
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    return lambda logits: module.load_balancing_loss_func(logits, experts, cfg.num_experts_per_tok)


def _reference(family: str, seqs: list[torch.Tensor]):
    """Aux loss over the real tokens, each sequence alone through the stock model, and its router gradients."""
    stock = _model(family)
    per_layer = None
    for s in seqs:
        out = stock(input_ids=s[None], use_cache=False, output_router_logits=True)
        layers = [r for r in out.router_logits if r is not None]
        per_layer = [[r] for r in layers] if per_layer is None else [a + [r] for a, r in zip(per_layer, layers)]
    aux = _balancing(stock)(tuple(torch.cat(rs) for rs in per_layer))
    params = _router_params(stock)
    grads = torch.autograd.grad(aux, list(params.values()))
    return aux.detach(), dict(zip(params, grads))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_pad_tail_stays_out_of_the_router_loss(family, layout):
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 200, (n,), generator=g) for n in LENGTHS]
    batch = DataCollatorForPackedSSM(**layout)([{"input_ids": s.tolist()} for s in seqs])
    assert batch["input_ids"].shape[1] > sum(LENGTHS) or not layout  # the layouts with a tail do pad
    ref_aux, ref_grads = _reference(family, seqs)
    model = safepad.wrap(_model(family))
    out = model(**batch)
    params = _router_params(model)
    assert params, "no router parameters found"
    grads = dict(zip(params, torch.autograd.grad(out.aux_loss, list(params.values()))))
    assert torch.allclose(out.aux_loss.detach(), ref_aux, rtol=1e-5, atol=1e-7), (float(out.aux_loss), float(ref_aux))
    for name, ref in ref_grads.items():
        scale = ref.abs().max().clamp_min(1e-12)
        assert float((grads[name] - ref).abs().max() / scale) < 1e-4, name
    # the LM loss is unchanged by the mask handed to the router loss: labels -100 on the tail
    coef = model.config.get_text_config().router_aux_loss_coef
    lm = model(**{k: v for k, v in batch.items()}, output_router_logits=False).loss
    assert torch.allclose(out.loss, lm + coef * out.aux_loss, rtol=1e-5, atol=1e-6)


def test_unwrapped_llama_ignores_the_real_token_mask():
    """An attention-only model (not wrapped) takes the collator's batch as before: same loss with the key."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2)
    )  # fmt: skip
    batch = DataCollatorForPackedSSM(pad_to_multiple_of=16)([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
    with_key = model(**batch).logits
    without = model(**{k: v for k, v in batch.items() if k != "real_token_mask"}).logits
    assert torch.equal(with_key, without)


def test_bad_real_token_mask_is_refused():
    model = safepad.wrap(_model("jamba"))
    batch = DataCollatorForPackedSSM(pad_to_multiple_of=16)([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
    batch["real_token_mask"] = batch["real_token_mask"][:, :-1]
    with pytest.raises(ValueError, match=r"real_token_mask must be a \[batch, seqlen\]"):
        model(**batch)


def test_pad_tail_stays_out_of_the_router_loss_compiled():
    """``torch.compile(model)`` with fixed-length rows (docs/compile.md): the traced hook hands the mask too."""
    family = "jamba"
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 200, (n,), generator=g) for n in LENGTHS]
    batch = DataCollatorForPackedSSM(pad_to_length=40)([{"input_ids": s.tolist()} for s in seqs])
    ref_aux, _ = _reference(family, seqs)
    compiled = torch.compile(safepad.wrap(_model(family)), backend="eager")
    out = compiled(**batch)
    assert torch.allclose(out.aux_loss.detach(), ref_aux, rtol=1e-5, atol=1e-7), (float(out.aux_loss), float(ref_aux))
