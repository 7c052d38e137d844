"""Part ``generate_cuda_graph``: padded-batch ``generate`` with a static cache, whose decode step transformers
compiles and captures in CUDA graphs (``CompileConfig``'s default ``mode="reduce-overhead"``, taken automatically
on CUDA with ``cache_implementation="static"``), against the same calls eager.

A Nemotron-H slice (mamba, attention, mamba, mlp) at the 9B mixer geometry (:data:`.speed.GEOMETRY`), bf16,
batch 8, prompts of 89-832 tokens (the GPU issue's load), 64 greedy new tokens:

* ``stock_left_graph`` / ``stock_left_eager``: stock with left pads (where its tokens are right), static cache
  compiled, and the dynamic cache eager;
* ``wrapped_{right,left}_graph`` / ``wrapped_{right,left}_eager``: ``safepad.wrap``, both pad sides, the same two.

Rows (correctness): each graph run against its eager twin — the captured step equals the eager step. Greedy tokens
of two runs may part at a near tie (a compiled kernel rounds bf16 differently), so a row compares the logits of
every step up to the first token where the two runs part (their inputs are identical there) and reports the
tokens' agreement as a figure. Also wrapped right-padded == wrapped left-padded (eager) the same way.

Figures: tokens/s of every side, the graph speedup over eager of each, and wrapped graph / stock graph. On the CPU
smoke run (``--device cpu``) the "graph" sides are the static cache eager (no CUDA graphs on CPU, and the compiled
static generate is tested by tests/contract/test_static_compile.py): the figures prove the code path only.
"""

from __future__ import annotations

import copy
import time

import torch

from .common import RUN, TOL, Row, S, emit, rel_err, small, sync
from .speed import VOCAB, _mamba2_config

BLOCKS = ("mamba", "attention", "mamba", "mlp")
SIDES = ("stock_left", "wrapped_right", "wrapped_left")


def _prompts(device: str) -> tuple[list[torch.Tensor], int]:
    """Batch 8 of prompts of 89-832 tokens (8-20 on CPU), and the new-token count."""
    lo, hi = S(89, 8), S(832, 20)
    gen = torch.Generator().manual_seed(5)
    lengths = [lo, hi] + torch.randint(lo, hi + 1, (6,), generator=gen).tolist()
    return [torch.randint(3, VOCAB, (n,), generator=gen).to(device) for n in lengths], S(64, 4)


def _pad(rows: list[torch.Tensor], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, L]`` ids (pad 0) and mask, padded on ``side``."""
    L = max(len(r) for r in rows)
    ids = rows[0].new_zeros(len(rows), L)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        sl = slice(L - len(r), L) if side == "left" else slice(0, len(r))
        ids[i, sl], mask[i, sl] = r, 1
    return ids, mask


def _generate(model, ids, mask, new: int, graph: bool):
    from transformers import CompileConfig

    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
              output_logits=True)  # fmt: skip
    if graph:
        kw["cache_implementation"] = "static"
        if RUN["device"] != "cuda":  # no CUDA graphs on CPU: the static cache, eager (the code path)
            kw["disable_compile"] = True
        else:
            kw["compile_config"] = CompileConfig()  # transformers' default: inductor, mode="reduce-overhead"
    else:
        kw["disable_compile"] = True
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, **kw)
    return out.sequences[:, ids.shape[1] :], torch.stack(out.logits, 1)  # [B, N], [B, N, V]


def _agreement(a, b, tol: float, name: str, dtype: str) -> tuple[Row, float]:
    """A row comparing two runs' logits up to each row's first differing token; the tokens' agreement."""
    (tok_a, log_a), (tok_b, log_b) = a, b
    same = tok_a == tok_b  # [B, N]
    worst = 0.0
    for i in range(tok_a.shape[0]):
        part = int((~same[i]).nonzero()[0]) if not bool(same[i].all()) else same.shape[1] - 1
        worst = max(worst, rel_err(log_a[i, : part + 1].float(), log_b[i, : part + 1].float()))
    return Row(name, dtype, worst, tol), float(same.float().mean())


def run(device: str) -> tuple[list[Row], dict]:
    from transformers import NemotronHForCausalLM

    import safepad

    dtype = torch.float32 if small() else torch.bfloat16
    tol = TOL[dtype]
    stock = NemotronHForCausalLM(_mamba2_config(block_types=BLOCKS)).to(device, dtype).eval()
    wrapped = safepad.wrap(copy.deepcopy(stock)).eval()
    rows_in, new = _prompts(device)
    batch = {"right": _pad(rows_in, "right"), "left": _pad(rows_in, "left")}
    models = {"stock_left": (stock, "left"), "wrapped_right": (wrapped, "right"), "wrapped_left": (wrapped, "left")}
    real = len(rows_in) * new
    outs, rows, figures = {}, [], {"batch": len(rows_in), "new_tokens": new, "dtype": str(dtype).removeprefix("torch.")}
    for side in SIDES:
        model, pad = models[side]
        ids, mask = batch[pad]
        for mode in ("eager", "graph"):
            key = f"{side}_{mode}"
            outs[key] = _generate(model, ids, mask, new, mode == "graph")  # the first call compiles / captures
            reps = 1 if small() else 3
            times = []
            for _ in range(reps):
                sync()
                t0 = time.perf_counter()
                _generate(model, ids, mask, new, mode == "graph")
                sync()
                times.append(time.perf_counter() - t0)
            figures[f"{key}_tokens_per_s"] = real / sorted(times)[len(times) // 2]
            emit(**figures)
        row, agree = _agreement(outs[f"{side}_graph"], outs[f"{side}_eager"], tol, f"{side}: graph == eager",
                                figures["dtype"])  # fmt: skip
        figures[f"{side}_graph_vs_eager_token_agreement"] = agree
        figures[f"{side}_graph_speedup"] = figures[f"{side}_graph_tokens_per_s"] / figures[f"{side}_eager_tokens_per_s"]
        rows.append(row)
        emit(row, **figures)
    row, agree = _agreement(outs["wrapped_right_eager"], outs["wrapped_left_eager"], tol,
                            "wrapped: right pads == left pads", figures["dtype"])  # fmt: skip
    figures["wrapped_right_vs_left_token_agreement"] = agree
    rows.append(row)
    for pad in ("right", "left"):
        figures[f"wrapped_{pad}_graph_vs_stock_graph"] = (
            figures[f"wrapped_{pad}_graph_tokens_per_s"] / figures["stock_left_graph_tokens_per_s"]
        )
    emit(row, **figures)
    return rows, figures
