"""Benchmark: continuous batching (``generate_batch`` / the manager) of a wrapped hybrid vs ``generate`` with padded
batches, at the same load.

The load: ``--requests`` requests (64; ``--quick`` 8) with lognormal prompt and output lengths (a fixed seed), all
submitted at once. Continuous batching: a wrapped Nemotron-H (mamba, attention, mamba, mlp) served by
``model.init_continuous_batching`` (each request with its own ``max_new_tokens``, up to ``--slots`` requests per step);
padded: the same wrapped model's ``generate`` over batches of ``--slots`` requests in arrival order, left-padded,
each batch decoding until its longest output (the tokens past a request's own output are wasted work and are not
counted). Greedy decoding, no eos: every request produces exactly its output length on both sides.

Figures: requests/s and useful (requested) output tokens/s, process CPU time on one thread (the manager's loop thread
included: both sides do their work in this process), the two sides interleaved over ``--rounds`` rounds (best time;
ratio: the median of the per-round ratios). How many requests give the same greedy tokens on both sides is printed
too (a request may differ after a near-tie of its top two logits).

    python benchmarks/bench_serving.py            # 64 requests, hidden 256
    python benchmarks/bench_serving.py --quick    # 8 requests, hidden 64, seconds
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch

import safepad

__all__ = ["Load", "make_load", "make_model", "run_continuous", "run_padded"]


class Load:
    """The requests: ``prompts`` (token ids) and ``outputs`` (max_new_tokens of each), in arrival order."""

    def __init__(self, prompts: list[list[int]], outputs: list[int]) -> None:
        self.prompts, self.outputs = prompts, outputs

    @property
    def tokens(self) -> int:
        return sum(self.outputs)


def make_load(n: int, seed: int = 0, prompt_median: float = 32, output_median: float = 16, sigma: float = 0.8,
              max_prompt: int = 256, max_output: int = 64) -> Load:  # fmt: skip
    """``n`` requests, prompt and output lengths lognormal (``exp(N(log median, sigma))``, clipped to 1..max)."""
    g = torch.Generator().manual_seed(seed)

    def lengths(median: float, cap: int) -> list[int]:
        x = torch.exp(torch.randn(n, generator=g, dtype=torch.float64) * sigma + float(torch.tensor(median).log()))
        return x.round().clamp(1, cap).long().tolist()

    plen, olen = lengths(prompt_median, max_prompt), lengths(output_median, max_output)
    prompts = [torch.randint(3, 250, (p,), generator=g).tolist() for p in plen]
    return Load(prompts, olen)


def make_model(hidden: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A wrapped Nemotron-H (mamba, attention, mamba, mlp) of width ``hidden``, Mamba2 head dim 32."""
    from transformers import AutoModelForCausalLM

    from safepad.testing.tiny import tiny_config

    cfg = tiny_config(
        "nemotron_h", hidden_size=hidden, mamba_num_heads=hidden * 2 // 32, mamba_head_dim=32, ssm_state_size=32,
        n_groups=2, chunk_size=64, layers_block_type=["mamba", "attention", "mamba", "mlp"],
        intermediate_size=hidden * 2, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(device=device, dtype=dtype).eval()
    return safepad.wrap(model)


def _gen_config(max_new: int):
    from transformers import GenerationConfig

    return GenerationConfig(do_sample=False, max_new_tokens=max_new, eos_token_id=-1, pad_token_id=0)


@torch.no_grad()
def run_continuous(model: torch.nn.Module, load: Load, slots: int, max_batch_tokens: int = 256,
                   timeout: float = 600.0) -> list[list[int]]:  # fmt: skip
    """Every request through one continuous-batching manager (all added at once, each with its own
    ``max_new_tokens``); returns the generated tokens in arrival order."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    longest = max(len(p) for p in load.prompts) + max(load.outputs)
    page = 16
    cb = ContinuousBatchingConfig(
        num_blocks=slots * (-(-longest // page) + 1), max_batch_tokens=max_batch_tokens, max_requests_per_batch=slots,
        page_size=page,
    )  # fmt: skip
    manager = model.init_continuous_batching(generation_config=_gen_config(max(load.outputs)),
                                             continuous_batching_config=cb)  # fmt: skip
    manager.start()
    finals: dict[str, list[int]] = {}
    try:
        for i, (prompt, n) in enumerate(zip(load.prompts, load.outputs)):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=n)
        deadline = time.monotonic() + timeout
        while len(finals) < len(load.prompts):
            if time.monotonic() > deadline:
                raise TimeoutError(f"continuous batching: {len(load.prompts) - len(finals)} requests unfinished")
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"request {result.request_id} failed: {result.error}")
                finals[result.request_id] = list(result.generated_tokens)
    finally:
        manager.stop(block=True)
    return [finals[f"r{i}"] for i in range(len(load.prompts))]


@torch.no_grad()
def run_padded(model: torch.nn.Module, load: Load, batch: int) -> list[list[int]]:
    """``generate`` over left-padded batches of ``batch`` requests in arrival order, each to its longest output;
    returns each request's first ``max_new_tokens`` generated tokens."""
    device = next(model.parameters()).device
    out: list[list[int]] = []
    for s in range(0, len(load.prompts), batch):
        prompts, outputs = load.prompts[s : s + batch], load.outputs[s : s + batch]
        P = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), P, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, p in enumerate(prompts):
            ids[b, P - len(p) :] = torch.tensor(p)
            mask[b, P - len(p) :] = 1
        seqs = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                              generation_config=_gen_config(max(outputs)))  # fmt: skip
        out += [seqs[b, P : P + n].tolist() for b, n in enumerate(outputs)]
    return out


