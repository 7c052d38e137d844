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


# generate(use_cache=False) re-feeds every column with the [4, B, T] positions it extended from each row's last
# prompt column, a pad after a right-padded prompt: the new tokens took the pad's position (qwen4_exp, the VLM;
# qwen4_exp_text gets 2-D positions, which safepad replaced already). 1.8e-4 and 8.1e-3 (a hole, then a pad) before
@pytest.mark.parametrize("family", [_param("qwen4_exp", id="qwen4_exp")])
@pytest.mark.parametrize(
    "batch",
    [pytest.param([[3, None, None], [3, 3, None], [3, 3, 3]], id="right-padded"),
     pytest.param([[3, None, 5, None], [3, 3, 3, 3]], id="hole-then-pad")],
)
def test_uncached_generate_of_right_padded_prompts(family: str, batch: list) -> None:
    s = fuzz.Session(family, skip_known=False)
    s.generate(batch, max_new_tokens=3, use_cache=False, mode="greedy", num_return_sequences=1, keep=False)


# a one-token cached step whose token is a pad, on a cache no call had re-laid, leaves the row [reals | pad]; the
# next chunk re-laid the cache as if it were [pads | reals] (the pad's key taken as real, the real one dropped):
# nemotron_h / nemotron_h_omni 2.3e-3, qwen4_exp 7.8e-4, bamba 6.6e-3, granitemoehybrid 1.8e-3 before (found by
# `make fuzz` runs of 20 and 55 minutes)
@pytest.mark.parametrize(
    "family",
    [_param("nemotron_h", id="nemotron_h"), _param("nemotron_h_omni", id="nemotron_h_omni"),
     _param("qwen4_exp", id="qwen4_exp"), _param("bamba", id="bamba"),
     _param("granitemoehybrid", id="granitemoehybrid")],
)
def test_all_pad_chunk_then_right_padded_chunk(family: str) -> None:
    s = fuzz.Session(family, skip_known=False)
    s.prefill([[3]], position_ids=False)
    s.chunk([[None]], position_ids=False)
    s.chunk([[3, None]], position_ids=False)


# the same with two rows (a left-padded prefill: never re-laid), one padded in the step: 4.0e-3 (nemotron_h) before
@pytest.mark.parametrize("family", [_param("nemotron_h", id="nemotron_h")])
def test_pad_decode_step_then_chunk_two_rows(family: str) -> None:
    s = fuzz.Session(family, skip_known=False)
    s.prefill([[None, 3, 5], [4, 6, 7]], position_ids=False)
    s.chunk([[None], [5]], position_ids=False)
    s.chunk([[3, None], [4, 6]], position_ids=False, output_attentions=True)
    s.generate_more([5], 2)


# qwen4_exp (the VLM) keeps rope_deltas on the model: generate continuing a cache added those of an earlier generate
# on other rows to its positions ("size of tensor a (2) must match the size of tensor b (3)" from inside transformers,
# fuzz new-4): a cache gets back the deltas of the generate that returned it, or none
@pytest.mark.parametrize("family", [_param("qwen4_exp", id="qwen4_exp")])
def test_generate_continuing_a_prefill_after_generate_on_other_rows(family: str) -> None:
    s = fuzz.Session(family, skip_known=False)
    s.generate([[3, 4, 5], [3, 3, None], [3, 3, 3]], max_new_tokens=2, use_cache=True, mode="greedy",
               num_return_sequences=1, keep=False)
    s.prefill([[3, 5], [7, None]])
    s.generate_more([5], 2)


@pytest.mark.parametrize("family", [_param("qwen4_exp", id="qwen4_exp")])
def test_generate_continuing_its_cache_after_generate_on_other_rows(family: str) -> None:
    s = fuzz.Session(family, skip_known=False)
    s.generate([[3, 4], [5, None]], max_new_tokens=2, use_cache=True, mode="greedy", num_return_sequences=1,
               keep=True)
    s.fork()
    s.generate([[3, 4, 5], [3, 3, None], [3, 3, 3]], max_new_tokens=2, use_cache=True, mode="greedy",
               num_return_sequences=1, keep=False)
    s.restore(copy=True)
    s.generate_more([5], 2)


