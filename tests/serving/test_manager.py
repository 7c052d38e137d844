"""Continuous batching of wrapped hybrids (safepad.serving.manager): ``generate_batch`` and the manager API.

Oracle: every request's generated tokens and per-token log-probs equal its prompt generated alone by the stock
model, cache-free (a full forward over prompt + tokens so far per step), whatever shares the batch, whenever it
arrived. Tolerance: ``|Δ log p| <= 1e-4 * max(1, |log p_ref|)`` (the project's float32 oracle tolerance; measured
differences are <= 1e-6); a greedy token may differ from the reference only where the reference's top two logits
are within ``1e-4 * max(1, max |logits|)`` of each other (a near-tie), after which the continuations diverge and are
not compared. Stock transformers 5.25 refuses every hybrid here (``Invalid layer type``), and so did a wrapped model
before safepad.serving.

``safepad.wrap`` keeps the user's ``"sdpa"`` on float32 models (transformers' continuous batching accepts ``"sdpa"``,
``"paged|eager"`` and flash only, not safepad's CPU half-precision ``"safepad_sdpa"``): the wrapped model is served
as wrapped.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching import cache as cb_cache

import safepad
from safepad.serving import SafepadContinuousBatching, SafepadContinuousBatchingManager, SafepadPagedCache
from safepad.testing.serving_reference import greedy_mismatch
from safepad.testing.tiny import tiny_model

from ..wrap.helpers import family_param

pytestmark = pytest.mark.usefixtures("quiet_transformers")

#: hybrids whose recurrent layers safepad serves (attention + Mamba2 / Mamba1 / gated delta / short conv); the
#: others raise (test_families_it_cannot_serve_raise)
SERVED_FAMILIES = (
    "lfm2",
    "qwen3_next",
    "nemotron_h",
    "bamba",
    "jamba",
    "granitemoehybrid",
    "olmo_hybrid",
    "qwen3_5_text",
    "lfm2_moe",
    "kimi_linear",
    "qwen3_5_moe_text",
    "bailing_hybrid",
    "lfm3",  # + sliding attention: the model looks every layer type up in the step's per-type masks
    "lara_mini",  # + sliding attention
    "lfm2_vl",  # vision-language wrappers, text requests
    "qwen3_5",
    "nemotron_h_omni",
)
TOL = 1e-4
NEW = 6


@pytest.fixture(scope="module")
def quiet_transformers():
    import logging

    logs = [logging.getLogger(n) for n in ("transformers", "ContinuousBatchingLogger")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)
    yield
    for log, level in zip(logs, levels):
        log.setLevel(level)


def _models(family: str):
    stock = tiny_model(family)
    wrapped = safepad.wrap(copy.deepcopy(stock))
    return stock, wrapped


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (n,), generator=g).tolist() for n in lengths]


def _cb_config(**overrides) -> ContinuousBatchingConfig:
    base = {"num_blocks": 64, "max_batch_tokens": 16, "max_requests_per_batch": 3, "page_size": 8, "return_logprobs": True}
    return ContinuousBatchingConfig(**{**base, **overrides})


@torch.no_grad()
def _reference_logits(stock, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """The stock model's float64 next-token logits after ``prompt + tokens[:k]``, for each k (no cache)."""
    out = []
    for k in range(len(tokens)):
        ids = torch.tensor([prompt + tokens[:k]])
        out.append(stock(ids, use_cache=False).logits[0, -1].double())
    return out


def _check_greedy(stock, prompt: list[int], result, max_new: int) -> None:
    """``result`` (a GenerationOutput) against the stock greedy continuation of ``prompt`` alone
    (:func:`safepad.testing.serving_reference.greedy_mismatch`)."""
    assert result.error is None, result.error
    got = list(result.generated_tokens)
    assert len(got) == max_new, (len(got), max_new)
    problem = greedy_mismatch(stock, prompt, got, list(result.logprobs), tol=TOL)
    assert problem is None, problem


#: multi-head latent attention (kv_lora_rank): transformers' paged cache holds it from 5.25 on
MLA_FAMILIES = ("kimi_linear", "bailing_hybrid")
MLA_PAGED = hasattr(cb_cache, "MLACacheAllocator")


