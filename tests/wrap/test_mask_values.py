"""A 2-D attention_mask is a padding mask (1 real, 0 pad, or bool): anything else raises, naming the convention.

A float *additive* mask (0 keep, -inf pad) reads under the 2-D convention as "every token real except the ones
holding exactly 0": the stock model silently drops the real tokens and keeps the pads (checked below against each
sequence alone). The wrapped model raises once per call (one host read) in its model hook.
"""

from __future__ import annotations

import copy

import pytest
import torch

import safepad
from safepad.testing.tiny import tiny_model


@pytest.fixture(scope="module")
def models():
    stock = tiny_model("nemotron_h")
    return stock, safepad.wrap(copy.deepcopy(stock), backend="torch")


def _batch():
    ids = torch.randint(3, 250, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    return ids, mask


def _additive(mask: torch.Tensor, fill: float) -> torch.Tensor:
    return torch.zeros(mask.shape).masked_fill(mask == 0, fill)


@torch.no_grad()
def test_stock_model_is_silently_wrong_with_an_additive_mask(models):
    """-inf poisons the stock row (NaN), a finite fill keeps its pads and drops its real tokens."""
    stock, _ = models
    ids, mask = _batch()
    alone = stock(input_ids=ids[1:, :4], use_cache=False).logits
    for fill in (float("-inf"), -1e9):
        out = stock(input_ids=ids, attention_mask=_additive(mask, fill), use_cache=False).logits
        assert not torch.allclose(out[1, :4], alone[0], atol=1e-2), fill


@torch.no_grad()
@pytest.mark.parametrize("fill", [pytest.param(float("-inf"), id="-inf"), pytest.param(-1e9, id="-1e9")])
@pytest.mark.parametrize("use_cache", [pytest.param(False, id="no_cache"), pytest.param(True, id="cache")])
def test_additive_mask_raises(models, fill, use_cache):
    _, wrapped = models
    ids, mask = _batch()
    with pytest.raises(ValueError, match=r"1 for a real token and 0 for a pad.*\(additive_mask == 0\)"):
        wrapped(input_ids=ids, attention_mask=_additive(mask, fill), use_cache=use_cache)


@torch.no_grad()
def test_additive_mask_raises_in_generate(models):
    _, wrapped = models
    ids, mask = _batch()
    with pytest.raises(ValueError, match="additive mask"):
        wrapped.generate(input_ids=ids, attention_mask=_additive(mask, -1e4), max_new_tokens=2, do_sample=False,
                         pad_token_id=0)


@torch.no_grad()
def test_integer_values_other_than_0_1_raise(models):
    _, wrapped = models
    ids, mask = _batch()
    with pytest.raises(ValueError, match="holds 2"):
        wrapped(input_ids=ids, attention_mask=mask * 2, use_cache=False)


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.bool, torch.long, torch.float32])
def test_padding_masks_of_any_dtype_are_accepted_and_agree(models, dtype):
    stock, wrapped = models
    ids, mask = _batch()
    out = wrapped(input_ids=ids, attention_mask=mask.to(dtype), use_cache=False).logits
    alone = stock(input_ids=ids[1:, :4], use_cache=False).logits
    assert (out[1, :4] - alone[0]).abs().max() < 1e-4


# ---------------------------------------------------------------------------------------------------------------
# under CUDA's rules (tests/conftest.py: safepad.testing.cuda_rules): a decode step's mask check, generate
# ---------------------------------------------------------------------------------------------------------------

#: hybrids whose hand-written cached decode runs on every transformers in use (a CCA and an attention-conv family)
CUDA_RULE_FAMILIES = ["zaya", "inkling_text"]


@pytest.fixture(scope="module", params=CUDA_RULE_FAMILIES)
def cuda_models(request):
    stock = tiny_model(request.param)
    return stock, safepad.wrap(copy.deepcopy(stock), backend="torch").eval()


def _prompt():
    ids = torch.randint(3, 200, (2, 6), generator=torch.Generator().manual_seed(1))
    return ids, torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])


class _MaskDeviceChecks:
    """Counts the device checks of ``check_mask_values`` (``safepad.layout.masks.device_check``)."""

    def __init__(self, monkeypatch):
        import safepad.layout.masks as masks

        self.messages: list[str] = []
        real = masks.device_check

        def counting(ok, message):
            self.messages.append(message)
            real(ok, message)

        monkeypatch.setattr(masks, "device_check", counting)