# the same after a generate(use_cache=False) on two rows: it returns no cache, and its rope_deltas stayed on the model
# (found by the fixed-seed tier with 30 call sequences)
@pytest.mark.parametrize("family", [_param("qwen4_exp", id="qwen4_exp")])
def test_generate_continuing_a_prefill_after_uncached_generate(family: str) -> None:
    s = fuzz.Session(family, skip_known=False)
    s.generate([[3, 4, 5], [3, 3, None]], max_new_tokens=2, use_cache=False, mode="greedy", num_return_sequences=1,
               keep=False)
    s.prefill([[3]], position_ids=False)
    s.generate_more([3], 1)


# generate with num_return_sequences=2 keeps one rope_delta per prompt ([2, 1]) while its cache holds 4 rows: the
# continuation raised a size mismatch inside transformers (fixed-seed tier, 30 call sequences)
@pytest.mark.parametrize("family", [_param("qwen4_exp", id="qwen4_exp")])
def test_generate_continuing_a_cache_of_several_sequences_per_prompt(family: str) -> None:
    s = fuzz.Session(family, skip_known=False)
    s.generate([[3, 3, 3, 3, 3], [3, None, None, None, None]], max_new_tokens=1, use_cache=True, mode="sample",
               num_return_sequences=2, keep=True)
    s.generate_more([3], 1)


# fuzz new-5 (torch.compile(model), a right-padded generate's cache reset, then a compiled prefill into it): dynamo
# raised "already tracked for mutation" from frames.py, or safepad refused the reset cache as re-laid. Passes since
# the compiled generate re-lays its prompt pads first and the call scope is one per thread (stop 32)
@pytest.mark.parametrize("family", [_param("bamba", id="bamba"), _param("falcon_h1", id="falcon_h1")])
def test_compiled_prefill_into_a_reset_cache_of_a_right_padded_generate(family: str) -> None:
    s = fuzz.Session(family, skip_known=False)
    try:
        s.compile(mode="model", backend="eager")
        s.generate([[202, 204, 215, 255, None], [250, 105, 18, 51, 251]], max_new_tokens=1, use_cache=True,
                   mode="greedy", keep=True)
        s.prefill([[None, None, 103, 16], [None, 125, 147, 82]], position_ids=False, reset=True)
    finally:
        s.close()


# fuzz new-6: batch_select_indices / batch_repeat_interleave on hybrid layers that inherit them from transformers'
# DynamicLayer (falcon_h1, zamba, zamba2, zaya, the Inkling texts) moved only keys and values: the conv / recurrent
# states kept the old rows (stock is as wrong; a later reorder_cache raised IndexError); layers with states only
# (mamba2 and every other family) have neither operation in transformers (AttributeError). A wrapped model's cache
# moves every state of every layer, and safepad's per-row bookkeeping beside it
@pytest.mark.parametrize("family", [_param("falcon_h1", id="falcon_h1")])
def test_batch_select_indices_then_reorder_on_a_hybrid_layer_cache(family: str) -> None:
    s = fuzz.Session(family, skip_known=False)
    s.prefill([[3]], position_ids=False)
    s.select([0, 0])
    s.reorder([1])


# torch.compile(model): an uncached call with a hole and the caller's position_ids on a family whose attention
# counts slots was neither re-laid (eager re-lays it) nor refused: inkling_text's tokens after the hole 1.75e-4 off
# (the 60-minute make fuzz of stop 33). Now refused on the device, with or without position_ids.
@pytest.mark.parametrize("family", [_param(f, id=f) for f in ("inkling_text", "inkling2_text", "recurrent_gemma")])
def test_compiled_hole_with_position_ids_on_slot_counting_family(family: str) -> None:
    s = fuzz.Session(family, skip_known=False)
    s.compile(mode="model", backend="eager")
    s.forward([[57, 255, 169, 214, None, None, 60, 174, 192, 249, 125]], position_ids=True,
              output_hidden_states=True)


