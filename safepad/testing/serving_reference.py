"""The continuous-batching oracle: a served request against its prompt generated alone by the stock model.

A request's tokens and log-probs (transformers' ``GenerationOutput``: ``generated_tokens``, ``logprobs``) are compared
with the stock model's cache-free runs of its prompt alone (a full forward over prompt + tokens so far, per step, no
padding, no cache). Tolerance: ``|Δ log p| <= tol * max(1, |log p_ref|)``, ``tol`` 1e-4 in float32 (the project's
float32 oracle tolerance); a greedy token may differ from the reference only where the reference's top two logits are
within ``tol * max(1, max |logits|)`` (a near-tie), after which the continuations diverge and are not compared.
Sampled tokens are not comparable with a run alone (the batch shares one random stream): each sampled token's
log-prob must be the stock model's at that prompt and sampled prefix.

Used by tests/serving/test_manager.py and the serving fuzzer (:mod:`safepad.testing.fuzz.serving`). Each function
returns ``None`` when the request matches, else a message naming the step and both values.
"""

from __future__ import annotations

import torch

__all__ = ["DEFAULT_TOL", "greedy_mismatch", "sampled_mismatch"]

#: float32 oracle tolerance (relative)
DEFAULT_TOL = 1e-4


@torch.no_grad()
def _next_logits(stock: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """The stock model's float64 next-token logits ``[V]`` after ``ids`` (one row, no cache)."""
    device = next(stock.parameters()).device
    return stock(torch.tensor([ids], device=device), use_cache=False).logits[0, -1].double().cpu()


def greedy_mismatch(stock: torch.nn.Module, prompt: list[int], tokens: list[int], logprobs: list[float] | None,
                    tol: float = DEFAULT_TOL) -> str | None:  # fmt: skip
    """``tokens`` (and ``logprobs``, if not None: one per token) against the stock greedy continuation of ``prompt``
    alone; the first mismatch as a message, or None."""
    if logprobs is not None and len(logprobs) != len(tokens):
        return f"{len(tokens)} tokens but {len(logprobs)} log-probs"
    ids = list(prompt)
    for k, token in enumerate(tokens):
        logits = _next_logits(stock, ids)
        ref = int(logits.argmax())
        if token != ref:
            top2 = logits.topk(2).values
            gap = float(top2[0] - top2[1])
            if gap <= tol * max(1.0, float(logits.abs().max())):
                return None  # a near-tie: the continuations diverge from here
            return f"step {k}: token {token} != {ref} alone (top-2 logit gap {gap:.3g})"
        if logprobs is not None:
            ref_lp = float(logits.log_softmax(-1)[ref])
            if abs(logprobs[k] - ref_lp) > tol * max(1.0, abs(ref_lp)):
                return f"step {k}: log p {logprobs[k]:.7g} != {ref_lp:.7g} alone"
        ids.append(token)
    return None


def sampled_mismatch(stock: torch.nn.Module, prompt: list[int], tokens: list[int], logprobs: list[float],
                     tol: float = DEFAULT_TOL) -> str | None:  # fmt: skip
    """Each sampled token's log-prob (temperature 1, no top-k / top-p) against the stock model's at ``prompt`` + the
    sampled prefix alone; the first mismatch as a message, or None."""
    if len(logprobs) != len(tokens):
        return f"{len(tokens)} tokens but {len(logprobs)} log-probs"
    ids = list(prompt)
    for k, token in enumerate(tokens):
        ref = float(_next_logits(stock, ids).log_softmax(-1)[token])
        if abs(logprobs[k] - ref) > tol * max(1.0, abs(ref)):
            return f"step {k}: sampled token {token}: log p {logprobs[k]:.7g} != {ref:.7g} alone"
        ids.append(token)
    return None
