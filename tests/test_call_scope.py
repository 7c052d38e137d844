"""One call scope (``safepad._tracing.CallScope``): the call context, the cache's call flag and the sequence-parallel
context are per thread, for eager and traced readers alike, so concurrent calls in two threads never see each other's.
"""

from __future__ import annotations

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
