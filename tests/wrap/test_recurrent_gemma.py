"""RecurrentGemma (Griffin): the wrapped recurrent blocks against each sequence run alone through the stock model.

The audit scenarios (``tests/wrap/test_new_families.py``) cover packing, padded prefill + decode, chunked prefill
and generate; these cover what is particular to a family whose stock code keeps its states on the modules.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from safepad.cache import cache_argument
from safepad.testing.scenarios import module_states
from safepad.testing.tiny import tiny_model
from safepad.wrap import wrap
from safepad.wrap.patching import is_wrapped


@pytest.fixture(scope="module")
def models():
    log = logging.getLogger("transformers")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        stock = tiny_model("recurrent_gemma")
        yield stock, wrap(copy.deepcopy(stock), backend="torch")
    finally:
        log.setLevel(level)


def _fresh_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def _cache_kw(model, cache) -> dict:
    return {cache_argument(model): cache}


@torch.no_grad()
def test_left_padded_forward_without_position_ids(models):
    """Without position_ids the stock model counts pads as positions: its RG-LRU never resets at the first real
    token and its conv reads the pads. Wrapped, each row equals the row alone."""
    stock, wrapped = models
    ids = torch.randint(3, 250, (2, 9), generator=torch.Generator().manual_seed(0))
    alone = stock(input_ids=ids, use_cache=False).logits
    lids = torch.cat([torch.zeros(2, 3, dtype=torch.long), ids], 1)
    lmask = torch.cat([torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 9, dtype=torch.long)], 1)
    got = wrapped(input_ids=lids, attention_mask=lmask, use_cache=False).logits[:, 3:]
    assert (got - alone).abs().max() < 1e-4
    bad = stock(input_ids=lids, attention_mask=lmask, use_cache=False).logits[:, 3:]
    assert (bad - alone).abs().max() > 1e-2


@torch.no_grad()
def test_module_storage_holds_each_rows_real_token_states(models):
    """After a right-padded cached prefill the module attributes (where stock code reads them) hold each row's
    states at its last real token, as after the row's own prefill; the stock block caches the pads'."""
    stock, wrapped = models
    g = torch.Generator().manual_seed(1)
    lengths = (7, 12, 2)
    seqs = [torch.randint(3, 250, (n,), generator=g) for n in lengths]
    ids = torch.zeros(3, 12, dtype=torch.long)
    mask = torch.zeros(3, 12, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : s.numel()], mask[b, : s.numel()] = s, 1
    alone = []
    for s in seqs:
        stock._setup_cache(stock.config, 1, torch.device("cpu"), torch.float32)
        stock(input_ids=s[None], use_cache=True, **_cache_kw(stock, _fresh_cache(stock)))
        alone.append(module_states(stock))
    for model, ok in ((wrapped, True), (stock, False)):
        if model is stock:
            stock._setup_cache(stock.config, 3, torch.device("cpu"), torch.float32)
        model(input_ids=ids, attention_mask=mask, use_cache=True, **_cache_kw(model, _fresh_cache(model)))
        got = module_states(model)
        assert set(got) == {"layer0.conv", "layer0.recurrent", "layer2.conv", "layer2.recurrent"}
        err = max((got[k][b] - alone[b][k][0]).abs().max().item() for b in range(3) for k in got)
        assert (err < 1e-4) == ok, (model is wrapped, err)


@torch.no_grad()
def test_a_fresh_cache_starts_fresh_whatever_the_modules_hold(models):
    """The module attributes still hold another batch's states; a new cache means new sequences."""
    _, wrapped = models
    g = torch.Generator().manual_seed(2)
    ids, other = torch.randint(3, 250, (2, 5), generator=g), torch.randint(3, 250, (2, 6), generator=g)
    full = wrapped(input_ids=ids, use_cache=False).logits
    wrapped(input_ids=other, use_cache=True, **_cache_kw(wrapped, _fresh_cache(wrapped)))
    cache = _fresh_cache(wrapped)
    out = [wrapped(input_ids=ids[:, :1], use_cache=True, **_cache_kw(wrapped, cache)).logits]  # a 1-token prompt
    for t in range(1, 5):
        out.append(wrapped(input_ids=ids[:, t : t + 1], use_cache=True, **_cache_kw(wrapped, cache)).logits)
    assert (torch.cat(out, 1) - full).abs().max() < 1e-4


