"""``safepad audit --model``: tiny checkpoints written with save_pretrained into tmp_path (no download). A model
without recurrent layers or one safepad cannot wrap is a usage error (exit 2, a message, no traceback); a VLM
is audited through its language model."""

from __future__ import annotations

import pytest
import torch

from safepad.cli.main import main
from safepad.wrap import wrap


def _run(argv, capsys, wrap_fn=None):
    code = main(["audit", "--no-progress", *argv], wrap_fn=wrap_fn)
    out, err = capsys.readouterr()
    return code, out, err


def _save(model, path):
    model.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory):
    from transformers.models.nemotron_h_omni.configuration_nemotron_h_omni import NemotronH_Omni_Reasoning_V3_Config
    from transformers.models.nemotron_h_omni.modeling_nemotron_h_omni import NemotronH_Omni_Reasoning_V3

    from safepad.testing.tiny import strengthen_mixers, tiny_config

    cfg = NemotronH_Omni_Reasoning_V3_Config(
        text_config=tiny_config("nemotron_h").to_dict(),
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                           patch_size=4, image_size=16, max_img_size=16, video_temporal_patch_size=2),
        projector_hidden_size=32, vision_hidden_size=32, force_image_size=16, image_token_id=250,
    )  # fmt: skip
    torch.manual_seed(0)
    return _save(strengthen_mixers(NemotronH_Omni_Reasoning_V3(cfg)), tmp_path_factory.mktemp("omni"))


def test_llama_checkpoint_is_a_usage_error(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    path = _save(LlamaForCausalLM(cfg), tmp_path / "llama")
    for extra in ([], ["--no-wrap"]):
        code, out, err = _run(["--model", path, *extra], capsys)
        assert code == 2, err
        assert "has no recurrent (SSM / linear-attention) layer" in err and "Traceback" not in err + out
        assert "safepad audit:" not in out  # nothing ran


def test_recurrent_model_safepad_cannot_wrap_is_a_usage_error(tmp_path, capsys):
    from transformers import MiniMaxConfig, MiniMaxForCausalLM

    cfg = MiniMaxConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=8, num_local_experts=2, num_experts_per_tok=1,
                        layer_types=["linear_attention", "full_attention"])  # fmt: skip
    path = _save(MiniMaxForCausalLM(cfg), tmp_path / "minimax")
    code, out, err = _run(["--model", path, "--scenarios", "left_pad_decode"], capsys, wrap_fn=wrap)
    assert code == 2, err
    assert "found no supported recurrent mixer" in err and "--no-wrap" in err and "Traceback" not in err + out


def test_checkpoint_of_no_language_model_is_a_usage_error(tmp_path, capsys):
    from transformers import ViTConfig, ViTModel

    path = _save(ViTModel(ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                    intermediate_size=32, image_size=8, patch_size=4)), tmp_path / "vit")  # fmt: skip
    code, _, err = _run(["--model", path], capsys)
    assert code == 2 and "'vit' model" in err and "AutoModelForImageTextToText" in err
    (tmp_path / "empty").mkdir()
    code, _, err = _run(["--model", str(tmp_path / "empty")], capsys)
    assert code == 2 and "cannot read its config" in err


def test_vlm_checkpoint_audits_its_language_model(omni_dir, capsys):
    """Nemotron-H Omni loads with AutoModelForImageTextToText; its NemotronHForCausalLM runs the scenarios."""
    scenarios = "packed_seq_idx,right_pad_decode,left_pad_decode"
    code, out, err = _run(["--model", omni_dir, "--scenarios", scenarios], capsys, wrap_fn=wrap)
    assert code == 0, out + err
    assert "language_model (NemotronHForCausalLM)" in out and "PASS" in out
    code, out, _ = _run(["--model", omni_dir, "--scenarios", scenarios, "--no-wrap"], capsys)
    assert code == 1 and "FAIL" in out  # the stock language model gets packing / right padding wrong
