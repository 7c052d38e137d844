"""transformers' "right-padding was detected! ... set padding_side='left'" warning is silenced for a wrapped model's
``generate`` (safepad makes right-padded prompts correct, so the advice is wrong there), and only there: the stock
model still warns, an unwrapped model warns again, and the filter does not touch other records of that logger."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import safepad
from safepad.testing.tiny import tiny_model

_LOGGER = "transformers.generation.utils"


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def records():
    """Every record of transformers' generation logger (its library root does not propagate, so no caplog)."""
    log = logging.getLogger(_LOGGER)
    handler, level = _Records(), log.level
    log.addHandler(handler)
    log.setLevel(logging.WARNING)
    yield handler
    log.removeHandler(handler)
    log.setLevel(level)


def _right_padded_generate(model) -> list[str]:
    pad = int(model.config.pad_token_id or 0)
    model.generation_config.pad_token_id = pad
    ids = torch.tensor([[5, 6, 7, 8, pad, pad], [9, 10, 11, 12, 13, 14]])
    model.generate(ids, attention_mask=(torch.arange(6) < torch.tensor([[4], [6]])).long(), max_new_tokens=2,
                   do_sample=False)


def _warned(records) -> bool:
    return any("right-padding was detected" in m for m in records.messages)


@pytest.mark.parametrize(
    "family",
    [
        pytest.param("nemotron_h", id="hybrid_with_attention-nemotron_h"),
        pytest.param("mamba2", id="recurrent_only-mamba2"),
    ],
)
def test_wrapped_generate_does_not_advise_left_padding(family, records):
    stock = tiny_model(family)
    _right_padded_generate(stock)
    assert _warned(records), "stock generate no longer warns on right padding: this test checks nothing"
    records.messages.clear()

    model = safepad.wrap(copy.deepcopy(stock))
    _right_padded_generate(model)
    assert not _warned(records), f"wrapped {family} still advises padding_side='left': {records.messages}"

    _right_padded_generate(stock)  # the filter is scoped to the wrapped call: stock still warns
    assert _warned(records)
    records.messages.clear()

    safepad.unwrap(model)
    _right_padded_generate(model)
    assert _warned(records), "an unwrapped model must warn again"


def test_the_filter_passes_other_records(records):
    """Inside a wrapped generate, only the right-padding advice is dropped."""
    from safepad.wrap.generate import _IN_WRAPPED_GENERATE, _quiet_right_padding_warning

    token = _quiet_right_padding_warning()
    try:
        logging.getLogger(_LOGGER).warning("some other generation warning")
    finally:
        _IN_WRAPPED_GENERATE.reset(token)
    assert records.messages == ["some other generation warning"]
