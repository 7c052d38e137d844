"""PackedGRPOMixin on MoE hybrids: TRL's MoE load-balancing loss, computed on the packed rows.

TRL turns ``compute_aux_loss`` on for an MoE model whose ``router_aux_loss_coef`` is not 0 (the default of
Qwen3-Next and the other MoE hybrids), so docs/rl.md's recipe met ``ValueError`` on them. Reference: each sequence
alone through the stock model, its router logits concatenated over the micro-batch's sequences, transformers' own
``load_balancing_loss_func`` of the family over them, averaged over the micro-batches as TRL does. Families whose
router loss safepad does not keep to the real tokens of packed rows raise, naming ``router_aux_loss_coef=0.0``.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import logging
import types

import pytest
import torch

import safepad
from safepad.testing.tiny import tiny_model
from safepad.trainer_ext import PackedGRPOMixin

trl = pytest.importorskip("trl")


@pytest.fixture(scope="module", autouse=True)
def _quiet():
    log = logging.getLogger("transformers")
    level = log.level
    log.setLevel(logging.ERROR)
    yield
    log.setLevel(level)


class _Bare(PackedGRPOMixin):
    """The mixin's method without a trainer around it."""

    temperature = 0.9
    accelerator = types.SimpleNamespace(autocast=contextlib.nullcontext)


def _batch(seed: int = 0):
    """``[6, 20]`` GRPO-style rows: prompts left-padded to 8, completions right-padded."""
    g = torch.Generator().manual_seed(seed)
    spans = [(3, 10), (1, 1), (5, 4), (2, 12), (8, 12), (6, 1)]
    ids = torch.zeros(len(spans), 20, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, (p, c) in enumerate(spans):
        ids[b, 8 - p : 8 + c] = torch.randint(3, 250, (p + c,), generator=g)
        mask[b, 8 - p : 8 + c] = 1
    return ids, mask


def _reference_aux(stock, ids, mask, batch_size: int) -> torch.Tensor:
    module = importlib.import_module(type(stock).__module__)
    cfg = stock.config.get_text_config()
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    losses = []
    for start in range(0, ids.shape[0], batch_size):
        per_layer = None
        for b in range(start, min(start + batch_size, ids.shape[0])):
            seq = ids[b, mask[b].bool()]
            out = stock(input_ids=seq[None], use_cache=False, output_router_logits=True)
            layers = [r for r in out.router_logits if r is not None]
            per_layer = [[r] for r in layers] if per_layer is None else [a + [r] for a, r in zip(per_layer, layers)]
        logits = tuple(torch.cat(rs) for rs in per_layer)
        losses.append(module.load_balancing_loss_func(logits, experts, cfg.num_experts_per_tok))
    return torch.stack(losses).mean()


@pytest.mark.parametrize("family", ["qwen3_next", "jamba", "granitemoehybrid", "qwen3_5_moe_text"])
def test_aux_loss_equals_each_sequence_alone(family):
    stock = tiny_model(family, **({"num_experts": 4} if family == "jamba" else {}))
    assert stock.config.get_text_config().router_aux_loss_coef != 0  # TRL would turn compute_aux_loss on
    wrapped = safepad.wrap(copy.deepcopy(stock))
    ids, mask = _batch()
    with torch.no_grad():
        lp, _, aux = _Bare()._get_per_token_logps_and_entropies(
            wrapped, ids, mask, 12, batch_size=4, compute_aux_loss=True
        )
        ref = _reference_aux(stock, ids, mask, batch_size=4)
        stock64 = copy.deepcopy(stock).double()
        stock64.set_experts_implementation("eager")  # grouped_mm has no float64
        ref64 = _reference_aux(stock64, ids, mask, batch_size=4)
    assert aux is not None and aux.dim() == 0 and lp.shape == (6, 12)
    # tolerance: the float32 reference's own rounding (vs float64), times 10, and at least 4 float32 ulps
    noise = max((ref - ref64).abs().item(), 4 * torch.finfo(torch.float32).eps * ref64.abs().item())
    assert abs(aux.item() - ref64.item()) <= 10 * noise, (aux.item(), ref.item(), ref64.item())


def test_unsupported_moe_family_names_the_setting():
    wrapped = safepad.wrap(tiny_model("lfm2_moe"))
    ids, mask = _batch()
    with pytest.raises(ValueError, match=r"router_aux_loss_coef=0\.0"):
        _Bare()._get_per_token_logps_and_entropies(wrapped, ids, mask, 12, compute_aux_loss=True)
    lp, _, aux = _Bare()._get_per_token_logps_and_entropies(wrapped, ids, mask, 12, compute_aux_loss=False)
    assert aux is None and torch.isfinite(lp).all()


def test_docs_recipe_runs_on_qwen3_next_with_the_aux_loss(tmp_path):
    """docs/rl.md's GRPO recipe, as printed, on a tiny Qwen3-Next (default router_aux_loss_coef): one step runs,
    and the aux loss the mixin hands TRL equals TRL's own padded forward's."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from conftest import make_tokenizer

    seen = []

    class PackedGRPOTrainer(safepad.PackedGRPOMixin, GRPOTrainer):
        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *a, **k):
            out = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, *a, **k)
            with torch.no_grad():
                padded = GRPOTrainer._get_per_token_logps_and_entropies(
                    self, model, input_ids, attention_mask, logits_to_keep, *a, **k
                )
            seen.append((out[2], padded[2]))
            return out

    model = safepad.wrap(tiny_model("qwen3_next", pad_token_id=0, eos_token_id=2))
    g = torch.Generator().manual_seed(0)
    prompts = [" ".join(f"t{int(i)}" for i in torch.randint(3, 250, (n,), generator=g)) for n in (2, 9, 1, 5)]
    config = GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, max_steps=1, report_to=[], save_strategy="no",
        per_device_train_batch_size=8, num_generations=4, max_completion_length=6, logging_steps=1,
        disable_tqdm=True, dataloader_num_workers=0, beta=0.0,
        generation_kwargs={"use_cache": False},  # the sampling is not under test here: no cached decode
    )  # fmt: skip
    trainer = PackedGRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=make_tokenizer("left"),
    )
    assert trainer.aux_loss_enabled
    trainer.train()
    assert trainer.state.global_step == 1
    with_aux = [(a, p) for a, p in seen if p is not None]
    assert with_aux
    for aux, padded in with_aux:
        assert abs(aux.item() - padded.item()) <= 1e-5 * max(1.0, abs(padded.item()))
