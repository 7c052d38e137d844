"""safepad.serving.slots: the slot pool's bookkeeping and its device pools."""

from __future__ import annotations

import pytest
import torch

from safepad.serving import RecurrentSlots


def test_slots_are_held_until_released_then_reused():
    slots = RecurrentSlots(2, "cpu")
    a, b = slots.acquire("a"), slots.acquire("b")
    assert {a, b} == {0, 1} and slots.num_free == 0
    assert slots.acquire("a") == a  # a request keeps its slot
    with pytest.raises(RuntimeError, match="no free recurrent-state slot"):
        slots.acquire("c")
    slots.release("a")
    assert slots.slot_of("a") is None and slots.acquire("c") == a
    slots.release_all()
    assert slots.num_free == 2


def test_pool_is_made_on_first_write_and_keeps_its_shape():
    slots = RecurrentSlots(3, "cpu")
    assert slots.pool(0, "recurrent", 0) is None
    slots.write(0, "recurrent", 0, torch.tensor([2]), torch.ones(1, 4, 5, dtype=torch.float64))
    pool = slots.pool(0, "recurrent", 0)
    assert pool.shape == (3, 4, 5) and pool.dtype == torch.float64
    assert pool[2].eq(1).all() and pool[:2].eq(0).all()
    with pytest.raises(ValueError, match="state shape changed"):
        slots.write(0, "recurrent", 0, torch.tensor([0]), torch.ones(1, 4, 6))
    with pytest.raises(ValueError, match="num_slots"):
        RecurrentSlots(0, "cpu")