@pytest.mark.parametrize(
    "family",
    [_param("zamba2", id="zamba2"), _param("zaya", id="zaya"), _param("inkling2_text", id="inkling2_text"),
     _param("mamba2", id="mamba2")],
)
def test_batch_select_and_repeat_move_every_state(family: str) -> None:
    s = fuzz.Session(family, skip_known=False)
    chunks, refused = s.stats.rules.get("chunk", 0), s.stats.refused  # counts are per family, per process
    s.prefill([[3, 5, 7], [4, 6, None]], position_ids=False)
    s.select([1, 0, 1])
    s.chunk([[9], [10], [11]], position_ids=False)
    s.repeat(2)
    s.chunk([[12, None], [13, 14], [15, 16], [3, 4], [5, 6], [7, None]], position_ids=False)
    # neither operation refused (mamba2's cache raised AttributeError as stock's does), both chunks ran
    assert (s.stats.rules.get("chunk", 0) - chunks, s.stats.refused - refused) == (2, 0), s.repro()


# fuzz new-7: cache.reset() keeps the conv / recurrent state tensors of the old batch size; a prefill of another
# number of rows into it was refused eagerly ("the cache holds states for 1 rows") and failed inside dynamo under
# torch.compile(model) ('expand: attempting to expand a dimension of length 2 -> 1', kimi_linear): the traced
# hook skipped the rows check. A reset cache now takes the new rows as a fresh cache does, eager and traced alike
@pytest.mark.parametrize("family", [_param("kimi_linear", id="kimi_linear")])
@pytest.mark.parametrize("compiled", [pytest.param(False, id="eager"), pytest.param(True, id="compiled-model")])
def test_prefill_of_other_rows_into_a_reset_cache(family: str, compiled: bool) -> None:
    s = fuzz.Session(family, skip_known=False)
    refused = s.stats.refused
    try:
        if compiled:
            s.compile(mode="model", backend="eager")
        s.prefill([[224, 253, 14, 167]], position_ids=False)
        s.prefill([[None, 235, 255, 28], [None, 176, 188, 252]], position_ids=True, reset=True)
        s.chunk([[3, 4], [5, None]], position_ids=False)
    finally:
        s.close()
    assert s.stats.refused == refused, s.repro()


# torch.compile(model, backend="aot_eager"), a loss with backward on qwen4_exp: the compiled backward replayed a
# ``view`` on the decay's permuted gradient ("view size is not compatible", softplus_backward viewed as [B * T, H];
# the 60-minute make fuzz of stop 33). beta / g now pass their gradients back contiguous, as q ... z already did
@pytest.mark.parametrize("family", [_param("qwen4_exp_text", id="qwen4_exp_text")])
def test_compiled_backward_of_the_decay_gradient(family: str) -> None:
    s = fuzz.Session(family, skip_known=False)
    s.compile(mode="model", backend="aot_eager")
    s.forward([[231, 132, 236, 19, 85, 135], [127, 117, 49, None, None, 208]], position_ids=True, labels=True,
              backward=True)


# torch.compile(model, backend="aot_eager"), two packed calls (cu_seq_lens) with labels and backward on bailing_hybrid
# (Kimi Delta Attention): the second call made the token count dynamic, and the compiled backward died on
# ``aten.view`` of the key gradient ("view size is not compatible"; the 60-minute make fuzz of stop 34). AOT autograd
# predicted that gradient contiguous (a permuted and a contiguous gradient summed, their sizes equal only after a
# simplification sympy does not make) and the kernels produced it permuted. The chunked rule now hands its inputs'
# gradients back as fresh contiguous copies (safepad.ops.grad)
@pytest.mark.parametrize("family", [_param("bailing_hybrid", id="bailing_hybrid")])
def test_compiled_backward_of_two_packed_calls_of_different_lengths(family: str) -> None:
    s = fuzz.Session(family, skip_known=False)
    s.compile(mode="model", backend="aot_eager")
    s.packed(seqs=[[220, 193, 8, 255, 228, 254], [184, 199], [158], [104]], via="cu_seq_lens", labels=True,
             backward=True)
    s.packed(seqs=[[93, 237, 12, 180, 30, 97, 110], [104, 96, 144, 78, 34, 142, 3, 23, 184, 155],
                   [13, 138, 72, 74, 85, 103, 226, 81, 160, 75], [73, 133, 21, 97, 162, 44, 66, 93, 57, 33]],
             via="cu_seq_lens", labels=True, backward=True)


