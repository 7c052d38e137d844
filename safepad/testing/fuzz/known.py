"""Known open defects the fuzzer finds: each names the issue item, the predicate of the draws it skips, and why.
Skipped draws are counted and printed, not hidden."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["KNOWN_DEFECTS", "KnownDefect", "known_defect"]


@dataclass(frozen=True)
class KnownDefect:
    """One open defect the fuzzer finds: draws matching ``applies(family, rule, call)`` are skipped and counted.

    ``call`` holds the rule's keyword arguments plus ``right`` / ``left`` / ``holes`` (whether any row of the
    batch is right-padded, left-padded, or has a hole), ``cached`` (a cache goes in or comes out), ``stream``
    (the live batch's flags, a dict, or None), ``compiled`` (``"eager"``, or the session's compile mode as
    ``"model:eager"``, ``"forward:eager"``, ``"model:aot_eager"``) and ``dtype`` (the session's torch dtype).
    """

    item: str
    applies: Callable[[str, str, dict[str, Any]], bool]
    reason: str



def _output_carries_cache(model: nn.Module) -> bool:
    """Whether ``model``'s forward returns a cache (its output dataclass has a cache field); True when unknown."""
    import inspect
    import typing

    ann = inspect.signature(type(model).forward).return_annotation
    for t in typing.get_args(ann) or (ann,):
        fields = getattr(t, "__dataclass_fields__", None)
        if fields is not None:
            return any(n in fields for n in ("past_key_values", "cache_params", "cache"))
    return True


#: The open defects of issue 28 that the fuzzer reaches; the coordinator removes an entry when its fix merges.
KNOWN_DEFECTS: tuple[KnownDefect, ...] = (
    KnownDefect(
        "37-a",
        lambda f, r, c: r == "forms" and c.get("positions") == "negative" and c.get("compiled", "eager") != "eager"
        and str(c.get("mask_form", "")).startswith("4d"),
        "compiled call with a plain causal 4-D mask (dropped on a packed call, as a 2-D one) and position_ids "
        "[-1, 0, 1, ...]: attention reads one sequence (transformers' find_packed_sequence_indices), the recurrent "
        "layers two (a restart at 0), as a compiled call without a mask does: the eager check of the two readings "
        "(hooks._check_attention_segments) does not run traced (docs/limits.md, 'One reading for every layer': not "
        "checked under torch.compile); nemotron_h 2.1e-3 off the reading safepad documents",
    ),
    KnownDefect(
        "stock-4d-bool",
        lambda f, r, c: r == "forms" and f.startswith("inkling2") and c.get("mask_form") == "4d_bool",
        "transformers' own: Inkling2 runs eager attention, which adds a 4-D attention_mask to the scores, so a bool "
        "mask adds 1 / 0 instead of hiding keys: the stock model with a causal bool 4-D mask is 3.3 off itself "
        "without a mask (inkling2_text, 4 tokens); the wrapped model equals stock with the same mask, and the float "
        "4-D forms (-inf, finfo.min) are exact",
    ),
    KnownDefect(
        "stock-mrope-rg",
        lambda f, r, c: r == "forms" and f.startswith("recurrent_gemma") and str(c.get("positions", "")).startswith(
            "mrope") and c.get("compiled", "eager") != "eager",
        "transformers' own: RecurrentGemma has no multimodal RoPE, and stacked [3|4, B, T] position_ids broadcast "
        "against its rotary tables; compiled, the stock forward raises the same broadcast error (dynamo's fake-tensor "
        "run) that the wrapped one does (eager, the default window of 64 raises in stock too)",
    ),
    KnownDefect(
        "stock-4d-window",
        lambda f, r, c: r == "forms" and f == "recurrent_gemma_w4" and str(c.get("mask_form", "")).startswith("4d"),
        "transformers' own: a 4-D attention_mask replaces RecurrentGemma's sliding window (4 tokens here), so a causal "
        "4-D mask over a row longer than the window is not the row alone (stock with the mask is 0.066 off itself "
        "without one on 5 tokens); the wrapped model equals stock with the same mask (5e-7)",
    ),
    KnownDefect(
        "37-c",
        lambda f, r, c: r == "generate" and c.get("mode") == "lookup" and f in ("zaya", "qwen4_exp", "qwen4_exp_text"),
        "assisted (prompt-lookup) generate that the stock model serves is refused by the wrapped one with a clear "
        "ValueError ('the cache records past states for rollback ..., and this safepad-wrapped mixer cannot roll its "
        "states back'): qwen4_exp / qwen4_exp_text on every prompt drawn (unpadded [[3]] included), zaya with "
        "max_new_tokens=1 or a right-padded prompt (tests/wrap/test_assisted.py covers neither family); a refusal, "
        "not a wrong result",
    ),
    KnownDefect(
        "new-2",
        lambda f, r, c: r == "generate" and c.get("mode") == "lookup" and bool(c.get("static", False)),
        "assisted (prompt-lookup) generate with a static cache on the conv-only families that serve it (lfm2_moe "
        "1.1e-3, lfm2_vl 4.8e-4 against the prompt alone): transformers' own, not state carried across calls: a "
        "fresh stock model gives the very same numbers (lfm2_vl [9, 9, 9, 9]: 1.19e-4 wrapped and stock, in float64 "
        "as well; a dynamic cache or plain greedy 3e-7), near the tolerance, so a draw crosses it or not",
    ),
    KnownDefect(
        "new-3",
        lambda f, r, c: r == "generate" and bool(c.get("static", False)) and f.startswith("inkling"),
        "greedy generate with a static cache on Inkling in float32 (inkling_text 1.8e-3 / 1.3e-3 off the rows "
        "alone from the 4th / 2nd new token, right-padded or not): transformers' own float32 rounding of its "
        "static-cache path: the stock model on an unpadded prompt of one row gives the very same numbers, and the "
        "wrapped model on the padded batch is exact in float64 (make fuzz, stop 34)",
    ),
)


def known_defect(item: str) -> KnownDefect:
    """The :data:`KNOWN_DEFECTS` entry named ``item`` (e.g. ``"new-5"``); a regression test names its defect."""
    for d in KNOWN_DEFECTS:
        if d.item == item:
            return d
    raise KeyError(f"no known defect {item!r}; open ones: {[d.item for d in KNOWN_DEFECTS]}")
