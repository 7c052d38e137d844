"""The README's PEFT statement, checked with the installed peft: which LoRA targets PEFT accepts on each family, and
that a wrapped model with active adapters still gives each packed sequence the logits it has alone."""

from __future__ import annotations

import copy

import pytest
import torch

import safepad
from safepad.testing.tiny import tiny_model

peft = pytest.importorskip("peft")

REFUSED_FAMILIES = ["nemotron_h", "mamba", "mamba2", "falcon_h1", "falcon_mamba"]


def _lora(family: str, targets: list[str]):
    torch.manual_seed(0)  # lora_A's init: independent of the tests that ran before
    model = peft.get_peft_model(tiny_model(family), peft.LoraConfig(r=4, target_modules=targets))
    with torch.no_grad():  # lora_B starts at zero: make the adapters change the output
        g = torch.Generator().manual_seed(0)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


@pytest.mark.parametrize("family, targets", [
    pytest.param("nemotron_h", ["in_proj"], id="nemotron_h-in_proj"),
    pytest.param("mamba", ["in_proj", "x_proj", "dt_proj"], id="mamba-in_x_dt_proj"),
    pytest.param("bamba", ["in_proj", "out_proj"], id="bamba-in_out_proj"),
])  # fmt: skip
def test_lora_targets_that_work_stay_packing_correct(family, targets):
    """Reference: the adapters merged into the weights (merge_and_unload), each sequence alone through the stock
    model. (Unmerged, stock Mamba1 mixers read ``dt_proj.weight`` directly and silently skip a dt_proj LoRA.)"""
    lora = _lora(family, targets).double()  # float64: merged and unmerged adapters round alike
    wrapped = safepad.wrap(copy.deepcopy(lora))
    stock = copy.deepcopy(lora).merge_and_unload().eval()
    g = torch.Generator().manual_seed(1)
    lens = [5, 9, 3]
    seqs = [torch.randint(3, 200, (n,), generator=g) for n in lens]
    ids = torch.cat(seqs)[None]
    seq_idx = torch.repeat_interleave(torch.arange(len(lens), dtype=torch.int32), torch.tensor(lens))[None]
    with torch.no_grad():
        alone = torch.cat([stock(input_ids=s[None]).logits[0] for s in seqs])
        packed = wrapped(input_ids=ids, seq_idx=seq_idx).logits[0]
        plain = tiny_model(family).double()(input_ids=seqs[0][None]).logits[0]
    assert (packed - alone).abs().max() < 1e-5  # float64 weights; some of the path still runs in float32
    assert (alone[: lens[0]] - plain).abs().max() > 1e-3  # the adapters are active


@pytest.mark.parametrize("family", REFUSED_FAMILIES)
@pytest.mark.parametrize("target", ["out_proj", "conv1d"])
def test_peft_refuses_out_proj_and_conv1d_on_mamba_models(family, target):
    with pytest.raises(ValueError, match="incompatible with Mamba-based models"):
        peft.get_peft_model(tiny_model(family), peft.LoraConfig(r=4, target_modules=[target]))