def _once(fn) -> tuple[object, float]:
    t0 = time.process_time()
    result = fn()
    return result, time.process_time() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 requests, hidden 64 (smoke test)")
    ap.add_argument("--requests", type=int, help="number of requests (default 64; --quick 8)")
    ap.add_argument("--slots", type=int, default=8, help="requests per step / per padded batch (default 8)")
    ap.add_argument("--rounds", type=int, help="interleaved timing rounds (default 3; --quick 1)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    for name in ("transformers", "ContinuousBatchingLogger"):
        logging.getLogger(name).setLevel(logging.ERROR)
    n = args.requests or (8 if args.quick else 64)
    rounds = args.rounds or (1 if args.quick else 3)
    hidden = 64 if args.quick else 256
    load = make_load(n, seed=args.seed)
    model = make_model(hidden)
    sides = {"continuous": lambda: run_continuous(model, load, args.slots),
             "padded": lambda: run_padded(model, load, args.slots)}  # fmt: skip
    results: dict[str, list[list[int]]] = {}
    times: dict[str, list[float]] = {k: [] for k in sides}
    for fn in sides.values():  # warm-up
        fn()
    for _ in range(rounds):
        for k, fn in sides.items():
            results[k], t = _once(fn)
            times[k].append(t)
    same = sum(a == b for a, b in zip(results["continuous"], results["padded"]))
    plens = sorted(len(p) for p in load.prompts)
    print(f"safepad {safepad.__version__}, torch {torch.__version__}; process CPU time, one thread, best of {rounds} "
          "interleaved rounds (after a warm-up round)")  # fmt: skip
    print(f"wrapped Nemotron-H (hidden {hidden}; mamba, attention, mamba, mlp), float32, greedy; {n} requests, seed "
          f"{args.seed}: prompts {plens[0]}..{plens[-1]} tokens (median {statistics.median(plens):.0f}), outputs "
          f"{min(load.outputs)}..{max(load.outputs)} (median {statistics.median(load.outputs):.0f}, "
          f"{load.tokens} in all); {args.slots} requests per step / per padded batch")  # fmt: skip
    for k, label in (("continuous", "continuous batching (manager)"), ("padded", "generate, left-padded batches")):
        best = min(times[k])
        print(f"  {label:32s} {best:8.2f} s  {n / best:8.2f} requests/s  {load.tokens / best:9.1f} tokens/s")
    print(f"  requests with the same greedy tokens on both sides: {same}/{n}")
    ratio = statistics.median(p / c for p, c in zip(times["padded"], times["continuous"]))
    print("\nratios (median of the per-round ratios; in brackets: ratio of the best times):")
    print(f"  continuous batching throughput / padded generate:  {ratio:6.2f}x  "
          f"[{min(times['padded']) / min(times['continuous']):.2f}x]")  # fmt: skip


if __name__ == "__main__":
    main()
