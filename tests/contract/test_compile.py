"""Compiled forward with ``fullgraph`` inside ``generate`` (transformers'
``test_generate_compile_model_forward_fullgraph``): a static cache, ``CompileConfig(fullgraph=True,
dynamic=False)``, two generations; the outputs equal the eager ones and dynamo recompiles no more often than
for the stock model (issue 21 item 4: a Python-int token count on the cache made wrapped mamba2 recompile
at every step). Dynamo's ``eager`` backend: the guards and recompiles are dynamo's, no code generation needed.

Families: those whose cache has only recurrent layers (the case of the issue) and whose stock class
declares ``_can_compile_fullgraph``.
"""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import CompileConfig

from .conftest import models
from .helpers import gen_kwargs, prompts

FAMILIES = ("mamba2", "mamba", "falcon_mamba")


class _Recompiles(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.count = 0

    def emit(self, record):
        if "Recompiling" in record.getMessage():
            self.count += 1


def _compiled_generations(model):
    """(recompile count, sequences of two compiled generations, the same generations eager, cache class names)."""
    torch.compiler.reset()
    for attr in ("_compiled_call", "_last_compile_config"):
        model.__dict__.pop(attr, None)
    cc = CompileConfig(fullgraph=True, dynamic=False, backend="eager", mode=None)
    cc._compile_all_devices = True  # compile on CPU too, as transformers' test does
    inputs = [torch.stack(prompts((5, 5), seed=s)) for s in (20, 21)]
    kw = dict(do_sample=False, return_dict_in_generate=True, output_scores=True, **gen_kwargs(4))
    with torch.compiler.set_stance("force_eager"):
        eager = [model.generate(input_ids=ids, **kw).sequences for ids in inputs]
    handler = _Recompiles()
    log = logging.getLogger("torch._dynamo")
    torch._logging.set_logs(recompiles=True)
    log.addHandler(handler)
    try:
        compiled, classes = [], []
        for ids in inputs:
            out = model.generate(input_ids=ids, cache_implementation="static", compile_config=cc, **kw)
            assert hasattr(model, "_compiled_call"), "generate did not compile the forward"
            classes.append(type(out.past_key_values).__name__)
            compiled.append(out.sequences)
    finally:
        log.removeHandler(handler)
        torch._logging.set_logs()
        torch.compiler.reset()
    return handler.count, compiled, eager, classes


@pytest.mark.slow
@pytest.mark.parametrize("family", [pytest.param(f, id=f) for f in FAMILIES])
def test_compiled_generate_recompiles_no_more_than_stock(family):
    stock, wrapped, _ = models(family)
    if not type(stock)._can_compile_fullgraph:
        pytest.skip(f"{type(stock).__name__} does not declare _can_compile_fullgraph")
    n_stock, comp_s, eager_s, cls_s = _compiled_generations(stock)
    n_wrapped, comp_w, eager_w, cls_w = _compiled_generations(wrapped)
    assert n_wrapped <= n_stock, f"wrapped recompiled {n_wrapped} times, stock {n_stock}"
    assert cls_w == cls_s == ["StaticCache"] * 2, (cls_w, cls_s)  # the class generate built, not a subclass
    for a, b in zip(comp_s, eager_s):
        assert torch.equal(a, b)
    for a, b, c in zip(comp_w, eager_w, eager_s):
        assert torch.equal(a, b) and torch.equal(b, c)
