"""The wrap contract: in place, idempotent, reversible, invisible to weights/config, visible in print(model)."""

from __future__ import annotations

import copy
import filecmp
import os

import pytest
import torch

import safepad
from safepad.testing.tiny import tiny_model
from safepad.wrap import wrapped_modules

from .helpers import packed_batch


def _logits(model, ids, **kw):
    with torch.no_grad():
        return model(input_ids=ids, **kw).logits


def test_wrap_in_place_idempotent_and_visible(nemotron):
    m = copy.deepcopy(nemotron)
    out = safepad.wrap(m)
    assert out is m
    names = [n for n, _ in wrapped_modules(m)]
    assert names == ["model.layers.0.mixer", "model.layers.2.mixer"]
    classes = {type(mod).__name__ for _, mod in wrapped_modules(m)}
    safepad.wrap(m)  # idempotent: same modules, no double patch, no extra hooks
    assert [n for n, _ in wrapped_modules(m)] == names
    assert {type(mod).__name__ for _, mod in wrapped_modules(m)} == classes == {"SafepadNemotronHMamba2Mixer"}
    assert len(m._safepad.hook_handles) == 2
    text = repr(m)
    assert text.count("SafepadNemotronHMamba2Mixer(") == 2
    assert text.count("safepad=mamba2:nemotron_h, backend=auto") == 2
    assert safepad.is_wrapped(m) and not safepad.is_wrapped(nemotron)


def test_unwrap_restores_original_forwards_exactly(nemotron):
    m = copy.deepcopy(nemotron)
    _, ids, seq_idx, _, _ = packed_batch([5, 9])
    before = _logits(m, ids, seq_idx=None)
    safepad.wrap(m)
    safepad.unwrap(m)
    assert not safepad.is_wrapped(m)
    assert all(not type(mod).__name__.startswith("Safepad") for mod in m.modules())
    assert not m._forward_pre_hooks and not m._forward_hooks
    assert torch.equal(_logits(m, ids), before)
    assert repr(m) == repr(nemotron)


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks")


@pytest.mark.parametrize(
    ("overrides", "stock_generates"),
    [
        pytest.param({}, True, id="hybrid"),
        # stock generate cannot tell an attention-free cache's length (safepad counts it: cache hooks)
        pytest.param({"layers_block_type": ["mamba", "mlp", "mamba"]}, False, id="recurrent_only-cache_hooks"),
    ],
)
def test_unwrap_leaves_no_safepad_state_after_use(overrides, stock_generates):
    """Everything safepad keeps on a module sits in ``module._safepad``: after wrap, a packed checkpointed training
    step, a padded generate and unwrap, every module equals the same never-wrapped module used the same way."""
    ref = tiny_model("nemotron_h", **overrides)
    m = copy.deepcopy(ref)
    safepad.wrap(m)
    assert repr(m).count("safepad=mamba2:nemotron_h, backend=auto") == 2  # print(model) shows the patches
    _, ids, _, _, pos = packed_batch([5, 9])
    prompt = torch.tensor([[0, 0, 7, 8, 9], [3, 4, 5, 6, 7]])
    prompt_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    for model in (m, ref):
        model.gradient_checkpointing_enable()
        model.train()
        model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss.backward()
        model.eval()
        if model is m or stock_generates:
            model.generate(input_ids=prompt, attention_mask=prompt_mask, max_new_tokens=2, do_sample=False)
    assert any(st.saw_packed for mod in m.modules() if (st := mod.__dict__.get("_safepad")) is not None)
    safepad.unwrap(m)
    for (name, mod), (_, plain) in zip(m.named_modules(), ref.named_modules(), strict=True):
        assert type(mod) is type(plain), name
        assert not [k for k in vars(mod) if k.startswith("_safepad")], name
        assert sorted(vars(mod)) == sorted(vars(plain)), name
        for hooks in _HOOK_DICTS:
            assert len(getattr(mod, hooks)) == len(getattr(plain, hooks)), (name, hooks)
        fn, plain_fn = mod.__dict__.get("_gradient_checkpointing_func"), plain.__dict__.get("_gradient_checkpointing_func")
        assert type(fn) is type(plain_fn), name
    assert repr(m) == repr(ref)
    assert torch.equal(_logits(m.eval(), ids, use_cache=False), _logits(ref.eval(), ids, use_cache=False))


def test_wrap_changes_no_parameter_buffer_or_config(nemotron, tmp_path):
    m = copy.deepcopy(nemotron)
    sd_before = {k: v.clone() for k, v in m.state_dict().items()}
    cfg_before = m.config.to_dict()
    safepad.wrap(m)
    sd_after = m.state_dict()
    assert list(sd_after) == list(sd_before)
    assert all(torch.equal(sd_after[k], sd_before[k]) for k in sd_before)
    assert m.config.to_dict() == cfg_before
    stock_dir, wrapped_dir = tmp_path / "stock", tmp_path / "wrapped"
    nemotron.save_pretrained(stock_dir)
    m.save_pretrained(wrapped_dir)
    files = sorted(os.listdir(stock_dir))
    assert files == sorted(os.listdir(wrapped_dir))
    for f in files:
        assert filecmp.cmp(stock_dir / f, wrapped_dir / f, shallow=False), f


