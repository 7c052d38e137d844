"""The scenario engine reproduces the measured stock findings, can fail, and passes correct models.

Stock findings: /work/shared/reference/stock-transformers-5.23.md (OK <= 1e-3 < BROKEN). transformers 5.25 changed
two of them: Nemotron-H's default ``time_step_limit`` lost its floor (``time_step_min``), so its decode no longer
departs from its full forward by default, and an SSD scan handed ``seq_idx`` without mamba-ssm raises instead of
dropping it.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import transformers
from torch import nn

from safepad.cache import output_cache
from safepad.testing import (
    SCENARIOS,
    ScenarioResult,
    audit,
    cache_states,
    packed_loss_grad_errors,
    pad_sweep,
    run_matrix,
    run_scenario,
    tiny_model,
)
from safepad.testing.scenarios import ROUNDING_FACTOR

OK, BROKEN = 1e-3, 1e-3
_TF525 = tuple(int(p) for p in transformers.__version__.split(".")[:2]) >= (5, 25)


@pytest.fixture(scope="module")
def models():
    """family -> (stock model, stock reference copy), built once per module."""
    cache: dict[str, tuple[nn.Module, nn.Module]] = {}

    def get(family: str) -> tuple[nn.Module, nn.Module]:
        if family not in cache:
            model = tiny_model(family)
            cache[family] = (model, copy.deepcopy(model))
        return cache[family]

    return get


# (family, scenario, expected): "ok" max|Δ logits| <= 1e-3, "broken" > 1e-3, "n/a", or an exception type name.
STOCK_FINDINGS = [
    pytest.param("nemotron_h", "right_pad_decode", "broken", id="nemotron_h-right_pad-broken"),
    pytest.param("mamba2", "left_pad_decode", "ok", id="mamba2-left_pad-ok"),
    pytest.param("bamba", "left_pad_decode", "ok", id="bamba-left_pad-ok"),
    pytest.param("mamba", "chunked_prefill", "broken", id="mamba-chunked-broken"),
    pytest.param("jamba", "chunked_prefill", "broken", id="jamba-chunked-broken"),
    pytest.param("mamba2", "chunked_prefill", "ok", id="mamba2-chunked-ok"),
    pytest.param("nemotron_h", "chunked_prefill", "ok", id="nemotron_h-chunked-ok"),
    pytest.param("nemotron_h", "decode_default", "ok" if _TF525 else "broken", id="nemotron_h-decode_default"),
    pytest.param("bamba", "decode_default", "ok", id="bamba-decode_default-ok"),
    pytest.param("bamba", "decode_dt_min", "broken", id="bamba-dt_min-broken"),
    pytest.param("granitemoehybrid", "decode_dt_max", "broken", id="granite-dt_max-broken"),
    pytest.param("jamba", "decode_dt_min", "n/a", id="jamba-dt_min-na"),
    pytest.param("nemotron_h", "packed_seq_idx", "ValueError", id="nemotron_h-seq_idx-raises"),
    pytest.param("mamba2", "packed_seq_idx", "ValueError" if _TF525 else "broken", id="mamba2-seq_idx"),
    pytest.param("qwen3_next", "packed_cu_seq_lens", "ValueError", id="qwen3_next-cu_seq_lens-raises"),
    pytest.param("kimi_linear", "packed_position_ids", "broken", id="kimi-position_ids-broken"),
    pytest.param("falcon_mamba", "chunked_prefill_pad", "RuntimeError", id="falcon_mamba-full-mask-chunk-raises"),
    pytest.param("olmo_hybrid", "generate", "ok", id="olmo_hybrid-generate-ok"),
]


@pytest.mark.parametrize("family,scenario,expected", STOCK_FINDINGS)
def test_engine_reproduces_stock_findings(models, family, scenario, expected):
    model, reference = models(family)
    res = run_scenario(model, reference, scenario)
    if expected == "n/a":
        assert not res.applicable and res.passed is None and res.status == "n/a"
    elif expected in ("ok", "broken"):
        assert res.error is None, res.error
        if expected == "ok":
            assert res.max_abs_logits <= OK
        else:
            assert res.max_abs_logits > BROKEN and res.passed is False and res.status == "FAIL"
    else:
        assert res.error is not None and res.error.startswith(expected + ":"), res.error
        assert res.passed is False and res.status == "raises"


@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_next", "lfm2", "mamba"])
def test_right_padding_corrupts_cached_states_left_padding_does_not(models, family):
    model, reference = models(family)
    right = run_scenario(model, reference, "right_pad_decode")
    left = run_scenario(model, reference, "left_pad_decode")
    assert right.details["prefill_logits"] < 1e-4 and left.details["prefill_logits"] < 1e-4
    assert right.max_state_error_of("conv") > 1e-2
    assert all(err <= 1e-4 * max(1.0, left.state_scales[k]) for k, err in left.state_errors.items())
    if family == "lfm2":  # a short conv only: no recurrent state
        assert right.max_state_error_of("recurrent") is None
    else:
        assert right.max_state_error_of("recurrent") > 1e-2


def test_nemotron_left_pad_is_right_but_its_decode_ignores_the_dt_floor(models):
    """The reference decodes by full forwards, so the stock dt-clamp bug shows in every decode scenario (from 5.25
    on, only with a floor in ``time_step_limit``, which the default no longer has)."""
    if _TF525:
        model = tiny_model("nemotron_h", time_step_limit=(0.001, float("inf")))
        reference = copy.deepcopy(model)
    else:
        model, reference = models("nemotron_h")
    res = run_scenario(model, reference, "left_pad_decode")
    assert res.details["prefill_logits"] < 1e-4
    assert res.details["decode_logits"] > 1e-3
    gen = run_scenario(model, reference, "generate")
    assert gen.max_abs_logits > 1e-3


def test_every_scenario_can_fail(models):
    """Perturb the model under test: every applicable scenario must notice."""
    _, reference = models("bamba")
    perturbed = copy.deepcopy(reference)
    with torch.no_grad():
        perturbed.lm_head.weight.add_(1e-2 * torch.randn_like(perturbed.lm_head.weight))
    for res in run_matrix(perturbed, reference):
        if res.applicable and res.error is None:
            assert res.passed is False, res.name
            assert res.max_abs_logits > 1e-3, res.name


def test_identical_copy_passes_where_stock_is_right(models):
    model, reference = models("mamba2")
    names = ["left_pad_decode", "chunked_prefill", "decode_default", "generate"]
    results = run_matrix(model, reference, names)
    assert [r.name for r in results] == names
    assert all(r.passed for r in results), [(r.name, r.max_error) for r in results]
    assert all(r.seconds < 5 for r in results)


def test_dt_limit_is_restored_after_the_scenario(models):
    model, reference = models("zamba2")
    mixers = [m for m in model.modules() if hasattr(m, "time_step_limit")]
    before = [m.time_step_limit for m in mixers]
    res = run_scenario(model, reference, "decode_dt_max")
    assert res.applicable and res.max_abs_logits > BROKEN
    assert [m.time_step_limit for m in mixers] == before


def test_reference_memo_notices_in_place_weight_changes(models):
    _, reference = models("mamba2")
    model = copy.deepcopy(reference)
    assert run_scenario(model, reference, "left_pad_decode").passed
    with torch.no_grad():
        model.lm_head.weight.mul_(1.01)  # tied: the reference's logits would change too...
        reference.lm_head.weight.mul_(1.01)  # ...so change both; a stale memo would make this fail
    assert run_scenario(model, reference, "left_pad_decode").passed
    with torch.no_grad():
        model.lm_head.weight.div_(1.01)
        reference.lm_head.weight.div_(1.01)


def test_cache_states_cover_every_layer_kind(models):
    for family, expected in [
        ("zamba2", {"layer0.conv", "layer0.recurrent", "layer1.conv", "layer1.recurrent", "layer2.conv"}),
        ("jamba", {"layer0.conv", "layer0.recurrent"}),
        ("lfm2", {"layer0.conv"}),
    ]:
        model, _ = models(family)
        with torch.no_grad():
            out = model(torch.randint(3, 256, (2, 9)), use_cache=True)
        states = cache_states(output_cache(out))
        assert expected <= set(states), (family, sorted(states))
        assert all(t.shape[0] == 2 for t in states.values())


def test_result_semantics():
    assert ScenarioResult("x", applicable=False).passed is None
    assert ScenarioResult("x", error="ValueError: no").passed is False
    assert ScenarioResult("x", max_abs_logits=float("nan")).passed is False
    assert ScenarioResult("x", max_abs_logits=1e-5).passed is True
    assert ScenarioResult("x", max_abs_logits=1e-5, mismatched_tokens=1).passed is False
    # state errors are judged relative to the state's scale
    big = ScenarioResult(
        "x", max_abs_logits=0.0, state_errors={"layer0.recurrent": 1e-1}, state_scales={"layer0.recurrent": 100.0}
    )
    assert big.passed is False  # 1e-1 > 1e-4 * 100
    big.state_scales["layer0.recurrent"] = 1e4
    assert big.passed is True  # 1e-1 <= 1e-4 * 1e4
    assert big.max_state_error_of("conv") is None and big.max_state_error_of("recurrent") == 1e-1
    assert big.to_dict()["status"] == "ok"


def test_run_scenario_validates(models):
    model, reference = models("mamba2")
    with pytest.raises(ValueError, match="unknown scenario"):
        run_scenario(model, reference, "right_pad")
    with pytest.raises(ValueError, match="reference_model"):
        run_scenario(model, model, "generate")
    assert len(SCENARIOS) == len(set(SCENARIOS)) == 11


@pytest.mark.parametrize("boundaries", ["position_ids", "cu_seq_lens"])
def test_packed_loss_and_grads(models, boundaries):
    model, reference = models("mamba2")
    stock = packed_loss_grad_errors(model, reference, boundaries)
    assert stock["loss_rel"] > 1e-4 and stock["grad_rel"] > 1e-2
    single = packed_loss_grad_errors(model, reference, boundaries, lengths=(20,))
    assert single["loss"] < 1e-3 and single["grad_rel"] < 1e-4
    assert all(p.grad is None for p in model.parameters())


def test_packed_loss_validates(models):
    model, reference = models("mamba2")
    with pytest.raises(ValueError, match="boundaries"):
        packed_loss_grad_errors(model, reference, "mask")
    with pytest.raises(ValueError, match="lengths"):
        packed_loss_grad_errors(model, reference, lengths=(3, 0))


def test_pad_sweep_one_pad_corrupts_and_saturates(models):
    model, reference = models("nemotron_h")
    errs = pad_sweep(model, reference, max_pads=6)
    assert len(errs) == 7 and errs[0] < 1e-4
    assert errs[1] > 1e-1
    assert errs[6] >= errs[1] and errs[6] - errs[5] < errs[2] - errs[1]  # grows, then flattens
    with pytest.raises(ValueError, match="max_pads"):
        pad_sweep(model, reference, max_pads=-1)


def test_audit_stock_vs_identity_wrap_and_factory():
    seen = []
    report = audit(
        lambda: tiny_model("mamba2"),
        lambda m: m,
        ["right_pad_decode", "left_pad_decode"],
        progress=lambda which, r: seen.append((which, r.name)),
        sweep_pads=2,
    )
    assert seen == [
        ("stock", "right_pad_decode"),
        ("stock", "left_pad_decode"),
        ("wrapped", "right_pad_decode"),
        ("wrapped", "left_pad_decode"),
    ]
    assert report.passed is False  # identity "wrap" keeps the stock bug
    assert [s.passed for s, _ in report.rows()] == [False, True]
    d = report.to_dict()
    assert d["passed"] is False and d["tol"] == 1e-4 and len(d["wrapped"]) == 2
    assert set(d["pad_sweep"]) == {"stock", "wrapped"} and len(d["pad_sweep"]["stock"]) == 3
    stock_only = audit(tiny_model("mamba2"), None, ["left_pad_decode"])
    assert stock_only.wrapped is None and stock_only.passed is True


def test_audit_rejects_bad_wrap_fns(monkeypatch):
    model = tiny_model("mamba")
    with pytest.raises(ValueError, match="wrap_fn"):
        audit(model, lambda m: None, ["left_pad_decode"])

    def class_level_patch(m):
        orig = nn.Linear.forward
        monkeypatch.setattr(nn.Linear, "forward", lambda self, x: orig(self, x) * 1.5)
        return m

    with pytest.raises(RuntimeError, match="class-level"):
        audit(model, class_level_patch, ["left_pad_decode"])
    with pytest.raises(TypeError, match="model_factory_or_model"):
        audit(42, None)
    assert math.isfinite(run_scenario(tiny_model("lfm2"), tiny_model("lfm2"), "packed_position_ids").max_abs_logits)


def test_half_precision_audit_uses_a_float64_reference_and_a_same_dtype_check():
    """Half precision: the logits against the float64 stock reference, within ROUNDING_FACTOR x the stock model's
    own bf16 rounding on the same sequences, and a tight check against each sequence alone through the same model in
    the same dtype (stock mamba2 keeps its SSM state in bf16 between decode steps, so its bf16 decode drifts from its
    own forward; the wrapped decode does not)."""
    import safepad

    model = tiny_model("mamba2", dtype=torch.bfloat16)
    report = audit(model, safepad.wrap, ["right_pad_decode", "left_pad_decode", "generate"])
    assert report.dtype == "bfloat16" and report.tol == 0.15  # the coarse tolerance bounds the cached states
    right, left, gen = report.stock
    assert right.passed is False and right.max_abs_logits > 1.0  # the padding bug is far above bf16 noise
    for r in (left, gen):  # within bf16 rounding of the float64 reference; the same-dtype check is reported
        assert r.rounding_factor == ROUNDING_FACTOR and r.logits_passed and r.same_dtype_error is not None
    assert not gen.mismatches_fail
    assert all(r.passed for r in report.wrapped), [(r.name, r.same_dtype_error) for r in report.wrapped]
    assert next(model.parameters()).dtype == torch.bfloat16  # the audited model is left as it was


def test_rounding_budget_is_the_stock_models_own_rounding_on_the_scenarios_sequences():
    """``rounding_rms`` = RMS of (stock bf16 - float64 copy) over the reference runs, recomputed here from the token
    sequences the stock model was called with (each alone, one-shot)."""
    import safepad

    stock = tiny_model("nemotron_h", dtype=torch.bfloat16)
    wide, wrapped = copy.deepcopy(stock).to(torch.float64), safepad.wrap(copy.deepcopy(stock))
    seen = []
    hook = stock.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].clone()), with_kwargs=True)
    try:
        res = run_scenario(wrapped, wide, "packed_position_ids", dtype_reference=stock)
    finally:
        hook.remove()
    assert [s.shape[1] for s in seen] == [1, 3, 17, 33]  # the packed sequences, each alone
    with torch.no_grad():
        diffs = [(stock(ids).logits.double() - wide(ids).logits.double()).flatten() for ids in seen]
    diff = torch.cat(diffs)
    assert res.rounding_rms == pytest.approx(diff.square().mean().sqrt().item(), rel=1e-6)
    assert res.rounding_max == pytest.approx(diff.abs().max().item(), rel=1e-6)
    assert res.rounding_factor == ROUNDING_FACTOR and res.passed
    assert res.rms_logits <= ROUNDING_FACTOR * res.rounding_rms


def test_the_rounding_rule_needs_a_float64_reference_and_the_stock_model_in_the_models_dtype():
    stock = tiny_model("mamba", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="float64 stock reference"):
        run_scenario(stock, copy.deepcopy(stock).float(), "packed_position_ids", dtype_reference=stock)
    with pytest.raises(ValueError, match="dtype_reference"):
        wide = copy.deepcopy(stock).double()
        run_scenario(stock, wide, "packed_position_ids", dtype_reference=copy.deepcopy(stock).float())


@pytest.mark.parametrize("family", ["nemotron_h", "mamba2", "falcon_mamba", "lfm2"])
def test_decode_steps_get_the_mask_generate_gives(models, family):
    """The engine gives one-token steps a mask exactly when generate() does (it drops it for the attention-free
    mamba / mamba2 / falcon_mamba, keeps it elsewhere), on whichever transformers version runs."""
    from safepad.testing.scenarios import _ModelIO

    model, _ = models(family)
    seen = []

    def record(module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[1] == 1:
            seen.append(kwargs.get("attention_mask") is not None)

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        ids = torch.randint(3, 200, (2, 5))
        mask = torch.ones_like(ids)
        mask[0, :2] = 0  # left-padded: an all-ones mask may be dropped for every model
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3,
                           do_sample=False, pad_token_id=0)  # fmt: skip
    finally:
        handle.remove()
    assert seen and len(set(seen)) == 1
    engine_gives = _ModelIO(model).decode_mask(torch.ones(2, 6, dtype=torch.long)) is not None
    assert engine_gives == seen[0], (family, seen)