def test_a_cache_without_recurrent_layers_raises(models):
    from transformers import DynamicCache

    _, wrapped = models
    with pytest.raises(ValueError, match=r"DynamicCache\(config=model.config\)"):
        wrapped(input_ids=torch.randint(3, 250, (1, 4)), use_cache=True, **_cache_kw(wrapped, DynamicCache()))


@torch.no_grad()
def test_packed_nan_stays_in_its_sequence_in_the_recurrent_blocks(models):
    """A NaN embedding in one packed sequence: the blocks keep it there (checked on a recurrent-only copy: the
    stock attention layers would pass a NaN across sequences, see README limits)."""
    stock, _ = models
    model = tiny_model("recurrent_gemma", block_types=["recurrent"], num_hidden_layers=2)
    ref = copy.deepcopy(model)
    wrap(model, backend="torch")
    g = torch.Generator().manual_seed(3)
    lengths = (4, 6, 5)
    seqs = [torch.randint(3, 250, (n,), generator=g) for n in lengths]
    emb = torch.cat([ref.get_input_embeddings()(s) for s in seqs])[None].clone()  # [1, T, D]
    emb[0, 4 + 2, 5] = torch.nan
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    out = model(inputs_embeds=emb, position_ids=pos, use_cache=False).logits[0]
    start = 0
    for i, (s, n) in enumerate(zip(seqs, lengths)):
        if i != 1:
            alone = ref(inputs_embeds=emb[:, start : start + n], use_cache=False).logits[0]
            assert (out[start : start + n] - alone).abs().max() < 1e-4
        else:
            assert not torch.isfinite(out[start + 2 : start + n]).all()
        start += n


# ---- issue 25 item 3: a short attention window, conv widths 2 and 3, lru width 48 -------------------------------

_SMALL = {"attention_window_size": 8, "lru_width": 48}


@pytest.fixture(scope="module", params=[pytest.param(2, id="conv2"), pytest.param(3, id="conv3")])
def small_models(request):
    log = logging.getLogger("transformers")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        stock = tiny_model("recurrent_gemma", conv1d_width=request.param, **_SMALL)
        yield stock, wrap(copy.deepcopy(stock), backend="torch")
    finally:
        log.setLevel(level)


def _alone(stock, seq, steps) -> torch.Tensor:
    """``[1 + len(steps), V]``: the last prompt logits and each decode step's, the row alone through stock.

    The decode steps get their ``position_ids``: from transformers 5.25 on, the stock model takes its positions from
    ``cache.get_seq_length()``, which is layer 0's own count, and layer 0 is a recurrent block that (stock) never
    writes the cache, so the count stays 0 and every stock decode step without positions runs at position 0 (a reset
    RG-LRU, wrong rotary). 5.23 / 5.24 asked the first attention layer. The wrapped blocks advance the count."""
    stock._setup_cache(stock.config, 1, torch.device("cpu"), torch.float32)
    cache = _fresh_cache(stock)
    out = [stock(input_ids=seq[None], use_cache=True, **_cache_kw(stock, cache)).logits[0, -1]]
    for k, tok in enumerate(steps):
        pos = torch.tensor([[seq.numel() + k]])
        out.append(stock(input_ids=tok.view(1, 1), position_ids=pos, use_cache=True,
                         **_cache_kw(stock, cache)).logits[0, -1])  # fmt: skip
    return torch.stack(out)


def _padded_decode(model, ids, mask, steps, with_pos: bool) -> torch.Tensor:
    """``[B, 1 + S, V]``: each row's last real prompt logits, then one per decode step ``steps [S, B]``."""
    B = ids.shape[0]
    if not is_wrapped(model):
        model._setup_cache(model.config, B, torch.device("cpu"), torch.float32)
    cache = _fresh_cache(model)
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1) if with_pos else None
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                   **_cache_kw(model, cache)).logits
    last = (mask * torch.arange(1, mask.shape[1] + 1)).argmax(1)
    out = [logits[torch.arange(B), last]]
    lengths = mask.sum(1)
    for k, tok in enumerate(steps):
        mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype)], 1)
        step_pos = (lengths + k)[:, None] if with_pos else None
        out.append(model(input_ids=tok[:, None], attention_mask=mask, position_ids=step_pos, use_cache=True,
                         **_cache_kw(model, cache)).logits[:, -1])
    return torch.stack(out, 1)


