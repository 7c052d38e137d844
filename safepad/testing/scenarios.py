"""The scenario matrix: every padding / packing / caching layout, checked against per-sequence runs.

The reference for every scenario is each sequence run ALONE through the stock (unwrapped) model: a full
forward without padding, without packing and without a cache. Decode steps are compared with a full forward
of the sequence grown by the same greedy tokens (the stock single-token path is itself wrong in nemotron_h
and zamba2, which ignore their dt floor in decode), and cached states with the stock cached prefill of the
sequence alone. A model under test (stock or wrapped) runs the same tokens in the scenario's layout:

==================== ======================================================================================
name                 layout
==================== ======================================================================================
packed_position_ids  sequences of lengths 1, 3, 17, 33 back to back in one ``[1, T]`` row, positions
                     restarting at 0 (TRL ``padding_free``), ``use_cache=False``
packed_seq_idx       the same row plus ``seq_idx`` ``[1, T]`` int32
packed_cu_seq_lens   the same row plus ``cu_seq_lens_q/k`` ``[N + 1]`` int32 and ``max_length_q/k``
right_pad_decode     3 rows of different lengths, right-padded, cached prefill then 3 greedy decode steps
left_pad_decode      the same, left-padded
chunked_prefill      2 rows fed through the cache in uneven chunks (splits 5, 16, 19, 31)
chunked_prefill_pad  the same with one row right-padded inside the last chunk
decode_default       8-token cached prefill, then token-by-token decode, vs one full forward
decode_dt_min        the same with every mixer's ``time_step_limit = (0.05, inf)`` (Mamba2 family only)
decode_dt_max        the same with ``time_step_limit = (0.0, 0.01)`` (Mamba2 family only)
generate             left-padded greedy ``generate`` of 3 prompts vs each prompt's greedy continuation alone
right_pad_decode_no_pos  ``right_pad_decode`` called as the README does: ``attention_mask`` and the cache, no
                     ``position_ids`` (the model derives them; the same holds for the ``*_no_pos`` below)
left_pad_decode_no_pos   ``left_pad_decode`` without ``position_ids``
chunked_prefill_no_pos   ``chunked_prefill`` without ``position_ids``
chunked_prefill_pad_no_pos  ``chunked_prefill_pad`` without ``position_ids`` (the README's chunked-prefill recipe)
==================== ======================================================================================

:data:`SCENARIOS` is the matrix the family tests hold every model to; :data:`NO_POSITION_SCENARIOS` are the
``*_no_pos`` calls; :data:`AUDIT_SCENARIOS` (both) is what ``safepad audit`` runs by default.

Half precision (:func:`audit` of a bf16 / fp16 model): the reference is the stock model in float64, and every
reference run also goes through the stock model in the audited dtype; the logits pass iff their RMS error from
float64 is within :data:`ROUNDING_FACTOR` x that stock model's own RMS rounding on the same sequences (a weight or
math defect fails, rounding does not). A second check compares with each sequence alone through the model under
test in its own dtype, within half an ulp or its measured noise (a layout defect of rounding size fails).

Caching scenarios also compare the cached states right after the prefill (per layer: conv state and
recurrent/SSM state of every row vs the row's own run). A model that raises is a finding, not a crash: the
exception is recorded in :attr:`ScenarioResult.error`.

Mask conventions follow ``generate()``: the 2-D ``attention_mask`` always spans past + current tokens, and
position ids are ``cumsum(mask) - 1`` with pads set to 1. Models whose forward declares no ``position_ids``
(the attention-free mamba, mamba2, falcon_mamba) get no mask on single-token decode steps, as ``generate()``
does for them. The cache goes in under the name the model's forward declares and comes back from the field
its output class declares (``cache`` in transformers 5.24, ``cache_params`` / ``past_key_values`` in 5.23;
:mod:`safepad.cache`).
"""

from __future__ import annotations

import copy
import inspect
import itertools
import logging
import math
import re
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..cache import CACHE_NAMES, cache_argument, needs_token_count, new_tracked_cache, output_cache

logger = logging.getLogger(__name__)

__all__ = [
    "AUDIT_SCENARIOS",
    "NO_POSITION_SCENARIOS",
    "PACKED_LENGTHS",
    "ROUNDING_FACTOR",
    "SAME_DTYPE_FLOOR",
    "SCENARIOS",
    "AuditReport",
    "ScenarioResult",
    "audit",
    "cache_states",
    "default_tol",
    "module_states",
    "packed_loss_grad_errors",
    "pad_sweep",
    "reference_noise",
    "reference_rounding",
    "run_matrix",
    "run_scenario",
    "same_dtype_tol",
]

SCENARIOS: tuple[str, ...] = (
    "packed_position_ids",
    "packed_seq_idx",
    "packed_cu_seq_lens",
    "right_pad_decode",
    "left_pad_decode",
    "chunked_prefill",
    "chunked_prefill_pad",
    "decode_default",
    "decode_dt_min",
    "decode_dt_max",
    "generate",
)
#: the cached scenarios called as users call them: mask and cache, no ``position_ids``
NO_POSITION_SCENARIOS: tuple[str, ...] = (
    "right_pad_decode_no_pos",
    "left_pad_decode_no_pos",
    "chunked_prefill_no_pos",
    "chunked_prefill_pad_no_pos",
)
#: what ``safepad audit`` runs by default
AUDIT_SCENARIOS: tuple[str, ...] = SCENARIOS + NO_POSITION_SCENARIOS
_NO_POS = "_no_pos"

#: Sequence lengths of the packed row: a length-1 sequence, and lengths on both sides of chunk 16 / 32.
PACKED_LENGTHS: tuple[int, ...] = (1, 3, 17, 33)
_PAD_LENGTHS = (7, 19, 12)  # rows of the padded-decode batch
_DECODE_STEPS = 3
# chunk boundaries: uneven sizes 5, 11, 3, 12, 9, mostly off the chunk_size grid. No 1-token chunk: that would
# take the single-token decode path, which decode_* scenarios check on their own.
_CHUNK_SPLITS = (5, 16, 19, 31)
_CHUNK_LEN = 40
_CHUNK_PAD_LEN = 35  # real length of the padded row in chunked_prefill_pad (pads inside the last chunk)
_DT_PREFIX, _DT_LEN = 8, 20
_DT_LIMITS = {"decode_dt_min": (0.05, math.inf), "decode_dt_max": (0.0, 0.01)}
_GEN_LENGTHS = (5, 11, 8)
_GEN_NEW_TOKENS = 5
_PAD_ID = 0
_FIRST_TOKEN = 3  # random tokens avoid pad/bos/eos ids


def default_tol(dtype: torch.dtype) -> float:
    """Tolerance for a model computing in ``dtype``: 1e-4 for fp32 (relative to max(1, reference scale)).

    Half precision: the logits are judged by the rounding rule instead (:data:`ROUNDING_FACTOR`, when
    :func:`run_scenario` gets ``dtype_reference``, as :func:`audit` gives it); this coarse value (bf16 0.15, fp16
    0.03) still bounds the cached states, and the logits of a :func:`run_scenario` call without
    ``dtype_reference``.
    """
    return {torch.float64: 1e-8, torch.float32: 1e-4, torch.float16: 3e-2, torch.bfloat16: 1.5e-1}.get(dtype, 1e-4)


