"""``safepad.wrap`` keeps the user's ``"sdpa"`` wherever ``"safepad_sdpa"`` (float64 attention for bf16 / fp16 on
CPU) is not needed, decides again at every call, and ``unwrap`` restores it.

Reference: the stock model's own dispatch. A spy on transformers' registered ``"sdpa"`` attention function counts
the calls a forward makes through it; a wrapped float32 model must make exactly the stock model's calls, with every
config still at ``"sdpa"`` (before this fix: 0 calls, ``"safepad_sdpa"``). Half precision on CPU, including a model
cast after ``wrap``, must still reach the float64 attention (its output is float64 sdpa rounded once:
``test_half_precision_attention.py``).
"""

from __future__ import annotations

import importlib
import logging

import pytest
import torch

import safepad
from safepad.testing.tiny import family_available, family_names, tiny_model

attention = importlib.import_module("safepad.wrap.attention")

pytestmark = pytest.mark.usefixtures("quiet_transformers")


def _impls(model) -> dict[int, str | None]:
    """``id(config) -> _attn_implementation`` of every config of ``model``'s modules and of their sub-configs."""
    out: dict[int, str | None] = {}
    stack = [getattr(m, "config", None) for m in model.modules()]
    while stack:
        cfg = stack.pop()
        if cfg is None or id(cfg) in out or not hasattr(cfg, "_attn_implementation"):
            continue
        out[id(cfg)] = cfg._attn_implementation
        stack.extend(getattr(cfg, key, None) for key in getattr(cfg, "sub_configs", {}) or {})
    return out


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Counts calls of transformers' registered ``"sdpa"`` attention function (``[B, Hq, T, d]`` queries)."""
    from transformers import AttentionInterface

    real = AttentionInterface._global_mapping["sdpa"]
    calls: list[torch.dtype] = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        calls.append(query.dtype)
        return real(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", spy)
    return calls


def _ids(model, B: int = 2, T: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(3, min(vocab, 200), (B, T), generator=torch.Generator().manual_seed(0))  # [B, T]
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :2] = 0  # a left-padded row
    return ids, mask


_FAMILIES = [pytest.param(f, id=f) for f in family_names() if family_available(f)[0]]


@pytest.mark.parametrize("family", _FAMILIES)
def test_float32_keeps_sdpa_and_dispatches_it(family, sdpa_calls):
    """fp32, every tiny family: wrap and a padded forward leave each config's implementation as it was, and the
    forward calls the registered sdpa function as often as the stock model's does."""
    stock = tiny_model(family)
    ids, mask = _ids(stock)
    with torch.no_grad():
        stock(input_ids=ids, attention_mask=mask)
    n_stock = len(sdpa_calls)
    sdpa_calls.clear()
    before = _impls(stock)
    model = safepad.wrap(stock)
    assert _impls(model) == before
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    assert _impls(model) == before
    assert len(sdpa_calls) == n_stock
    assert set(sdpa_calls) <= {torch.float32}


def test_bf16_on_cpu_switches_at_wrap_and_unwrap_restores(caplog):
    model = tiny_model("bamba", dtype=torch.bfloat16)
    assert model.config._attn_implementation == "sdpa"
    with caplog.at_level(logging.INFO, logger="safepad.wrap.attention"):
        safepad.wrap(model)
    assert model.config._attn_implementation == attention.UPCAST_SDPA
    assert any("safepad_sdpa" in r.getMessage() and "bamba" in r.getMessage() for r in caplog.records)
    safepad.wrap(model)  # idempotent
    assert model.config._attn_implementation == attention.UPCAST_SDPA
    safepad.unwrap(model)
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize(
    "cast",
    [
        pytest.param(lambda m: m.to(torch.bfloat16), id="bf16-after-wrap"),
        pytest.param(lambda m: m.to(torch.float16), id="fp16-after-wrap"),
    ],
)
def test_half_cast_after_wrap_gets_the_upcast_at_its_call(cast, sdpa_calls):
    """A model wrapped in fp32 (config "sdpa") and cast afterwards runs the float64 attention from its first call:
    its logits equal those of the same weights wrapped in half precision, and the stock sdpa function is not
    called; cast back to fp32, the next call runs stock sdpa again."""
    model = safepad.wrap(tiny_model("bamba"))
    assert model.config._attn_implementation == "sdpa"
    cast(model)
    ids, mask = _ids(model)
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
    assert model.config._attn_implementation == attention.UPCAST_SDPA
    assert sdpa_calls == []
    ref_model = safepad.wrap(cast(tiny_model("bamba")))
    with torch.no_grad():
        ref = ref_model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(got, ref)
    model.float()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    assert model.config._attn_implementation == "sdpa"
    assert sdpa_calls and set(sdpa_calls) == {torch.float32}


def test_cpu_autocast_gets_the_upcast(sdpa_calls):
    """An fp32 model under CPU autocast to bf16 gives its attention bf16 tensors: the float64 attention runs."""
    model = safepad.wrap(tiny_model("bamba"))
    ids, mask = _ids(model)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids, attention_mask=mask)
    assert model.config._attn_implementation == attention.UPCAST_SDPA
    assert sdpa_calls == []


def test_other_implementations_are_left_alone():
    model = tiny_model("bamba", dtype=torch.bfloat16)
    model.set_attn_implementation("eager")
    safepad.wrap(model)
    ids, mask = _ids(model)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    assert model.config._attn_implementation == "eager"


def test_compiled_cast_after_wrap_switches_once_and_recompiles_nothing():
    """``torch.compile(model)`` of a model cast to bf16 after ``wrap``: its first call switches the config (traced
    in the hook), later calls compile no frame, and the logits equal those of the model wrapped in bf16."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    def compiled_calls(model, n: int = 3) -> tuple[list[int], torch.Tensor]:
        dynamo.reset()
        counters.clear()
        run = torch.compile(model, backend="eager")
        frames = []
        for _ in range(n):
            before = counters["frames"]["ok"]
            with torch.no_grad():
                logits = run(input_ids=ids, attention_mask=mask, use_cache=False).logits
            frames.append(counters["frames"]["ok"] - before)
        dynamo.reset()
        return frames, logits

    after = safepad.wrap(tiny_model("bamba")).to(torch.bfloat16)
    ids, mask = _ids(after)
    frames, got = compiled_calls(after)
    assert after.config._attn_implementation == attention.UPCAST_SDPA
    assert frames[0] > 0 and frames[1:] == [0, 0], frames
    _, want = compiled_calls(safepad.wrap(tiny_model("bamba", dtype=torch.bfloat16)))
    assert torch.equal(got, want)
