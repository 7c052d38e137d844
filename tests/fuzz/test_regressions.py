"""Regression tests for defects the call-sequence fuzzer found (safepad.testing.fuzz), each as the fuzzer's
shrunk repro. Open ones are ``xfail(strict=True)``: when a fix lands, the test passes, strict xfail fails, and
the marker (and the matching entry of ``fuzz.KNOWN_DEFECTS``) comes out."""

from __future__ import annotations

import pytest

from safepad.testing import fuzz
from safepad.testing.tiny import family_available


def _param(family: str, *marks, id: str):
    ok, why = family_available(family)
    return pytest.param(family, id=id, marks=(*marks, *(() if ok else (pytest.mark.skip(reason=why),))))


@pytest.mark.parametrize(
    "family",
    [
        _param("olmo_hybrid", id="olmo_hybrid"),  # 3.2e-2 before the uncached re-lay of holes (issue 28 item 7)
        _param("lfm2_moe", id="lfm2_moe"),  # 1.5e-4 before
    ],
)
def test_hole_without_position_ids(family: str) -> None:
    s = fuzz.Session(family, skip_known=False)
    s.forward([[4, None, 3, 3, 3, 3, 3, 3], [3, None, None, None, None, None, None, None]], position_ids=False)


# zaya: with a hole and no position_ids the gradients of the attention's qk_norm were 1.1e-3 (of the largest
# gradient) off the rows alone before the uncached re-lay of holes (issue 28 item 7)
@pytest.mark.parametrize("family", [_param("zaya", id="zaya")])
def test_hole_without_position_ids_gradients(family: str) -> None:
    s = fuzz.Session(family, skip_known=False)
    s.forward(
        [
            [3, 3, 3, 3, 3, 3, 3, 3, 3, None, None, None],
            [3, 3, 3, 3, 3, 8, 162, 163, 212, 239, 247, 250],
            [3, None, None, None, None, 3, 30, 86, 120, 150, 214, 250],
        ],
        position_ids=False, labels=True, backward=True,
    )


# output_attentions on a cached chunk after a hole returned the weights in the re-laid slot order
# (inkling2_loop_text 0.37; issue 28 item 1's mechanism with a hole instead of right padding)
@pytest.mark.parametrize("family", [_param("inkling2_loop_text", id="inkling2_loop_text")])
def test_attentions_after_hole_in_cached_chunk(family: str) -> None:
    s = fuzz.Session(family, skip_known=False)
    s.prefill([[3]], position_ids=False)
    s.chunk([[None, 3]], position_ids=False, output_attentions=True)



def test_recurrent_gemma_prefill_with_the_documented_cache() -> None:
    """RecurrentGemma's output carries no cache: the fuzzer hands in DynamicCache(config=...) as the docs say, and a
    prefill then a continuation equal the rows alone (the fuzzer failed 'returned no cache' before)."""
    ok, why = family_available("recurrent_gemma")
    if not ok:
        pytest.skip(why)
    s = fuzz.Session("recurrent_gemma", skip_known=False)
    s.prefill([[3, 5, 7], [4, None, None]], position_ids=False)
    s.decode([[9, 11]])


@pytest.mark.parametrize("family", [_param("qwen4_exp", id="qwen4_exp")])
def test_fork_of_a_cache_generate_returned_after_right_pads(family: str) -> None:
    """copy.deepcopy of the cache a right-padded generate returned, then a continuation: the cache held the generate
    call's frame (stacked-position shift) and the copy raised 'cannot pickle frame' (found by the fuzzer)."""
    s = fuzz.Session(family, skip_known=False)
    s.generate([[3, None], [3, 3]], max_new_tokens=1, use_cache=True, mode="greedy", num_return_sequences=1,
               keep=True)
    s.fork()
    s.generate_more([5], 2)


@pytest.mark.xfail(strict=True, reason=fuzz.KNOWN_DEFECTS[1].reason)
@pytest.mark.parametrize("family", [_param("qwen4_exp", id="qwen4_exp")])
def test_uncached_generate_of_right_padded_prompts(family: str) -> None:
    s = fuzz.Session(family, skip_known=False)
    s.generate([[3, None, None], [3, 3, None], [3, 3, 3]], max_new_tokens=2, use_cache=False, mode="greedy",
               num_return_sequences=1, keep=False)


@pytest.mark.xfail(
    strict=True,
    reason="found by a 20-minute `make fuzz` run: a cached chunk that is all padding, then a right-padded chunk, "
    "gives the next real token wrong logits (nemotron_h and nemotron_h_omni 2.3e-3, qwen4_exp 7.8e-4); not fixed",
)
@pytest.mark.parametrize(
    "family",
    [_param("nemotron_h", id="nemotron_h"), _param("nemotron_h_omni", id="nemotron_h_omni"),
     _param("qwen4_exp", id="qwen4_exp")],
)
def test_all_pad_chunk_then_right_padded_chunk(family: str) -> None:
    s = fuzz.Session(family, skip_known=False)
    s.prefill([[3]], position_ids=False)
    s.chunk([[None]], position_ids=False)
    s.chunk([[3, None]], position_ids=False)


@pytest.mark.xfail(strict=True, raises=fuzz.FuzzFailure, reason=fuzz.KNOWN_DEFECTS[3].reason)
@pytest.mark.parametrize("family", [_param("bamba", id="bamba")])
def test_compiled_prefill_into_a_reset_cache_of_a_right_padded_generate(family: str) -> None:
    s = fuzz.Session(family, skip_known=False)
    try:
        s.compile(mode="model", backend="eager")
        s.generate([[202, 204, 215, 255, None], [250, 105, 18, 51, 251]], max_new_tokens=1, use_cache=True,
                   mode="greedy", keep=True)
        s.prefill([[None, None, 103, 16], [None, 125, 147, 82]], position_ids=False, reset=True)
    finally:
        s.close()


@pytest.mark.xfail(strict=True, raises=fuzz.FuzzFailure, reason=fuzz.KNOWN_DEFECTS[4].reason)
@pytest.mark.parametrize("family", [_param("falcon_h1", id="falcon_h1")])
def test_batch_select_indices_then_reorder_on_a_hybrid_layer_cache(family: str) -> None:
    s = fuzz.Session(family, skip_known=False)
    s.prefill([[3]], position_ids=False)
    s.select([0, 0])
    s.reorder([1])