#: Half precision: the largest |Δ logits| / max(1, scale) a model may show against each sequence run alone
#: through the same model in the same dtype (one-shot forward, no padding, no cache), when that reference's
#: own measured noise is below it (see :func:`same_dtype_tol`): half an ulp of the dtype (eps / 2) at the
#: logits' scale. On the tiny bf16 models a correct wrapped model is within 2e-3 of it (one-ulp flips of
#: logits below 0.5, from attention over padded rows), stock Bamba's dt-limit decode 3.3e-2 away.
SAME_DTYPE_FLOOR: dict[torch.dtype, float] = {
    torch.bfloat16: torch.finfo(torch.bfloat16).eps / 2,
    torch.float16: torch.finfo(torch.float16).eps / 2,
}
_NOISE_FACTOR = 4.0

#: Half precision, against the float64 reference: the largest ratio tolerated between the model's RMS |Δ logits|
#: from the float64 reference (each sequence alone, the same weights in float64) and the stock model's own RMS
#: rounding at the model's dtype on the same sequences (each sequence alone through the stock model in that dtype
#: vs the same float64 reference). A correct model is one more rounding of the same math: on the tiny bf16 models
#: of every family the wrapped ratio is 0.3-2.0 (2.0: Jamba's right-padded decode); with ``dt_bias + 0.1`` it is
#: 0.95-11, and 3.5-11 in each family's most sensitive scenario, so each family's audit fails it (docs/audit.md).
ROUNDING_FACTOR = 3.0


def same_dtype_tol(dtype: torch.dtype, noise: float = 0.0) -> float | None:
    """Relative tolerance of the same-dtype check of a half-precision model (None for other dtypes).

    ``noise``: the reference's own measured noise, relative to max(1, its logits scale): the spread between two
    mathematically equivalent runs of the same sequences alone in that dtype (:func:`reference_noise`). The
    tolerance is ``max(SAME_DTYPE_FLOOR[dtype], 4 * noise)``.
    """
    floor = SAME_DTYPE_FLOOR.get(dtype)
    return None if floor is None else max(floor, _NOISE_FACTOR * float(noise))


@dataclass
class ScenarioResult:
    """Outcome of one scenario on one model.

    Attributes:
        name: scenario id (one of :data:`SCENARIOS`).
        applicable: False when the scenario does not apply to the model (e.g. dt limits on a non-Mamba2 mixer).
        max_abs_logits: max |Δ logits| over every compared token (None when not applicable or raised).
        state_errors: max |Δ| of each cached state, keyed ``"layer{i}.conv"`` / ``"layer{i}.recurrent"``
            (``"layer{i}.conv.{s}"`` for layers with several states).
        state_scales: max |reference state| per key; a state passes when its error is
            ``<= tol * max(1, scale)`` (recurrent states can reach O(100), where fp32 rounding alone is ~1e-5).
        logits_scale: max |reference logits|; the logits pass when ``max_abs_logits <= tol * max(1, scale)``.
        error: ``"ExceptionType: message"`` when the model raised.
        tol: tolerance used by :attr:`passed`.
        mismatched_tokens: ``generate`` only: generated tokens that differ from the per-prompt run.
        mismatches_fail: whether ``mismatched_tokens`` fail the scenario (False in half precision, where
            near-ties flip; the logits up to the first flip are still compared).
        seconds: wall time of the scenario.
        note: why it is not applicable, or other context.
        details: finer errors, e.g. ``prefill_logits`` / ``decode_logits`` of the padded-decode scenarios.
        same_dtype_error: half precision only: max |Δ logits| against each sequence run alone through the
            same model in the same dtype (one-shot, no padding, no cache); None otherwise. It separates a layout
            defect from rounding, which the float32-referenced check cannot at half-precision tolerances.
        same_dtype_scale: max |logits| of that reference.
        same_dtype_tol: its relative tolerance (:func:`same_dtype_tol`); the scenario passes only when
            ``same_dtype_error <= same_dtype_tol * max(1, same_dtype_scale)`` as well.
        rms_logits: root mean square of Δ logits over every compared logit (the statistic of the rounding rule).
        rounding_rms: half precision with a float64 reference (``dtype_reference`` of :func:`run_scenario`): the
            RMS of (each sequence alone through the stock model in the model's dtype - the float64 reference) over
            the scenario's reference logits, i.e. the stock model's own rounding on these sequences; None otherwise.
        rounding_max: the max of that difference (reported, not judged).
        rounding_factor: when set (:data:`ROUNDING_FACTOR`), the logits pass iff
            ``rms_logits <= rounding_factor * rounding_rms``, instead of ``max_abs_logits <= tol * max(1, scale)``.
    """

    name: str
    applicable: bool = True
    max_abs_logits: float | None = None
    state_errors: dict[str, float] = field(default_factory=dict)
    state_scales: dict[str, float] = field(default_factory=dict)
    logits_scale: float = 0.0
    error: str | None = None
    tol: float = 1e-4
    mismatched_tokens: int | None = None
    mismatches_fail: bool = True
    seconds: float = 0.0
    note: str | None = None
    details: dict[str, float] = field(default_factory=dict)
    same_dtype_error: float | None = None
    same_dtype_scale: float = 0.0
    same_dtype_tol: float | None = None
    rms_logits: float | None = None
    rounding_rms: float | None = None
    rounding_max: float | None = None
    rounding_factor: float | None = None

    @property
    def logits_passed(self) -> bool:
        """Whether the logits are within tolerance: the rounding rule when :attr:`rounding_factor` is set, else
        ``max_abs_logits <= tol * max(1, logits_scale)`` (NaN fails)."""
        if self.max_abs_logits is None:
            return False
        if self.rounding_factor is not None:
            return (
                self.rms_logits is not None
                and self.rounding_rms is not None
                and self.rms_logits <= self.rounding_factor * self.rounding_rms
            )
        return self.max_abs_logits <= self.tol * max(1.0, self.logits_scale)

    @property
    def max_state_error(self) -> float | None:
        """Largest cached-state error (None when no state was compared)."""
        return max(self.state_errors.values()) if self.state_errors else None

    def max_state_error_of(self, kind: str) -> float | None:
        """Largest error among states of ``kind`` (``"conv"`` or ``"recurrent"``)."""
        vals = [v for k, v in self.state_errors.items() if k.split(".")[1] == kind]
        return max(vals) if vals else None

    @property
    def max_error(self) -> float | None:
        """max(logits error, state errors); None when nothing was measured."""
        vals = [v for v in (self.max_abs_logits, self.max_state_error) if v is not None]
        return max(vals) if vals else None

    @property
    def passed(self) -> bool | None:
        """None when not applicable; False when raised, any error is above tolerance or NaN, or tokens differ."""
        if not self.applicable:
            return None
        if self.error is not None or not self.logits_passed:
            return False
        for key, err in self.state_errors.items():
            if not err <= self.tol * max(1.0, self.state_scales.get(key, 1.0)):
                return False
        if self.same_dtype_tol is not None and not (
            self.same_dtype_error is not None
            and self.same_dtype_error <= self.same_dtype_tol * max(1.0, self.same_dtype_scale)
        ):
            return False
        return not (self.mismatched_tokens and self.mismatches_fail)

    @property
    def status(self) -> str:
        """``"n/a"``, ``"raises"``, ``"ok"`` or ``"FAIL"``."""
        if not self.applicable:
            return "n/a"
        if self.error is not None:
            return "raises"
        return "ok" if self.passed else "FAIL"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(passed=self.passed, status=self.status, max_state_error=self.max_state_error)
        return d