@pytest.mark.parametrize("family", [family_param(f) for f in SERVED_FAMILIES])
def test_generate_batch_matches_each_prompt_alone(family):
    """Different lengths (1 to 40 tokens: the 40-token prompt is prefilled in chunks of at most 16 tokens across
    steps), more requests than slots (7 requests, 3 slots: slots are reused), log-probs."""
    stock, model = _models(family)
    if family in MLA_FAMILIES and not MLA_PAGED:
        with pytest.raises(ValueError, match="multi-head latent attention"):
            model.init_continuous_batching(continuous_batching_config=_cb_config())
        return
    prompts = _prompts([3, 9, 1, 40, 5, 17, 2])
    gen = GenerationConfig(do_sample=False, max_new_tokens=NEW, eos_token_id=-1, pad_token_id=0)
    out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=_cb_config(), warmup=False)
    assert list(out) == [f"req_{i}" for i in range(len(prompts))]
    for i, prompt in enumerate(prompts):
        _check_greedy(stock, prompt, out[f"req_{i}"], NEW)


def _collect(manager, request_ids: set[str], timeout: float = 120.0) -> dict:
    finals, deadline = {}, time.monotonic() + timeout
    while set(finals) != request_ids:
        assert time.monotonic() < deadline, f"timed out waiting for {request_ids - set(finals)}"
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            finals[result.request_id] = result
    return finals


@pytest.mark.parametrize("family", [family_param(f) for f in ("lfm2", "nemotron_h", "qwen3_next")])
def test_manager_requests_arriving_mid_generation(family):
    """Requests added while others decode (the manager API, the loop paused to add them between two steps), each
    with its own max_new_tokens; a 30-token prompt arrives while a slot is freed and reused."""
    stock, model = _models(family)
    gen = GenerationConfig(do_sample=False, max_new_tokens=4, eos_token_id=-1, pad_token_id=0)
    a, b, c, d = _prompts([7, 30, 2, 11], seed=1)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=_cb_config())
    assert manager.continuous_batching_config.max_batch_tokens < len(b)  # b's prefill is chunked
    manager.start()
    try:
        ra = manager.add_request(a, request_id="a", max_new_tokens=9, streaming=True)
        first = None
        while first is None:  # a decodes before the others arrive
            r = manager.get_result(request_id=ra, timeout=5)
            first = r if r is not None and r.generated_tokens else None
        with manager.pause():
            manager.add_request(b, request_id="b", max_new_tokens=5)
            manager.add_request(c, request_id="c", max_new_tokens=1)
        manager.add_request(d, request_id="d", max_new_tokens=7)
        finals = _collect(manager, {"a", "b", "c", "d"})
    finally:
        manager.stop(block=True)
    for rid, prompt, n in (("a", a, 9), ("b", b, 5), ("c", c, 1), ("d", d, 7)):
        _check_greedy(stock, prompt, finals[rid], n)


@pytest.mark.parametrize("family", [family_param(f) for f in ("lfm2", "bamba")])
def test_sampling_draws_from_each_prompts_own_distribution(family):
    """Seeded sampling: the stream of draws is shared by the batch, so tokens are not comparable with a run alone;
    what must hold is that each sampled token's log-prob is the stock model's at that prompt + sampled prefix."""
    stock, model = _models(family)
    prompts = _prompts([4, 19, 1, 8], seed=2)
    gen = GenerationConfig(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=5, eos_token_id=-1, pad_token_id=0
    )
    out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=_cb_config(seed=0),
                               warmup=False)  # fmt: skip
    for i, prompt in enumerate(prompts):
        result = out[f"req_{i}"]
        assert result.error is None, result.error
        tokens = list(result.generated_tokens)
        for k, logits in enumerate(_reference_logits(stock, prompt, tokens)):
            ref = float(logits.log_softmax(-1)[tokens[k]])
            assert abs(result.logprobs[k] - ref) <= TOL * max(1.0, abs(ref)), (i, k, result.logprobs[k], ref)


@pytest.mark.parametrize(
    ("family", "match"),
    [
        pytest.param("mamba2", "no attention layer", id="mamba2-recurrent-only"),
        pytest.param("falcon_h1", "neither attention types", id="falcon_h1-hybrid-layers"),
        pytest.param("glm5_next_text", "neither attention types", id="glm5_next-indexed-attention"),
        pytest.param("recurrent_gemma", "rg_lru mixer", id="recurrent_gemma-rg_lru"),
    ],
)
def test_families_it_cannot_serve_raise(family, match):
    _, model = _models(family)
    gen = GenerationConfig(do_sample=False, max_new_tokens=2, eos_token_id=-1, pad_token_id=0)
    with pytest.raises(ValueError, match=match):
        model.generate_batch([[5, 6, 7]], generation_config=gen, continuous_batching_config=_cb_config(), warmup=False)