def _decode(model, step_mask=None):
    """A hand-written prefill of the padded prompt, then one decode step with ``step_mask`` ``[2, 7]`` (default: the
    prompt's mask extended with ones, as generate builds it); returns the step's ``[2, 1, V]`` logits."""
    from safepad.testing.scenarios import _ModelIO

    io = _ModelIO(model)
    ids, mask = _prompt()
    _, cache = io(ids, attention_mask=mask, cache=io.fresh_cache(), use_cache=True)
    if step_mask is None:
        step_mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)  # [2, 7]
    logits, _ = io(ids[:, -1:], attention_mask=step_mask, position_ids=mask.sum(1, keepdim=True), cache=cache,
                   use_cache=True)
    return logits


@torch.no_grad()
def test_decode_step_with_a_mask_runs_under_cuda_rules(cuda_models, monkeypatch):
    """A hand-written decode step (one token, the full-length integer mask): its mask values are checked on the
    device (no host sync), with a message CUDA takes (the old 270-character one raised 'Message length must be
    smaller than 255' on every step on a GPU)."""
    _, wrapped = cuda_models
    checks = _MaskDeviceChecks(monkeypatch)
    logits = _decode(wrapped)
    assert torch.isfinite(logits).all()
    assert len(checks.messages) == 1 and "check D1" in checks.messages[0], checks.messages


@torch.no_grad()
def test_generate_with_a_mask_runs_under_cuda_rules_and_agrees(cuda_models, monkeypatch):
    """A wrapped generate with a padded prompt: the caller's mask is checked once on the host, and no decode step
    checks it on the device (each would be a device-side assert on CUDA, had it failed); the padded row generates
    what it generates alone."""
    _, wrapped = cuda_models
    ids, mask = _prompt()
    checks = _MaskDeviceChecks(monkeypatch)
    out = wrapped.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert checks.messages == []
    alone = wrapped.generate(input_ids=ids[1:, 2:], max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.equal(out[1, -3:], alone[0, -3:])


@torch.no_grad()
@pytest.mark.parametrize("prompt_len", [pytest.param(1, id="one_token_prompt"), pytest.param(6, id="prompt")])
def test_generate_refuses_an_additive_mask_on_the_host(cuda_models, prompt_len):
    """Under CUDA's device-side-assert semantics (opaque, fatal): generate's bad mask is a clear ValueError from the
    host, a one-token prompt's too (its first step used to check on the device: a lost CUDA context)."""
    from safepad.testing.cuda_rules import opaque_device_asserts

    _, wrapped = cuda_models
    ids, mask = _prompt()
    ids, mask = ids[:, -prompt_len:], mask[:, -prompt_len:]
    with opaque_device_asserts() as asserts:
        with pytest.raises(ValueError, match=r"additive mask.*\(additive_mask == 0\)"):
            wrapped.generate(input_ids=ids, attention_mask=_additive(mask, -1e9) - 1.0, max_new_tokens=2,
                             do_sample=False, pad_token_id=0)
    assert not asserts.failed, asserts.messages


@torch.no_grad()
def test_bad_mask_on_a_hand_written_decode_step_is_a_short_device_check(cuda_models):
    """Outside generate a one-token step checks its mask on the device (documented in docs/limits.md, check D1): on
    CPU a RuntimeError that names the input, the rule and the fix, short enough for CUDA."""
    from safepad._tracing import is_device_check_error

    _, wrapped = cuda_models
    _, mask = _prompt()
    step = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1).float()
    step[1, 0] = float("-inf")
    with pytest.raises(RuntimeError) as info:
        _decode(wrapped, step)
    message = str(info.value)
    assert is_device_check_error(info.value) and len(message) < 255, message
    assert "attention_mask" in message and "(mask == 0).long()" in message and "check D1" in message


@torch.no_grad()
def test_compiled_call_with_a_mask_runs_under_cuda_rules(cuda_models):
    """A compiled call checks its mask on the device (traced): under CUDA's rules it compiles (the old message failed
    while dynamo traced it) and equals the eager call; a bad mask raises the short device check."""
    import torch._dynamo as dynamo

    from safepad._tracing import is_device_check_error

    _, wrapped = cuda_models
    ids, mask = _prompt()
    dynamo.reset()
    try:
        compiled = torch.compile(wrapped, backend="eager")
        got = compiled(input_ids=ids, attention_mask=mask, use_cache=False).logits
        want = wrapped(input_ids=ids, attention_mask=mask, use_cache=False).logits
        torch.testing.assert_close(got, want)
        with pytest.raises(RuntimeError) as info:
            compiled(input_ids=ids, attention_mask=mask * 2, use_cache=False)
        assert is_device_check_error(info.value) and "check D1" in str(info.value)
    finally:
        dynamo.reset()