@dataclass
class AuditReport:
    """Stock vs wrapped results of one model; ``wrapped`` is None for a stock-only audit."""

    model_name: str
    stock: list[ScenarioResult]
    wrapped: list[ScenarioResult] | None
    tol: float
    dtype: str = "float32"
    device: str = "cpu"
    #: ``{"stock": [...], "wrapped": [...]}`` cached-state error vs number of trailing pads (:func:`pad_sweep`)
    pad_sweep: dict[str, list[float]] | None = None
    #: the float32 reference's own rounding on its device (:func:`reference_rounding`), when measured; ``tol`` is at
    #: least 4x it
    reference_rounding: float | None = None

    @property
    def subject(self) -> list[ScenarioResult]:
        """The results that decide :attr:`passed`: the wrapped ones, or the stock ones when nothing was wrapped."""
        return self.wrapped if self.wrapped is not None else self.stock

    @property
    def passed(self) -> bool:
        """True iff every applicable scenario of :attr:`subject` passes."""
        return all(r.passed for r in self.subject if r.applicable)

    def rows(self) -> Iterator[tuple[ScenarioResult, ScenarioResult | None]]:
        """(stock, wrapped-or-None) per scenario, in run order."""
        wrapped = self.wrapped or [None] * len(self.stock)
        yield from zip(self.stock, wrapped)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model_name,
            "dtype": self.dtype,
            "device": self.device,
            "tol": self.tol,
            "passed": self.passed,
            "stock": [r.to_dict() for r in self.stock],
            "wrapped": None if self.wrapped is None else [r.to_dict() for r in self.wrapped],
            "pad_sweep": self.pad_sweep,
            "reference_rounding": self.reference_rounding,
        }


# --------------------------------------------------------------------------------------------------------------
# Model I/O: the one place that knows how each family takes the cache, positions and masks.
# --------------------------------------------------------------------------------------------------------------


class _ModelIO:
    """Uniform forward over every family: the cache under the name the forward declares, optional positions."""

    def __init__(self, model: nn.Module):
        self.model = model
        params = inspect.signature(model.forward).parameters
        has_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        self.cache_kw = cache_argument(model.forward)  # None: the forward declares none of CACHE_NAMES
        self.declares_positions = "position_ids" in params
        self.takes_positions = self.declares_positions or has_var_kw
        first = next(model.parameters())
        self.device, self.dtype = first.device, first.dtype
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.vocab = int(cfg.vocab_size)
        self.text_config = cfg
        #: RecurrentGemma-style models keep recurrent states on their modules (``_setup_cache`` resets them) and
        #: return no cache
        self.stateful = callable(getattr(model, "_setup_cache", None))

    def __call__(
        self,
        input_ids: Tensor,
        *,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        cache: Any = None,
        use_cache: bool = False,
        **extra: Any,
    ) -> tuple[Tensor, Any]:
        """Run ``[B, L]`` tokens; return (``[B, L, V]`` float32 logits, the cache or None)."""
        kwargs: dict[str, Any] = {"input_ids": input_ids.to(self.device), "use_cache": use_cache}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask.to(self.device)
        if position_ids is not None and self.takes_positions:
            kwargs["position_ids"] = position_ids.to(self.device)
        if cache is None and use_cache and self.stateful:
            # what the stateful model does when it builds its own cache (fresh module states), keeping the cache
            # object so that the next call can continue it (the model does not return it)
            from transformers import DynamicCache

            cache = DynamicCache(config=self.text_config)
            setup = getattr(self.model, "_setup_cache", None)
            if callable(setup):
                setup(self.model.config, input_ids.shape[0], self.device, self.dtype)
        if cache is not None:
            if self.cache_kw is None:
                raise ValueError(
                    f"{type(self.model).__name__}.forward declares no cache argument (none of "
                    f"{', '.join(CACHE_NAMES)}), so a cache cannot be fed back; if transformers renamed it, add the "
                    "new name to safepad.cache.CACHE_NAMES"
                )
            kwargs[self.cache_kw] = cache
        kwargs.update({k: v.to(self.device) if isinstance(v, Tensor) else v for k, v in extra.items()})
        out = self.model(**kwargs)
        new_cache = output_cache(out) if use_cache else None
        if new_cache is None and use_cache and self.stateful:
            new_cache = cache
        return out.logits.float(), new_cache

    @property
    def models(self) -> list[nn.Module]:
        """Every model this reference runs (a scenario's settings, e.g. ``time_step_limit``, go on each)."""
        return [self.model]

    def states(self, cache: Any) -> dict[str, Tensor]:
        """:func:`cache_states` of ``cache`` plus the states the model keeps on its modules (:func:`module_states`)."""
        return {**cache_states(cache), **module_states(self.model)}

    def decode_mask(self, full_mask: Tensor) -> Tensor | None:
        """Mask for a single-token step: ``generate()`` drops it for models without ``position_ids`` (no attention)."""
        return full_mask if self.declares_positions else None

    def fresh_cache(self) -> Any:
        """None (the model builds its own cache), or, for a model that asks a cache without attention layers
        for its length (which stock transformers cannot tell), an empty one that counts its tokens
        (:func:`safepad.cache.needs_token_count`)."""
        model = self.model
        return new_tracked_cache(model.config) if needs_token_count(model) else None


@dataclass
class _Rounding:
    """Running sums of (stock in the model's dtype - float64 reference) over the reference logits of a scenario."""

    sq_sum: float = 0.0
    count: int = 0
    max_abs: float = 0.0

    def add(self, other: _Rounding) -> None:
        self.sq_sum += other.sq_sum
        self.count += other.count
        self.max_abs = max(self.max_abs, other.max_abs)

    @property
    def rms(self) -> float | None:
        return math.sqrt(self.sq_sum / self.count) if self.count else None


class _PairedIO(_ModelIO):
    """The float64 stock reference, shadowed by the stock model in the audited dtype.

    Every uncached call (each sequence alone, full forward) runs both on the same tokens and returns the float64
    logits; the difference (the stock model's own rounding in its dtype on these sequences) is summed into
    :attr:`rounding`. :func:`_memo` stores the sums of each memoised reference run and adds them again on a hit, so
    a scenario's rounding covers every reference logit it uses, whether computed now or by an earlier scenario.
    """

    def __init__(self, model: nn.Module, shadow: nn.Module):
        super().__init__(model)
        self.shadow = _ModelIO(shadow)
        self.rounding = _Rounding()

    @property
    def models(self) -> list[nn.Module]:
        return [self.model, self.shadow.model]

    def __call__(self, input_ids: Tensor, **kwargs: Any) -> tuple[Tensor, Any]:
        logits, cache = super().__call__(input_ids, **kwargs)
        if not kwargs.get("use_cache", False):
            low, _ = self.shadow(input_ids, **kwargs)
            diff = low.to(logits.device).double() - logits.double()
            self.rounding.add(_Rounding(diff.square().sum().item(), diff.numel(), diff.abs().max().item()))
        return logits, cache


def cache_states(cache: Any) -> dict[str, Tensor]:
    """Clone every conv / recurrent state held by a transformers 5.x cache.

    Works for ``DynamicCache`` holding ``LinearAttentionLayer`` (and its hybrid subclasses) of every family:
    keys are ``"layer{i}.conv"`` and ``"layer{i}.recurrent"`` (``.{s}`` appended for layers with several
    states); attention-only layers and unset states are skipped. Conv states are ``[B, C, K]``, recurrent
    states ``[B, ...]``.
    """
    out: dict[str, Tensor] = {}
    layers = getattr(cache, "layers", None)
    if layers is None:
        return out
    for i, layer in enumerate(layers):
        for kind, attr in (("conv", "conv_states"), ("recurrent", "recurrent_states")):
            states = getattr(layer, attr, None)
            if not isinstance(states, dict):
                continue
            for s, tensor in states.items():
                if tensor is None:
                    continue
                key = f"layer{i}.{kind}" if len(states) == 1 else f"layer{i}.{kind}.{s}"
                out[key] = tensor.detach().clone()
    return out


