"""Per-token outputs of re-laid calls come back in the caller's order: attention weights, router logits, tuples.

A cached call on rows with padding after real tokens (and a call without a cache on a hybrid's rows with holes)
runs re-laid, each row ``[pads | real tokens]`` (``safepad.layout.slots``). Every per-token output must then be put
back in the caller's layout:

* attention weights ``[B, H, T, L + T]``: queries in the caller's order, keys as the columns of the caller's
  full-length mask (the cached tokens as the caller laid them out, then the current ones). The reference is each
  row alone through the stock model (its real tokens so far, no padding, no cache): the weights of a real query
  over the real keys equal the row alone's; pad columns (and pad query rows) hold 0;
* router logits ``[B * T, E]``, per token, as each row alone;
* ``return_dict=False`` returns the same tensors as ``return_dict=True`` (transformers'
  ``test_model_outputs_equivalence``): hidden states, attentions and logits in the caller's order.
"""

from __future__ import annotations

import copy

import pytest
import torch

from safepad.cache import cache_argument
from safepad.testing.tiny import EXTRA_FAMILIES, FAMILIES, NEW_FAMILIES, tiny_model
from safepad.wrap import wrap
from .helpers import family_param

pytestmark = pytest.mark.usefixtures("quiet_transformers")

_RECURRENT_ONLY = ("mamba", "mamba2", "falcon_mamba")
ALL = FAMILIES + EXTRA_FAMILIES + NEW_FAMILIES
HYBRIDS = [pytest.param(p.values[0], {}, id=p.id, marks=p.marks) for f in ALL if f not in _RECURRENT_ONLY
           for p in [family_param(f)]] + [
    pytest.param("lfm3", {"sliding_window": 4}, id="lfm3-window-4"),  # a sliding layer keeps fewer key slots
]


def _build(family: str, **overrides):
    stock = tiny_model(family, **overrides)
    if family not in _RECURRENT_ONLY:
        stock.set_attn_implementation("eager")  # attention weights
    return stock, wrap(copy.deepcopy(stock), backend="torch")


def _cache_of(out):
    return next(c for n in ("cache", "past_key_values", "cache_params") if (c := getattr(out, n, None)) is not None)


def _router(model) -> dict:
    # (the tiny Jamba has no expert layer: stock's aux loss fails on its empty router logits)
    wanted = hasattr(model.config.get_text_config(), "output_router_logits") and model.config.model_type != "jamba"
    return {"output_router_logits": True} if wanted else {}


def _first_cache(model) -> dict:
    """recurrent_gemma keeps its states in the cache it is handed (none is built for it)."""
    if model.config.model_type != "recurrent_gemma":
        return {}
    from transformers import DynamicCache

    return {cache_argument(model): DynamicCache(config=model.config)}


