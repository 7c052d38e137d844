"""Overhead of safepad.guard per training step (target: <= 1% of the step time).

Two numbers per model, measured side by side in one run:

* ``hook/step`` — the guard's pre-hook alone (called directly, many times, on the step's own inputs)
  divided by the median training step (forward + backward + AdamW step) without the guard. This is the
  precise number.
* ``A/B`` — median step with the guard / median step without it, steps interleaved so that machine load
  hits both alike. It is noisy at the 1% level on a shared CPU; it shows nothing else is slowed.

Inputs are right-padded rows without a cache (a safe layout), so the unwrapped model takes the full check
path: every reduction plus the one ``.tolist()`` per forward.

    python benchmarks/bench_guard.py [--quick] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import NemotronHConfig, NemotronHForCausalLM

from safepad.guard import guard

MODELS = {
    # name: (config kwargs, batch, seqlen)
    "tiny (hidden 64, 4 layers, T=128)": (
        {
            "hidden_size": 64, "layers_block_type": ["mamba", "attention", "mamba", "mlp"],
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
            "mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2, "chunk_size": 16,
        },
        4, 128,
    ),
    "mid (hidden 512, 8 layers, T=1024)": (
        {
            "hidden_size": 512,
            "layers_block_type": ["mamba", "mamba", "mamba", "attention", "mamba", "mamba", "mamba", "mlp"],
            "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 1024,
            "mamba_num_heads": 16, "mamba_head_dim": 64, "ssm_state_size": 64, "n_groups": 2, "chunk_size": 128,
        },
        2, 1024,
    ),
}  # fmt: skip


def build(cfg_kwargs: dict) -> NemotronHForCausalLM:
    cfg = NemotronHConfig(vocab_size=256, pad_token_id=0, bos_token_id=None, eos_token_id=None, use_cache=False,
                          **cfg_kwargs)  # fmt: skip
    torch.manual_seed(0)
    return NemotronHForCausalLM(cfg).train()


def batch(B: int, T: int) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 256, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    for b in range(B):
        mask[b, T - (b * T) // (2 * B) :] = 0 if b else 1  # row b: b*T/(2B) trailing pads
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def step(model, opt, inputs) -> None:
    loss = model(**inputs).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def bench(name: str, cfg_kwargs: dict, B: int, T: int, pairs: int, hook_reps: int) -> None:
    model = build(cfg_kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    inputs = batch(B, T)
    step(model, opt, inputs)  # warm-up (allocations, lazy init)
    handle = guard(model, "error")
    step(model, opt, inputs)
    handle.remove()
    off, on = [], []
    for i in range(pairs):
        for use_guard in ((False, True) if i % 2 == 0 else (True, False)):
            h = guard(model, "error") if use_guard else None
            t0 = time.perf_counter()
            step(model, opt, inputs)
            (on if use_guard else off).append(time.perf_counter() - t0)
            if h is not None:
                h.remove()
    h = guard(model, "error")
    h._pre_forward(model, (), inputs)
    t0 = time.perf_counter()
    for _ in range(hook_reps):
        h._pre_forward(model, (), inputs)
    hook = (time.perf_counter() - t0) / hook_reps
    h.remove()
    t_off, t_on = statistics.median(off), statistics.median(on)
    print(
        f"{name:38s} step {t_off * 1e3:9.2f} ms | hook {hook * 1e6:7.1f} us | hook/step {100 * hook / t_off:6.3f} % "
        f"| A/B on/off {t_on / t_off:6.3f} ({pairs} pairs)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"safepad.guard overhead per training step (fwd+bwd+AdamW), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; target hook/step <= 1 %")  # fmt: skip
    for name, (cfg_kwargs, B, T) in MODELS.items():
        mid = T >= 1024
        pairs = (2 if mid else 10) if args.quick else (4 if mid else 30)
        bench(name, cfg_kwargs, B, T, pairs=pairs, hook_reps=200 if args.quick else 1000)


if __name__ == "__main__":
    main()
