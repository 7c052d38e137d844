"""Record the input dtypes of every matmul-family aten op a call dispatches: a CPU proxy for the precision the
same call's GEMMs would run in on CUDA (bf16 tensor cores, or float32 / float64 ones).

``nn.Linear`` dispatches ``aten.mm`` / ``aten.addmm``, ``torch.einsum`` and ``@`` lower to ``aten.bmm`` / ``aten.mm``,
attention to an ``aten._scaled_dot_product_*`` op: the :class:`~torch.utils._python_dispatch.TorchDispatchMode` of
:func:`record_matmuls` sees each, with the dtypes of its tensor inputs and the innermost ``safepad`` frame that
called it (``"stock"`` outside safepad); the body of a ``safepad::`` custom op (the SSD core, the selective scan)
runs under it too, so its matmuls are recorded, e.g.::

    from safepad.testing.matmul_dtypes import record_matmuls

    calls = record_matmuls(lambda: model(input_ids))
    assert {c.dtypes for c in calls if c.site.startswith("ops/ssd.py")} == {(torch.float32,) * 2}
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["MATMUL_OPS", "MatmulCall", "record_matmuls"]

#: aten ops (overload packet names) of the matmul family
MATMUL_OPS: frozenset[str] = frozenset(
    {
        "aten.mm", "aten.bmm", "aten.addmm", "aten.baddbmm", "aten.addbmm", "aten.matmul", "aten.mv", "aten.addmv",
        "aten.dot", "aten.vdot", "aten.linear", "aten._scaled_mm",
        "aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_flash_attention_for_cpu",
        "aten._scaled_dot_product_efficient_attention", "aten._scaled_dot_product_cudnn_attention",
        "aten._scaled_dot_product_attention_math", "aten._scaled_dot_product_fused_attention_overrideable",
    }
)


class MatmulCall(NamedTuple):
    """One matmul-family op :func:`record_matmuls` saw."""

    #: the op (``"aten.bmm"``)
    op: str
    #: the dtypes of its tensor arguments, in order
    dtypes: tuple[torch.dtype, ...]
    #: ``"path:function"`` of the innermost safepad frame below it (``"ops/ssd.py:_chunk_scan"``), else ``"stock"``
    site: str


class _Recorder(TorchDispatchMode):
    def __init__(self, calls: list[MatmulCall]):
        super().__init__()
        self.calls = calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)
        if name in MATMUL_OPS:
            dtypes = tuple(a.dtype for a in args if isinstance(a, torch.Tensor))
            self.calls.append(MatmulCall(name, dtypes, _site()))
        body = _custom_op_body(func)
        if body is not None:  # safepad's own custom op: its torch body, with its matmuls recorded too
            with self:
                return body(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def _custom_op_body(func) -> Callable[..., Any] | None:
    """The Python body of a ``safepad::`` custom op (``torch.library.custom_op``), else None: the dispatch mode sees
    such an op as one call, and its body's ops only when the body runs under the mode."""
    if getattr(func, "namespace", None) != "safepad":
        return None
    from torch._library.custom_ops import OPDEFS

    opdef = OPDEFS.get(func.name())
    return getattr(opdef, "_init_fn", None)


def _site() -> str:
    for frame in reversed(traceback.extract_stack()[:-3]):
        path = frame.filename.replace("\\", "/")
        if "/safepad/" in path and "/safepad/testing/" not in path:
            return f"{path.split('/safepad/')[-1]}:{frame.name}"
    return "stock"


def record_matmuls(fn: Callable[[], Any]) -> list[MatmulCall]:
    """Run ``fn()`` and return every matmul-family op it dispatched (forward and any backward), in order."""
    calls: list[MatmulCall] = []
    with _Recorder(calls):
        fn()
    return calls
