"""``safepad.testing.cuda_rules``: CUDA's ``torch._assert_async`` rules on CPU, eager and compiled.

The suite runs under them (``tests/conftest.py``): a message of 255 bytes or more raises CUDA's ``RuntimeError``
whether or not the check holds, in an eager call, and in a compiled one whatever the backend (inductor lowers the op
into its generated code, which never calls the aten op: the check runs while dynamo traces).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo as dynamo

from safepad.testing import cuda_rules

LONG = "m" * cuda_rules.MAX_MESSAGE_BYTES  # 255: refused
LONGEST = "m" * (cuda_rules.MAX_MESSAGE_BYTES - 1)  # 254: taken


def _check(x: torch.Tensor, holds: bool, message: str) -> torch.Tensor:
    ok = (x > -1e9).all() if holds else (x > 1e9).all()
    torch._assert_async(ok, message)
    return x * 2


@pytest.fixture
def _fresh_dynamo():
    dynamo.reset()
    yield
    dynamo.reset()


def test_installed_for_the_suite():
    assert cuda_rules.installed()


@pytest.mark.parametrize("holds", [pytest.param(True, id="holds"), pytest.param(False, id="fails")])
def test_eager_long_message_raises_cudas_error(holds):
    x = torch.randn(4)
    with pytest.raises(RuntimeError, match="^Message length must be smaller than 255$"):
        _check(x, holds, LONG)
    with pytest.raises(RuntimeError, match="Message length must be smaller than 255"):
        torch.ops.aten._assert_async.msg((x > 0).any() | holds, LONG)  # the aten op itself (torch internals)
    with pytest.raises(RuntimeError, match="Message length must be smaller than 255"):
        _check(x, holds, "\u00e9" * 128)  # bytes, not characters: 256 bytes in UTF-8


def test_eager_short_message_behaves_as_torch():
    x = torch.randn(4)
    torch.testing.assert_close(_check(x, True, LONGEST), x * 2)
    with pytest.raises(RuntimeError, match="^the check failed$"):
        _check(x, False, "the check failed")
    torch._assert_async(torch.tensor(True))  # the overload without a message
    with pytest.raises(RuntimeError, match="ambiguous"):
        torch._assert_async(torch.ones(2, dtype=torch.bool), "two values")


@pytest.mark.usefixtures("_fresh_dynamo")
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compiled_long_message_raises_cudas_error(backend):
    """Compiled: a long message fails (at trace time or when the graph runs), a short one compiles and checks."""
    x = torch.randn(4)
    compiled = torch.compile(_check, backend=backend)
    torch.testing.assert_close(compiled(x, True, LONGEST), x * 2)
    with pytest.raises(RuntimeError, match="Message length must be smaller than 255"):
        compiled(x, True, LONG)
    with pytest.raises(RuntimeError, match="short and failing"):
        compiled(x, False, "short and failing")


def test_opaque_device_asserts_lose_the_message_and_the_context():
    x = torch.randn(4)
    with cuda_rules.opaque_device_asserts() as asserts:
        _check(x, True, "holds")
        assert not asserts.failed
        with pytest.raises(RuntimeError) as info:
            _check(x, False, "safepad check failed: the message")
        assert "device-side assert triggered" in str(info.value) and "the message" not in str(info.value)
        assert asserts.failed and asserts.messages == ["safepad check failed: the message"]
        with pytest.raises(RuntimeError, match="device-side assert triggered"):
            _check(x, True, "holds")  # the context is lost: every later check fails too
    torch.testing.assert_close(_check(x, True, "holds"), x * 2)  # a new process, as it were
    with pytest.raises(RuntimeError, match="^back to CPU rules$"):
        _check(x, False, "back to CPU rules")


def test_uninstall_restores_torch_and_install_is_idempotent():
    x = torch.randn(4)
    cuda_rules.install()  # already installed: nothing changes
    cuda_rules.uninstall()
    try:
        assert not cuda_rules.installed()
        torch.testing.assert_close(_check(x, True, LONG), x * 2)  # the CPU kernel takes any length
    finally:
        cuda_rules.install()
    with pytest.raises(RuntimeError, match="Message length must be smaller than 255"):
        _check(x, True, LONG)
