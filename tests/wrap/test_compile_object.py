"""``model = torch.compile(model)``: the model object compiled, so its safepad hooks are traced with the forward.

The traced pre-hook must give a cached call without ``position_ids`` the positions the eager hook gives (each
row's cached real tokens plus ``cumsum(mask) - 1``; Bamba in transformers 5.24 restarts its rotary positions at 0
on every call without them, even unpadded), and a right-padded loss must go through the compiled backward
(Qwen3-Next's stock projection split ``view``s gradients that the delta rule leaves permuted). Reference: every
real token's logits against its sequence alone through the stock model (no padding, no cache); the compiled
training step against the eager wrapped one. ``backend="eager"`` / ``"aot_eager"`` (the hooks are traced by
dynamo either way; inductor's code generation would only add CPU time).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo as dynamo

import safepad
from safepad.cache import cache_argument, output_cache
from safepad.testing.tiny import tiny_model
from .helpers import family_param, strengthen_attention

TOL = 1e-4

pytestmark = pytest.mark.usefixtures("quiet_transformers")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    dynamo.reset()
    yield
    dynamo.reset()


def _case(family: str, layout: str):
    return pytest.param(family, layout, id=f"{family}-{layout}", marks=family_param(family).marks)


@pytest.mark.parametrize(("family", "layout"), [_case("qwen3_next", "right_padded"), _case("bamba", "unpadded")])
@torch.no_grad()
def test_compiled_object_cached_steps_without_positions_equal_alone(family: str, layout: str):
    """A (padded) prefill, then one-token steps with the full mask and no position_ids, as docs/inference.md does."""
    stock = strengthen_attention(tiny_model(family)).eval()
    ids = torch.randint(3, 250, (3, 11), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    if layout == "right_padded":
        mask[1, 6:9] = 0
        mask[2, 3:9] = 0
    ids = ids * mask
    model = torch.compile(safepad.wrap(copy.deepcopy(stock), backend="torch"), backend="eager")
    name = cache_argument(stock)
    cache, outs = None, []
    for a, b in ((0, 9), (9, 10), (10, 11)):
        kw = {name: cache} if cache is not None else {}
        out = model(input_ids=ids[:, a:b], attention_mask=mask[:, :b], use_cache=True, **kw)
        cache = output_cache(out)
        outs.append(out.logits)
    logits = torch.cat(outs, dim=1)  # [B, N, V]
    err = 0.0
    for r in range(ids.shape[0]):
        real = mask[r].bool()
        alone = stock(input_ids=ids[r, real][None], use_cache=False).logits[0]
        err = max(err, (logits[r, real] - alone).abs().max().item())
    assert err < TOL, (family, layout, err)


def test_compiled_object_right_padded_loss_backward_equals_eager():
    """Qwen3-Next, right-padded rows with labels: the compiled backward ran a failing ``view`` before."""
    torch.manual_seed(0)
    eager = safepad.wrap(tiny_model("qwen3_next"), backend="torch").train()
    compiled = torch.compile(copy.deepcopy(eager), backend="aot_eager")
    ids = torch.randint(3, 250, (3, 14), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    mask[2, 4:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    grads = []
    for model in (eager, compiled):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
        loss.backward()
        grads.append({n.removeprefix("_orig_mod."): p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for n, g in grads[0].items():
        assert (grads[1][n] - g).abs().max().item() <= 1e-5 * max(1.0, g.abs().max().item()), n


_HOLES = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 1, 1, 1, 1]])  # [2, 10]: a hole per row


@pytest.mark.parametrize("family", [family_param("qwen3_next"), family_param("olmo_hybrid")])
def test_compiled_object_uncached_holes_equal_alone(family: str):
    """An uncached call with holes on a RoPE hybrid: eager re-lays it (positions from the mask); the compiled object
    gives the real tokens the same positions on the device. Each real token's logits equal its row alone, stock,
    without the masked tokens (before: the traced hook left arange positions, counting the holes)."""
    torch.manual_seed(0)
    stock = strengthen_attention(tiny_model(family)).eval()
    compiled = torch.compile(safepad.wrap(copy.deepcopy(stock)), backend="eager")
    ids = torch.randint(3, 200, _HOLES.shape)
    with torch.no_grad():
        got = compiled(input_ids=ids, attention_mask=_HOLES, use_cache=False).logits
        for b in range(ids.shape[0]):
            keep = _HOLES[b].bool()
            want = stock(input_ids=ids[b, keep][None], use_cache=False).logits[0]
            err = (got[b, keep] - want).abs().max().item()
            assert err <= TOL * max(1.0, want.abs().max().item()), (b, err)


def test_compiled_object_uncached_holes_raise_where_attention_counts_slots():
    """lfm3 with a sliding window: the window would count the holes, and a traced call cannot re-lay the rows, so the
    compiled call raises naming the fix (eager re-lays it: tests/wrap/test_holes.py)."""
    ok, why = safepad.testing.tiny.family_available("lfm3")
    if not ok:
        pytest.skip(why)
    model = safepad.wrap(tiny_model("lfm3", sliding_window=4)).eval()
    compiled = torch.compile(model, backend="eager")
    ids = torch.randint(3, 200, _HOLES.shape)
    with pytest.raises(RuntimeError, match="pad between real tokens"), torch.no_grad():
        compiled(input_ids=ids, attention_mask=_HOLES, use_cache=False)


@torch.no_grad()
def test_compiled_in_place_generate_right_padded_equals_alone():
    """``model.compile()`` (every call of the model object traced, its hooks too) and ``generate`` on right-padded
    prompts (default cache): each row's new tokens are those of the row alone (stock, full forwards, no cache).
    Before: the right-padded prompt's prefill ran traced in the caller's layout and generate read row 1's next
    token from a pad (``[104, 60, 50]`` for ``[209, 54, 251]``); now its prompt is laid pads first, as for a
    compiled ``forward``."""
    from ..contract.helpers import gen_kwargs, greedy_alone, pad, prompts

    stock = tiny_model("nemotron_h").eval()
    model = safepad.wrap(copy.deepcopy(stock))
    model.compile(backend="eager")
    rows = prompts((6, 3), seed=5)
    ids, mask = pad(rows, "right")
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, **gen_kwargs(3))
    assert torch.equal(out[:, : ids.shape[1]], ids)  # the caller's prompt
    for i, r in enumerate(rows):
        want, _ = greedy_alone(stock, r, 3)
        assert torch.equal(out[i, ids.shape[1] :], want), (i, out[i].tolist(), want.tolist())