# cache.reset(), then a prefill of other rows, then cache.batch_select_indices (make fuzz, stop 35, recurrent_gemma):
# the reset cache still carried the pad slots of the 1-row generate that filled it, and the row selection over the
# 3 new rows died inside safepad (IndexError in index_select). reset() now forgets safepad's per-row facts as well
@pytest.mark.parametrize("family", [_param("recurrent_gemma", id="recurrent_gemma")])
def test_row_selection_after_a_reset_and_a_prefill_of_more_rows(family: str) -> None:
    s = fuzz.Session(family, skip_known=False)
    refused = s.stats.refused
    try:
        s.generate(batch=[[None, 192, 250, 50, 95, 176, 154, 71, 255]], max_new_tokens=4, use_cache=True,
                   mode="sample", num_return_sequences=1, keep=True)
        s.prefill(batch=[[228, 254, 85, 108, 251, 250, 182, 21, None, None],
                         [191, 255, 123, 45, 255, 30, 66, None, None, None],
                         [75, 89, 184, 44, 162, 177, 148, 115, None, None]], position_ids=True, reset=True)
        s.select(indices=[0, 3, 2])
        s.chunk([[3, 4], [5, None], [6, 7]], position_ids=False)
    finally:
        s.close()
    assert s.stats.refused == refused, s.repro()


# torch.compile(model): a chunk of several tokens re-laid over a re-laid cache, with output_attentions, gave wrong
# logits (recurrent_gemma 0.78, inkling_text 4.7e-3 off the row alone; the 60-minute make fuzz on d5a5d32), and was
# refused since. The call's extra recompiles reached dynamo's recompile limit on transformers' deprecate_kwarg
# wrapper, so a decoder layer ran uncompiled inside the compiled call, where its mixer read no call context (the
# traced hook had pushed it only where traced code reads it). Now served: logits and attention weights, in the
# caller's order, equal each row alone (the session's oracle), and nothing is refused
@pytest.mark.parametrize(
    "family", [_param("recurrent_gemma", id="recurrent_gemma"), _param("inkling_text", id="inkling_text")]
)
def test_compiled_relaid_chunk_with_attentions(family: str) -> None:
    s = fuzz.Session(family, skip_known=False)
    refused = s.stats.refused
    try:
        s.compile(mode="model", backend="eager")
        s.prefill([[None, None, 92, 131, 39, 69, 173, 90], [None, None, None, None, 243, 127, 197, 252]],
                  position_ids=True, output_attentions=True, return_dict=False)
        s.chunk([[218], [117]], position_ids=True)
        s.chunk([[239, None, None, None], [165, 242, 136, None]], position_ids=True, output_attentions=True)
    finally:
        s.close()
    assert s.stats.refused == refused, s.repro()


# torch.compile(model): code that dynamo runs eagerly inside the compiled call (a frame past its recompile limit, a
# skipped or torch._dynamo.disable-d function; the 60-minute make fuzz of stop 33 hit the limit on frames of
# glm5_next's forward while the hooks stayed traced) read the call context from the ContextVar, which the traced hook
# never set: no boundaries, the packed sequences mixed (glm5_next 0.786, glm5_next_text 0.416 in that run; mamba2
# 0.878 here, with every decoder layer run eagerly). Eager code now reads the innermost context a traced push made
@pytest.mark.parametrize("family", [_param("mamba2", id="mamba2"), _param("glm5_next_text", id="glm5_next_text")])
def test_compiled_call_whose_layers_run_eagerly(family: str) -> None:
    import torch
    from torch import nn

    s = fuzz.Session(family, skip_known=False)
    layers = [m for n, m in s.model.named_modules() if n.endswith("layers") and isinstance(m, nn.ModuleList)]
    assert layers, "no decoder layers found"
    for layer in layers[0]:
        layer.forward = torch._dynamo.disable(layer.forward)  # as dynamo runs a frame past its recompile limit
    try:
        s.compile(mode="model", backend="eager")
        s.packed(seqs=[[85], [25], [252], [234, 10, 83, 170, 146, 57]], via="seq_idx")
        s.forward([[3, 5, 7, None], [4, 6, 8, 9]], position_ids=False)
    finally:
        s.close()
        for layer in layers[0]:
            del layer.forward