@pytest.mark.parametrize(
    ("gen_kwargs", "cb_kwargs", "match"),
    [
        pytest.param({"num_return_sequences": 2, "do_sample": True}, {}, "num_return_sequences", id="fork"),
        pytest.param({}, {"cpu_offload_space": 1.0}, "cpu_offload_space", id="cpu-offload"),
        pytest.param({}, {"use_cuda_graph": True}, "use_cuda_graph", id="cuda-graphs"),
        pytest.param({}, {"use_async_batching": True}, "use_async_batching", id="async"),
    ],
)
def test_unsupported_options_raise(gen_kwargs, cb_kwargs, match):
    _, model = _models("lfm2")
    gen = GenerationConfig(**{"do_sample": False, "max_new_tokens": 2, "eos_token_id": -1, "pad_token_id": 0, **gen_kwargs})
    with pytest.raises(ValueError, match=match):
        model.init_continuous_batching(generation_config=gen, continuous_batching_config=_cb_config(**cb_kwargs))


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")])
def test_half_precision_on_cpu_raises_naming_the_fix(dtype):
    """On the CPU a half-precision wrapped model computes attention in float64 (``"safepad_sdpa"``), which
    transformers' continuous batching refuses by name; safepad says why and what to do instead."""
    _, model = _models("lfm2")
    model.to(dtype)
    gen = GenerationConfig(do_sample=False, max_new_tokens=2, eos_token_id=-1, pad_token_id=0)
    with pytest.raises(ValueError, match=r"float32 on the CPU \(model.float\(\)\)"):
        model.generate_batch([[5, 6, 7]], generation_config=gen, continuous_batching_config=_cb_config(), warmup=False)


def test_wrap_installs_and_unwrap_removes_the_entry_point():
    """A manager kept by ``persistent_manager=True`` serves a second session (its slots still hold the first
    session's states: every request must start from zeros); unwrap removes the entry point and that manager (it
    serves wrapped mixers)."""
    stock, model = _models("lfm2")
    assert isinstance(model.__dict__["init_continuous_batching"], SafepadContinuousBatching)
    assert "SafepadContinuousBatching" in repr(model.init_continuous_batching)
    gen = GenerationConfig(do_sample=False, max_new_tokens=3, eos_token_id=-1, pad_token_id=0)
    for seed in (3, 4):
        prompts = _prompts([6, 2, 11, 4], seed=seed)
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=_cb_config(),
                                   warmup=False, persistent_manager=True)  # fmt: skip
        assert len(out) == len(prompts)  # in the prompts' order; a kept manager numbers requests on from req_4
        for prompt, result in zip(prompts, out.values()):
            _check_greedy(stock, prompt, result, 3)
    assert isinstance(model.__dict__.get("_cached_continuous_batching_manager"), SafepadContinuousBatchingManager)
    safepad.unwrap(model)
    assert "init_continuous_batching" not in model.__dict__
    assert "_cached_continuous_batching_manager" not in model.__dict__
    assert not isinstance(model.init_continuous_batching, SafepadContinuousBatching)


def test_cache_keeps_pages_for_attention_layers_only():
    """nemotron_h's 4 layers hold 1 attention layer: the paged cache has one page per block, and slots are freed
    with their requests."""
    _, model = _models("nemotron_h")
    gen = GenerationConfig(do_sample=False, max_new_tokens=2, eos_token_id=-1, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=_cb_config())
    processor = manager._create_batch_processor()
    cache = processor.cache
    assert isinstance(cache, SafepadPagedCache)
    (allocator,) = cache.cache_allocators.values()
    assert allocator.layer_indices == [0] and allocator.pages_per_block == 1
    assert cache.slots.num_slots == 3 and cache.slots.num_free == 3


def test_request_too_long_for_the_cache_fails_alone():
    """A prompt the paged cache cannot hold (60 tokens, 4 blocks of 8) fails with transformers' scheduler error; the
    request next to it completes, equal to its prompt alone."""
    stock, model = _models("lfm2")
    gen = GenerationConfig(do_sample=False, max_new_tokens=4, eos_token_id=-1, pad_token_id=0)
    prompts = [list(range(3, 63)), [5, 6, 7]]
    out = model.generate_batch(prompts, generation_config=gen, warmup=False,
                               continuous_batching_config=_cb_config(num_blocks=4, max_requests_per_batch=2))  # fmt: skip
    assert "No requests can be scheduled" in str(out["req_0"].error)
    assert list(out["req_0"].generated_tokens) == []
    _check_greedy(stock, prompts[1], out["req_1"], 4)