def test_wrapped_model_pickles(nemotron, tmp_path):
    m = safepad.wrap(copy.deepcopy(nemotron))
    torch.save(m, tmp_path / "m.pt")
    back = torch.load(tmp_path / "m.pt", weights_only=False)
    assert safepad.is_wrapped(back)


def test_unsupported_model_raises_naming_types():
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(safepad.UnsupportedModelError, match="model_type='llama'.*nemotron_h"):
        safepad.wrap(llama)
    assert issubclass(safepad.UnsupportedModelError, ValueError)


def test_bad_backend_raises(nemotron):
    with pytest.raises(ValueError, match="backend"):
        safepad.wrap(copy.deepcopy(nemotron), backend="cuda")


def test_supported_model_types_lists_mamba2_family():
    types = safepad.supported_model_types()
    for t in ("nemotron_h", "mamba2", "bamba", "falcon_h1", "granitemoehybrid", "zamba2"):
        assert t in types


def test_lora_on_in_proj_stays_active_after_wrapping(nemotron):
    peft = pytest.importorskip("peft")
    m = copy.deepcopy(nemotron)
    lora = peft.get_peft_model(m, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["in_proj"], init_lora_weights=False))
    seqs, ids, seq_idx, _, _ = packed_batch([7, 12])
    with lora.disable_adapter():
        base = _logits(lora, seqs[1][None])
    adapted = _logits(lora, seqs[1][None])
    assert (adapted - base).abs().max() > 1e-2  # the adapter matters on the stock model
    safepad.wrap(lora)
    assert safepad.is_wrapped(lora)
    with lora.disable_adapter():
        base_w = _logits(lora, seqs[1][None])
    adapted_w = _logits(lora, seqs[1][None])
    torch.testing.assert_close(base_w, base, atol=1e-4, rtol=0)
    torch.testing.assert_close(adapted_w, adapted, atol=1e-4, rtol=0)  # the adapter is still applied
    # and it is applied on the packed path too: packed == each sequence alone, with the adapter
    packed = _logits(lora, ids, seq_idx=seq_idx)[0]
    alone = torch.cat([_logits(lora, s[None])[0] for s in seqs])
    torch.testing.assert_close(packed, alone, atol=1e-4, rtol=0)


def test_time_step_limit_read_at_call_time(nemotron):
    m = safepad.wrap(copy.deepcopy(nemotron))
    ids = packed_batch([24])[1]
    a = _logits(m, ids)
    for _, mod in wrapped_modules(m):
        mod.time_step_limit = (0.0, 0.01)
    b = _logits(m, ids)
    assert (a - b).abs().max() > 1e-2


def test_nemotron_h_inside_a_vlm_is_wrapped_and_packed_correctly():
    from transformers.models.nemotron_h_omni.configuration_nemotron_h_omni import NemotronH_Omni_Reasoning_V3_Config
    from transformers.models.nemotron_h_omni.modeling_nemotron_h_omni import NemotronH_Omni_Reasoning_V3

    from safepad.testing.tiny import strengthen_mixers, tiny_config

    cfg = NemotronH_Omni_Reasoning_V3_Config(
        text_config=tiny_config("nemotron_h").to_dict(),
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                           patch_size=4, image_size=16, max_img_size=16, video_temporal_patch_size=2),
        projector_hidden_size=32, vision_hidden_size=32, force_image_size=16, image_token_id=250,
    )
    torch.manual_seed(0)
    vlm = strengthen_mixers(NemotronH_Omni_Reasoning_V3(cfg)).eval()
    stock = copy.deepcopy(vlm)
    safepad.wrap(vlm)
    assert [n for n, _ in wrapped_modules(vlm)] == ["language_model.model.layers.0.mixer", "language_model.model.layers.2.mixer"]
    seqs, ids, seq_idx, cu, pos = packed_batch([6, 17, 11])
    alone = torch.cat([_logits(stock, s[None])[0] for s in seqs])
    for kw in (dict(seq_idx=seq_idx), dict(position_ids=pos), dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu)):
        err_w = (_logits(vlm, ids, **kw)[0] - alone).abs().max()
        err_s = (_logits(stock, ids, position_ids=pos)[0] - alone).abs().max()
        assert err_w < 1e-4, kw.keys()
        assert err_s > 1e-3


@pytest.mark.parametrize("name", ["cache_params", "past_key_values", "cache"])
def test_mixer_accepts_every_cache_kwarg_name(nemotron, name):
    """transformers 5.23 hands mixers `cache_params` (or `past_key_values`); later releases call it `cache`."""
    from transformers import DynamicCache

    m = safepad.wrap(copy.deepcopy(nemotron))
    mixer = m.model.layers[0].mixer
    x = torch.randn(2, 6, m.config.hidden_size)
    cache = DynamicCache(config=m.config)
    with torch.no_grad():
        mixer(x, **{name: cache})
    assert cache.layers[0].has_previous_state[0]