# torch.compile(model): a compiled packed call of one row, then a right-padded compiled prefill of two rows (make
# fuzz, stop 34). dynamo made the batch size dynamic at the second call, and `s0 in (1, s0)` evaluated to False in the
# traced pre-hook: the prefill's inputs were not reordered pads first while its outputs were put back, so the padded
# row came back permuted (recurrent_gemma 1.0 off the row alone). Sizes are compared with == (_tracing.size_in)
@pytest.mark.parametrize("family", [_param("recurrent_gemma", id="recurrent_gemma")])
def test_compiled_prefill_after_a_packed_call_of_another_batch_size(family: str) -> None:
    s = fuzz.Session(family, skip_known=False)
    try:
        s.compile(mode="model", backend="eager")
        s.packed(seqs=[[241, 184, 141, 215]], via="position_ids")
        s.prefill([[129, 7, 223, 52], [193, None, None, None]], position_ids=True)
    finally:
        s.close()


# torch.compile(model): calls without position_ids, then packed rows given by restarting position_ids of
# another batch size (make fuzz FUZZ_MINUTES=60, stop 42; jamba). dynamo made input_ids' sizes dynamic at the second
# call while position_ids, seen for the first time, kept static ones, and `3 not in (1, s0)` read True in the traced
# pre-hook (packing_positions): the positions were read as no packing and the packed sequences leaked into each
# other (jamba 0.87, nemotron_h 0.70, qwen3_next 0.66, lfm2 0.36 off each sequence alone), silently.
@pytest.mark.parametrize(
    "family", [_param("jamba", id="jamba"), _param("nemotron_h", id="nemotron_h"), _param("lfm2", id="lfm2")]
)
def test_compiled_packed_positions_after_a_call_of_another_shape(family: str) -> None:
    s = fuzz.Session(family, skip_known=False)
    try:
        s.compile(mode="model", backend="eager")
        s.prefill([[230, 235, 107, 138, 172, 229, 207, 141, 83, 241, 111, 252]], position_ids=False, reset=True)
        # refused (a 4-D mask hiding pads); its frames were compiled with input_ids of other sizes
        s.forms([[109, 32, None, 59, 82, 229, 100, 241, 125], [145, 167, 3, 47, 171, 230, 255, None, None],
                 [71, 150, 72, 127, 55, 207, 122, 104, 150]], mask_form="4d_min", positions="offset", offset=3,
                cached=False)
        s.restarts(rows=[[[40, 35, 14]], [[250, 44, 55]], [[228, 98], [126]]])
    finally:
        s.close()


# new-3 (a known defect the fuzzer skips, transformers' own): greedy generate with a static cache on Inkling in
# float32 is 1.8e-3 off the rows alone from the 4th new token (make fuzz, stop 34, on a right-padded batch). The stock
# model on an unpadded prompt of one row gives the same number, and the wrapped model on the padded batch is exact in
# float64: float32 rounding of transformers' static-cache path, not padding. This test fails when either changes
@pytest.mark.parametrize("family", [_param("inkling_text", id="inkling_text")])
def test_known_static_generate_deviation_is_stock_float32_rounding(family: str) -> None:
    import torch

    from safepad.testing.fuzz.known import known_defect

    assert known_defect("new-3").applies(family, "generate", {"static": True})
    stock = fuzz.Session(family, skip_known=False, wrap=False)
    with pytest.raises(fuzz.FuzzFailure, match=r"= 0\.0018"):
        stock.generate(batch=[[230]], max_new_tokens=4, use_cache=True, mode="greedy", static=True)
    wrapped = fuzz.Session(family, dtype=torch.float64, skip_known=False)
    wrapped.generate(
        batch=[[167, 153, 179, 121, 84, 236, 247, None, None], [146, 18, 119, 73, 89, 151, 87, None, None],
               [230] + [None] * 8],
        max_new_tokens=4, use_cache=True, mode="greedy", static=True,
    )


