"""The ``kernels`` package's ``use_kernelized_func`` routing (transformers 5.25 decorates mixer and attention classes
with it): wrap gives the other decorated modules a ``Safepad<Class>`` that calls the class's own forward unless the
module was kernelized, visible in ``print(model)`` and undone by ``unwrap``; pickling finds the class again.

The routing sets a module-level context variable around each call, which torch.compile cannot trace inside a
checkpointed layer (a graph break per layer: ``test_compile.test_gradient_checkpointing_compiled_equals_eager``).
"""

from __future__ import annotations

import copy
import pickle
from types import MethodType

import pytest
import torch

import safepad
from safepad.wrap import wrapped_modules
from safepad.wrap.patching import _kernel_routing_forward

from .helpers import packed_batch


def _attention(model):
    return model.model.layers[1].mixer  # tiny nemotron_h: mamba, attention, mamba, mlp


@pytest.fixture
def routed(nemotron):
    if _kernel_routing_forward(type(_attention(nemotron))) is None:
        pytest.skip("this transformers / kernels does not route NemotronHAttention's kernel functions")
    return nemotron


def _logits(model, ids, **kw):
    with torch.no_grad():
        return model(input_ids=ids, **kw).logits


def test_routing_skipped_visibly_and_restored(routed):
    m = copy.deepcopy(routed)
    _, ids, _, _, _ = packed_batch([5, 9])
    before = _logits(m, ids)
    safepad.wrap(m)
    attn = _attention(m)
    assert type(attn).__name__ == "SafepadNemotronHAttention"
    assert type(attn)._safepad_original_class is type(_attention(routed))
    assert "SafepadNemotronHAttention(\n" in repr(m) and "safepad=kernel-routing-skipped" in repr(m)
    assert [n for n, _ in wrapped_modules(m)] == ["model.layers.0.mixer", "model.layers.2.mixer"]
    safepad.wrap(m)  # idempotent
    assert type(_attention(m)) is type(attn)
    torch.testing.assert_close(_logits(m, ids), before, rtol=0, atol=1e-5)  # one unpacked row: the same model
    back = pickle.loads(pickle.dumps(m))
    assert type(_attention(back)) is type(attn)
    safepad.unwrap(m)
    assert type(_attention(m)) is type(_attention(routed))
    assert repr(m) == repr(routed)


def test_kernelized_module_keeps_the_routing(routed):
    """A module whose kernel function ``kernels.kernelize`` replaced (it sets the function's ``forward``) is
    called through the decorated forward, which routes the function to the kernel."""
    from kernels._internals.layer.layer import _ACTIVE_KERNEL_FUNCS

    m = safepad.wrap(copy.deepcopy(routed))
    attn = _attention(m)
    (kernel_func,) = attn._kernel_funcs.values()
    seen = []
    attn.q_proj.register_forward_pre_hook(lambda mod, args: seen.append(_ACTIVE_KERNEL_FUNCS.get()))
    _, ids, _, _, _ = packed_batch([5, 9])
    _logits(m, ids)
    assert seen == [None]  # not kernelized: the class's own forward, no routing
    kernel_func.forward = MethodType(type(kernel_func).forward, kernel_func)  # as kernelize sets it
    _logits(m, ids)
    assert seen[1] is not None and any(f is kernel_func for f, _ in seen[1].values())
