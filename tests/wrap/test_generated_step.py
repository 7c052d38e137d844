"""``generated_step``: inside a wrapped ``generate``, a one-token call whose mask has more columns than the prompt
brings generate's own token, real in every row (generate appends a 1 for it), so no pad mask reaches the mixers and
a re-laid cache is not re-laid on that step (issue 38). Everything else keeps the step's mask: a hand-written decode
step, a one-token call covering only the caller's columns, a call outside ``generate``. That the generated tokens
are each row's own is tests/wrap/test_right_padded_generate.py's and tests/contract/test_generate.py's."""

from __future__ import annotations

import copy

import pytest
import torch

import safepad
from safepad.context import current_context
from safepad.testing import tiny_model
from safepad.testing.syncs import decode_step
from safepad.testing.tiny import find_mixers
from safepad.wrap.generate import _GEN_MASK_CHECKED, _GEN_PROMPT_COLUMNS, _prompt_columns, generated_step


def _record_contexts(model) -> list[tuple[int, bool, bool]]:
    """Hook the first mixer: for each call, ``(T, whether a decode mask reached it, whether a token mask did)``."""
    seen: list[tuple[int, bool, bool]] = []
    _, mixer = find_mixers(model)[0]

    def hook(module, args, kwargs):
        hidden = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
        ctx = current_context()
        seen.append((hidden.shape[1], ctx is not None and ctx.decode_mask is not None,
                     ctx is not None and ctx.token_mask is not None))

    mixer.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def _prompt(side: str) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 200, (3, 6), generator=torch.Generator().manual_seed(0))  # [B, L]
    mask = torch.ones(3, 6, dtype=torch.long)
    if side == "left":
        mask[1, :2] = mask[2, :1] = 0
    else:
        mask[1, -2:] = mask[2, -1:] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize(
    "family", [pytest.param("nemotron_h", id="mamba2_hybrid"), pytest.param("lfm2", id="short_conv")]
)
@pytest.mark.parametrize("side", [pytest.param("left", id="left_padded"), pytest.param("right", id="right_padded")])
def test_generate_steps_hand_no_mask_to_the_mixers(family, side):
    model = safepad.wrap(tiny_model(family))
    seen = _record_contexts(model)
    ids, mask = _prompt(side)
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3, do_sample=False,
                       pad_token_id=0, eos_token_id=None)
    steps = [s for s in seen if s[0] == 1]
    assert seen[0][0] > 1 and len(steps) == 2, seen  # the prompt, then generate's two decode steps
    assert all(not decode and not token for _, decode, token in steps), seen


@pytest.mark.parametrize("side", [pytest.param("left", id="left_padded"), pytest.param("right", id="right_padded")])
def test_hand_written_step_keeps_its_mask(side):
    """Outside generate a step's token may be a pad: its mask still reaches the mixers (which hold the row)."""
    model = safepad.wrap(tiny_model("nemotron_h"))
    step = decode_step(model, padding_side=side)
    seen = _record_contexts(model)
    step(step.fresh_cache())
    assert seen and seen[-1][0] == 1 and (seen[-1][1] or seen[-1][2]), seen


def test_generated_step_reads_only_generate_s_own_columns():
    model = tiny_model("nemotron_h")
    mask = torch.ones(2, 7, dtype=torch.long)  # [B, M]
    assert not generated_step(model, 1, mask)  # outside generate
    checked = _GEN_MASK_CHECKED.set(model)
    try:
        for prompt, expected in ((6, True), (7, False), (None, False)):
            columns = _GEN_PROMPT_COLUMNS.set(prompt)
            try:
                # 7 columns after a 6-column prompt: generate appended the last; a 7-column prompt whose last token
                # alone is uncached: the caller's column (it may be a pad); an unknown prompt width: no fact
                assert generated_step(model, 1, mask) is expected, prompt
                assert not generated_step(model, 2, mask)  # several tokens: not a step
                assert not generated_step(copy.copy(model), 1, mask)  # another model's generate
            finally:
                _GEN_PROMPT_COLUMNS.reset(columns)
    finally:
        _GEN_MASK_CHECKED.reset(checked)
    assert not generated_step(model, 1, mask)


def test_prompt_columns():
    ids, mask = _prompt("left")
    assert _prompt_columns((), {"input_ids": ids, "attention_mask": mask[:, :5]}) == 5
    assert _prompt_columns((ids,), {}) == 6
    assert _prompt_columns((), {"inputs": ids}) == 6
    assert _prompt_columns((), {"inputs_embeds": torch.randn(3, 6, 8)}) is None