def module_states(model: nn.Module) -> dict[str, Tensor]:
    """Clone the recurrent states a model keeps on its modules (RecurrentGemma's ``conv1d_state`` and
    ``rg_lru.recurrent_states``), as the family spec's ``options["module_states"]`` names them, keyed like
    :func:`cache_states` (``"layer{i}.conv"`` / ``"layer{i}.recurrent"``, ``i`` the decoder layer of the module)."""
    from ..specs.registry import spec_for_module
    from ..wrap.patching import layer_index as _layer_index

    out: dict[str, Tensor] = {}
    for name, module in model.named_modules():
        spec = spec_for_module(module)
        where = spec.options.get("module_states") if spec is not None else None
        idx = _layer_index(name) if where else None
        if not where or idx is None:
            continue
        for kind, path in where.items():
            obj: Any = module
            for part in path.split("."):
                obj = getattr(obj, part, None)
            if isinstance(obj, Tensor):
                out[f"layer{idx}.{kind}"] = obj.detach().clone()
    return out


def _state_errors(
    batched: dict[str, Tensor],
    row: int,
    alone: dict[str, Tensor],
    into: dict[str, float],
    scales: dict[str, float] | None = None,
) -> None:
    """Max |Δ| of row ``row`` of each batched state vs the alone run's row 0, accumulated (max) into ``into``.

    ``scales`` (if given) accumulates max |reference state| per key.
    """
    for key, ref in alone.items():
        if scales is not None:
            scales[key] = max(scales.get(key, 0.0), ref.float().abs().max().item())
        got = batched.get(key)
        if got is None:
            err = math.inf
        else:
            a, b = got[row].float(), ref[0].float().to(got.device)
            if key.split(".")[1] == "conv":  # [C, K]: compare the trailing columns both hold
                k = min(a.shape[-1], b.shape[-1])
                a, b = a[..., -k:], b[..., -k:]
            err = (a - b).abs().max().item() if a.shape == b.shape else math.inf
        into[key] = max(into.get(key, 0.0), err)


def _maxdiff(a: Tensor, b: Tensor) -> float:
    return (a.float() - b.float().to(a.device)).abs().max().item()


def _cmp(res: ScenarioResult, got: Tensor, ref: Tensor) -> float:
    """max |got - ref| of logits; records max |ref| in ``res.logits_scale`` and the RMS of every logit compared so
    far in ``res.rms_logits``."""
    res.logits_scale = max(res.logits_scale, ref.float().abs().max().item())
    diff = got.double() - ref.double().to(got.device)
    sq_sum = getattr(res, "_sq_sum", 0.0) + diff.square().sum().item()
    count = getattr(res, "_count", 0) + diff.numel()
    res._sq_sum, res._count = sq_sum, count  # type: ignore[attr-defined]  # running sums, not reported fields
    res.rms_logits = math.sqrt(sq_sum / count) if count else 0.0
    return diff.abs().max().item() if diff.numel() else 0.0


def _tokens(gen: torch.Generator, vocab: int, length: int) -> Tensor:
    """``[length]`` random token ids that avoid the pad / bos / eos ids."""
    return torch.randint(_FIRST_TOKEN, max(vocab, _FIRST_TOKEN + 1), (length,), generator=gen)


def _gen(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 7919 + sum(map(ord, name)))


# --------------------------------------------------------------------------------------------------------------
# Reference runs (each sequence alone through the stock model)
# --------------------------------------------------------------------------------------------------------------

# reference model -> {key: result}. The stock and the wrapped model of an audit (and every wrapped variant a
# test suite checks) share one reference, so its per-sequence runs are computed once. A fingerprint of the
# parameters' storage and in-place version counters invalidates the entries when the weights change.
_MEMO: weakref.WeakKeyDictionary[nn.Module, tuple[int, dict[Any, Any]]] = weakref.WeakKeyDictionary()


def _fingerprint(model: nn.Module) -> int:
    return hash(tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in model.parameters()))


def _memo(ref: _ModelIO, key: Any, compute: Callable[[], Any]) -> Any:
    fp = _fingerprint(ref.model)
    entry = _MEMO.get(ref.model)
    if entry is None or entry[0] != fp:
        entry = (fp, {})
        _MEMO[ref.model] = entry
    store = entry[1]
    if not isinstance(ref, _PairedIO):
        if key not in store:
            store[key] = compute()
        return store[key]
    # a float64 reference shadowed by the stock model: the stock model's rounding on these runs is kept with them
    rkey = ("rounding", key, _fingerprint(ref.shadow.model), ref.shadow.dtype)
    if key not in store or rkey not in store:
        outer, ref.rounding = ref.rounding, _Rounding()
        try:
            store[key] = compute()
            store[rkey] = ref.rounding
        finally:
            ref.rounding = outer
    ref.rounding.add(store[rkey])
    return store[key]


def _alone_full(ref: _ModelIO, ids: Tensor) -> Tensor:
    """``[L]`` ids alone, full forward without cache -> ``[L, V]`` logits."""
    logits, _ = ref(ids[None], position_ids=torch.arange(ids.numel())[None], use_cache=False)
    return logits[0]


def _alone_states(ref: _ModelIO, ids: Tensor) -> dict[str, Tensor]:
    """Cached states after a cached prefill of ``[L]`` ids alone (the stock prefill path is the reference).

    A model whose cache has no attention layer gets a cache that can tell its length (the stock model raises
    ``get_seq_length can only be called on Attention layers`` otherwise); its states are the stock model's own,
    in the cache or (RecurrentGemma) on its modules.
    """
    pos = torch.arange(ids.numel())[None]
    _, cache = ref(ids[None], position_ids=pos, cache=ref.fresh_cache(), use_cache=True)
    return ref.states(cache)


def _banned_tokens(model: nn.Module) -> list[int]:
    """eos ids: never chosen by the greedy reference, as ``min_new_tokens`` does for ``generate``."""
    cfg = getattr(model, "generation_config", None)
    eos = getattr(cfg, "eos_token_id", None)
    return [eos] if isinstance(eos, int) else list(eos or [])


def _greedy(logits: Tensor, banned: Sequence[int]) -> int:
    """Greedy choice from ``[V]`` logits, never a ``banned`` id."""
    if banned:
        logits = logits.clone()
        logits[list(banned)] = -math.inf
    return int(logits.argmax())


def _alone_greedy(ref: _ModelIO, ids: Tensor, n_new: int) -> tuple[Tensor, list[int], list[Tensor]]:
    """Greedy continuation of ``[L]`` ids alone, every step a full forward without cache (no decode path).

    Returns (``[L, V]`` logits of the prompt, the ``n_new`` greedy tokens, the ``[V]`` logits each token was
    chosen from). Full forwards keep the reference independent of the stock single-token path, which is
    itself wrong for some families (no dt clamp in nemotron_h / zamba2 decode).
    """
    banned = _banned_tokens(ref.model)
    prompt = _alone_full(ref, ids)
    tokens: list[int] = []
    step_logits = [prompt[-1]]
    for k in range(n_new):
        tokens.append(_greedy(step_logits[-1], banned))
        if k + 1 < n_new:
            seq = torch.cat([ids, torch.tensor(tokens, dtype=ids.dtype)])
            step_logits.append(_alone_full(ref, seq)[-1])
    return prompt, tokens, step_logits


# --------------------------------------------------------------------------------------------------------------
# Scenarios
# --------------------------------------------------------------------------------------------------------------


