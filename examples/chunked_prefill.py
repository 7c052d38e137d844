"""Chunked prefill of multi-turn conversations: each turn goes into the model's cache, right-padded rows included.

Three conversations are served as one batch. Turn ``k`` of every conversation is fed as one chunk
``[B, T_k]`` (each row right-padded to the batch's longest turn) into the cache built by the earlier turns,
as an assistant server does when a user message arrives. Afterwards the batch generates a few tokens
greedily from the cache.

The reference is each conversation ALONE through the stock model: one full forward without padding and
without a cache for the logits, and one cached forward for the states. The script prints, for the stock
model and for ``safepad.wrap(model)`` side by side:

* max |Δ logits| over every real token of every turn,
* the max |Δ| of the cached conv / SSM states after the last turn,
* the greedy tokens decoded from the cache, against the greedy continuation of each conversation alone.

The stock model caches each right-padded row's state *after* its pads (the conv window then holds zeros,
and the SSM state has decayed over every pad), so every later turn and every generated token of that row
goes wrong; the wrapped model keeps each row's state at its last real token.

The model is a tiny Nemotron-H built in memory (random init, byte vocabulary, mixer weights strengthened so
that the SSM dominates the logits: with a default random init the mixers barely move the logits and the
padding bugs hide below 1e-4). Run::

    python examples/chunked_prefill.py [--family nemotron_h] [--new-tokens 8]
"""

from __future__ import annotations

import argparse
import copy
import inspect
import logging
import sys
from pathlib import Path

import torch

import safepad
from safepad.cache import cache_argument, output_cache
from safepad.testing import cache_states
from safepad.testing.tiny import MAMBA2_FAMILIES, tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from byte_data import EOS_ID, PAD_ID, VOCAB_SIZE, ByteTokenizer

CONVERSATIONS: list[list[str]] = [
    [
        "<user>What does a state-space layer keep between tokens?\n",
        "<assistant>A fixed-size state: a short conv window and the SSM state.\n",
        "<user>And padding?\n",
    ],
    [
        "<user>Hi!\n",
        "<assistant>Hello. How can I help you today with your training run?\n",
        "<user>Why is my loss different when I pad on the right side of the batch?\n",
    ],
    [
        "<user>Summarise the design notes in one line.\n",
        "<assistant>Reset at boundaries.\n",
        "<user>Thanks.\n",
    ],
]


def _turn_ids(tokenizer: ByteTokenizer) -> list[list[list[int]]]:
    """Token ids of every turn of every conversation; the first turn starts with bos."""
    return [[tokenizer.encode(t, add_bos=k == 0, add_eos=False) for k, t in enumerate(conv)] for conv in CONVERSATIONS]