# model.forward = torch.compile(model.forward), a right-padded generate (which re-lays the prompt pads first before it
# starts), then a decode step continuing its cache under the caller's mask (make fuzz, stop 35): row 0 1.2e-3 off the
# row alone (kimi_linear; qwen3_next 1.5e-4, bailing_hybrid 3.1e-4). The returned cache held every row
# [pads | real] but was not marked re-laid, so the step read the caller's [real | pads] layout; generate now marks it
@pytest.mark.parametrize("family", [_param("kimi_linear", id="kimi_linear"), _param("qwen3_next", id="qwen3_next")])
def test_decode_step_on_the_cache_of_a_compiled_right_padded_generate(family: str) -> None:
    s = fuzz.Session(family, skip_known=False)
    try:
        s.compile(mode="forward", backend="eager")
        s.generate(batch=[[195, 129, 220, 195, 240, None], [251, None, None, None, None, None],
                          [4, 13, 253, 3, None, None]], max_new_tokens=1, use_cache=True, mode="sample",
                   num_return_sequences=1, keep=True)
        s.chunk(batch=[[224], [29], [216]], position_ids=False)
    finally:
        s.close()


# issue 37: a 4-D attention mask reaches the attention layers only; the recurrent layers ran over the pads it hid
# (nemotron_h, a left-padded row: 0.75 off the row alone). Now refused, naming the key column and the 2-D fix.
@pytest.mark.parametrize("form", [pytest.param(f, id=f) for f in ("4d_bool", "4d_inf", "4d_min")])
@pytest.mark.parametrize("family", [_param("nemotron_h", id="nemotron_h"), _param("qwen3_next", id="qwen3_next")])
def test_four_d_mask_hiding_pads(family: str, form: str) -> None:
    s = fuzz.Session(family, skip_known=False)
    s.forms([[5, 9, 7, 12], [None, None, 8, 3]], mask_form=form, positions="none")
    assert s.stats.refused > 0


# issue 37: a plain causal 4-D mask next to position_ids [-1, 0, 1, 2]: the recurrent layers read two sequences
# (a restart at 0), attention the one the mask gives, silently (nemotron_h 0.55 off the row alone at its positions).
# The mask is now dropped on such a packed call as a 2-D one is, and the disagreeing readings raise.
@pytest.mark.parametrize("family", [_param("nemotron_h", id="nemotron_h"), _param("qwen3_next", id="qwen3_next")])
def test_causal_four_d_mask_with_restarting_positions(family: str) -> None:
    s = fuzz.Session(family, skip_known=False)
    s.forms([[5, 9, 7, 12], [8, 3, 6, 6]], mask_form="4d_bool", positions="negative")
    s.restarts([[[5, 6, 7], [8]], [[3, 4], [5, 6]]])


# issue 37: a batch of 0 rows raised ZeroDivisionError in safepad's causal conv (stock returns [0, T, V] logits)
@pytest.mark.parametrize("family", [_param("nemotron_h", id="nemotron_h"), _param("mamba2", id="mamba2")])
def test_batch_of_zero_rows(family: str) -> None:
    s = fuzz.Session(family, skip_known=False)
    s.sizes("batch0", cached=False)
    s.sizes("batch0", cached=True)


# issue 37: an uncached recurrent_gemma call whose position_ids start past 0 ([3, 4, 5, 6]): stock runs the row from
# a zero state without its sequence-start reset, safepad ran it from a reset, silently (0.47 off the row alone at
# its positions); the earlier tokens' states are gone either way, so it now raises as the cached call did
@pytest.mark.parametrize("family", [_param("recurrent_gemma", id="recurrent_gemma")])
def test_uncached_positions_continuing_a_sequence(family: str) -> None:
    s = fuzz.Session(family, skip_known=False)
    s.forms([[5, 9, 7, 12], [8, 3, 6, 6]], mask_form="int", positions="offset", offset=3)
    s.forms([[5, 9, 7, 12], [None, None, 8, 3]], mask_form="bool", positions="offset", offset=2)
    s.sizes("len0", rows=2, cached=True)


# issue 37 (make fuzz, 60 minutes): position_ids starting at -1 on RecurrentGemma, uncached: stock resets its
# recurrence exactly where position_ids == 0, so the row alone at those positions is 0.79 off the wrapped model,
# which started a sequence there; safepad now raises as for a start past 0 (recurrent_gemma_w4, found by the fuzzer)
@pytest.mark.parametrize("family", [_param("recurrent_gemma", id="recurrent_gemma"),
                                    _param("recurrent_gemma_w4", id="recurrent_gemma_w4")])
