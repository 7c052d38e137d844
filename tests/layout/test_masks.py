"""safepad.layout.masks.check_mask_values: a 2-D mask holds only 0 and 1 (or is bool), checked on the host or on
the device, and the bool copy the check makes serves the rest of the call."""

from __future__ import annotations

import pytest
import torch

from safepad._tracing import is_device_check_error
from safepad.layout.masks import check_mask_values
from safepad.testing.launches import count_ops


@pytest.mark.parametrize(
    "dtype", [pytest.param(torch.long, id="long"), pytest.param(torch.int32, id="int32"),
              pytest.param(torch.uint8, id="uint8"), pytest.param(torch.float32, id="float32"),
              pytest.param(torch.bfloat16, id="bfloat16")],
)
@pytest.mark.parametrize("on_device", [pytest.param(False, id="host"), pytest.param(True, id="device")])
def test_a_padding_mask_passes_and_comes_back_as_bool(dtype, on_device):
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0]], dtype=dtype)  # [B, T]
    real = check_mask_values(mask, on_device=on_device)
    assert real.dtype == torch.bool and torch.equal(real, mask != 0)
    flags = mask.bool()
    assert check_mask_values(flags, on_device=on_device) is flags  # a bool mask is its own copy


@pytest.mark.parametrize(
    "bad",
    [pytest.param(2.0, id="two"), pytest.param(0.5, id="half"), pytest.param(-1.0, id="minus-one"),
     pytest.param(float("nan"), id="nan"), pytest.param(float("-inf"), id="minus-inf"),
     pytest.param(float("inf"), id="inf"), pytest.param(-3.4e38, id="additive-min")],
)
def test_any_other_value_raises_on_the_host_and_on_the_device(bad):
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, bad, 1.0]])  # [B, T]
    with pytest.raises(ValueError, match="attention_mask"):
        check_mask_values(mask)
    with pytest.raises(RuntimeError) as info:
        check_mask_values(mask, on_device=True)
    assert is_device_check_error(info.value)


@pytest.mark.parametrize("bad", [pytest.param(2, id="two"), pytest.param(-1, id="minus-one"),
                                 pytest.param(255, id="byte-max")])
def test_other_integers_raise_on_the_host_and_on_the_device(bad):
    mask = torch.tensor([[1, 1, 0], [1, bad, 1]], dtype=torch.int32 if bad < 0 else torch.uint8)  # [B, T]
    with pytest.raises(ValueError, match="attention_mask"):
        check_mask_values(mask)
    with pytest.raises(RuntimeError) as info:
        check_mask_values(mask, on_device=True)
    assert is_device_check_error(info.value)


def test_the_device_check_is_one_compare_and_one_reduction_of_its_bool_copy():
    """A decode step's device check of an integer mask dispatches the bool copy it returns (which the call reuses),
    one compare with the mask, one reduction and the assert: no pass per allowed value."""
    mask = torch.ones(4, 9, dtype=torch.long)
    mask[1, 7:] = 0
    _, n, ops = count_ops(lambda: check_mask_values(mask, on_device=True))
    assert dict(ops) == {"aten._to_copy": 1, "aten.eq": 1, "aten.all": 1, "aten._assert_async": 1}, ops
