"""GRPO-shaped log-prob forwards: ``safepad.packed_logprobs`` (packed rows) vs the padded forward, side by side.

Shapes: ``--prompts`` prompts x 16 completions each (GRPO's group), prompt lengths lognormal (median
``--prompt-median``), completion lengths lognormal (median ``--completion-median``, sigma 0.8) capped at
``--max-completion``; prompts left-padded, completions right-padded, as TRL's ``GRPOTrainer`` lays them out.
Model: a Nemotron-H (hidden 128, mamba / attention / mamba / mlp, vocabulary ``--vocab``), wrapped.

* **packed**: ``safepad.packed_logprobs(model, ids, mask, completion_mask=..., temperature=0.9)``: the sequences
  packed into rows as long as the longest one (best-fit-decreasing), only the completion tokens through the LM
  head, in chunks.
* **padded**: ``model(ids, attention_mask=mask, logits_to_keep=K).logits``, divided by the temperature,
  ``log_softmax`` and gather at the completion tokens (the ``[B, K, V]`` logits materialised).
* **trl-fused** (when TRL is installed): what TRL 1.16's ``GRPOTrainer`` runs, the padded forward through TRL's
  fused LM head (``add_fused_lm_head``: chunked, no ``[B, K, V]`` logits), so the gain of packing alone shows.

Both sides use the same wrapped model and give the same log-probs (checked, max |diff| printed). Timing:
process CPU time with one torch thread, in one process, the two sides interleaved round by round (order
alternating), median of ``--rounds``; ``no-grad`` (old / reference log-probs) and ``fwd+bwd`` (the policy loss,
``sum(logps)`` backpropagated). The last line is
``rl: packed speed-up no-grad X.XXx vs padded, ...; fwd+bwd Y.YYx vs padded, ...``.

    python benchmarks/bench_rl.py            # 2 prompts x 16 completions, about a minute on one core
    python benchmarks/bench_rl.py --quick    # 1 prompt x 16 shorter completions
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch


def make_model(vocab: int):
    from transformers import NemotronHConfig, NemotronHForCausalLM

    import safepad

    cfg = NemotronHConfig(
        vocab_size=vocab, hidden_size=128, layers_block_type=["mamba", "attention", "mamba", "mlp"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
        mamba_num_heads=8, mamba_head_dim=32, ssm_state_size=32, n_groups=2, chunk_size=64,
        pad_token_id=0, bos_token_id=None, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    return safepad.wrap(NemotronHForCausalLM(cfg).eval())


def make_batch(args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``(input_ids, attention_mask, completion_mask)`` ``[B, T]`` and ``K`` (the completion width)."""
    rng = np.random.default_rng(args.seed)
    prompts = np.clip(np.round(rng.lognormal(np.log(args.prompt_median), 0.6, args.prompts)), 1, None).astype(int)
    groups = [(int(p), c) for p in prompts for c in rng.lognormal(np.log(args.completion_median), 0.8, 16)]
    spans = [(p, int(np.clip(round(c), 1, args.max_completion))) for p, c in groups]
    P, K = max(p for p, _ in spans), max(c for _, c in spans)
    B = len(spans)
    ids = torch.zeros(B, P + K, dtype=torch.long)
    mask = torch.zeros(B, P + K, dtype=torch.long)
    for b, (p, c) in enumerate(spans):
        ids[b, P - p : P + c] = torch.as_tensor(rng.integers(3, args.vocab, p + c))
        mask[b, P - p : P + c] = 1
    completion = mask.clone()
    completion[:, :P] = 0
    return ids, mask, completion, K


def padded_logprobs(model, ids, mask, completion, K: int, temperature: float) -> torch.Tensor:
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=K + 1).logits[:, :-1]
    logp = (logits.float() / temperature).log_softmax(-1)  # [B, K, V]
    picked = logp.gather(-1, ids[:, -K:, None]).squeeze(-1)  # [B, K]
    return picked * completion[:, -K:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--prompt-median", type=int, default=64)
    parser.add_argument("--completion-median", type=int, default=192)
    parser.add_argument("--max-completion", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="1 prompt, completions around 64 tokens, 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.completion_median, args.max_completion, args.rounds = 1, 64, 256, 2
    torch.set_num_threads(1)
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    import safepad

    model = make_model(args.vocab)
    ids, mask, completion, K = make_batch(args)
    B, T = ids.shape
    real = int(mask.sum())
    L = int(mask.sum(1).max())
    temperature = 0.9

    def packed():
        return safepad.packed_logprobs(model, ids, mask, completion_mask=completion, temperature=temperature)[:, -K:]

    def padded():
        return padded_logprobs(model, ids, mask, completion, K, temperature)

    sides = {"packed": packed, "padded": padded}
    try:
        from trl.trainer.utils import add_fused_lm_head
    except ImportError:
        add_fused_lm_head = None
    if add_fused_lm_head is not None:
        add_fused_lm_head(model, temperature=temperature)  # model(..., fused_lm_head=True) only; else unchanged
        labels = ids.masked_fill(completion == 0, -100)

        def trl_fused():
            out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False, fused_lm_head=True)
            return out.log_probs[:, -K:]

        sides["trl-fused"] = trl_fused

    with torch.no_grad():
        diff = max((packed() - fn()).abs().max().item() for name, fn in sides.items() if name != "packed")
        rows = []
        hook = model.register_forward_pre_hook(lambda m, a, k: rows.append(k["input_ids"].shape), with_kwargs=True)
        packed()
        hook.remove()
    R = rows[0][0]
    print(
        f"batch: {B} sequences ({args.prompts} prompts x 16 completions), padded [{B}, {T}] = {B * T} tokens, "
        f"{real} real ({real / (B * T):.0%}); packed [{R}, {L}] = {R * L} tokens; "
        f"completion width K={K}, V={args.vocab}"
    )
    print(f"max |packed - {' / '.join(n for n in sides if n != 'packed')}| log-prob: {diff:.2e}")

    def timed(fn, grad: bool) -> float:
        start = time.process_time()
        if grad:
            fn().sum().backward()
            model.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                fn()
        return time.process_time() - start

    results = {}
    for grad in (False, True):
        times = {name: [] for name in sides}
        for r in range(args.rounds + 1):  # round 0 warms up
            order = list(sides.items())
            for name, fn in order if r % 2 == 0 else order[::-1]:
                t = timed(fn, grad)
                if r:
                    times[name].append(t)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        label = "fwd+bwd" if grad else "no-grad"
        results[label] = {name: med[name] / med["packed"] for name in sides if name != "packed"}
        cols = "  ".join(f"{name} {t:.3f}" for name, t in med.items())
        ups = ", ".join(f"{x:.2f}x vs {name}" for name, x in results[label].items())
        print(f"{label:8s} CPU s (median of {args.rounds}): {cols}  packed speed-up {ups}")
    print(
        "rl: packed speed-up "
        + "; ".join(f"{label} " + ", ".join(f"{x:.2f}x vs {n}" for n, x in r.items()) for label, r in results.items())
    )


if __name__ == "__main__":
    main()