@pytest.mark.parametrize(
    "left, with_pos",
    [
        pytest.param(False, True, id="right-pos"),
        pytest.param(False, False, id="right-no-pos"),
        pytest.param(True, False, id="left-no-pos"),  # stock counted the pads in the prefill's rotary positions
    ],
)
@torch.no_grad()
def test_padded_prefill_then_decode_equals_each_row_alone(small_models, left, with_pos):
    """Rows longer and shorter than the attention window, padded, then three decode steps: each row's logits
    equal the row's own prefill + decode through the stock model (the stock batch does not)."""
    stock, wrapped = small_models
    g = torch.Generator().manual_seed(4)
    lengths, T = (5, 12, 9), 12
    seqs = [torch.randint(3, 250, (n,), generator=g) for n in lengths]
    steps = torch.randint(3, 250, (3, len(seqs)), generator=g)  # [S, B]
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for b, s in enumerate(seqs):
        sl = slice(T - s.numel(), T) if left else slice(0, s.numel())
        ids[b, sl], mask[b, sl] = s, 1
    ref = torch.stack([_alone(stock, s, steps[:, b]) for b, s in enumerate(seqs)])
    got = _padded_decode(wrapped, ids, mask, steps, with_pos)
    assert (got - ref).abs().max() < 1e-4
    if not left:
        assert (_padded_decode(stock, ids, mask, steps, with_pos) - ref).abs().max() > 1e-2


@torch.no_grad()
def test_holes_in_the_mask_then_decode_equal_the_row_without_them(small_models):
    """Masked tokens inside a row (a hole) are skipped: the row equals the row with the hole cut out."""
    stock, wrapped = small_models
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(3, 250, (n,), generator=g) for n in (12, 7)]
    steps = torch.randint(3, 250, (2, 2), generator=g)
    ids = torch.zeros(2, 12, dtype=torch.long)
    mask = torch.zeros(2, 12, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : s.numel()], mask[b, : s.numel()] = s, 1
    mask[0, 4:6] = 0  # a hole in row 0
    kept = [torch.cat([seqs[0][:4], seqs[0][6:]]), seqs[1]]
    ref = torch.stack([_alone(stock, s, steps[:, b]) for b, s in enumerate(kept)])
    got = _padded_decode(wrapped, ids, mask, steps, with_pos=False)
    assert (got - ref).abs().max() < 1e-4
    assert (_padded_decode(stock, ids, mask, steps, with_pos=False) - ref).abs().max() > 1e-2


@torch.no_grad()
def test_a_deep_copied_cache_decodes_apart_from_the_original(small_models):
    """Decoding different tokens on ``copy.deepcopy(cache)`` and on the original: each continues its own
    prefix (the wrapped blocks read their states from the cache they are handed, not from the modules; the
    stock blocks read the modules' and so mix the two)."""
    stock, wrapped = small_models
    g = torch.Generator().manual_seed(6)
    prompt = torch.randint(3, 250, (2, 6), generator=g)
    a, b = torch.randint(3, 250, (2, 2, 1), generator=g)  # [2, 1] each: two different next tokens per row

    def run(model):
        if not is_wrapped(model):
            model._setup_cache(model.config, 2, torch.device("cpu"), torch.float32)
        cache = _fresh_cache(model)
        model(input_ids=prompt, use_cache=True, **_cache_kw(model, cache))
        twin = copy.deepcopy(cache)
        la = model(input_ids=a, use_cache=True, **_cache_kw(model, cache)).logits[:, -1]
        lb = model(input_ids=b, use_cache=True, **_cache_kw(model, twin)).logits[:, -1]
        la2 = model(input_ids=b, use_cache=True, **_cache_kw(model, cache)).logits[:, -1]
        return torch.stack([la, lb, la2], 1)  # [2, 3, V]

    ref = torch.stack(
        [torch.stack([_alone(stock, prompt[r], [a[r, 0], b[r, 0]])[1], _alone(stock, prompt[r], [b[r, 0]])[1],
                      _alone(stock, prompt[r], [a[r, 0], b[r, 0]])[2]]) for r in range(2)]
    )
    assert (run(wrapped) - ref).abs().max() < 1e-4
    assert (run(stock) - ref).abs().max() > 1e-2


