"""safepad.layout.slots: the slot-justified cache layout, against per-row Python references."""

from __future__ import annotations

import pytest
import torch

from safepad.layout.slots import SlotJustifiedCall, justified_mask, justify_kv, pads_first_order


def _ref_justify(past, new, past_real, new_real):
    """Per row: the real slots of [past ‖ new] in order, right-aligned, zeros before them."""
    B, H, S, D = past.shape
    T = new.shape[2]
    out = torch.zeros(B, H, S + T, D, dtype=past.dtype)
    for b in range(B):
        reals = [past[b, :, j] for j in range(S - int(past_real[b]), S)]
        reals += [new[b, :, j] for j in range(T - int(new_real[b]), T)]
        for i, r in enumerate(reversed(reals)):
            out[b, :, S + T - 1 - i] = r
    return out[:, :, :S], out[:, :, S:]


@pytest.mark.parametrize(
    ("S", "T", "past_real", "new_real"),
    [
        pytest.param(5, 3, [5, 2, 0], [1, 3, 0], id="mixed"),
        pytest.param(2, 6, [2, 1, 0], [6, 0, 2], id="more-new-pads-than-past"),
        pytest.param(4, 1, [4, 4, 3], [0, 1, 0], id="decode-step-pad"),
    ],
)
def test_justify_kv_matches_reference(S, T, past_real, new_real):
    g = torch.Generator().manual_seed(S * 10 + T)
    past = torch.randn(3, 2, S, 4, generator=g, dtype=torch.float64)
    new = torch.randn(3, 2, T, 4, generator=g, dtype=torch.float64)
    pr, nr = torch.tensor(past_real), torch.tensor(new_real)
    got = justify_kv(past, new, pr, nr)
    want = _ref_justify(past, new, pr, nr)
    real = justified_mask(torch.minimum(pr + nr, torch.tensor(S + T)), S + T)[:, None, :, None]  # [B, 1, S + T, 1]
    if T == 1:  # (one token: the pad slots keep whatever they held, masked all the same)
        got = tuple(torch.cat(got, 2).where(real, 0.0).split([S, T], 2))
    for a, b in zip(got, want):
        assert a.shape == b.shape and torch.equal(a, b)


def test_pads_first_order_is_stable():
    mask = torch.tensor([[True, False, True, False, True], [False, False, True, True, True]])
    order = pads_first_order(mask)
    assert order.tolist() == [[1, 3, 0, 2, 4], [0, 1, 2, 3, 4]]
    assert justified_mask(torch.tensor([2, 0]), 3).tolist() == [[False, True, True], [False, False, False]]


def test_call_reorders_and_restores_the_chunk():
    # cached 3 slots (row 0: 3 real, row 1: 1 real), chunk of 4 with a hole and a trailing pad
    full = torch.tensor([[1, 1, 1, 1, 0, 1, 0], [0, 0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    call = SlotJustifiedCall(full, past_len=3)
    assert not call.noop and call.relay
    assert call.mask.tolist() == [[False, False, True, True, True, True, True], [False, False, True, True, True, True, True]]
    assert call.token_mask.tolist() == [[False, False, True, True], [True, True, True, True]]
    x = torch.arange(8.0).view(2, 4, 1)
    y = call.reorder(x)
    assert y[0, :, 0].tolist() == [1.0, 3.0, 0.0, 2.0]  # pads (columns 1, 3) first, real tokens in order
    assert torch.equal(call.restore(y), x)
    # row 0: its two leading pad columns take the positions of the cached real tokens the re-lay moves there (1, 2)
    assert call.position_ids().tolist() == [[1, 2, 3, 4], [1, 2, 3, 4]]


def test_call_on_a_justified_layout_is_a_noop():
    full = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)  # left-padded past + real chunk
    call = SlotJustifiedCall(full, past_len=4)
    assert call.noop and not call.relay and call.order is None


def test_decode_step_decides_on_the_device():
    """One token: no host read (noop / relay are not read from the mask), and the justified mask, positions and
    pad counts are the ones the chunk path computes."""
    from safepad.testing.syncs import count_syncs

    full = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 1], [1, 1, 0, 0, 0]], dtype=torch.bool)
    call, n, _ = count_syncs(lambda: SlotJustifiedCall(full, past_len=4))
    assert n == 0 and call.decode and call.relay and call.order is None
    assert call.mask.tolist() == [[False, False, True, True, True], [False, True, True, True, True],
                                  [False, False, False, True, True]]
    # each row's cached real tokens; row 2's step token is a pad (its query changes no real output, and its column
    # holds the row's last cached key after the re-lay, rotated when it was cached)
    assert call.position_ids().tolist() == [[2], [3], [2]]
    assert call.pads().tolist() == [2, 1, 3]


