"""One call scope (``safepad._tracing.CallScope``): the call context, the cache's call flag and the sequence-parallel
context are per thread, for eager and traced readers alike, so concurrent calls in two threads never see each other's.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch

import safepad
from safepad import cache as cache_mod
from safepad.context import current_context
from safepad.parallel import context as sp_mod
from safepad.testing.tiny import tiny_model


def _in_other_thread(enter, leave):
    """Run ``enter()`` in a second thread, keep it entered until the returned ``release()`` runs ``leave(token)``."""
    entered, done = threading.Event(), threading.Event()
    box: dict = {}

    def run():
        box["token"] = enter()
        entered.set()
        done.wait(30)
        leave(box["token"])

    t = threading.Thread(target=run)
    t.start()
    assert entered.wait(30)

    def release():
        done.set()
        t.join(30)

    return release


def _sp_ctx() -> sp_mod.SPContext:
    return sp_mod.SPContext(
        group=None, rank=0, world=2, offset=0, shape=(1, 4), global_len=8, global_seq_idx=None,
        crosses=torch.zeros(2, 1, dtype=torch.bool), attention_seen=set(),
    )  # fmt: skip


def test_sp_context_of_another_thread_is_invisible_to_compiled_code():
    """A sequence-parallel call in progress in one thread must not refuse a compiled call in another (before: one
    process-wide list, so the compiled call raised 'sequence parallelism is not supported under torch.compile')."""
    torch._dynamo.reset()
    module = torch.nn.Identity()

    @torch.compile(backend="eager", fullgraph=True)
    def read(x):
        return x + (0 if sp_mod.resolve_sp(module, (1, 4)) is None else 1)

    release = _in_other_thread(lambda: sp_mod.set_sp(_sp_ctx()), sp_mod.reset_sp)
    try:
        assert sp_mod.current_sp() is None
        assert torch.equal(read(torch.zeros(1)), torch.zeros(1))
    finally:
        release()
    token = sp_mod.set_sp(_sp_ctx())  # in this thread it is seen (and refused under compile)
    try:
        with pytest.raises(Exception, match="not supported under torch.compile"):
            read(torch.zeros(1))
    finally:
        sp_mod.reset_sp(token)


def test_cache_call_flag_of_another_thread_is_invisible_to_compiled_code():
    """A traced cache call entered in one thread must not make another thread's call skip its token count (before:
    one process-wide list)."""
    torch._dynamo.reset()

    @torch.compile(backend="eager", fullgraph=True)
    def enter(x):
        cache_mod._enter_call()
        return x

    @torch.compile(backend="eager", fullgraph=True)
    def in_call(x):
        return x + (1 if cache_mod._in_call() else 0)

    box: dict = {}

    def enter_traced():
        enter(torch.zeros(1))
        box["seen"] = float(in_call(torch.zeros(1)))
        return "traced"

    release = _in_other_thread(enter_traced, cache_mod._exit_call)
    try:
        assert box["seen"] == 1.0  # the entering thread's compiled code sees its own call
        assert float(in_call(torch.zeros(1))) == 0.0 and not cache_mod._in_call()
    finally:
        release()


def test_two_threads_calling_wrapped_models_see_their_own_scopes():
    """Two wrapped models called at once in two threads (both inside their forward together): each mixer sees its
    own call's context, and each recurrent-only cache counts its own call's tokens."""
    # a Mamba-only NemotronH: its cache has no attention layer, so safepad counts its tokens (safepad.cache)
    models = [safepad.wrap(tiny_model("nemotron_h", layers_block_type=["mamba", "mlp", "mamba"])) for _ in (0, 1)]
    barrier = threading.Barrier(2, timeout=30)
    seen: dict = {}
    errors: list = []

    def call(i: int, length: int):
        try:
            model = models[i]

            def probe(module, args):
                barrier.wait()  # both calls are in progress now
                ctx = current_context()
                seen[i] = (ctx.shape if ctx is not None else None, cache_mod._in_call())
                barrier.wait()

            handle = model.model.layers[0].mixer.register_forward_pre_hook(probe)
            ids = torch.randint(1, 50, (2, length))
            mask = torch.ones(2, length, dtype=torch.long)
            mask[0, :2] = 0
            with torch.no_grad():
                out = model(input_ids=ids, attention_mask=mask, use_cache=True)
            handle.remove()
            seen[f"len{i}"] = cache_mod.output_cache(out).get_seq_length()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=call, args=(i, n)) for i, n in ((0, 5), (1, 9))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert seen[0] == ((2, 5), True) and seen[1] == ((2, 9), True)
    assert seen["len0"] == 5 and seen["len1"] == 9
    assert current_context() is None and not cache_mod._in_call()


def test_a_failed_compiled_device_check_is_recognised_as_safepads() -> None:
    """A compiled ``require`` fails as a ``RuntimeError`` raised inside torch (not at a safepad raise site): the
    fuzzer's oracle must still tell it apart from a crash, by its message."""
    import torch

    from safepad._tracing import is_device_check_error, require

    message = "safepad test: rows must be positive (pass positive rows)"

    def f(x):
        require((x > 0).all(), message)
        return x * 2

    compiled = torch.compile(f, backend="eager", fullgraph=True)
    assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 2.0))
    with pytest.raises(RuntimeError) as info:
        compiled(-torch.ones(3))
    assert message in str(info.value) and is_device_check_error(info.value)
    assert not is_device_check_error(RuntimeError("view size is not compatible with input tensor's size"))
    assert not is_device_check_error(ValueError(message))  # eager raises ValueError at its own raise site