@pytest.mark.parametrize("rows", [pytest.param(2, id="2-rows"), pytest.param(1, id="1-row-broadcasts")])
def test_a_cache_of_more_rows_than_the_call_raises(small_models, rows):
    """A 3-row cache handed to a decode step of fewer rows raises naming both counts (it is never broadcast)."""
    _, wrapped = small_models
    cache = _fresh_cache(wrapped)
    with torch.no_grad():
        wrapped(input_ids=torch.randint(3, 250, (3, 5)), use_cache=True, **_cache_kw(wrapped, cache))
        with pytest.raises(ValueError, match=rf"3 rows but this call has {rows} rows"):
            wrapped(input_ids=torch.randint(3, 250, (rows, 1)), use_cache=True, **_cache_kw(wrapped, cache))


@torch.no_grad()
def test_cached_beam_search_on_one_unpadded_prompt_equals_the_cache_free_search(models):
    """Stock keeps the recurrent states on its modules, where beam search's cache reorder never reaches them:
    its cached beam search on one unpadded prompt scores beams by another beam's state (greedy, one row, is
    right). Wrapped, the cached search returns the beams and scores of the cache-free search, every step a full
    forward of the stock model."""
    stock, wrapped = models
    prompt = torch.randint(3, 250, (1, 7), generator=torch.Generator().manual_seed(4))
    kw = dict(
        max_new_tokens=4, min_new_tokens=4, num_beams=3, num_return_sequences=2, do_sample=False,
        length_penalty=0.0, output_scores=True, return_dict_in_generate=True, pad_token_id=0,
        attention_mask=torch.ones_like(prompt),
    )
    ref = stock.generate(input_ids=prompt, use_cache=False, **kw)
    got = wrapped.generate(input_ids=prompt, **kw)
    assert torch.equal(got.sequences, ref.sequences)
    assert (got.sequences_scores - ref.sequences_scores).abs().max() < 1e-4
    bad = stock.generate(input_ids=prompt, **kw)
    assert not torch.equal(bad.sequences, ref.sequences)
    assert (bad.sequences_scores - ref.sequences_scores).abs().max() > 1e-2


