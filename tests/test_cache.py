"""safepad.cache: cache names read from what transformers declares, and the length of attention-free caches."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import re

import pytest
import torch

import safepad
from safepad.cache import (
    CACHE_NAMES,
    cache_argument,
    fresh_cache_is_recurrent_only,
    needs_token_count,
    new_tracked_cache,
    output_cache,
    recurrent_only,
    track_seq_length,
)
from safepad.testing.tiny import family_available, tiny_model

#: parameter / field names that match "cache" or "past" but are not a cache object (inkling2's ``cache_offset``
#: is an int added to the layer index of a looped block)
NOT_A_CACHE = {"use_cache", "cache_offset"}
_CACHE_LIKE = re.compile(r"cache|past")


def _layers_count_tokens() -> bool:
    """transformers >= 5.25: a linear-attention cache layer counts the tokens it has read (``cumulative_length_linear``),
    and ``get_seq_length`` of a cache without attention layer returns that count (5.23 / 5.24 raise)."""
    from transformers.cache_utils import LinearAttentionLayer

    return hasattr(LinearAttentionLayer(), "cumulative_length_linear")


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("model_type", safepad.supported_model_types())
@torch.no_grad()
def test_every_cache_name_transformers_uses_is_known(model_type):
    """Fails when transformers names a cache argument or output field in a way safepad does not know.

    Every forward of every module of the stock model (top model, base model, decoder layers, mixers) and
    every field of its output class is scanned for cache-like names; each one must be in CACHE_NAMES
    (transformers 5.23: cache_params / past_key_values, 5.24: cache). A rename (say ``state_cache``) shows
    up here, with the module that declares it, before a scenario silently runs without its cache.
    """
    available, why = family_available(model_type)
    if not available:
        pytest.skip(why)  # a family newer than the installed transformers
    model = tiny_model(model_type)
    unknown = set()
    for name, module in model.named_modules():
        try:
            params = inspect.signature(module.forward).parameters
        except (TypeError, ValueError):
            continue
        for p in params:
            if _CACHE_LIKE.search(p) and p not in NOT_A_CACHE and p not in CACHE_NAMES:
                unknown.add(f"{type(module).__name__}.forward({p}=)")
    out = model(input_ids=torch.randint(3, 200, (1, 5)), use_cache=True)
    for f in dataclasses.fields(out):
        if _CACHE_LIKE.search(f.name) and f.name not in CACHE_NAMES:
            unknown.add(f"{type(out).__name__}.{f.name}")
    assert not unknown, f"cache names unknown to safepad.cache.CACHE_NAMES: {sorted(unknown)}"
    # and the helpers find the model's own: the name its forward takes, the cache its output returns
    assert cache_argument(model) in CACHE_NAMES
    from transformers import Cache

    if callable(getattr(model, "_setup_cache", None)):
        assert output_cache(out) is None  # RecurrentGemma returns no cache: the caller passes DynamicCache(config)
    else:
        assert isinstance(output_cache(out), Cache)


def test_cache_argument_reads_declarations_not_families():
    def f(x, cache=None): ...
    def g(x, cache_params=None, **kw): ...
    def h(x, past_key_values=None): ...
    def k(x, **kwargs): ...

    assert [cache_argument(fn) for fn in (f, g, h, k)] == ["cache", "cache_params", "past_key_values", None]
    wrapped = safepad.wrap(tiny_model("mamba2"))
    mixer = wrapped.backbone.layers[0].mixer
    # a patched mixer's own forward takes any name: it answers for its original class
    assert cache_argument(mixer) == cache_argument(type(mixer)._safepad_original_class.forward) in CACHE_NAMES


def test_output_cache_reads_the_declared_field():
    @dataclasses.dataclass
    class Out:
        logits: object = None
        cache_params: object = None

    sentinel = object()
    assert output_cache(Out(cache_params=sentinel)) is sentinel
    assert output_cache({"past_key_values": sentinel}) is sentinel
    assert output_cache(None) is None


# ------------------------------------------------------------------------------------------------------------
# caches without attention layers: transformers cannot tell their length, safepad counts it
# ------------------------------------------------------------------------------------------------------------

PURE = ["mamba", "mlp", "mamba"]  # a Nemotron-H without attention layer


def test_recurrent_only_is_decided_by_the_cache_layers():
    assert fresh_cache_is_recurrent_only(tiny_model("nemotron_h", layers_block_type=PURE).config)
    assert not fresh_cache_is_recurrent_only(tiny_model("nemotron_h").config)  # has an attention layer
    assert fresh_cache_is_recurrent_only(tiny_model("mamba2").config)


@pytest.mark.parametrize(
    ("family", "overrides", "expected"),
    [
        pytest.param("nemotron_h", {"layers_block_type": PURE}, True, id="pure_nemotron_h-asks"),
        pytest.param("nemotron_h", {}, False, id="hybrid-attention_answers"),
        pytest.param("mamba2", {}, False, id="mamba2-never_asks"),
        pytest.param("mamba", {}, False, id="mamba-never_asks"),
        pytest.param("falcon_mamba", {}, False, id="falcon_mamba-never_asks"),
    ],
)
def test_token_count_only_where_the_model_asks_the_cache_for_its_length(family, overrides, expected):
    """mamba / mamba2 / falcon_mamba take no position_ids, so neither their forward nor generate asks a cache
    for its length: wrapped, they keep DynamicCache / StaticCache (issue 21 item 3), with no count to guard on."""
    model = tiny_model(family, **overrides)
    assert needs_token_count(model) is expected
    wrapped = safepad.wrap(model)
    with torch.no_grad():
        out = wrapped(input_ids=torch.randint(3, 200, (1, 5)), use_cache=True)
    assert (type(output_cache(out)).__name__ == "SafepadLengthDynamicCache") is expected


def test_tracked_cache_counts_and_a_prefilled_one_says_why_it_cannot():
    """A prefilled cache (states written before safepad saw it): before transformers 5.25 nobody knows its length and
    it says so; from 5.25 on its layers count their tokens, and the tracked cache answers from that count."""
    from transformers import DynamicCache

    config = tiny_model("nemotron_h", layers_block_type=PURE).config
    with pytest.raises(ValueError, match="only contain"):  # what stock transformers says
        DynamicCache(config=config).get_mask_sizes(3, 0)
    if _layers_count_tokens():  # stock 5.25 answers get_seq_length from layer 0's own count
        assert int(DynamicCache(config=config).get_seq_length()) == 0
    else:
        with pytest.raises(ValueError, match="only contain"):
            DynamicCache(config=config).get_seq_length()
    cache = new_tracked_cache(config)
    assert recurrent_only(cache) and cache.get_seq_length() == 0 and cache.get_mask_sizes(3, 0) == (3, 0)
    copy.deepcopy(cache).get_seq_length()  # the swapped class survives a copy
    filled = DynamicCache(config=config)
    filled.update_conv_state(torch.zeros(1, 192, 4), 0, conv_kernel_size=4)  # marks has_previous_state
    if _layers_count_tokens():  # the layer counted the 4 conv columns it was handed
        tracked = track_seq_length(filled)
        assert tracked.get_seq_length() == 4 and tracked.get_mask_sizes(3, 0) == (7, 0)
    else:
        with pytest.raises(ValueError, match="written before safepad saw it"):
            track_seq_length(filled).get_seq_length()
    hybrid = DynamicCache(config=tiny_model("nemotron_h").config)
    assert track_seq_length(hybrid).__class__ is DynamicCache  # attention caches are left alone


def test_a_tracked_cache_unpickles_in_a_fresh_process(tmp_path):
    """The generated class is rebuilt on import (a pickled model output or cache in another process)."""
    import pickle
    import subprocess
    import sys

    config = tiny_model("nemotron_h", layers_block_type=PURE).config
    cache = new_tracked_cache(config)
    cache.__dict__["_safepad_seen_tokens"] = 7
    path = tmp_path / "cache.pkl"
    path.write_bytes(pickle.dumps(cache))
    code = f"import pickle; c = pickle.loads(open({str(path)!r}, 'rb').read()); print(type(c).__name__, c.get_seq_length())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["SafepadLengthDynamicCache", "7"]


def _rows_generate(model, ids, cache=None, n=1):
    kw = {cache_argument(model): cache} if cache is not None else {}
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0, return_dict_in_generate=True, **kw)  # fmt: skip


@pytest.mark.parametrize("family", [pytest.param(f, id=f) for f in ("mamba", "mamba2", "falcon_mamba")])
@torch.no_grad()
def test_generate_feeds_a_returned_recurrent_cache_only_its_unseen_tokens(family):
    """generate() hands an all-linear cache the whole sequence again; the wrapped one feeds the unseen suffix
    (reference: the joined sequence's greedy continuation by full forwards of the stock model, no cache)."""
    ok, why = family_available(family)
    if not ok:
        pytest.skip(why)
    stock = tiny_model(family)
    wrapped = safepad.wrap(copy.deepcopy(stock))
    ids = torch.randint(3, 200, (2, 6), generator=torch.Generator().manual_seed(3))
    first = _rows_generate(wrapped, ids, n=2)
    second = _rows_generate(wrapped, first.sequences, output_cache(first), n=3)
    seq = first.sequences
    for _ in range(3):
        seq = torch.cat([seq, stock(input_ids=seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(second.sequences, seq)


@pytest.mark.parametrize("family", [pytest.param(f, id=f) for f in ("mamba", "mamba2")])
@torch.no_grad()
def test_generate_refuses_a_recurrent_cache_of_unknown_history(family):
    """A cache whose states a plain forward wrote (or advanced after generate) cannot say which of the tokens it
    has read before transformers 5.25: generate raises naming the fix instead of reading the prompt twice (stock
    reads it silently). From 5.25 on the cache's layers count their tokens, so it can: generate feeds the unseen
    suffix (as stock 5.25 does) and refuses a cache that has read as many tokens as the sequence holds (stock 5.25
    then feeds a wrong slice of the sequence)."""
    ok, why = family_available(family)
    if not ok:
        pytest.skip(why)
    stock = tiny_model(family)
    wrapped = safepad.wrap(copy.deepcopy(stock))
    ids = torch.randint(3, 200, (2, 6), generator=torch.Generator().manual_seed(4))
    name = cache_argument(wrapped)
    from_forward = output_cache(wrapped(input_ids=ids, use_cache=True))
    if _layers_count_tokens():
        with pytest.raises(ValueError, match=r"already read 6 tokens but the input sequence holds 6"):
            _rows_generate(wrapped, ids, from_forward)
        prefix = output_cache(wrapped(input_ids=ids[:, :4], use_cache=True))  # a forward read the first 4 tokens
        got = _rows_generate(wrapped, ids, prefix, n=2).sequences
        assert torch.equal(got, _rows_generate(stock, ids, n=2).sequences)  # stock, fresh cache
        first = _rows_generate(wrapped, ids)
        cache = output_cache(first)
        wrapped(input_ids=first.sequences[:, -1:], use_cache=True, **{name: cache})  # advanced outside generate
        with pytest.raises(ValueError, match="already read 7 tokens"):
            _rows_generate(wrapped, first.sequences, cache)
        return
    with pytest.raises(ValueError, match="cannot tell which of the input tokens it has already read"):
        _rows_generate(wrapped, ids, from_forward)
    first = _rows_generate(wrapped, ids)
    cache = output_cache(first)
    wrapped(input_ids=first.sequences[:, -1:], use_cache=True, **{name: cache})  # advanced outside generate
    with pytest.raises(ValueError, match="return_dict_in_generate=True"):
        _rows_generate(wrapped, first.sequences, cache)


@pytest.mark.skipif(not _layers_count_tokens(), reason="transformers < 5.25: linear layers keep no token count")
@pytest.mark.parametrize("tokens", [pytest.param(1, id="decode-step"), pytest.param(5, id="chunk")])
def test_a_continuation_conv_write_is_one_copy_with_update_conv_state_s_result(tokens):
    """A continuation's conv state written through ``write_states`` leaves the layer exactly as transformers'
    ``update_conv_state`` (the last K columns of ``[old ‖ conv]``, i.e. ``conv``) plus the token count growing
    by the call's tokens, with one copy into the layer's buffer (its static address kept) and one count add: no
    concatenation, no slice."""
    from safepad.cache import write_states
    from safepad.testing.launches import count_ops

    model = tiny_model("lfm2")
    ids = torch.randint(3, 200, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
    idx = next(i for i, layer in enumerate(cache.layers) if getattr(layer, "has_previous_state", {}).get(0))
    layer = cache.layers[idx]
    conv = torch.randn(layer.conv_states[0].shape, generator=torch.Generator().manual_seed(1))  # [B, D, K]
    ref = copy.deepcopy(cache)
    ref.update_conv_state(conv, idx, state_idx=0, conv_kernel_size=conv.shape[-1])  # stock's write
    ref.layers[idx].cumulative_length_linear.add_(tokens - conv.shape[-1])  # stock counts the call's tokens
    buffer = layer.conv_states[0]
    _, _, ops = count_ops(lambda: write_states(cache, idx, tokens=tokens, conv=conv))
    assert layer.conv_states[0] is buffer and torch.equal(buffer, ref.layers[idx].conv_states[0])
    assert int(layer.cumulative_length_linear) == int(ref.layers[idx].cumulative_length_linear)
    assert dict(ops) == {"aten.copy_": 1, "aten.add_": 1}, ops