class _Runner:
    """One forward of a causal LM with a cache, whatever its forward calls the cache argument.

    The name comes from the forward's signature (``cache`` on transformers 5.24, ``cache_params`` or
    ``past_key_values`` on 5.23) and the returned cache from the field the output class declares.
    Models without ``position_ids`` (Mamba, Mamba2, FalconMamba: no attention) get no mask on one-token
    steps, as ``generate()`` does for them.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.cache_kw = cache_argument(model)
        self.takes_positions = "position_ids" in inspect.signature(model.forward).parameters

    @torch.no_grad()
    def __call__(self, ids, mask=None, cache=None, use_cache=True):
        """``[B, T]`` ids, ``[B, past + T]`` mask -> (``[B, T, V]`` logits, cache)."""
        kwargs = {"input_ids": ids, "use_cache": use_cache}
        if mask is not None:
            kwargs["attention_mask"] = mask
            if self.takes_positions:
                kwargs["position_ids"] = (mask.cumsum(-1) - 1).clamp_min(0)[:, -ids.shape[1] :]  # [B, T]
        if cache is not None:
            kwargs[self.cache_kw] = cache
        out = self.model(**kwargs)
        return out.logits.float(), output_cache(out) if use_cache else None


def _greedy(logits: torch.Tensor) -> int:
    """Greedy id from ``[V]`` logits, never eos or pad (as ``min_new_tokens`` would)."""
    logits = logits.clone()
    logits[[EOS_ID, PAD_ID]] = -float("inf")
    return int(logits.argmax())


def reference(ref: _Runner, turns: list[list[list[int]]], new_tokens: int):
    """Each conversation alone: full-forward logits ``[L_i, V]``, cached states, greedy continuation."""
    out = []
    for conv in turns:
        ids = torch.tensor([[t for turn in conv for t in turn]])  # [1, L_i]
        logits, _ = ref(ids, use_cache=False)
        _, cache = ref(ids, use_cache=True)
        tokens, seq = [], ids
        for _ in range(new_tokens):  # full forwards only: no decode path in the reference
            tokens.append(_greedy(ref(seq, use_cache=False)[0][0, -1]))
            seq = torch.cat([seq, torch.tensor([[tokens[-1]]])], dim=1)
        out.append((logits[0], cache_states(cache), tokens))
    return out


def chunked(run: _Runner, turns: list[list[list[int]]], new_tokens: int):
    """Feed the batch turn by turn (right-padded chunks) through the cache, then decode greedily from it.

    Returns (per conversation ``[L_i, V]`` logits of its real tokens, the cached states after the last turn,
    per conversation the greedy tokens).
    """
    batch = len(turns)
    cache, mask = None, torch.zeros(batch, 0, dtype=torch.long)  # mask: [B, past]
    real_logits: list[list[torch.Tensor]] = [[] for _ in range(batch)]
    for k in range(len(turns[0])):
        width = max(len(conv[k]) for conv in turns)
        ids = torch.full((batch, width), PAD_ID, dtype=torch.long)  # [B, T_k], right-padded
        chunk_mask = torch.zeros(batch, width, dtype=torch.long)
        for b, conv in enumerate(turns):
            ids[b, : len(conv[k])] = torch.tensor(conv[k])
            chunk_mask[b, : len(conv[k])] = 1
        mask = torch.cat([mask, chunk_mask], dim=1)  # [B, past + T_k]: generate()'s convention
        logits, cache = run(ids, mask, cache)
        for b, conv in enumerate(turns):
            real_logits[b].append(logits[b, : len(conv[k])])
    states = cache_states(cache)
    generated: list[list[int]] = [[] for _ in range(batch)]
    step_logits = [torch.cat(rows)[-1] for rows in real_logits]  # [V] at each row's last real token
    for step in range(new_tokens):
        for b in range(batch):
            generated[b].append(_greedy(step_logits[b]))
        if step + 1 == new_tokens:
            break
        tok = torch.tensor([[g[-1]] for g in generated])  # [B, 1]
        mask = torch.cat([mask, torch.ones(batch, 1, dtype=torch.long)], dim=1)  # [B, past + 1]
        logits, cache = run(tok, mask if run.takes_positions else None, cache)
        step_logits = [logits[b, -1] for b in range(batch)]
    return [torch.cat(rows) for rows in real_logits], states, generated


def compare(got, ref_out) -> tuple[float, float, int]:
    """(max |Δ logits|, max |Δ cached state|, number of generated tokens that agree) against the reference."""
    logits, states, generated = got
    d_logits = max((lg - r[0]).abs().max().item() for lg, r in zip(logits, ref_out))
    d_state = 0.0
    for b, (_, ref_states, _) in enumerate(ref_out):
        for key, ref in ref_states.items():
            a, r = states[key][b].float(), ref[0].float()
            if key.endswith("conv"):  # [C, K]: the trailing columns both hold
                width = min(a.shape[-1], r.shape[-1])
                a, r = a[..., -width:], r[..., -width:]
            d_state = max(d_state, (a - r).abs().max().item())
    agree = sum(g == t for gen, r in zip(generated, ref_out) for g, t in zip(gen, r[2]))
    return d_logits, d_state, agree


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--family",
        default="nemotron_h",
        help=f"tiny model family with a cache (default nemotron_h; Mamba2 family: {', '.join(MAMBA2_FAMILIES)})",
    )
    p.add_argument(
        "--new-tokens",
        type=int,
        default=8,
        help="greedy tokens generated from the cache (default 8)",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.new_tokens < 1:
        p.error(f"--new-tokens must be >= 1, got {args.new_tokens}")
    return args


def main(argv: list[str] | None = None) -> dict[str, tuple[float, float, int] | str]:
    args = parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    tokenizer = ByteTokenizer()
    turns = _turn_ids(tokenizer)
    stock = tiny_model(args.family, seed=args.seed, vocab_size=VOCAB_SIZE)
    wrapped = safepad.wrap(copy.deepcopy(stock))

    lengths = [[len(t) for t in conv] for conv in turns]
    print(f"model: tiny {args.family} (mixers strengthened), {len(turns)} conversations, turn lengths {lengths}")
    ref_out = reference(_Runner(stock), turns, args.new_tokens)
    results: dict[str, tuple[float, float, int] | str] = {}
    generated: list[list[int]] = []
    for name, model in (("stock", stock), ("safepad.wrap", wrapped)):
        try:
            got = chunked(_Runner(model), turns, args.new_tokens)
        except (RuntimeError, ValueError) as exc:
            if model is wrapped:
                raise
            # stock mamba / falcon_mamba cannot take generate()'s full-length mask in a chunked prefill
            results[name] = f"raises {type(exc).__name__}: {str(exc).splitlines()[0][:60]}"
            continue
        results[name] = compare(got, ref_out)
        generated = got[2]  # the wrapped model's, printed below

    total = args.new_tokens * len(turns)
    print(f"\n{'':14s}{'max |Δ logits|':>16s}{'cached state |Δ|':>18s}{'greedy tokens = alone':>24s}")
    for name, result in results.items():
        if isinstance(result, str):
            print(f"{name:14s}  {result}")
            continue
        d_logits, d_state, agree = result
        print(f"{name:14s}{d_logits:16.2e}{d_state:18.2e}{f'{agree}/{total}':>24s}")
    print("\ngenerated from the cache by the wrapped model (random weights, so the text is noise):")
    for b, gen in enumerate(generated):
        print(f"  conversation {b}: {tokenizer.decode(gen)!r}  (alone: {tokenizer.decode(ref_out[b][2])!r})")
    return results


if __name__ == "__main__":
    main()