@torch.no_grad()
@pytest.mark.parametrize("split", [pytest.param(8, id="chunk"), pytest.param(11, id="token")])
@pytest.mark.parametrize("side", ["unpadded", "right", "left"])
def test_a_continuation_without_the_cache_raises_naming_it(models, split, side):
    """The stock model returns no cache and builds a new one on every call handed none: a prefill with use_cache,
    then the next chunk / token with its position_ids (or the full mask) and no cache, has lost the earlier states
    (stock and the old wrapped model answered off by ~2 against the sequence alone). Wrapped it raises naming the
    cache to build; handing that cache to every call equals each row alone."""
    from transformers import DynamicCache

    stock, wrapped = models
    ids = torch.randint(3, 250, (2, 12), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    if side != "unpadded":  # row 1 holds 9 real tokens
        mask[1] = torch.arange(12) < 9 if side == "right" else torch.arange(12) >= 3
        ids = ids * mask
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    kw = {} if side == "unpadded" else {"attention_mask": mask[:, :split]}
    wrapped(input_ids=ids[:, :split], position_ids=pos[:, :split], use_cache=True, **kw)
    nxt = {"input_ids": ids[:, split:], "position_ids": pos[:, split:], "use_cache": True}
    calls = [nxt]
    if side != "unpadded":  # with the full mask, and with the chunk's own columns (an old message's advice)
        calls += [{**nxt, "attention_mask": mask}, {**nxt, "attention_mask": mask[:, split:]}]
    for call in calls:
        with pytest.raises(ValueError, match=r"DynamicCache\(config=model\.config\)"):
            wrapped(**call)
    cache = DynamicCache(config=wrapped.config)
    kw = {} if side == "unpadded" else {"attention_mask": mask[:, :split]}
    wrapped(input_ids=ids[:, :split], position_ids=pos[:, :split], use_cache=True, **_cache_kw(wrapped, cache), **kw)
    kw = {} if side == "unpadded" else {"attention_mask": mask}
    got = wrapped(**nxt, **_cache_kw(wrapped, cache), **kw).logits
    for r in range(2):
        real = ids[r][mask[r].bool()]
        alone = stock(input_ids=real[None], use_cache=False).logits[0]
        m = mask[r, split:].bool()
        n_before = int(mask[r, :split].sum())
        if bool(m.any()):  # (a right-padded row may bring only pads)
            assert (got[r][m] - alone[n_before : n_before + int(m.sum())]).abs().max() < 1e-4


@pytest.fixture(scope="module")
def window4():
    log = logging.getLogger("transformers")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        stock = tiny_model("recurrent_gemma", attention_window_size=4)
        yield stock, wrap(copy.deepcopy(stock), backend="torch")
    finally:
        log.setLevel(level)


@torch.no_grad()
@pytest.mark.parametrize("positions", [pytest.param(False, id="no-pos"), pytest.param(True, id="pos")])
@pytest.mark.parametrize("select", [pytest.param(False, id="kept"), pytest.param(True, id="rows-selected")])
def test_a_row_of_pads_only_then_decode_equals_the_row_alone(window4, positions, select):
    """A first cached call where one row is all pads: the row's state has read no real token, so its first real
    token (a later chunk or step) must start from a reset, as the row alone (the RG-LRU's ``h = i * x``); it
    continued the empty state instead (``h = sqrt(1 - a^2) i x``: 0.50 relative off the row alone, window 4 or
    not). Then a chunk of 2 and two steps; with ``select`` the cache's rows are reordered first (the per-row fact
    follows them). Each row against its real tokens alone through the stock model, without a cache."""
    stock, wrapped = window4
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 250, (3, 6), generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0], [0, 0, 1, 1, 1, 1]])
    cache = _fresh_cache(wrapped)
    kw = {"position_ids": (mask.cumsum(1) - 1).clamp(min=0)} if positions else {}
    outs = [wrapped(input_ids=ids, attention_mask=mask, use_cache=True, **kw, **_cache_kw(wrapped, cache)).logits]
    if select:
        order = torch.tensor([1, 2, 0])  # the row of pads moves to row 0
        cache.batch_select_indices(order)
        ids, mask, outs = ids[order], mask[order], [outs[0][order]]
    seen = [ids[b][mask[b].bool()] for b in range(3)]
    for T in (2, 1, 1):
        new = torch.randint(3, 250, (3, T), generator=g)
        kw = {"position_ids": mask.sum(1, keepdim=True) + torch.arange(T)} if positions else {}
        mask = torch.cat([mask, torch.ones(3, T, dtype=torch.long)], 1)
        outs.append(wrapped(input_ids=new, attention_mask=mask, use_cache=True, **kw, **_cache_kw(wrapped, cache)).logits)
        seen = [torch.cat([s, new[b]]) for b, s in enumerate(seen)]
    got = torch.cat(outs, 1)  # [3, 10, V]
    for b in range(3):
        alone = stock(input_ids=seen[b][None], use_cache=False).logits[0]
        row = got[b][mask[b].bool()]
        assert (row - alone).abs().max() <= 1e-4 * alone.abs().max(), b


@torch.no_grad()
def test_generate_reads_gate_weights_written_through_data_between_calls():
    """A wrapped ``generate`` builds the RG-LRU's stacked gate parameters once for its own call
    (``safepad.ops.prepared``); a write through ``.data`` between two calls (it moves no version counter nor the
    data pointer: an EMA update, a hand-written weight sync) is read by the next call: its logits equal the stock
    model's with the same weights. A value kept past the call would decode the old gates."""
    stock = tiny_model("recurrent_gemma")
    wrapped = wrap(copy.deepcopy(stock), backend="torch")
    ids = torch.randint(3, 250, (2, 5), generator=torch.Generator().manual_seed(1))
    kw = {"max_new_tokens": 3, "do_sample": False, "return_dict_in_generate": True, "output_logits": True,
          "pad_token_id": 0}
    before = torch.stack(wrapped.generate(input_ids=ids, **kw).logits)  # [N, B, V]
    g = torch.Generator().manual_seed(2)
    for model in (stock, wrapped):
        for layer in model.model.layers:
            rg = getattr(getattr(layer, "temporal_block", None), "rg_lru", None)
            if rg is not None:
                rg.recurrent_gate_weight.data.copy_(torch.randn(rg.recurrent_gate_weight.shape, generator=g) * 0.6)
        g = torch.Generator().manual_seed(2)  # the same new values in both models
    ref = torch.stack(stock.generate(input_ids=ids, **kw).logits)  # [N, B, V]
    got = torch.stack(wrapped.generate(input_ids=ids, **kw).logits)
    assert (ref - before).abs().max() > 1e-2, "the write must move the logits (else the test is void)"
    assert (got - ref).abs().max() < 1e-4
