"""safepad.wrap on the gated-delta-rule hybrids (qwen3_next, olmo_hybrid, kimi_linear; siblings qwen3_5, qwen3_5_moe)
and LFM2's short conv (sibling lfm2_moe).

Reference: each sequence run alone through the stock (unwrapped) model, fp32 CPU, tolerance 1e-4 on the
logits. Every behaviour is also run on the stock model, which must fail it (error > 1e-3 or raise) — or,
for the layouts stock already gets right (left padding, unpadded chunked prefill, token decode, left-padded
generate), it is a cross-check; the padded variants of those (right pads, pads inside continuation chunks,
masked decode tokens) are where stock fails and are tested separately.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from safepad.cache import cache_argument, output_cache
from safepad.testing.scenarios import packed_loss_grad_errors, run_scenario
from safepad.testing.tiny import tiny_model
from safepad.wrap import unwrap, wrap, wrapped_modules

FAMILIES = ("qwen3_next", "olmo_hybrid", "kimi_linear", "lfm2")
MIXER_CLASS = {
    "qwen3_next": "Qwen3NextGatedDeltaNet",
    "olmo_hybrid": "OlmoHybridGatedDeltaNet",
    "kimi_linear": "KimiLinearDeltaAttention",
    "lfm2": "Lfm2ShortConv",
}
TOL = 1e-4  # fp32 logits
STOCK_BROKEN = 1e-3  # stock must be at least this far off (or raise)
GRAD_RTOL = 1e-4
VOCAB_LO, VOCAB_HI = 3, 250  # avoid pad / bos / eos ids


@pytest.fixture(scope="module", autouse=True)
def _quiet_transformers():
    log = logging.getLogger("transformers")
    level = log.level
    log.setLevel(logging.ERROR)  # "falling back to its reference PyTorch implementation" on every call
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threading costs more than it gives (and the CI box is shared)
    yield
    torch.set_num_threads(threads)
    log.setLevel(level)


@pytest.fixture(scope="module", params=FAMILIES)
def models(request):
    """(stock, reference copy, wrapped copy) of one tiny strengthened family model, shared by the module."""
    stock = tiny_model(request.param)
    ref = copy.deepcopy(stock)
    wrapped = wrap(copy.deepcopy(stock), backend="torch")
    return request.param, stock, ref, wrapped


def _ids(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(VOCAB_LO, VOCAB_HI, (n,), generator=g)


@torch.no_grad()
def _alone(ref: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """``[L]`` ids alone, no cache -> ``[L, V]`` logits."""
    return ref(input_ids=ids[None], use_cache=False).logits[0].float()


def _stock_fails(err: float | None, raised: str | None) -> bool:
    return raised is not None or (err is not None and not err <= STOCK_BROKEN)


# ------------------------------------------------------------------------------------------------------------
# structure
# ------------------------------------------------------------------------------------------------------------


def test_wrap_patches_every_mixer_and_unwrap_restores(models):
    family, stock, ref, _ = models
    model = wrap(copy.deepcopy(stock))
    names = wrapped_modules(model)
    expected = [n for n, m in stock.named_modules() if type(m).__name__ == MIXER_CLASS[family]]
    assert [n for n, _ in names] == expected and expected
    assert all(type(m).__name__ == f"Safepad{MIXER_CLASS[family]}" for _, m in names)
    assert "safepad=" in repr(names[0][1])
    assert model.state_dict().keys() == stock.state_dict().keys()
    unwrap(model)
    assert all(type(m).__name__ == MIXER_CLASS[family] for n, m in model.named_modules() if n in expected)
    ids = _ids(9, 1)
    torch.testing.assert_close(_alone(model, ids), _alone(ref, ids), rtol=0, atol=0)


def test_every_projection_is_called_as_a_module(models):
    """PEFT replaces nn.Linear children: the wrapped forward must call each one as a module, not read .weight."""
    _, _, _, wrapped = models
    mixer = wrapped_modules(wrapped)[0][1]
    seen: set[str] = set()
    handles = [
        sub.register_forward_hook(lambda mod, a, o, name=name: seen.add(name))
        for name, sub in mixer.named_modules()
        if isinstance(sub, nn.Linear)
    ]
    try:
        with torch.no_grad():
            wrapped(input_ids=_ids(6, 2)[None], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    linears = {n for n, s in mixer.named_modules() if isinstance(s, nn.Linear)}
    assert seen == linears, f"projections bypassed: {sorted(linears - seen)}"


# ------------------------------------------------------------------------------------------------------------
# scenarios that stock fails: packed three ways, right-padded prefill + decode, padded chunked prefill
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "scenario",
    [
        pytest.param("packed_position_ids", id="packed-position_ids"),
        pytest.param("packed_seq_idx", id="packed-seq_idx"),
        pytest.param("packed_cu_seq_lens", id="packed-cu_seq_lens"),
        pytest.param("right_pad_decode", id="right-pad-prefill+decode"),
        pytest.param("chunked_prefill_pad", id="chunked-prefill-right-pad"),
    ],
)
def test_scenario_wrapped_exact_stock_broken(models, scenario):
    family, stock, ref, wrapped = models
    got = run_scenario(wrapped, ref, scenario)
    assert got.error is None, got.error
    assert got.max_abs_logits <= TOL, (family, scenario, got.max_abs_logits)
    if got.state_errors:  # cached states of every row equal the row run alone
        assert got.max_state_error <= TOL, got.state_errors
    base = run_scenario(stock, ref, scenario)
    assert _stock_fails(base.max_error, base.error), (family, scenario, base.max_error)


@pytest.mark.parametrize(
    "scenario",
    [
        pytest.param("left_pad_decode", id="left-pad-prefill+decode"),
        pytest.param("chunked_prefill", id="chunked-prefill"),
        pytest.param("decode_default", id="token-decode-eq-full"),
        pytest.param("generate", id="generate-left-pad"),
    ],
)
def test_scenario_wrapped_exact_stock_crosscheck(models, scenario):
    """Layouts stock already handles: wrapped must match too (stock passing confirms the reference)."""
    family, stock, ref, wrapped = models
    got = run_scenario(wrapped, ref, scenario)
    assert got.passed, (family, scenario, got.to_dict())
    base = run_scenario(stock, ref, scenario)
    assert base.passed, (family, scenario, "stock cross-check", base.to_dict())


# ------------------------------------------------------------------------------------------------------------
# harder variants stock fails: left pads inside a continuation chunk, any chunk split
# ------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def _chunked_run(model: nn.Module, seqs: list[torch.Tensor], splits: list[list[int]], left: bool) -> list[torch.Tensor]:
    """Feed each row's tokens through the cache in chunks (``splits[c][row]`` real tokens of row ``row`` in
    chunk ``c``, padded on the left or right to the chunk width), then one decode token. Returns the
    per-row ``[n_real, V]`` logits of every real token, in order."""
    B = len(seqs)
    cache, full_mask, outs = None, torch.zeros(B, 0, dtype=torch.long), [[] for _ in range(B)]
    done = [0] * B
    for chunk in splits + [[1] * B]:
        width = max(chunk)
        ids = torch.zeros(B, width, dtype=torch.long)
        mask = torch.zeros(B, width, dtype=torch.long)
        for r, n in enumerate(chunk):
            sl = slice(width - n, width) if left else slice(0, n)
            ids[r, sl] = seqs[r][done[r] : done[r] + n]
            mask[r, sl] = 1
        full_mask = torch.cat([full_mask, mask], dim=1)
        pos = (full_mask.cumsum(1) - 1).clamp(min=0)[:, -width:]
        kw = {} if cache is None else {cache_argument(model): cache}
        out = model(input_ids=ids, attention_mask=full_mask, position_ids=pos, use_cache=True, **kw)
        cache = output_cache(out)
        for r, n in enumerate(chunk):
            sl = slice(width - n, width) if left else slice(0, n)
            outs[r].append(out.logits[r, sl].float())
            done[r] += n
    return [torch.cat(o) for o in outs]


CHUNK_CASES = [
    pytest.param([[8, 8], [12, 4]], True, id="left-pads-inside-continuation"),
    pytest.param([[1, 3], [1, 1], [17, 9], [2, 3]], False, id="right-pad-1-token-chunks"),
    pytest.param([[5, 7], [1, 1], [3, 5], [11, 3]], True, id="left-pad-mixed-splits"),
]


@pytest.mark.parametrize("splits,left", CHUNK_CASES)
def test_chunked_prefill_any_split(models, splits, left):
    family, stock, ref, wrapped = models
    lengths = [sum(c[r] for c in splits) + 1 for r in range(2)]
    seqs = [_ids(n, 10 + i) for i, n in enumerate(lengths)]
    alone = [_alone(ref, s) for s in seqs]

    def err(model):
        try:
            got = _chunked_run(model, seqs, splits, left)
        except Exception as exc:  # noqa: BLE001 - stock raising is a finding
            return None, f"{type(exc).__name__}: {exc}"
        return max((g - a).abs().max().item() for g, a in zip(got, alone)), None

    w_err, w_raised = err(wrapped)
    assert w_raised is None, w_raised
    assert w_err <= TOL, (family, w_err)
    s_err, s_raised = err(stock)
    assert _stock_fails(s_err, s_raised), (family, "stock", s_err)


@torch.no_grad()
def test_masked_decode_token_leaves_states_untouched(models):
    """A decode step whose token is masked must not move that row's states (the mixer called directly:
    the model itself drops the mask on single-token steps)."""
    family, _, _, wrapped = models
    out = wrapped(input_ids=torch.stack([_ids(9, 30), _ids(9, 31)]), use_cache=True)
    cache = output_cache(out)
    mixer = wrapped_modules(wrapped)[0][1]
    layer = cache.layers[mixer.layer_idx]

    def states():
        return [s.clone() for s in (layer.conv_states[0], layer.recurrent_states[0]) if isinstance(s, torch.Tensor)]

    before = states()
    hidden = torch.randn(2, 1, wrapped.config.hidden_size, generator=torch.Generator().manual_seed(3))
    y = mixer(hidden, attention_mask=torch.tensor([[1], [0]]), **{cache_argument(mixer): cache})
    assert y.shape == hidden.shape and torch.isfinite(y).all()
    after = states()
    assert len(after) == len(before) >= 1
    for b, a in zip(before, after):
        torch.testing.assert_close(a[1], b[1], rtol=0, atol=0)  # masked row unchanged
        assert not torch.equal(a[0], b[0])  # real row advanced


# ------------------------------------------------------------------------------------------------------------
# packed training: loss and parameter gradients
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("boundaries", ["position_ids", "seq_idx", "cu_seq_lens"])
def test_packed_loss_and_grads(models, boundaries):
    family, stock, ref, wrapped = models
    got = packed_loss_grad_errors(wrapped, ref, boundaries)
    assert got["loss_rel"] <= GRAD_RTOL and got["grad_rel"] <= GRAD_RTOL, (family, got)
    try:
        base = packed_loss_grad_errors(stock, ref, boundaries)
    except Exception:  # noqa: BLE001 - stock refuses seq_idx / cu_seq_lens on the torch path
        return
    assert base["grad_rel"] > STOCK_BROKEN, (family, "stock", base)


def test_packed_grads_with_gradient_checkpointing(models):
    """Checkpointed layers re-run the mixers during backward, outside the model call: boundaries must hold."""
    family, stock, ref, _ = models
    model = wrap(copy.deepcopy(stock), backend="torch")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    mixer = wrapped_modules(model)[0][1]
    calls = []
    handle = mixer.register_forward_pre_hook(lambda mod, args: calls.append(torch.is_grad_enabled()))
    try:
        got = packed_loss_grad_errors(model, ref, "seq_idx")
    finally:
        handle.remove()
    assert len(calls) >= 2, "the checkpointed mixer was not recomputed during backward"
    assert got["loss_rel"] <= GRAD_RTOL and got["grad_rel"] <= GRAD_RTOL, (family, got)


@pytest.mark.filterwarnings("ignore::FutureWarning")
@torch.no_grad()
def test_lora_on_every_mixer_projection_stays_active(models):
    """LoRA on each mixer projection: the wrapped model with adapters == the stock model with the same
    adapters on each row alone (padded batch), and the adapters change the output (so none is bypassed)."""
    peft = pytest.importorskip("peft")
    family, stock, _, _ = models
    mixer_names = {n for n, m in stock.named_modules() if type(m).__name__ == MIXER_CLASS[family]}
    targets = sorted(
        f"{mn}.{sn}" for mn in mixer_names for sn, s in stock.get_submodule(mn).named_modules() if isinstance(s, nn.Linear)
    )
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    torch.manual_seed(0)
    lora_ref = peft.get_peft_model(copy.deepcopy(stock), config).eval()
    lora_wrapped = wrap(copy.deepcopy(lora_ref), backend="torch")
    seqs = [_ids(n, 50 + n) for n in (10, 6)]
    ids = torch.zeros(2, 10, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, q in enumerate(seqs):
        ids[r, : len(q)], mask[r, : len(q)] = q, 1
    out = lora_wrapped(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
    for r, q in enumerate(seqs):
        alone = lora_ref(input_ids=q[None], use_cache=False).logits[0].float()
        torch.testing.assert_close(out[r, : len(q)], alone, rtol=0, atol=TOL)
        with lora_ref.disable_adapter():
            base = lora_ref(input_ids=q[None], use_cache=False).logits[0].float()
        assert (base - alone).abs().max() > STOCK_BROKEN  # the adapters matter


# ------------------------------------------------------------------------------------------------------------
# clear errors
# ------------------------------------------------------------------------------------------------------------


def _packed_row():
    lens = [5, 7, 4]
    ids = torch.cat([_ids(n, 40 + i) for i, n in enumerate(lens)])[None]
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    seq_idx = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lens)])[None]
    cu = torch.tensor([0, 5, 12, 16], dtype=torch.int32)
    return ids, pos, seq_idx, cu


@pytest.mark.parametrize(
    "how",
    [
        pytest.param("position_ids+use_cache", id="position_ids-use_cache"),
        pytest.param("seq_idx+use_cache", id="seq_idx-use_cache"),
        pytest.param("position_ids+past_key_values", id="position_ids-explicit-cache"),
    ],
)
@torch.no_grad()
def test_packed_with_explicit_cache_raises(models, how):
    from transformers import DynamicCache

    _, stock, _, wrapped = models
    ids, pos, seq_idx, _ = _packed_row()
    kw = {"position_ids": pos} if how.startswith("position_ids") else {"seq_idx": seq_idx, "position_ids": pos}
    if how.endswith("past_key_values"):
        kw.update({cache_argument(wrapped): DynamicCache(config=wrapped.config)}, use_cache=True)
    else:
        kw["use_cache"] = True
    with pytest.raises(ValueError, match="cache"):
        wrapped(input_ids=ids, **kw)
    if how == "position_ids+use_cache":  # stock silently caches a state mixing three sequences
        assert output_cache(stock(input_ids=ids, **kw)) is not None


@torch.no_grad()
def test_packed_with_all_ones_attention_mask():
    """An all-ones mask must not hide the packing from the attention layers (transformers reads packed
    position_ids only when no 2-D mask is given)."""
    stock = tiny_model("qwen3_next")
    wrapped = wrap(copy.deepcopy(stock), backend="torch")
    ids, pos, _, _ = _packed_row()
    alone = torch.cat([_alone(stock, s) for s in torch.split(ids[0], [5, 7, 4])])
    out = wrapped(input_ids=ids, position_ids=pos, attention_mask=torch.ones_like(ids), use_cache=False)
    assert (out.logits[0].float() - alone).abs().max() <= TOL
    leaky = stock(input_ids=ids, position_ids=pos, attention_mask=torch.ones_like(ids), use_cache=False)
    assert (leaky.logits[0].float() - alone).abs().max() > 1e-3


@torch.no_grad()
def test_packed_without_cache_request_skips_config_cache(models):
    _, _, _, wrapped = models
    ids, pos, _, _ = _packed_row()
    out = wrapped(input_ids=ids, position_ids=pos)  # config.use_cache is True: no cache may be built
    assert output_cache(out) is None


@pytest.mark.parametrize(
    "kwargs,match",
    [
        pytest.param({"seq_idx": torch.tensor([[0, 0, 1, 1, 0, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2]], dtype=torch.int32)}, "seq_idx", id="decreasing-seq_idx"),
        pytest.param({"seq_idx": torch.zeros(1, 15, dtype=torch.int32)}, "seq_idx", id="seq_idx-wrong-shape"),
        pytest.param({"cu_seq_lens_q": torch.tensor([0, 5, 12, 15], dtype=torch.int32)}, "cu_seq_lens", id="cu-not-ending-at-T"),
        pytest.param({"cu_seq_lens_q": torch.tensor([0, 7, 5, 16], dtype=torch.int32)}, "cu_seq_lens", id="cu-decreasing"),
        pytest.param(
            {"cu_seq_lens_q": torch.tensor([0, 5, 16], dtype=torch.int32), "cu_seq_lens_k": torch.tensor([0, 7, 16], dtype=torch.int32)},
            "cu_seq_lens",
            id="cu-q-k-differ",
        ),
    ],
)
@torch.no_grad()
def test_bad_boundaries_raise(models, kwargs, match):
    _, _, _, wrapped = models
    ids, _, _, _ = _packed_row()
    with pytest.raises(ValueError, match=match):
        wrapped(input_ids=ids, use_cache=False, **kwargs)


# ------------------------------------------------------------------------------------------------------------
# sibling families served by the same specs (tiny configs built here: safepad.testing.tiny does not list them)
# ------------------------------------------------------------------------------------------------------------

_SMALL = {"vocab_size": 256, "hidden_size": 64, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
_SMALL_ATTN = {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "num_hidden_layers": 2}
_SMALL_GDN = {
    "layer_types": ["linear_attention", "full_attention"],
    "head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}
_SMALL_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
SIBLINGS = {
    "qwen3_5_text": {**_SMALL_GDN},
    "qwen3_5_moe_text": {**_SMALL_GDN, **_SMALL_MOE, "shared_expert_intermediate_size": 32},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], **_SMALL_MOE, "num_dense_layers": 1},
}


@pytest.fixture(scope="module", params=sorted(SIBLINGS))
def sibling_models(request):
    from transformers import AutoConfig, AutoModelForCausalLM

    from safepad.testing.tiny import strengthen_mixers

    config = AutoConfig.for_model(request.param, **_SMALL, **_SMALL_ATTN, **SIBLINGS[request.param])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        stock = strengthen_mixers(AutoModelForCausalLM.from_config(config)).eval()
    return request.param, stock, copy.deepcopy(stock), wrap(copy.deepcopy(stock), backend="torch")


@pytest.mark.parametrize("scenario", ["packed_position_ids", "right_pad_decode", "chunked_prefill_pad"])
def test_sibling_family_scenarios(sibling_models, scenario):
    family, stock, ref, wrapped = sibling_models
    assert wrapped_modules(wrapped), family
    got = run_scenario(wrapped, ref, scenario)
    assert got.passed, (family, scenario, got.to_dict())
    base = run_scenario(stock, ref, scenario)
    assert _stock_fails(base.max_error, base.error), (family, scenario, base.max_error)


def test_sibling_family_packed_grads(sibling_models):
    family, stock, ref, wrapped = sibling_models
    got = packed_loss_grad_errors(wrapped, ref, "position_ids")
    assert got["loss_rel"] <= GRAD_RTOL and got["grad_rel"] <= GRAD_RTOL, (family, got)
    base = packed_loss_grad_errors(stock, ref, "position_ids")
    assert base["grad_rel"] > STOCK_BROKEN, (family, "stock", base)