def _packed_inputs(vocab: int, gen: torch.Generator, lengths: Sequence[int]) -> tuple[list[Tensor], Tensor, Tensor]:
    seqs = [_tokens(gen, vocab, n) for n in lengths]
    ids = torch.cat(seqs)[None]  # [1, T]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]  # [1, T], restarting at 0
    return seqs, ids, pos


def _packed_kwargs(name: str, lengths: Sequence[int]) -> dict[str, Any]:
    if name == "packed_seq_idx":
        seq_idx = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])[None]
        return {"seq_idx": seq_idx}  # [1, T] int32
    if name == "packed_cu_seq_lens":
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)  # [N + 1]
        m = max(lengths)
        return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": m, "max_length_k": m}
    return {}


def _scn_packed(io: _ModelIO, ref: _ModelIO, res: ScenarioResult, seed: int) -> None:
    seqs, ids, pos = _packed_inputs(ref.vocab, _gen(seed, "packed"), PACKED_LENGTHS)
    expected = _memo(ref, ("packed", seed), lambda: torch.cat([_alone_full(ref, s) for s in seqs]))  # [T, V]
    logits, _ = io(ids, position_ids=pos, use_cache=False, **_packed_kwargs(res.name, PACKED_LENGTHS))
    res.max_abs_logits = _cmp(res, logits[0], expected)


