"""safepad.guard on a plain inference loop: detection of each layout, the three modes, stats, cost paths.

Every detection test first runs the same inputs through the stock (unguarded) model and asserts that it
raises and warns nothing by itself, so the test fails without the guard.
"""

from __future__ import annotations

import copy
import importlib.util
import itertools
import warnings

import pytest
import torch
from torch import nn
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    NemotronHConfig,
    NemotronHForCausalLM,
)

from safepad.errors import PaddingError, PaddingWarning
from safepad.testing.tiny import tiny_model
from safepad.guard import (
    KIND_HOLES,
    KIND_PACKED,
    KIND_RIGHT_PADDING,
    find_ssm_layers,
    get_guard,
    guard,
)

HAS_WRAP = importlib.util.find_spec("safepad.wrap") is not None
needs_wrap = pytest.mark.skipif(not HAS_WRAP, reason="safepad.wrap is not importable yet (lead's safepad/wrap.py)")


def tiny_nemotron_h(seed: int = 0, strong: bool = False) -> NemotronHForCausalLM:
    """Nemotron-H, hidden 64 / vocab 256, layers mamba-attention-mamba-mlp, eval mode, fp32."""
    cfg = NemotronHConfig(
        vocab_size=256, hidden_size=64, layers_block_type=["mamba", "attention", "mamba", "mlp"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
        mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=16,
        pad_token_id=0, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = NemotronHForCausalLM(cfg).eval()
    if strong:  # make the mixers visible next to the residual (a random init hides the bugs under 1e-4)
        _strengthen(model)
    return model


def tiny_mamba2(seed: int = 0, strong: bool = False):
    """Mamba2 (whose CausalLM drops ``**kwargs`` before the mixers), hidden 64 / vocab 256, 2 layers."""
    from transformers import Mamba2Config, Mamba2ForCausalLM

    cfg = Mamba2Config(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16, expand=2,
                       n_groups=2, state_size=16, chunk_size=16, pad_token_id=0, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(seed)
    model = Mamba2ForCausalLM(cfg).eval()
    if strong:
        _strengthen(model)
    return model


def _strengthen(model: nn.Module) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mixer." in name and p.dim() >= 2 and ("proj" in name or "conv1d" in name):
                p.normal_(0.0, 0.5 if "conv1d" in name else 0.3)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and 2 threads per xdist worker on 2 cores thrash."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model() -> NemotronHForCausalLM:
    return tiny_nemotron_h()


def _batch(B: int = 3, T: int = 10, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (B, T), generator=g)


def right_padded(B: int = 3, T: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = _batch(B, T), torch.ones(B, T, dtype=torch.long)
    mask[0, -3:] = 0  # row 0: 3 trailing pads
    mask[2, -1:] = 0
    ids[mask == 0] = 0
    return ids, mask


def left_padded(B: int = 3, T: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = _batch(B, T), torch.ones(B, T, dtype=torch.long)
    mask[0, :3] = 0
    mask[2, :1] = 0
    ids[mask == 0] = 0
    return ids, mask


def packed_kwargs(seq_idx: bool = True, cu: bool = True) -> dict:
    lens = [4, 3, 5]
    T = sum(lens)
    pos = torch.cat([torch.arange(n) for n in lens])[None]  # [1, T]
    out = {"input_ids": _batch(1, T), "position_ids": pos}
    if cu:
        cu_lens = torch.tensor([0, 4, 7, 12], dtype=torch.int32)
        out.update(cu_seq_lens_q=cu_lens, cu_seq_lens_k=cu_lens, max_length_q=5, max_length_k=5)
    if seq_idx:
        out["seq_idx"] = torch.tensor([[0] * 4 + [1] * 3 + [2] * 5], dtype=torch.int32)
    return out


def holes() -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = _batch(2, 10), torch.ones(2, 10, dtype=torch.long)
    mask[1, 4:6] = 0
    return ids, mask


def run_stock(model: nn.Module, **kwargs) -> list[warnings.WarningMessage]:
    """Run the unguarded model; return what it warned. Raises whatever the stock model raises."""
    assert get_guard(model) is None
    with warnings.catch_warnings(record=True) as rec, torch.no_grad():
        warnings.simplefilter("always")
        model(**kwargs)
    return [w for w in rec if issubclass(w.category, PaddingWarning)]


# --------------------------------------------------------------------------------------- detection
DETECTIONS = [
    pytest.param(lambda: dict(zip(("input_ids", "attention_mask"), right_padded()), use_cache=True),
                 KIND_RIGHT_PADDING, id="right-pad-use_cache"),
    pytest.param(lambda: dict(zip(("input_ids", "attention_mask"), right_padded())),
                 KIND_RIGHT_PADDING, id="right-pad-config-default-eval"),
    pytest.param(lambda: packed_kwargs(seq_idx=False, cu=False), KIND_PACKED, id="packed-position_ids"),
    pytest.param(lambda: packed_kwargs(seq_idx=False, cu=True), KIND_PACKED, id="packed-cu_seq_lens"),
    pytest.param(lambda: dict(zip(("input_ids", "attention_mask"), holes()), use_cache=False),
                 KIND_HOLES, id="mask-holes"),
]  # fmt: skip


@pytest.mark.parametrize("make, kind", DETECTIONS)
def test_error_mode_raises_where_stock_is_silent(model, make, kind):
    assert run_stock(model, **make()) == []  # the stock model raises and warns nothing by itself
    with guard(model, "error"), pytest.raises(PaddingError) as exc, torch.no_grad():
        model(**make())
    assert kind in exc.value.kinds
    msg = str(exc.value)
    assert "nemotron_h" in msg and "NemotronHMamba2Mixer" in msg and "safepad.wrap" in msg
    assert get_guard(model) is None  # the context manager removed it


def test_right_padding_message_names_row_pads_and_fixes(model):
    ids, mask = right_padded()
    with guard(model, "error"), pytest.raises(PaddingError, match=r"row 0 of attention_mask ends in 3 padding") as e:
        model(input_ids=ids, attention_mask=mask, use_cache=True)
    msg = str(e.value)
    assert "2 of 3 rows" in msg and "pad on the left" in msg and "use_cache=True" in msg


def test_packed_seq_idx_collator_batch_raises_padding_error(model):
    # The stock torch path refuses seq_idx with a generic ValueError; the guard raises the explicit one first.
    with pytest.raises(ValueError) as stock:
        run_stock(model, **packed_kwargs())
    assert not isinstance(stock.value, PaddingError)
    with guard(model, "error"), pytest.raises(PaddingError, match=r"row 0 holds 3 sequences") as exc:
        model(**packed_kwargs())
    assert exc.value.kinds == (KIND_PACKED,)


SILENT = [
    pytest.param(lambda: dict(zip(("input_ids", "attention_mask"), left_padded()), use_cache=True), id="left-pad-cache"),
    pytest.param(lambda: dict(zip(("input_ids", "attention_mask"), right_padded()), use_cache=False),
                 id="right-pad-no-cache"),
    pytest.param(lambda: {"input_ids": _batch(), "position_ids": torch.arange(10)[None].expand(3, 10)}, id="arange-pos"),
    pytest.param(lambda: {"input_ids": _batch(), "position_ids": torch.arange(10)[None].expand(3, 10).clone(),
                          "attention_mask": left_padded()[1], "use_cache": True},
                 id="left-pad-generate-style-positions"),
    pytest.param(lambda: {**packed_kwargs(seq_idx=False, cu=False), "input_ids": _batch(1, 12)[:, :4],
                          "position_ids": torch.arange(4)[None]}, id="single-sequence"),
]  # fmt: skip


@pytest.mark.parametrize("make", SILENT)
def test_safe_layouts_stay_silent(model, make):
    with guard(model, "error") as handle, torch.no_grad():
        model(**make())
    assert handle.detections == {}


def test_generate_position_ids_with_left_padding_are_not_packing(model):
    ids, mask = left_padded()
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # what generate() passes: a 0 inside the padded row
    assert bool((pos[:, 1:] == 0).any())
    with guard(model, "error"), torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)


def test_left_padded_generate_is_silent_right_padded_generate_warns(model):
    ids, mask = left_padded()
    with guard(model, "error"):
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert out.shape == (3, 14)
    ids, mask = right_padded()
    with warnings.catch_warnings(record=True) as stock:
        warnings.simplefilter("always")
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    assert not [w for w in stock if issubclass(w.category, PaddingWarning)]
    with guard(model, "error"), pytest.raises(PaddingError, match="ends in 3 padding"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False)


def test_warn_mode_warns_once_per_kind_and_logs_each(model, caplog):
    ids, mask = right_padded()
    hids, hmask = holes()
    with guard(model, "warn") as handle, warnings.catch_warnings(record=True) as rec, torch.no_grad():
        warnings.simplefilter("always")
        with caplog.at_level("WARNING", logger="safepad.guard"):
            for _ in range(3):
                model(input_ids=ids, attention_mask=mask, use_cache=True)
                model(**packed_kwargs(seq_idx=False))
                model(input_ids=hids, attention_mask=hmask, use_cache=False)
    kinds = sorted(w.message.kind for w in rec if issubclass(w.category, PaddingWarning))
    assert kinds == sorted([KIND_RIGHT_PADDING, KIND_PACKED, KIND_HOLES])
    assert handle.detections == {KIND_RIGHT_PADDING: 3, KIND_PACKED: 3, KIND_HOLES: 3}
    assert sum("safepad guard" in r.getMessage() for r in caplog.records) == 9


def test_training_mode_default_cache_is_counted_not_reported(model):
    ids, mask = right_padded()
    model.train()
    try:
        with guard(model, "error") as handle:
            model(input_ids=ids, attention_mask=mask)  # cache only from config.use_cache: the Trainer drops it
            stats = handle.pop_stats(training=True)
            with pytest.raises(PaddingError):
                model(input_ids=ids, attention_mask=mask, use_cache=True)
    finally:
        model.eval()
    assert stats["safepad/right_padded_default_cache"] == 1.0


def test_positional_arguments_are_read(model):
    ids, mask = right_padded()
    # NemotronHForCausalLM.forward(input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, labels,
    # use_cache)
    with guard(model, "error"), pytest.raises(PaddingError), torch.no_grad():
        model(ids, mask, None, None, None, None, True)


def test_stats_on_plain_inference_loop(model):
    ids, mask = right_padded()
    with guard(model, "warn") as handle, torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=False)  # 4 pads of 30 slots, 3 rows
        with pytest.warns(PaddingWarning, match="packed inputs"):
            model(**packed_kwargs(seq_idx=False))  # 12 tokens, 3 sequences
        stats = handle.pop_stats(training=False)
        assert handle.stats(training=False) == {}
    assert stats["safepad/pad_fraction"] == pytest.approx(4 / 42)
    assert stats["safepad/tokens_per_batch"] == pytest.approx((26 + 12) / 2)
    assert stats["safepad/sequences_per_batch"] == pytest.approx((3 + 3) / 2)


# --------------------------------------------------------------------------------------- handle / validation
def test_remove_detaches_and_validation(model):
    handle = guard(model, "error")
    with pytest.raises(ValueError, match="already has an active safepad guard"):
        guard(model, "warn")
    handle.remove()
    handle.remove()
    assert not handle.active and get_guard(model) is None
    ids, mask = right_padded()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=True)  # no guard any more: no error
    with pytest.raises(ValueError, match="mode must be one of"):
        guard(model, "strict")
    with pytest.raises(ValueError, match="model must be a torch.nn.Module"):
        guard("model")


def test_non_ssm_model_is_never_reported():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, pad_token_id=0)  # fmt: skip
    llama = LlamaForCausalLM(cfg).eval()
    assert find_ssm_layers(llama) is None
    ids, mask = right_padded()
    with guard(llama, "error") as handle, torch.no_grad():
        llama(input_ids=ids, attention_mask=mask, use_cache=True)
        llama(**packed_kwargs(seq_idx=False))
    assert handle.detections == {}
    assert handle.stats(training=False)["safepad/tokens_per_batch"] == pytest.approx((26 + 12) / 2)


class ToyConfig:
    model_type = "toy_ssm"
    use_cache = True


class ToyShortConvMixer(nn.Module):
    """An SSM-ish mixer from a family safepad knows nothing about."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.conv1d = nn.Conv1d(d, d, 4, groups=d, padding=3)

    def forward(self, x):  # x: [B, T, D]
        return self.conv1d(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)  # [B, T, D]


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = ToyConfig()
        self.embed = nn.Embedding(256, 8)
        self.mixer = ToyShortConvMixer()

    def forward(self, input_ids, attention_mask=None, use_cache=None, **kwargs):
        return self.mixer(self.embed(input_ids))


def test_unknown_family_is_detected_and_reported():
    toy = ToyModel().eval()
    info = find_ssm_layers(toy)
    assert info is not None and info.mixer_classes == ("ToyShortConvMixer",)
    ids, mask = right_padded()
    with guard(toy, "error"), pytest.raises(PaddingError, match="toy_ssm .*ToyShortConvMixer"):
        toy(ids, mask)
    with guard(toy, "warn"), pytest.warns(PaddingWarning, match="packed inputs"):
        toy(**packed_kwargs(seq_idx=False, cu=False))


def test_find_ssm_layers_on_other_families():
    from transformers import MambaConfig, MambaForCausalLM

    mamba = MambaForCausalLM(MambaConfig(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=2))
    info = find_ssm_layers(mamba)
    assert info is not None and info.mixer_classes == ("MambaMixer",) and info.num_layers == 2
    info = find_ssm_layers(tiny_nemotron_h())
    assert info.describe() == "nemotron_h (2 NemotronHMamba2Mixer layers)"


# --------------------------------------------------------------------------------------- wrap interplay
@needs_wrap
def test_wrapped_model_is_silent_and_keeps_stats():
    from safepad.wrap import is_wrapped, wrap

    model = tiny_nemotron_h()
    wrap(model)
    assert is_wrapped(model)
    ids, mask = right_padded()
    with guard(model, "error") as handle, torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=True)
        model(**packed_kwargs(seq_idx=False))
    assert handle.detections == {}
    assert handle.stats(training=False)["safepad/sequences_per_batch"] == pytest.approx(3.0)


def _per_row_reference(model, ids, mask):
    """Logits after each row's greedy next token, from cache-free runs of the row alone without pads.

    Cache-free on purpose: the stock Nemotron-H single-token decode skips the dt clamp, so it is no oracle.
    """
    outs = []
    for row in range(ids.shape[0]):
        real = ids[row][mask[row].bool()][None]  # [1, n]
        nxt = model(input_ids=real, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
        full = model(input_ids=torch.cat([real, nxt], 1), use_cache=False)  # [1, n + 1, V]
        outs.append(full.logits[0, -1])
    return torch.stack(outs)  # [B, V]


def _right_padded_decode(model, ids, mask):
    out = model(input_ids=ids, attention_mask=mask, use_cache=True)
    last = mask.sum(1) - 1  # [B]
    nxt = out.logits[torch.arange(ids.shape[0]), last].argmax(-1)[:, None]  # [B, 1]
    mask2 = torch.cat([mask, torch.ones_like(nxt)], 1)  # [B, T + 1]
    from safepad.cache import cache_argument, output_cache

    cache_kw = {cache_argument(model): output_cache(out)}  # `cache` on 5.24, `past_key_values` on 5.23
    step = model(input_ids=nxt, attention_mask=mask2, use_cache=True, **cache_kw)
    return step.logits[:, -1]  # [B, V]


@needs_wrap
@torch.no_grad()
def test_fix_mode_wraps_before_the_forward_and_outputs_are_correct():
    from safepad.wrap import is_wrapped

    model = tiny_nemotron_h(strong=True)
    stock = copy.deepcopy(model)
    ids, mask = right_padded()
    ref = _per_row_reference(stock, ids, mask)
    assert (_right_padded_decode(stock, ids, mask) - ref).abs().max() > 1e-2  # the stock model is wrong
    with guard(model, "fix") as handle:
        got = _right_padded_decode(model, ids, mask)
    assert is_wrapped(model) and handle.detections.get(KIND_RIGHT_PADDING) == 1
    torch.testing.assert_close(got, ref, atol=1e-3, rtol=1e-3)


@needs_wrap
@pytest.mark.parametrize("build", [pytest.param(tiny_nemotron_h, id="nemotron_h"),
                                   pytest.param(tiny_mamba2, id="mamba2-drops-kwargs")])  # fmt: skip
@torch.no_grad()
def test_fix_mode_packed_matches_per_sequence(build):
    # the very first call must already be right: the guard runs the pre-hooks wrap adds to the model
    model = build(strong=True)
    stock = copy.deepcopy(model)
    kw = packed_kwargs(seq_idx=False, cu=False)
    ids, bounds = kw["input_ids"], [0, 4, 7, 12]
    ref = torch.cat([stock(input_ids=ids[:, a:b]).logits for a, b in itertools.pairwise(bounds)], 1)  # [1, T, V]
    assert (stock(**kw).logits - ref).abs().max() > 1e-2
    with guard(model, "fix"):
        got = model(**kw).logits
    torch.testing.assert_close(got, ref, atol=1e-3, rtol=1e-3)


def _count_host_reads(monkeypatch) -> dict[str, int]:
    """Count every Tensor -> host read (.tolist / .item / bool / int / float) from now on."""
    counts: dict[str, int] = {}
    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _original=original, _name=name, **k):
            counts[_name] = counts.get(_name, 0) + 1
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return counts


@pytest.mark.parametrize("make", [
    pytest.param(lambda: dict(zip(("input_ids", "attention_mask"), right_padded()), use_cache=False), id="padded"),
    pytest.param(lambda: {"input_ids": _batch(), "position_ids": torch.arange(10)[None].expand(3, 10)}, id="ids"),
    pytest.param(lambda: {"input_ids": _batch(1, 12), "seq_idx": torch.zeros(1, 12, dtype=torch.int32),
                          "cu_seq_lens_q": torch.tensor([0, 12], dtype=torch.int32)}, id="one-sequence-varlen"),
])  # fmt: skip
def test_one_host_read_per_forward_and_none_without_checks(model, monkeypatch, make):
    kwargs = make()
    with guard(model, "error") as handle:
        counts = _count_host_reads(monkeypatch)
        handle._pre_forward(model, (), kwargs)
        assert counts == {"tolist": 1}  # the one sync of an unwrapped SSM on a safe layout
        handle.info = None  # stats only (what a wrapped or a non-SSM model gets): nothing is read back
        counts.clear()
        handle._pre_forward(model, (), kwargs)
        assert counts == {}
        monkeypatch.undo()
        assert handle.stats(training=False)["safepad/tokens_per_batch"] > 0


class PlainModel(nn.Module):
    """No recognisable mixer class, no layer_types, unknown model_type: only the cache gives the SSM away."""

    def __init__(self) -> None:
        super().__init__()
        self.config = type("Cfg", (), {"model_type": "opaque", "use_cache": False})()
        self.embed = nn.Embedding(256, 8)

    def forward(self, input_ids, attention_mask=None, past_key_values=None, **kwargs):
        return self.embed(input_ids)


def test_recurrent_cache_layers_reveal_an_undetected_ssm():
    from transformers import DynamicCache

    opaque = PlainModel()
    assert find_ssm_layers(opaque) is None
    ids, mask = right_padded()
    cache = DynamicCache(config=tiny_nemotron_h().config)  # holds LinearAttentionLayer layers
    opaque(ids, mask, past_key_values=cache)  # stock: silent
    with guard(opaque, "error"):
        opaque(ids, mask, past_key_values=DynamicCache())  # attention-only cache: nothing to report
        with pytest.raises(PaddingError, match="opaque"):
            opaque(ids, mask, past_key_values=cache)


# --- issue 17: packed position_ids followed by trailing pads ([A(6), B(9), 3 pads], mask 15 ones + 3 zeros)


def _packed_then_pads():
    ids = torch.randint(3, 250, (1, 18), generator=torch.Generator().manual_seed(11))
    pos = torch.cat([torch.arange(6), torch.arange(9), torch.zeros(3, dtype=torch.long)])[None]  # [1, 18]
    mask = torch.cat([torch.ones(15, dtype=torch.long), torch.zeros(3, dtype=torch.long)])[None]  # [1, 18]
    return ids, pos, mask


@pytest.mark.parametrize("family", ["nemotron_h", "mamba2"])
def test_guard_error_mode_catches_packed_position_ids_with_trailing_pads(family):
    stock = tiny_model(family)
    ids, pos, mask = _packed_then_pads()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stock(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)  # stock: silent
    with guard(stock, mode="error"), pytest.raises(PaddingError, match="packed"):
        stock(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)


def test_guard_stays_silent_on_generate_style_left_padding():
    stock = tiny_nemotron_h()
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with guard(stock, mode="error"):
        stock(input_ids=torch.randint(3, 200, (2, 5)), attention_mask=mask, position_ids=pos, use_cache=False)


def test_guard_reports_right_padded_generate_on_the_stock_model():
    """generate() on a right-padded batch: the guard (error mode) stops it on the stock model."""
    stock = tiny_model("nemotron_h")
    ids = torch.randint(3, 250, (2, 6), generator=torch.Generator().manual_seed(4))
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    with guard(stock, mode="error"), pytest.raises(PaddingError, match="padding token"):
        stock.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