def _ids(T: int, seed: int):
    return torch.randint(3, 250, (2, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family,overrides", HYBRIDS)
@torch.no_grad()
def test_attentions_and_router_logits_in_the_callers_order(family, overrides):
    """Right-padded cached prefill, a chunk with a hole, a decode step: weights (and router logits) equal each row
    alone, the key axis being the caller's columns of the full-length mask."""
    stock, wrapped = _build(family, **overrides)
    prefill, chunk = _ids(7, 1), _ids(3, 2)
    m1 = torch.tensor([[1, 1, 1, 1, 0, 0, 0], [1] * 7])
    m2 = torch.cat([m1, torch.tensor([[1, 1, 1], [1, 0, 1]])], 1)
    router = _router(stock)
    first = _first_cache(wrapped)
    out1 = wrapped(input_ids=prefill, attention_mask=m1, use_cache=True, output_attentions=True, **router, **first)
    cache = next(iter(first.values())) if first else _cache_of(out1)
    out2 = wrapped(input_ids=chunk, attention_mask=m2, use_cache=True, output_attentions=True,
                   **{cache_argument(wrapped): cache})
    step, m3 = _ids(1, 3), torch.cat([m2, torch.ones(2, 1, dtype=m2.dtype)], 1)  # a decode step on the re-laid cache
    out3 = wrapped(input_ids=step, attention_mask=m3, use_cache=True, output_attentions=True,
                   **{cache_argument(wrapped): cache})
    ids = torch.cat([prefill, chunk, step], 1)
    for out, T, mask in ((out1, 7, m1), (out2, 3, m2), (out3, 1, m3)):
        full = mask.bool()  # [B, L + T]: the caller's columns
        layers = [a for a in out.attentions if a is not None]
        assert layers
        for b in range(2):
            seq = ids[b, : full.shape[1]][full[b]]
            ref = stock(input_ids=seq[None], use_cache=False, output_attentions=True, **(router if out is out1 else {}))
            q = full[b, -T:]  # real queries of this call
            n_new = int(q.sum())
            for i, (got, want) in enumerate(zip(layers, [a for a in ref.attentions if a is not None])):
                assert got.shape[-1] >= full.shape[1], (family, i, tuple(got.shape))
                g = got[b][:, q][:, :, : full.shape[1]]  # [H, n_new, L + T]
                err = (g[:, :, full[b]] - want[0][:, -n_new:]).abs().max().item()
                assert err < 1e-5, f"{family} call {T} row {b} layer {i}: weights over real keys off by {err:.2e}"
                assert g[:, :, ~full[b]].abs().max().item() == 0 if (~full[b]).any() else True
                assert got[b][:, ~q].abs().max().item() == 0 if (~q).any() else True  # pad queries: zeros
            if out is out1 and getattr(ref, "router_logits", None) is not None:
                for got, want in zip(out.router_logits, ref.router_logits):
                    got = got.view(2, T, -1)[b][q]
                    assert (got - want.view(n_new, -1)).abs().max().item() < 1e-5, family


def _equal(t, d, path="out"):
    """transformers' ``test_model_outputs_equivalence`` check: tuple and dict outputs hold the same tensors."""
    if isinstance(t, (tuple, list)):
        assert isinstance(d, (tuple, list)) and len(t) == len(d), path
        for i, (a, b) in enumerate(zip(t, d)):
            _equal(a, b, f"{path}[{i}]")
    elif isinstance(t, torch.Tensor):
        assert isinstance(d, torch.Tensor) and t.shape == d.shape, path
        assert torch.allclose(t.nan_to_num(0), d.nan_to_num(0), atol=1e-5), (
            f"{path}: tuple and dict outputs differ by {(t - d).abs().max().item():.2e}"
        )


@pytest.mark.parametrize("family", [family_param(f) for f in ALL])
@torch.no_grad()
def test_tuple_outputs_equal_dict_outputs(family):
    """``return_dict=False`` vs ``True`` on a right-padded cached call (with and without labels, all outputs) and
    on a call without a cache with holes: the same tensors, in the same order."""
    stock, wrapped = _build(family)
    ids = _ids(7, 4)
    right = torch.tensor([[1, 1, 1, 1, 0, 0, 0], [1] * 7])
    holes = torch.tensor([[1, 0, 1, 1, 0, 1, 1], [1] * 7])
    extra = {"output_hidden_states": True, **_router(stock)}
    if family not in _RECURRENT_ONLY:
        extra["output_attentions"] = True
    calls = [
        dict(attention_mask=right, use_cache=True),
        dict(attention_mask=right, use_cache=True, labels=ids.masked_fill(right == 0, -100)),
        dict(attention_mask=holes, use_cache=False),
    ]
    for kw in calls:
        d = wrapped(input_ids=ids, **kw, **extra, return_dict=True)
        t = wrapped(input_ids=ids, **kw, **extra, return_dict=False)
        assert isinstance(t, tuple)
        keys = [k for k in d.keys() if k not in ("past_key_values", "cache", "cache_params")]
        positions = [i for i, k in enumerate(d.keys()) if k in keys]
        _equal(tuple(t[i] for i in positions), tuple(d[k] for k in keys))