def test_uncached_positions_starting_before_zero(family: str) -> None:
    s = fuzz.Session(family, skip_known=False)
    s.packed(seqs=[[3]], via="position_ids", labels=False, backward=False)
    s.forms(batch=[[3]], mask_form="int", positions="negative", offset=1, cached=False)
    s.forms([[5, 9, 7, 12], [8, 3, 6, 6]], mask_form="int", positions="negative")
    assert s.stats.refused >= 2


# issue 37: the same 4-D mask under torch.compile(model): nemotron_h 0.44 off row 2 (a hole hidden by the mask)
# before the traced device check (docs/limits.md, check D10)
@pytest.mark.parametrize("family", [_param("nemotron_h", id="nemotron_h")])
def test_compiled_four_d_mask_hiding_pads(family: str) -> None:
    s = fuzz.Session(family, skip_known=False)
    s.compile(mode="model", backend="eager")
    try:
        s.forms([[134, 44, 92, 221], [199, 201, None, None], [46, None, None, 244]], mask_form="4d_min",
                positions="offset", offset=3)
        assert s.stats.refused > 0
    finally:
        s.close()


# issue 37: packed_logprobs of a batch with no scored token (one-token rows, an all-zero completion_mask, only
# pads) returned zeros outside the graph, so the caller's loss.backward() raised "element 0 of tensors does not
# require grad" where the padded forward backpropagates zeros (mamba2, found by the fuzzer)
@pytest.mark.parametrize("family", [_param("mamba2", id="mamba2"), _param("nemotron_h", id="nemotron_h")])
def test_logprobs_backward_with_nothing_scored(family: str) -> None:
    s = fuzz.Session(family, skip_known=False)
    s.logprobs([[3]], [False], backward=True)
    s.logprobs([[5, 9, 7], [8, 3, None]], [False], entropy=True, backward=True)
    s.logprobs([[None, None]], [True], backward=True)


# issue 37: ShadowCheckCallback crashed every training step of GraniteMoeHybrid on packed rows ('dict' object has no
# attribute 'detach': safepad's pre-hook hands that model a dict of block-diagonal masks, which the callback's
# forward hook read as the padding mask); found by the fuzzer's callbacks rule
@pytest.mark.parametrize("family", [_param("granitemoehybrid", id="granitemoehybrid")])
def test_shadow_check_on_a_model_given_a_mask_mapping(family: str) -> None:
    s = fuzz.Session(family, skip_known=False)
    s.callbacks([[188, 4, 154], [188, 4, 154], [188, 4, 154]], wrapped=True, which="shadow")
    s.callbacks([[188, 4, 154], [7, 9]], wrapped=False, which="shadow")


# torch.compile(model) on LFM2 with stacked [3, B, T] position_ids (make fuzz FUZZ_MINUTES=60, stop 42): LFM2 has no
# multimodal RoPE; the stock model raises a broadcast RuntimeError eagerly and compiled alike, and so does the wrapped
# one, but dynamo's compiled form is a TorchRuntimeError quoting symbolic sizes. The fuzzer now reads that as the stock
# model's own refusal (session._same_error_compiled) instead of a failure of safepad's
@pytest.mark.parametrize("family", [_param("lfm2", id="lfm2")])
def test_compiled_stacked_positions_refused_as_stock_refuses_them(family: str) -> None:
    s = fuzz.Session(family, skip_known=False)
    try:
        s.compile(mode="model", backend="eager")
        s.packed(seqs=[[156], [116, 253, 190, 152, 66, 77], [90, 91, 237, 175, 87, 30, 252, 150, 34, 61]],
                 via="position_ids")
        s.forms([[87, 26, 100, 143, 25, 197, 15, 182, None], [223, None, None, None, None, None, None, None, 45]],
                mask_form="int", positions="mrope3", offset=3, cached=False)
        assert any(line.startswith("# stock refuses it too: TorchRuntimeError") for line in s.lines)
    finally:
        s.close()