def _padded_batch(seqs: Sequence[Tensor], left: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(``[B, L]`` ids, ``[B, L]`` mask, ``[B, L]`` generate-style position ids) of padded rows."""
    width = max(s.numel() for s in seqs)
    ids = torch.full((len(seqs), width), _PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for b, s in enumerate(seqs):
        sl = slice(width - s.numel(), width) if left else slice(0, s.numel())
        ids[b, sl], mask[b, sl] = s, 1
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as generate() builds them
    return ids, mask, pos


def _scn_pad_decode(io: _ModelIO, ref: _ModelIO, res: ScenarioResult, seed: int) -> None:
    left = res.name.removesuffix(_NO_POS) == "left_pad_decode"
    with_pos = not res.name.endswith(_NO_POS)
    gen = _gen(seed, "pad_decode")
    seqs = [_tokens(gen, ref.vocab, n) for n in _PAD_LENGTHS]
    # decode step k feeds token k and is compared with the logits token k + 1 is chosen from
    alone = _memo(
        ref,
        ("pad_decode", seed),
        lambda: [(*_alone_greedy(ref, s, _DECODE_STEPS + 1), _alone_states(ref, s)) for s in seqs],
    )
    ids, mask, pos = _padded_batch(seqs, left)
    logits, cache = io(ids, attention_mask=mask, position_ids=pos if with_pos else None, use_cache=True)
    if cache is None:
        raise RuntimeError("the model returned no cache for use_cache=True")
    got_states = io.states(cache)
    prefill_err = 0.0
    for b, (prompt, _, _, states) in enumerate(alone):
        real = mask[b].bool().to(logits.device)
        prefill_err = max(prefill_err, _cmp(res, logits[b, real], prompt))
        _state_errors(got_states, b, states, res.state_errors, res.state_scales)
    lengths = torch.tensor(_PAD_LENGTHS)
    decode_err = 0.0
    for k in range(_DECODE_STEPS):
        tok = torch.tensor([[a[1][k]] for a in alone])  # [B, 1] each row's own greedy token
        mask = torch.cat([mask, torch.ones(len(seqs), 1, dtype=mask.dtype)], dim=1)  # [B, width + k + 1]
        step_pos = (lengths + k)[:, None]  # [B, 1]
        logits, cache = io(
            tok, attention_mask=io.decode_mask(mask), position_ids=step_pos if with_pos else None, cache=cache,
            use_cache=True,
        )
        for b, a in enumerate(alone):
            decode_err = max(decode_err, _cmp(res, logits[b, -1], a[2][k + 1]))
    res.details.update(prefill_logits=prefill_err, decode_logits=decode_err)
    res.max_abs_logits = max(prefill_err, decode_err)


def _scn_chunked(io: _ModelIO, ref: _ModelIO, res: ScenarioResult, seed: int) -> None:
    base = res.name.removesuffix(_NO_POS)
    padded = base == "chunked_prefill_pad"
    with_pos = base == res.name
    gen = _gen(seed, "chunked")
    lengths = (_CHUNK_LEN, _CHUNK_PAD_LEN if padded else _CHUNK_LEN)
    seqs = [_tokens(gen, ref.vocab, n) for n in lengths]
    ids, mask, pos = _padded_batch(seqs, left=False)  # [2, 40]
    expected, alone_states = _memo(
        ref,
        (base, seed),
        lambda: ([_alone_full(ref, s) for s in seqs], [_alone_states(ref, s) for s in seqs]),
    )
    bounds = [0, *_CHUNK_SPLITS, ids.shape[1]]
    cache, outs = None, []
    for a, b in itertools.pairwise(bounds):
        chunk_mask = mask[:, :b] if padded else None  # generate()-style: past + current
        if padded and b - a == 1:
            chunk_mask = io.decode_mask(chunk_mask)
        logits, cache = io(
            ids[:, a:b], attention_mask=chunk_mask, position_ids=pos[:, a:b] if with_pos else None, cache=cache,
            use_cache=True,
        )
        outs.append(logits)
    logits = torch.cat(outs, dim=1)  # [2, 40, V]
    err = 0.0
    got_states = io.states(cache)
    for b, n in enumerate(lengths):
        err = max(err, _cmp(res, logits[b, :n], expected[b]))
        _state_errors(got_states, b, alone_states[b], res.state_errors, res.state_scales)
    res.max_abs_logits = err


def _dt_mixers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "time_step_limit")]


@contextmanager
def _time_step_limit(models: Sequence[nn.Module], limit: tuple[float, float] | None) -> Iterator[None]:
    """Set ``time_step_limit`` on every mixer module of ``models`` (restored on exit); no-op for None."""
    saved = [(m, m.time_step_limit) for model in models for m in _dt_mixers(model)] if limit is not None else []
    try:
        for m, _ in saved:
            m.time_step_limit = tuple(limit)
        yield
    finally:
        for m, old in saved:
            m.time_step_limit = old


def _scn_decode(io: _ModelIO, ref: _ModelIO, res: ScenarioResult, seed: int) -> None:
    limit = _DT_LIMITS.get(res.name)
    if limit is not None and not (_dt_mixers(io.model) and _dt_mixers(ref.model)):
        res.applicable, res.note = False, "no mixer has a time_step_limit attribute"
        return
    gen = _gen(seed, "decode")
    seqs = [_tokens(gen, ref.vocab, _DT_LEN) for _ in range(2)]
    ids = torch.stack(seqs)  # [2, _DT_LEN]
    with _time_step_limit([io.model, *ref.models], limit):
        expected = _memo(ref, (res.name, seed), lambda: torch.stack([_alone_full(ref, s) for s in seqs]))  # [2, L, V]
        logits, cache = io(
            ids[:, :_DT_PREFIX], position_ids=torch.arange(_DT_PREFIX)[None].expand(2, -1), use_cache=True
        )
        outs = [logits]
        for t in range(_DT_PREFIX, _DT_LEN):
            pos = torch.full((2, 1), t)
            logits, cache = io(ids[:, t : t + 1], position_ids=pos, cache=cache, use_cache=True)
            outs.append(logits)
    res.max_abs_logits = _cmp(res, torch.cat(outs, dim=1), expected)


def _generate(model: nn.Module, ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Greedy generate -> (``[B, new]`` tokens, ``[B, new, V]`` raw logits)."""
    device = next(model.parameters()).device
    out = model.generate(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        max_new_tokens=_GEN_NEW_TOKENS,
        min_new_tokens=_GEN_NEW_TOKENS,  # no early eos: every row generates the same number of tokens
        do_sample=False,
        pad_token_id=_PAD_ID,
        output_logits=True,
        return_dict_in_generate=True,
    )
    new = out.sequences[:, ids.shape[1] :].cpu()
    return new, torch.stack(out.logits, dim=1).float().cpu()


def _scn_generate(io: _ModelIO, ref: _ModelIO, res: ScenarioResult, seed: int) -> None:
    gen = _gen(seed, "generate")
    seqs = [_tokens(gen, ref.vocab, n) for n in _GEN_LENGTHS]
    alone = _memo(ref, ("generate", seed), lambda: [_alone_greedy(ref, s, _GEN_NEW_TOKENS) for s in seqs])
    ids, mask, _ = _padded_batch(seqs, left=True)
    tokens, logits = _generate(io.model, ids, mask)
    mismatches, err = 0, 0.0
    for b, (_, ref_tokens, ref_logits) in enumerate(alone):
        diff = tokens[b] != torch.tensor(ref_tokens)
        mismatches += int(diff.sum())
        # logits are comparable up to (and including) the first diverging step
        upto = int(diff.float().argmax()) + 1 if diff.any() else diff.numel()
        err = max(err, _cmp(res, logits[b, :upto], torch.stack(ref_logits[:upto]).cpu()))
    res.mismatched_tokens, res.max_abs_logits = mismatches, err
    res.mismatches_fail = io.dtype not in (torch.float16, torch.bfloat16)


_RUNNERS: dict[str, Callable[[_ModelIO, _ModelIO, ScenarioResult, int], None]] = {
    "packed_position_ids": _scn_packed,
    "packed_seq_idx": _scn_packed,
    "packed_cu_seq_lens": _scn_packed,
    "right_pad_decode": _scn_pad_decode,
    "left_pad_decode": _scn_pad_decode,
    "chunked_prefill": _scn_chunked,
    "chunked_prefill_pad": _scn_chunked,
    "decode_default": _scn_decode,
    "decode_dt_min": _scn_decode,
    "decode_dt_max": _scn_decode,
    "generate": _scn_generate,
    "right_pad_decode_no_pos": _scn_pad_decode,
    "left_pad_decode_no_pos": _scn_pad_decode,
    "chunked_prefill_no_pos": _scn_chunked,
    "chunked_prefill_pad_no_pos": _scn_chunked,
}


def _check_names(names: Sequence[str] | None) -> list[str]:
    if names is None:
        return list(SCENARIOS)
    unknown = [n for n in names if n not in _RUNNERS]
    if unknown:
        raise ValueError(
            f"names: unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(AUDIT_SCENARIOS)}"
        )
    return list(names)


def _format_error(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {msg[:300]}"


def run_scenario(
    model: nn.Module,
    reference_model: nn.Module,
    name: str,
    *,
    tol: float | None = None,
    seed: int = 0,
    dtype_reference: nn.Module | None = None,
) -> ScenarioResult:
    """Run scenario ``name`` on ``model`` against per-sequence runs of the stock ``reference_model``.

    Args:
        model: the model under test (stock or wrapped), eval mode.
        reference_model: the stock model with the same weights (never wrapped); float64 with ``dtype_reference``.
        name: one of :data:`SCENARIOS`.
        tol: max |Δ| for :attr:`ScenarioResult.passed`; default :func:`default_tol` of the model's dtype.
        seed: seeds the random token ids.
        dtype_reference: half precision: the stock model in ``model``'s dtype (the same weights; it may be the
            stock model under test). Each reference run then also runs through it, and the logits pass iff their
            RMS error from the float64 ``reference_model`` is within :data:`ROUNDING_FACTOR` x that stock model's
            own RMS rounding on the same sequences (:attr:`ScenarioResult.rounding_rms`).

    An exception raised by ``model`` is recorded in ``error``; one raised by the reference is recorded as
    ``"reference: ..."`` (the cell then tells nothing about ``model``).
    """
    (name,) = _check_names([name])
    if model is reference_model:
        raise ValueError("reference_model: pass a separate copy (copy.deepcopy(model)) of the stock model")
    io = _ModelIO(model)
    ref = _ModelIO(reference_model)
    if dtype_reference is not None:
        ref = _paired_reference(io, reference_model, dtype_reference)
    res = ScenarioResult(name=name, tol=default_tol(io.dtype) if tol is None else float(tol))
    start = time.perf_counter()
    try:
        with torch.no_grad():
            _RUNNERS[name](io, ref, res, seed)
            if isinstance(ref, _PairedIO) and res.applicable:
                res.rounding_rms, res.rounding_max = ref.rounding.rms, ref.rounding.max_abs
                res.rounding_factor = ROUNDING_FACTOR
            if same_dtype_tol(io.dtype) is not None and res.applicable:
                _same_dtype_check(io, res, seed)
    except Exception as exc:  # a raising model is a finding, not a crash of the audit
        res.error = _format_error(exc)
        res.max_abs_logits = None
        logger.debug("scenario %s raised", name, exc_info=True)
    res.seconds = time.perf_counter() - start
    return res


def _paired_reference(io: _ModelIO, reference_model: nn.Module, dtype_reference: nn.Module) -> _PairedIO:
    """``reference_model`` (float64) shadowed by ``dtype_reference`` (the stock model in ``io``'s dtype)."""
    ref = _PairedIO(reference_model, dtype_reference)
    if ref.dtype != torch.float64:
        raise ValueError(
            f"reference_model: the rounding rule needs a float64 stock reference, got {ref.dtype}; pass "
            "copy.deepcopy(stock).to(torch.float64), or no dtype_reference for the plain tolerance check"
        )
    if ref.shadow.dtype != io.dtype:
        raise ValueError(
            f"dtype_reference: the stock model in the dtype of the model under test ({io.dtype}) is needed, got "
            f"{ref.shadow.dtype}; pass the stock model itself (or a copy cast to {io.dtype})"
        )
    return ref


def _same_dtype_check(io: _ModelIO, res: ScenarioResult, seed: int) -> None:
    """Half precision: the scenario again, against each sequence alone through the model itself, same dtype.

    The float64 check (the rounding rule) cannot resolve a layout defect of rounding size (stock Bamba's decode
    that ignores its dt floor). Each sequence run alone (one-shot, no padding, no cache) through the same model in
    the same dtype carries the same rounding as the layout under test, so only a layout defect remains. The
    tolerance comes from that reference's own measured noise (:func:`reference_noise`), with the floor
    :data:`SAME_DTYPE_FLOOR`. A weight defect is on both sides here: the float64 check is the one that sees it.
    """
    own = ScenarioResult(name=res.name, tol=res.tol)
    _RUNNERS[res.name](io, io, own, seed)
    res.same_dtype_error, res.same_dtype_scale = own.max_abs_logits, own.logits_scale
    res.same_dtype_tol = same_dtype_tol(io.dtype, reference_noise(io.model, seed))


@torch.no_grad()
def reference_noise(model: nn.Module, seed: int = 0) -> float:
    """The same-dtype reference's own noise, relative to max(1, logits scale): the spread between two
    mathematically equivalent runs of sequences alone, one-shot each and the same sequences (equal lengths) in
    one batch, through ``model`` in its dtype. Memoised per model (and weights)."""
    io = _ModelIO(model)

    def compute() -> float:
        gen = _gen(seed, "reference_noise")
        seqs = [_tokens(gen, io.vocab, _DT_LEN) for _ in range(3)]
        alone = torch.stack([_alone_full(io, s) for s in seqs])  # [3, L, V]
        batch, _ = io(torch.stack(seqs), position_ids=torch.arange(_DT_LEN)[None].expand(3, -1), use_cache=False)
        return _maxdiff(batch, alone) / max(1.0, alone.abs().max().item())

    return _memo(io, ("reference_noise", seed), compute)


@torch.no_grad()
def reference_rounding(model: nn.Module, seed: int = 0) -> float:
    """The float32 reference's own rounding on its device, relative to max(1, its logits scale): sequences alone
    through ``model`` against the same sequences alone through a float64 copy of it (on the same device; on the CPU
    when the device refuses float64). Memoised per model (and weights).

    On the CPU this is ~1e-7. On CUDA a stock Mamba2-family or gated-DeltaNet model is ~1e-3 off: transformers sends
    its SSD scan and delta rule to mamba-ssm's / FLA's Triton kernels whenever they import, and their ``tl.dot``
    rounds float32 inputs to TF32 (:mod:`safepad.testing.tf32`). A wrapped model runs safepad's IEEE float32 core,
    so it is that far from such a reference by the reference's rounding alone; :func:`audit` widens its float32
    tolerance to cover it (``4 x`` this), which a padding defect (~0.5) still exceeds by orders of magnitude.
    """
    io = _ModelIO(model)

    def compute() -> float:
        gen = _gen(seed, "reference_rounding")
        # the lengths the scenarios run alone (rounding grows with the length: more chunks, longer scans)
        seqs = [_tokens(gen, io.vocab, n) for n in (_CHUNK_LEN, _CHUNK_LEN, max(PACKED_LENGTHS))]
        own = [_alone_full(io, s) for s in seqs]
        wide = copy.deepcopy(model).to(torch.float64)
        if hasattr(wide, "set_experts_implementation"):
            wide.set_experts_implementation("eager")  # transformers' grouped_mm MoE has no float64
        try:
            hi = [_alone_full(_ModelIO(wide), s) for s in seqs]
        except Exception as exc:  # noqa: BLE001 - a device (or a package kernel) without float64: the CPU then
            logger.info("reference_rounding: float64 on %s failed (%s); measuring on the CPU", io.device, exc)
            wide = wide.to("cpu")
            hi = [_alone_full(_ModelIO(wide), s) for s in seqs]
        scale = max(1.0, max(h.abs().max().item() for h in hi))
        return max(_maxdiff(o, h.to(o.device)) for o, h in zip(own, hi)) / scale

    return _memo(io, ("reference_rounding", seed), compute)


def run_matrix(
    model: nn.Module,
    reference_model: nn.Module,
    names: Sequence[str] | None = None,
    progress: Callable[[ScenarioResult], None] | None = None,
    *,
    tol: float | None = None,
    seed: int = 0,
    dtype_reference: nn.Module | None = None,
) -> list[ScenarioResult]:
    """Run every scenario in ``names`` (default :data:`SCENARIOS`); ``progress(result)`` after each one.
    ``dtype_reference``: see :func:`run_scenario`."""
    results = []
    for name in _check_names(names):
        res = run_scenario(model, reference_model, name, tol=tol, seed=seed, dtype_reference=dtype_reference)
        results.append(res)
        if progress is not None:
            progress(res)
    return results


@torch.no_grad()
def _probe(model: nn.Module) -> Tensor:
    io = _ModelIO(model)
    ids = _tokens(torch.Generator().manual_seed(1234), io.vocab, 9)[None]
    return io(ids, use_cache=False)[0]


def audit(
    model_factory_or_model: nn.Module | Callable[[], nn.Module],
    wrap_fn: Callable[[nn.Module], nn.Module] | None,
    names: Sequence[str] | None = None,
    *,
    tol: float | None = None,
    progress: Callable[[str, ScenarioResult], None] | None = None,
    model_name: str | None = None,
    sweep_pads: int | None = None,
    reference_dtype: torch.dtype | None = None,
    measure_rounding: bool | None = None,
) -> AuditReport:
    """Run the matrix on the stock model and on a wrapped copy, both against the stock per-sequence reference.

    Args:
        model_factory_or_model: a stock model (left unmodified), or a zero-argument callable returning one.
        wrap_fn: ``model -> wrapped model`` applied to a deep copy; None for a stock-only audit.
        names: scenario ids (default :data:`AUDIT_SCENARIOS`: the matrix, with and without ``position_ids``).
        tol: see :func:`run_scenario`.
        progress: ``progress(which, result)`` after each scenario, ``which`` in ``{"stock", "wrapped"}``.
        model_name: label for the report (default: the model class name).
        sweep_pads: also run :func:`pad_sweep` with this many pads on both models (``report.pad_sweep``).
        reference_dtype: dtype of the stock reference copy. Default: float64 for a float16 / bfloat16 model,
            which then runs the rounding rule (:func:`run_scenario`'s ``dtype_reference`` is the stock model: both
            models' logits are judged against the float64 reference, within :data:`ROUNDING_FACTOR` x the stock
            model's own rounding in its dtype on the same sequences); the model's dtype otherwise. A device that
            cannot run the model in float64 gets the float64 reference on the CPU.
        measure_rounding: measure the float32 reference's own rounding on its device (:func:`reference_rounding`)
            and widen the tolerance to 4x it when larger (``report.reference_rounding``). Default: on a device
            other than the CPU, where the stock reference may run TF32 Triton kernels; never when ``tol`` is given.
    """
    names = _check_names(AUDIT_SCENARIOS if names is None else names)
    if isinstance(model_factory_or_model, nn.Module):
        model = model_factory_or_model
    elif callable(model_factory_or_model):
        model = model_factory_or_model()
    else:
        raise TypeError("model_factory_or_model: pass an nn.Module or a zero-argument callable returning one")
    model.eval()
    model_dtype = next(model.parameters()).dtype
    half = model_dtype in (torch.float16, torch.bfloat16)
    if reference_dtype is None:
        reference_dtype = torch.float64 if half else model_dtype
    reference = _reference_copy(model, reference_dtype)
    # half precision against float64: each reference run also goes through the stock model in its own dtype
    dtype_reference = model if half and reference_dtype == torch.float64 else None
    stock = model  # run as is: only the wrapped copy is modified
    wrapped = None
    if wrap_fn is not None:
        before = _probe(reference)
        wrapped = wrap_fn(copy.deepcopy(model))
        if wrapped is None:
            raise ValueError("wrap_fn: returned None; it must return the wrapped model")
        wrapped.eval()
        if not torch.equal(before, _probe(reference)):
            raise RuntimeError(
                "wrap_fn changed the outputs of an untouched copy of the model (a class-level patch?): the stock "
                "reference is no longer stock, so the audit cannot tell anything; wrap instances, not classes"
            )
    first = next(model.parameters())
    rounding = None
    if measure_rounding is None:
        measure_rounding = tol is None and first.device.type != "cpu"
    if measure_rounding and reference_dtype == torch.float32:
        rounding = reference_rounding(reference)
    tol = default_tol(first.dtype) if tol is None else float(tol)
    if rounding is not None and _NOISE_FACTOR * rounding > tol:
        logger.info("audit: the float32 reference rounds %.1e on %s: tolerance %.1e", rounding, first.device, tol)
        tol = _NOISE_FACTOR * rounding

    def _cb(which: str) -> Callable[[ScenarioResult], None] | None:
        return None if progress is None else (lambda r: progress(which, r))

    kw: dict[str, Any] = {"tol": tol, "dtype_reference": dtype_reference}
    stock_res = run_matrix(stock, reference, names, _cb("stock"), **kw)
    wrapped_res = None if wrapped is None else run_matrix(wrapped, reference, names, _cb("wrapped"), **kw)
    sweep = None
    if sweep_pads is not None:
        sweep = {"stock": pad_sweep(stock, reference, sweep_pads)}
        if wrapped is not None:
            sweep["wrapped"] = pad_sweep(wrapped, reference, sweep_pads)
    return AuditReport(
        model_name=model_name or type(model).__name__,
        stock=stock_res,
        wrapped=wrapped_res,
        tol=tol,
        dtype=str(first.dtype).removeprefix("torch."),
        device=str(first.device),
        pad_sweep=sweep,
        reference_rounding=rounding,
    )


@torch.no_grad()
def _reference_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A stock copy of ``model`` in ``dtype``, eval mode. Float64: transformers' grouped_mm MoE experts run eagerly
    (grouped_mm has no float64); what the model computes in float32 by design (``_keep_in_fp32_modules_strict``,
    e.g. Inkling2's router, which casts its input to float32) stays float32, as in the stock model; and the copy
    moves to the CPU when its device cannot run a float64 forward (a package's Triton kernel), which the
    comparisons then bridge."""
    reference = copy.deepcopy(model).to(dtype).eval()
    if dtype != torch.float64:
        return reference
    if hasattr(reference, "set_experts_implementation"):
        reference.set_experts_implementation("eager")
    keep = sorted(getattr(reference, "_keep_in_fp32_modules_strict", None) or ())
    if keep:
        pattern = re.compile("|".join(rf"(^|\.){re.escape(k)}(\.|$)" for k in keep))
        for name, tensor in itertools.chain(reference.named_parameters(), reference.named_buffers()):
            if tensor.is_floating_point() and pattern.search(name):
                tensor.data = tensor.data.float()
    if next(reference.parameters()).device.type != "cpu":
        try:
            _probe(reference)
        except Exception as exc:  # noqa: BLE001 - the device refuses float64: the reference runs on the CPU
            logger.info("audit: float64 reference on the CPU (%s)", _format_error(exc))
            reference = reference.to("cpu")
    return reference


@torch.no_grad()
def pad_sweep(
    model: nn.Module, reference_model: nn.Module, max_pads: int = 8, length: int = 12, seed: int = 0
) -> list[float]:
    """Cached-state error after a right-padded prefill, for 0..``max_pads`` trailing pads.

    One row of ``length`` real tokens followed by n pads (mask 0) is prefilled with the cache; the returned
    ``[max_pads + 1]`` list holds the max |Δ| over every cached conv / recurrent state vs the row alone
    (``inf`` when the model raised or returned no cache).
    """
    if max_pads < 0 or length < 1:
        raise ValueError(f"max_pads must be >= 0 and length >= 1, got max_pads={max_pads}, length={length}")
    io, ref = _ModelIO(model), _ModelIO(reference_model)
    seq = _tokens(_gen(seed, "pad_sweep"), ref.vocab, length)
    alone_states = _alone_states(ref, seq)
    errors = []
    for n in range(max_pads + 1):
        ids = torch.cat([seq, torch.full((n,), _PAD_ID)])[None]  # [1, length + n]
        mask = torch.cat([torch.ones(length, dtype=torch.long), torch.zeros(n, dtype=torch.long)])[None]
        pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        errs: dict[str, float] = {}
        try:
            _, cache = io(ids, attention_mask=mask, position_ids=pos, use_cache=True)
            _state_errors(io.states(cache), 0, alone_states, errs)
        except Exception as exc:  # noqa: BLE001 - a raising model is a finding: its point is drawn as inf
            logger.debug("pad_sweep: model raised with %d pads: %s", n, _format_error(exc))
            errs["raised"] = math.inf
        errors.append(max(errs.values()) if errs else math.inf)
    return errors


def _sum_token_loss(logits: Tensor, ids: Tensor) -> Tensor:
    """Sum of next-token cross-entropies of one sequence: ``[L, V]`` logits, ``[L]`` ids -> scalar."""
    if ids.numel() < 2:
        return logits.sum() * 0.0
    return torch.nn.functional.cross_entropy(logits[:-1].float(), ids[1:].to(logits.device), reduction="sum")


def packed_loss_grad_errors(
    model: nn.Module,
    reference_model: nn.Module,
    boundaries: str = "position_ids",
    lengths: Sequence[int] = PACKED_LENGTHS,
    seed: int = 0,
) -> dict[str, float]:
    """Packed-row loss and parameter gradients of ``model`` vs per-sequence runs of ``reference_model``.

    The packed loss is the sum of next-token losses inside each sequence (no loss across a boundary); the
    reference is the same sum over each sequence run alone. Gradients of both are compared parameter by
    parameter (by name). ``model`` and ``reference_model`` must hold the same weights.

    Args:
        boundaries: how the packed row describes its boundaries: ``"position_ids"`` (restarting positions),
            ``"seq_idx"`` or ``"cu_seq_lens"`` (each also passes the restarting positions, as collators do).
        lengths: sequence lengths of the packed row.

    Returns:
        ``{"loss": |Δ loss|, "loss_rel": |Δ loss| / |loss_ref|, "grad": max |Δ grad|,
        "grad_rel": max |Δ grad| / max |grad_ref|}``. Gradients are left cleared on both models. Unlike
        :func:`run_scenario`, an exception raised by ``model`` propagates.
    """
    names = {"position_ids": "packed_position_ids", "seq_idx": "packed_seq_idx", "cu_seq_lens": "packed_cu_seq_lens"}
    if boundaries not in names:
        raise ValueError(f"boundaries: expected one of {', '.join(names)}, got {boundaries!r}")
    if not lengths or min(lengths) < 1:
        raise ValueError(f"lengths: need at least one sequence, every length >= 1, got {tuple(lengths)}")
    if model is reference_model:
        raise ValueError("reference_model: pass a separate copy (copy.deepcopy(model)) of the stock model")
    io, ref = _ModelIO(model), _ModelIO(reference_model)
    seqs, ids, pos = _packed_inputs(ref.vocab, _gen(seed, "packed_grad"), lengths)
    for m in (model, reference_model):
        m.zero_grad(set_to_none=True)
    try:
        with torch.enable_grad():
            ref_loss = sum(_sum_token_loss(_alone_full(ref, s), s) for s in seqs)
            ref_loss.backward()
            logits, _ = io(ids, position_ids=pos, use_cache=False, **_packed_kwargs(names[boundaries], lengths))
            starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
            loss = sum(_sum_token_loss(logits[0, a:b], ids[0, a:b]) for a, b in itertools.pairwise(starts))
            loss.backward()
        ref_grads = {n: p.grad for n, p in reference_model.named_parameters() if p.grad is not None}
        grad_err, grad_scale = 0.0, 0.0
        for n, p in model.named_parameters():
            g_ref = ref_grads.get(n)
            if g_ref is None:
                continue
            g = torch.zeros_like(g_ref) if p.grad is None else p.grad
            grad_err = max(grad_err, _maxdiff(g, g_ref))
            grad_scale = max(grad_scale, g_ref.abs().max().item())
        loss_err = abs(loss.item() - ref_loss.item())
        return {
            "loss": loss_err,
            "loss_rel": loss_err / max(abs(ref_loss.item()), 1e-30),
            "grad": grad_err,
            "grad_rel": grad_err / max(grad_scale, 1e-30),
        }
    finally:
        for m in (model, reference_model):
            m.zero_grad(set_to_none=True)