def test_justify_kv_from_a_layout_that_is_not_justified():
    # stored rows laid out as the caller's mask says (a one-token step with a pad on a cache never re-laid leaves
    # [reals | pad]): past_real as a [B, S] mask of the real slots; the result is the reference on those slots
    g = torch.Generator().manual_seed(7)
    past = torch.randn(2, 2, 4, 3, generator=g, dtype=torch.float64)
    new = torch.randn(2, 2, 2, 3, generator=g, dtype=torch.float64)
    slots = torch.tensor([[True, False, True, False], [True, True, True, True]])
    nr = torch.tensor([1, 2])
    got = justify_kv(past, new, slots, nr)
    for b in range(2):
        reals = torch.cat([past[b][:, slots[b]], new[b][:, 2 - int(nr[b]) :]], dim=1)  # [H, n, D] in order
        full = torch.cat(got, dim=2)[b]  # [H, S + T, D]
        n = reals.shape[1]
        assert torch.equal(full[:, -n:], reals) and not full[:, :-n].any()


def test_call_re_lays_a_cached_layout_that_is_not_justified():
    # cached [real, pad] (the caller's layout, never re-laid), then a chunk of real tokens: the cache must move
    full = torch.tensor([[1, 0, 1, 1]], dtype=torch.bool)
    call = SlotJustifiedCall(full, past_len=2, past_slots=full[:, :2])
    assert call.relay and not call.noop
    assert call.mask.tolist() == [[False, True, True, True]]
    assert call.position_ids().tolist() == [[1, 2]]
    assert not SlotJustifiedCall(full, past_len=2).relay  # read as justified ([pad, real]) nothing would move


def _step_cache(n_layers: int, past: torch.Tensor):
    """A DynamicCache of ``n_layers`` layers, each holding ``past`` ``[B, H, S, D]`` as keys and ``-past`` as values."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for i in range(n_layers):
        cache.update(past.clone(), -past, i)
    return cache


def _step_batch():
    """Justified cached rows ``[pads | reals]`` (3, 1, 0 and 4 real of 4) and a step whose token is a pad in rows
    1 and 3: ``(past [B, H, S, D], new [B, H, 1, D], full mask [B, S + 1], n_past [B], n_new [B])``, float64."""
    g = torch.Generator().manual_seed(11)
    n_past, n_new = torch.tensor([3, 1, 0, 4]), torch.tensor([1, 0, 1, 0])
    past = torch.randn(4, 2, 4, 3, generator=g, dtype=torch.float64)
    new = torch.randn(4, 2, 1, 3, generator=g, dtype=torch.float64)
    full = torch.cat([justified_mask(n_past, 4), n_new[:, None].bool()], 1)  # [B, S + 1]
    return past, new, full, n_past, n_new


def test_a_decode_step_re_lays_each_layer_as_the_reference():
    """A one-token step on a DynamicCache: every layer's keys and values become the stable partition of
    ``[past ‖ new]`` (the per-row Python reference) on each real slot of the justified mask, a pad step's row
    moved right by one (its pad first, its own key dropped)."""
    past, new, full, n_past, n_new = _step_batch()
    cache = _step_cache(2, past)
    call = SlotJustifiedCall(full, past_len=4)
    call.install(cache)
    try:
        for i in range(2):
            keys, values = cache.update(new.clone(), -new, i)
            want = torch.cat(_ref_justify(past, new, n_past, n_new), 2)  # [B, H, S + 1, D]
            real = call.mask[:, None, :, None]  # [B, 1, S + 1, 1]
            for got, sign in ((keys, 1), (values, -1)):
                assert torch.equal(got.where(real, 0.0), sign * want)
            assert cache.layers[i].keys is keys and cache.layers[i].values is values
    finally:
        call.uninstall()


def test_a_decode_step_re_lay_costs_each_layer_one_gather_per_tensor():
    """The step's re-lay index is made once per call and shape; each further layer of that shape costs its stock
    update's two concatenations and one gather for its keys, one for its values: nothing else."""
    from safepad.testing.launches import count_ops

    past, new, full, _, _ = _step_batch()

    def step(n_layers: int):
        cache = _step_cache(n_layers, past)
        call = SlotJustifiedCall(full, past_len=4)
        call.install(cache)
        try:
            return count_ops(lambda: [cache.update(new.clone(), -new, i) for i in range(n_layers)]).ops
        finally:
            call.uninstall()

    one, three = step(1), step(3)
    extra = three.copy()
    extra.subtract(one)
    extra.subtract({"aten.clone": 2, "aten.neg": 2})  # the test's own inputs
    assert {k: v for k, v in extra.items() if v} == {"aten.cat": 4, "aten.gather": 4}, extra