def test_eager_code_inside_a_traced_push_reads_it():
    """A value pushed by traced code reaches only the list traced code reads (the compiled code replays the append):
    eager code running inside that call (a frame dynamo leaves uncompiled) must read it too, and so must the context
    snapshot a checkpointed layer takes there for its recompute (before: both read the ContextVar, None)."""
    from safepad._tracing import copy_context
    from safepad.context import CallContext, enter_call, exit_call
    from safepad.wrap.checkpoint import _CheckpointWithContext

    torch._dynamo.reset()
    ctx = CallContext(seq_idx=None, shape=(2, 3), source="test")

    @torch.compile(backend="eager", fullgraph=True)
    def enter(x):
        enter_call(ctx)
        return x

    recomputes: list = []

    def checkpoint(function, *args):  # a checkpoint function: the forward now, the recompute later (backward)
        recomputes.append(lambda: function(*args))
        return function(*args)

    seen: list = []
    enter(torch.zeros(1))
    try:
        assert current_context() is ctx
        _CheckpointWithContext(checkpoint)(lambda: seen.append(current_context()))
        snapshot = copy_context()
    finally:
        exit_call("traced")
    assert current_context() is None
    recomputes[0]()
    assert seen == [ctx, ctx]
    assert snapshot.run(current_context) is ctx


def test_a_mixer_dynamo_leaves_uncompiled_inside_a_compiled_call():
    """``torch.compile(model)`` traces safepad's model hook, and dynamo may still run a layer uncompiled inside the
    compiled call (past its recompile limit: transformers' ``deprecate_kwarg`` wrapper, shared by every decorated
    forward, reached it on the fuzzer's compiled chunk with attention weights). RecurrentGemma's recurrent block
    reads the row's padding from the call context; run uncompiled, it read none and took left pads as tokens
    (1.14 off the row alone before). Each row must equal the row alone."""
    from safepad.testing.tiny import family_available

    ok, why = family_available("recurrent_gemma")
    if not ok:
        pytest.skip(why)
    torch._dynamo.reset()
    stock = tiny_model("recurrent_gemma")
    model = safepad.wrap(copy.deepcopy(stock)).eval()
    block = model.model.layers[0].temporal_block
    block.forward = torch.compiler.disable(block.forward)  # dynamo runs this layer's mixer uncompiled
    rows = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    ids = torch.zeros(2, 6, dtype=torch.long)
    mask = torch.zeros(2, 6, dtype=torch.long)
    for b, row in enumerate(rows):  # left padded
        ids[b, 6 - len(row) :] = torch.tensor(row)
        mask[b, 6 - len(row) :] = 1
    with torch.no_grad():
        logits = torch.compile(model, backend="eager")(input_ids=ids, attention_mask=mask, use_cache=False).logits
        for b, row in enumerate(rows):
            ref = stock(input_ids=torch.tensor([row]), use_cache=False).logits[0]
            torch.testing.assert_close(logits[b, 6 - len(row) :], ref, atol=1e-5, rtol=1e-5)
