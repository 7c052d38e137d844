"""The one GPU script (< 10 min on one GPU): kernel agreement, mixer / training speed, syncs, CUDA graphs, memory.

    python benchmarks/gpu_check.py                  # one GPU with mamba-ssm, causal-conv1d (and FLA)
    python benchmarks/gpu_check.py --dry-run        # the plan, each part's budget and the JSON schema; runs nothing
    TRITON_INTERPRET=1 python benchmarks/gpu_check.py --emulate   # CPU (CI): the agreement part, emulated kernels
    python benchmarks/gpu_check.py --json out.json --parts mixer_vs_mamba_ssm,decode_cuda_graph

The check is a list of parts (``PARTS``), each with a hard wall-clock budget (SIGALRM: a part that runs past it
is stopped and reported as ``timeout``; the next part runs), a progress line when it starts and when it ends,
and its figures in ONE JSON report, printed last on a line starting ``GPU_CHECK_JSON`` (and written to
``--json PATH``). The budgets add up to under 10 minutes:

1. ``kernel_agreement`` - every function in ``CHECKS`` on random packed / padded / stateful inputs in fp32 and
   bf16: max relative error of the kernel path against the torch core (forward, and gradients where the
   route has a backward), the tolerance, both timings. ``--emulate`` runs it on CPU through
   ``safepad.testing.kernel_emulation`` (Triton interpreter, C++ stand-ins) at small shapes.
2. ``mixer_vs_mamba_ssm`` - fwd+bwd of a wrapped transformers Mamba2 mixer vs mamba-ssm's own fused ``Mamba2``
   module at the Nemotron-H 9B mixer geometry (128 heads x 64, 8 groups, state 128, chunk 128), bf16; target
   ratio <= 1.05.
3. ``train_tokens_per_s`` - packed + wrapped vs padded stock (with its kernels) training tokens/s on a 2-layer
   Nemotron-H slice (mamba, attention) at that geometry, and the peak memory of each side.
4. ``syncs_per_step`` - host-device syncs in one wrapped packed training step under
   ``torch.cuda.set_sync_debug_mode("warn")``, with the code sites.
5. ``decode_cuda_graph`` - a Mamba2 decode step (conv step + SSD state step) captured in a CUDA graph: tokens/s
   captured vs eager, and that both give the same output.
6. ``mamba1_time_per_token`` - Mamba1's selective scan per token: packed rows (the torch core today) vs one
   sequence per row (mamba-ssm).
7. ``gdn_time_per_token`` - Gated DeltaNet through FLA vs the torch core, packed rows, per token.
8. ``fsdp2_accelerate`` - the FSDP2 recipe through accelerate (needs CUDA, not the kernels).

Every part records its peak CUDA memory. Without CUDA (and without ``--emulate``) only the torch-core self-check
runs and every other part is reported as skipped. Extend the agreement part by appending a function to
``CHECKS`` (``check(device: str) -> list[Row]``), or the check by appending a ``Part``. Exit status: 0 when no
part failed, errored or timed out (skipped parts are fine), 1 otherwise.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from itertools import pairwise
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if __name__ == "__main__" and "--emulate" in sys.argv:  # before anything imports triton
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")
    from safepad.testing import kernel_emulation

    kernel_emulation.install()

from safepad.ops import (  # noqa: E402
    causal_conv1d,
    causal_conv1d_step,
    chunk_gated_delta_rule,
    kernels,
    selective_scan,
    selective_state_step,
    ssd_scan,
    ssd_step,
)
from safepad.testing.inputs import random_seq_idx  # noqa: E402
from safepad.testing.inputs import ssd_inputs as _ssd_inputs  # noqa: E402

#: shape scale: 1 on a GPU; the emulation divides sequence lengths and widths (the interpreter is slow)
SMALL = False


def S(n: int, small: int) -> int:
    """``n`` on a GPU, ``small`` under ``--emulate``."""
    return small if SMALL else n


TOL = {torch.float32: 2e-3, torch.bfloat16: 3e-2, torch.float16: 5e-3}


@dataclass
class Row:
    name: str
    dtype: str
    err: float
    tol: float
    t_kernel_ms: float = float("nan")
    t_torch_ms: float = float("nan")

    @property
    def ok(self) -> bool:
        return self.err <= self.tol


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def timed(fn: Callable[[], object], reps: int = 5) -> tuple[object, float]:
    """Result of ``fn`` and its best time in ms (synchronising on CUDA)."""
    out = fn()
    if SMALL:
        reps = 0
    best = float("inf")
    for _ in range(reps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) * 1e3)
    return out, best


def varlen_seq_idx(Bsz: int, T: int, seed: int, device: str, max_seqs: int = 6) -> torch.Tensor:
    """Random packed layout: ``[B, T]`` int32 with 1..max_seqs sequences per row."""
    return random_seq_idx(Bsz, T, seed, device, max_seqs=max_seqs)


def ssd_inputs(Bsz: int, T: int, device: str, dtype: torch.dtype, H=16, P=64, G=2, N=64, seed=0) -> dict:
    if SMALL:
        H, P, G, N = 2, 8, 1, 8
    return _ssd_inputs(Bsz, T, device, dtype, heads=H, head_dim=P, groups=G, state=N, seed=seed)


def check_conv(device: str) -> list[Row]:
    rows = []
    Bsz, T, D, K = 4, S(4096, 40), S(1280, 16), 4
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator(device=device).manual_seed(1)
        x = torch.randn(Bsz, T, D, generator=g, device=device).to(dtype)
        w = torch.randn(D, K, generator=g, device=device) * 0.5
        b = torch.randn(D, generator=g, device=device)
        init = torch.randn(Bsz, D, K, generator=g, device=device).to(dtype)
        mask = torch.ones(Bsz, T, dtype=torch.bool, device=device)
        mask[1, T - T // 4 :] = False
        cases = {
            "conv varlen (seq_idx)": {"seq_idx": varlen_seq_idx(Bsz, T, 2, device)},
            "conv init+mask+state": {
                "initial_state": init,
                "token_mask": mask,
                "return_final_state": True,
                "state_len": K,
            },
        }
        for name, kw in cases.items():
            with torch.no_grad():
                out_k, tk = timed(partial(causal_conv1d, x, w, b, activation="silu", backend="kernels", **kw))
                out_t, tt = timed(partial(causal_conv1d, x, w, b, activation="silu", backend="torch", **kw))
            out_k = out_k if isinstance(out_k, tuple) else (out_k,)
            out_t = out_t if isinstance(out_t, tuple) else (out_t,)
            err = max(rel_err(a, c) for a, c in zip(out_k, out_t))
            rows.append(Row(name, str(dtype).removeprefix("torch."), err, TOL[dtype], tk, tt))
    return rows


def check_scan(device: str) -> list[Row]:
    rows = []
    Bsz, T, chunk = 2, S(4096, 24), S(256, 8)
    # the Triton interpreter's tl.dot is wrong for bfloat16 (numpy has no bf16): --emulate checks float16
    for dtype in (torch.float32, torch.float16 if SMALL else torch.bfloat16):
        t = ssd_inputs(Bsz, T, device, dtype)
        seq = varlen_seq_idx(Bsz, T, 3, device)
        mask = torch.ones(Bsz, T, dtype=torch.bool, device=device)
        mask[1, T - T // 8 :] = False
        kw = {
            "chunk_size": chunk,
            "D": t["D"],
            "dt_bias": t["dt_bias"],
            "dt_limit": (0.01, 0.5),
            "seq_idx": seq,
            "initial_state": t["initial_state"],
            "token_mask": mask,
            "return_final_state": True,
        }
        args = (t["x"], t["dt"], t["A"], t["B"], t["C"])
        with torch.no_grad():
            (yk, fk), tk = timed(partial(ssd_scan, *args, backend="kernels", **kw))
            (yt, ft), tt = timed(partial(ssd_scan, *args, backend="torch", **kw))
        m = mask[..., None, None]
        err = max(rel_err(yk.float() * m, yt.float() * m), rel_err(fk, ft))
        rows.append(Row("scan varlen+init+mask", str(dtype).removeprefix("torch."), err, TOL[dtype], tk, tt))
    t = ssd_inputs(1, T, device, torch.float32, seed=4)
    seq = varlen_seq_idx(1, T, 5, device, max_seqs=12)
    kw = {"chunk_size": chunk, "D": t["D"], "dt_bias": t["dt_bias"], "seq_idx": seq, "return_varlen_states": True}
    args = (t["x"], t["dt"], t["A"], t["B"], t["C"])
    with torch.no_grad():
        (yk, vk), tk = timed(lambda: ssd_scan(*args, backend="kernels", **kw))
        (yt, vt), tt = timed(lambda: ssd_scan(*args, backend="torch", **kw))
    err = max(rel_err(yk, yt), rel_err(vk, vt))
    rows.append(Row("scan varlen states (B=1)", "float32", err, TOL[torch.float32], tk, tt))
    # backward through the Triton kernels: packed rows + initial state, every input's gradient
    t = ssd_inputs(Bsz, T, device, torch.float32, seed=6)
    leaves = {k: v.detach().clone().requires_grad_() for k, v in t.items()}
    seq = varlen_seq_idx(Bsz, T, 7, device)
    grads = {}
    for backend in ("kernels", "torch"):
        for v in leaves.values():
            v.grad = None

        def step():
            y, fin = ssd_scan(
                **leaves, chunk_size=chunk, seq_idx=seq, dt_limit=(0.0, 0.5), return_final_state=True, backend=backend
            )
            (y.square().mean() + fin.square().mean()).backward()

        _, ms = timed(step)
        grads[backend] = ({k: v.grad.clone() for k, v in leaves.items()}, ms)
    err = max(rel_err(grads["kernels"][0][k], grads["torch"][0][k]) for k in leaves)
    rows.append(Row("scan fwd+bwd grads (packed+init)", "float32", err, 1e-2, grads["kernels"][1], grads["torch"][1]))
    return rows


def check_step(device: str) -> list[Row]:
    rows = []
    t = ssd_inputs(8, 1, device, torch.float32)
    args = (t["initial_state"], t["x"][:, 0], t["dt"][:, 0], t["A"], t["B"][:, 0], t["C"][:, 0])
    for lim in ((0.0, float("inf")), (0.05, float("inf")), (0.0, 0.01)):
        kw = {"D": t["D"], "dt_bias": t["dt_bias"], "dt_limit": lim}
        with torch.no_grad():
            (yk, sk), tk = timed(partial(ssd_step, *args, backend="kernels", **kw))
            (yt, st), tt = timed(partial(ssd_step, *args, backend="torch", **kw))
        rows.append(Row(f"ssd_step dt_limit={lim}", "float32", max(rel_err(yk, yt), rel_err(sk, st)), 1e-4, tk, tt))
    g = torch.Generator(device=device).manual_seed(2)
    D = S(1280, 16)
    x = torch.randn(8, D, generator=g, device=device)
    state = torch.randn(8, D, 4, generator=g, device=device)
    w, b = torch.randn(D, 4, generator=g, device=device), torch.randn(D, generator=g, device=device)
    with torch.no_grad():
        (yk, sk), tk = timed(lambda: causal_conv1d_step(x, state, w, b, activation="silu", backend="kernels"))
        (yt, st), tt = timed(lambda: causal_conv1d_step(x, state, w, b, activation="silu", backend="torch"))
    rows.append(Row("conv step", "float32", max(rel_err(yk, yt), rel_err(sk, st)), 1e-5, tk, tt))
    return rows


def check_mamba1(device: str) -> list[Row]:
    """selective_scan_fn (fwd+bwd, one sequence per row) and selective_state_update (decode)."""
    g = torch.Generator(device=device).manual_seed(8)
    Bsz, T, Dm, N = 2, S(2048, 12), S(1536, 16), 16
    r = lambda *s: torch.randn(*s, generator=g, device=device)  # noqa: E731
    inp = {
        "u": r(Bsz, T, Dm),
        "delta": r(Bsz, T, Dm) * 0.5 - 1,
        "A": -torch.rand(Dm, N, generator=g, device=device),
        "B": r(Bsz, T, N),
        "C": r(Bsz, T, N),
        "D": r(Dm),
        "z": r(Bsz, T, Dm),
        "delta_bias": r(Dm) * 0.3,
    }
    leaves = {k: v.requires_grad_() for k, v in inp.items()}
    res = {}
    for backend in ("kernels", "torch"):
        for v in leaves.values():
            v.grad = None

        def step():
            y = selective_scan(**leaves, backend=backend)
            y.square().mean().backward()
            return y.detach()

        y, ms = timed(step)
        res[backend] = (y, {k: v.grad.clone() for k, v in leaves.items()}, ms)
    err = max(
        rel_err(res["kernels"][0], res["torch"][0]),
        *(rel_err(res["kernels"][1][k], res["torch"][1][k]) for k in leaves),
    )
    rows = [Row("mamba1 selective_scan fwd+bwd", "float32", err, 1e-3, res["kernels"][2], res["torch"][2])]
    st = r(Bsz, Dm, N)
    args = (st, r(Bsz, Dm), r(Bsz, Dm), inp["A"].detach(), r(Bsz, N), r(Bsz, N))
    with torch.no_grad():
        zz = r(Bsz, Dm)
        (yk, sk), tk = timed(lambda: selective_state_step(*args, D=inp["D"].detach(), z=zz, backend="kernels"))
        (yt, s_t), tt = timed(lambda: selective_state_step(*args, D=inp["D"].detach(), z=zz, backend="torch"))
    rows.append(Row("mamba1 selective_state_step", "float32", max(rel_err(yk, yt), rel_err(sk, s_t)), 1e-4, tk, tt))
    return rows


def check_fla(device: str) -> list[Row]:
    """FLA chunk_gated_delta_rule on a packed, padded bf16 batch with initial states (skipped without FLA)."""
    if kernels.fla_chunk_gated_delta_rule is None:
        return []
    if SMALL:  # fla 0.6.0's chunk_delta_h stops with a Triton interpreter error: GPU only
        print("fla chunk_gated_delta_rule: not runnable under the Triton interpreter (checked on a GPU only)")
        return []
    g = torch.Generator(device=device).manual_seed(9)
    Bsz, T, H, Dk = 2, S(2048, 16), 8, S(128, 16)
    k = torch.nn.functional.normalize(torch.randn(Bsz, T, H, Dk, generator=g, device=device), dim=-1)
    inp = {
        "q": torch.randn(Bsz, T, H, Dk, generator=g, device=device).bfloat16(),
        "k": k.bfloat16(),
        "v": torch.randn(Bsz, T, H, Dk, generator=g, device=device).bfloat16(),
        "g": -torch.rand(Bsz, T, H, generator=g, device=device) * 0.3,
        "beta": torch.rand(Bsz, T, H, generator=g, device=device).bfloat16(),
    }
    mask = torch.ones(Bsz, T, dtype=torch.bool, device=device)
    mask[1, T - T // 4 :] = False
    kw = {
        "seq_idx": varlen_seq_idx(Bsz, T, 10, device),
        "token_mask": mask,
        "use_qk_l2norm": True,
        "initial_state": torch.randn(Bsz, H, Dk, Dk, generator=g, device=device) * 0.1,
        "return_final_state": True,
    }
    with torch.no_grad():
        (ok, fk), tk = timed(lambda: chunk_gated_delta_rule(**inp, backend="kernels", **kw))
        fp32 = {n: v.float() for n, v in inp.items()}
        (ot, ft), tt = timed(lambda: chunk_gated_delta_rule(**fp32, backend="torch", **kw))
    err = max(rel_err(ok.float()[mask], ot[mask]), rel_err(fk, ft))
    return [Row("fla chunk_gated_delta_rule packed+pad+init", "bfloat16", err, TOL[torch.bfloat16], tk, tt)]


def check_models(device: str) -> list[Row]:
    """safepad.wrap on CUDA: kernel backend == torch backend, and the audit scenarios pass on the GPU."""
    import copy

    import safepad
    from safepad.testing.scenarios import run_scenario
    from safepad.testing.tiny import tiny_model

    rows = []
    for family in ("nemotron_h", "mamba2", "jamba", "qwen3_next"):
        stock = tiny_model(family).to(device)
        on_kernels = safepad.wrap(copy.deepcopy(stock), backend="auto")
        on_torch = safepad.wrap(copy.deepcopy(stock), backend="torch")
        lens = [1, 17, 40, 130, 7]
        ids = torch.randint(3, 250, (1, sum(lens)), device=device)
        seq_idx = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lens)])[None].to(device)
        with torch.no_grad():
            yk, tk = timed(lambda: on_kernels(input_ids=ids, seq_idx=seq_idx).logits)
            yt, tt = timed(lambda: on_torch(input_ids=ids, seq_idx=seq_idx).logits)
        rows.append(Row(f"wrap {family}: packed logits", "float32", rel_err(yk, yt), TOL[torch.float32], tk, tt))
        ref = copy.deepcopy(stock)
        for scenario in ("packed_seq_idx", "right_pad_decode", "chunked_prefill_pad", "decode_dt_max", "generate"):
            res = run_scenario(on_kernels, ref, scenario, tol=1e-3)
            if res.applicable:
                err = float("inf") if res.max_error is None else res.max_error
                rows.append(Row(f"wrap {family}: {scenario} vs alone", "float32", err, 1e-3))
    return rows


# Each check is ``check(device) -> list[Row]``; model-level checks (safepad.wrap) come last.
CHECKS: list[Callable[[str], list[Row]]] = [check_conv, check_scan, check_step, check_mamba1, check_fla, check_models]


# ---------------------------------------------------------------------------------------------------------------
# GPU measurements (CUDA only). Each returns a dict of figures; the runner below gives each a hard time budget.
# ---------------------------------------------------------------------------------------------------------------

#: Nemotron-H 8B/9B mixer geometry: 128 heads x 64, 8 groups, state 128, chunk 128 (hidden 4096, expand 2)
GEOMETRY = {"hidden": 4096, "heads": 128, "head_dim": 64, "groups": 8, "state": 128, "chunk": 128, "conv": 4}


def _cuda_median_ms(fn: Callable[[], object], reps: int, warmup: int = 3) -> float:
    """Median wall time of ``fn`` in ms, synchronising around every call (warm-up calls first: autotuning)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def _mamba2_config(layers: int = 1, block_types: tuple[str, ...] | None = None):
    """A transformers ``Mamba2Config`` (``block_types`` None) or ``NemotronHConfig`` at :data:`GEOMETRY`."""
    g = GEOMETRY
    common = dict(hidden_size=g["hidden"], n_groups=g["groups"], chunk_size=g["chunk"], conv_kernel=g["conv"],
                  vocab_size=32000, use_conv_bias=True, use_bias=False)  # fmt: skip
    if block_types is None:
        from transformers import Mamba2Config

        return Mamba2Config(num_heads=g["heads"], head_dim=g["head_dim"], state_size=g["state"], expand=2,
                            num_hidden_layers=layers, **common)  # fmt: skip
    from transformers import NemotronHConfig

    return NemotronHConfig(mamba_num_heads=g["heads"], mamba_head_dim=g["head_dim"], ssm_state_size=g["state"],
                           expand=2, layers_block_type=list(block_types), num_attention_heads=32,
                           num_key_value_heads=8, head_dim=128, intermediate_size=4 * g["hidden"],
                           attn_implementation="sdpa", **common)  # fmt: skip


def bench_mixer_vs_raw(device: str, reps: int = 20) -> dict:
    """fwd+bwd of a wrapped transformers Mamba2 mixer vs mamba-ssm's ``Mamba2`` module, same shapes, bf16.

    Geometry :data:`GEOMETRY` (the Nemotron-H 9B mixer), ``[B=2, T=4096]``. Both sides run the same math:
    in_proj, depthwise conv, SSD scan, gated RMSNorm, out_proj. The raw module takes mamba-ssm's fused path
    (``mamba_split_conv1d_scan_combined``); the wrapped mixer takes safepad's dispatch. Target ratio <= 1.05.
    """
    from mamba_ssm.modules.mamba2 import Mamba2 as RawMamba2
    from transformers import Mamba2Model

    import safepad

    g, Bsz, T = GEOMETRY, 2, 4096
    hf = safepad.wrap(Mamba2Model(_mamba2_config())).to(device, torch.bfloat16)
    mixer = hf.layers[0].mixer
    raw = RawMamba2(
        d_model=g["hidden"],
        d_state=g["state"],
        d_conv=g["conv"],
        expand=2,
        headdim=g["head_dim"],
        ngroups=g["groups"],
        chunk_size=g["chunk"],
        bias=False,
        conv_bias=True,
    ).to(device, torch.bfloat16)
    x = torch.randn(Bsz, T, g["hidden"], device=device, dtype=torch.bfloat16, requires_grad=True)

    def run(fn):
        def step():
            fn(x).sum().backward()

        return step

    sides = {"wrapped": run(lambda h: mixer(h)), "raw": run(lambda h: raw(h))}
    for f in sides.values():  # warm-up (autotune) both
        for _ in range(3):
            f()
    times: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(reps):  # interleaved
        for k, f in sides.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            f()
            torch.cuda.synchronize()
            times[k].append((time.perf_counter() - t0) * 1e3)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    ratio = med["wrapped"] / med["raw"]
    return {"wrapped_ms": med["wrapped"], "mamba_ssm_ms": med["raw"], "ratio": ratio, "target": 1.05,
            "met": ratio <= 1.05, "shape": f"B={Bsz} T={T} hidden={g['hidden']} bf16"}  # fmt: skip


def _doc_lengths(n: int, median: int, cap: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.exp(torch.randn(n, generator=gen) + float(torch.log(torch.tensor(float(median)))))
    return [int(v) for v in x.round().clamp(16, cap)]


def bench_train_tokens(device: str, steps: int = 8) -> dict:
    """Training tokens/s on a 2-layer Nemotron-H slice (mamba, attention) at :data:`GEOMETRY`, bf16, AdamW.

    * packed + wrapped: documents packed into one ``[1, 8192]`` row by ``DataCollatorForPackedSSM``
      (``pad_to_length``), through ``safepad.wrap`` (mamba-ssm kernels with ``seq_idx``);
    * padded stock with kernels: the same documents in a right-padded ``[B, longest]`` batch, the stock model
      (transformers' own CUDA path with ``attention_mask``).

    tokens/s counts real (non-pad) tokens. Also the peak memory of each side.
    """
    import copy

    from transformers import NemotronHForCausalLM

    import safepad
    from safepad.collators import DataCollatorForPackedSSM

    row = 8192
    lengths, total = [], 0
    for n in _doc_lengths(64, 600, 2048, seed=0):
        if total + n > row:
            break
        lengths.append(n)
        total += n
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(3, 32000, (n,), generator=gen) for n in lengths]
    packed = DataCollatorForPackedSSM(pad_to_length=row)([{"input_ids": d} for d in docs])
    packed = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in packed.items()}
    longest = max(lengths)
    ids = torch.zeros(len(docs), longest, dtype=torch.long)
    mask = torch.zeros(len(docs), longest, dtype=torch.long)
    for i, d in enumerate(docs):
        ids[i, : len(d)], mask[i, : len(d)] = d, 1
    padded = {"input_ids": ids.to(device), "attention_mask": mask.to(device),
              "labels": ids.masked_fill(mask == 0, -100).to(device)}  # fmt: skip
    base = NemotronHForCausalLM(_mamba2_config(block_types=("mamba", "attention"))).to(device, torch.bfloat16)
    sides = {"packed_wrapped": (safepad.wrap(copy.deepcopy(base)).train(), packed),
             "padded_stock": (base.train(), padded)}  # fmt: skip
    out: dict = {"real_tokens": total, "documents": len(docs), "packed_row": row,
                 "padded_shape": [len(docs), longest]}  # fmt: skip
    for name, (model, batch) in sides.items():
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def step(model=model, batch=batch, opt=opt):
            model(**batch, use_cache=False).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        torch.cuda.reset_peak_memory_stats()
        ms = _cuda_median_ms(step, steps, warmup=2)
        out[f"{name}_step_ms"] = ms
        out[f"{name}_tokens_per_s"] = total / (ms / 1e3)
        out[f"{name}_peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        del opt
    out["speedup"] = out["packed_wrapped_tokens_per_s"] / out["padded_stock_tokens_per_s"]
    return out


def count_syncs_per_step(device: str) -> dict:
    """Host-device syncs in one wrapped packed training step (1-layer slice), ``set_sync_debug_mode("warn")``.

    Every synchronising CUDA call warns once per call; the warnings are counted (after two warm-up steps).
    """
    import warnings

    from transformers import NemotronHForCausalLM

    import safepad
    from safepad.collators import DataCollatorForPackedSSM

    model = safepad.wrap(NemotronHForCausalLM(_mamba2_config(block_types=("mamba", "attention"))))
    model = model.to(device, torch.bfloat16).train()
    gen = torch.Generator().manual_seed(2)
    feats = [{"input_ids": torch.randint(3, 32000, (n,), generator=gen)} for n in (700, 1500, 300, 1200, 396)]
    batch = DataCollatorForPackedSSM(pad_to_length=4096)(feats)
    batch = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}

    def step():
        model(**batch, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)

    step()
    step()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    where = sorted({f"{w.filename.rsplit('/', 1)[-1]}:{w.lineno}" for w in syncs})
    return {"syncs_per_step": len(syncs), "sites": where[:20]}


def bench_decode_graph(device: str, reps: int = 200) -> dict:
    """One Mamba2 decode step (conv step + SSD state step, one layer at :data:`GEOMETRY`, batch 8, fp32)
    captured in a CUDA graph vs eager: tokens/s of each, and that the captured step equals the eager one."""
    g, Bsz = GEOMETRY, 8
    H, P, G, N, K = g["heads"], g["head_dim"], g["groups"], g["state"], g["conv"]
    D = H * P + 2 * G * N  # the conv runs over x, B and C
    gen = torch.Generator(device=device).manual_seed(3)

    def r(*shape, scale=1.0, dtype=torch.float32):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    w, b = r(D, K, scale=0.5), r(D, scale=0.1)
    A, dt_bias, Dskip = -torch.rand(H, generator=gen, device=device), r(H, dtype=torch.float32), r(H)
    xin, dtin = r(Bsz, D), r(Bsz, H, scale=0.5)
    conv_state, ssm_state = r(Bsz, D, K), r(Bsz, H, P, N, dtype=torch.float32)

    def step():
        y, new_conv = causal_conv1d_step(xin, conv_state, w, b, activation="silu")
        conv_state.copy_(new_conv)
        x, B_, C_ = torch.split(y, [H * P, G * N, G * N], dim=-1)
        out, new_ssm = ssd_step(ssm_state, x.view(Bsz, H, P), dtin, A, B_.view(Bsz, G, N), C_.view(Bsz, G, N),
                                D=Dskip, dt_bias=dt_bias)  # fmt: skip
        ssm_state.copy_(new_ssm)
        return out

    saved = (conv_state.clone(), ssm_state.clone())
    eager_out = step()
    conv_state.copy_(saved[0])
    ssm_state.copy_(saved[1])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up on a side stream before capture (allocator, kernel selection)
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    conv_state.copy_(saved[0])
    ssm_state.copy_(saved[1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = step()
    conv_state.copy_(saved[0])
    ssm_state.copy_(saved[1])
    graph.replay()
    err = rel_err(graph_out.float(), eager_out.float())
    eager_ms = _cuda_median_ms(step, reps)
    graph_ms = _cuda_median_ms(graph.replay, reps)
    return {"eager_step_ms": eager_ms, "graph_step_ms": graph_ms, "eager_tokens_per_s": Bsz / (eager_ms / 1e3),
            "graph_tokens_per_s": Bsz / (graph_ms / 1e3), "speedup": eager_ms / graph_ms,
            "graph_vs_eager_rel_err": err, "batch": Bsz}  # fmt: skip


def bench_mamba1(device: str, reps: int = 10) -> dict:
    """Mamba1 selective scan fwd+bwd time per token (Falcon-Mamba-7B-like: d_inner 8192, state 16, bf16 inputs):
    packed rows (``seq_idx``: the torch core today) vs the same tokens as one sequence per row (mamba-ssm)."""
    gen = torch.Generator(device=device).manual_seed(4)
    Bsz, T, Dm, N = 1, 4096, 8192, 16

    def r(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    inp = {
        "u": r(Bsz, T, Dm),
        "delta": r(Bsz, T, Dm) * 0.5 - 1,
        "A": -torch.rand(Dm, N, generator=gen, device=device),
        "B": r(Bsz, T, N),
        "C": r(Bsz, T, N),
        "D": r(Dm),
        "z": r(Bsz, T, Dm),
        "delta_bias": r(Dm) * 0.3,
    }
    leaves = {k: v.requires_grad_() for k, v in inp.items()}
    seq = random_seq_idx(Bsz, T, 5, device, max_seqs=8)
    out = {"tokens": Bsz * T, "d_inner": Dm, "state": N}
    for name, kw in (("packed", {"seq_idx": seq}), ("unpacked", {})):

        def step(kw=kw):
            selective_scan(**leaves, **kw).square().mean().backward()

        ms = _cuda_median_ms(step, reps, warmup=2)
        out[f"{name}_ms"] = ms
        out[f"{name}_us_per_token"] = ms * 1e3 / (Bsz * T)
    out["packed_vs_unpacked"] = out["packed_ms"] / out["unpacked_ms"]
    return out


def bench_gdn(device: str, reps: int = 10) -> dict:
    """Gated DeltaNet fwd+bwd time per token through FLA (``chunk_gated_delta_rule``, packed rows, bf16,
    Qwen3-Next-like: 32 value heads x 128, 16 key heads x 128) vs safepad's torch core."""
    if kernels.fla_chunk_gated_delta_rule is None:
        raise RuntimeError("flash-linear-attention (fla) is not importable")
    gen = torch.Generator(device=device).manual_seed(6)
    Bsz, T, H, Hk, Dk = 1, 4096, 32, 16, 128

    def r(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    k = torch.nn.functional.normalize(r(Bsz, T, Hk, Dk), dim=-1)
    inp = {"q": r(Bsz, T, Hk, Dk).bfloat16(), "k": k.bfloat16(), "v": r(Bsz, T, H, Dk).bfloat16(),
           "g": -torch.rand(Bsz, T, H, generator=gen, device=device) * 0.3,
           "beta": torch.rand(Bsz, T, H, generator=gen, device=device).bfloat16()}  # fmt: skip
    leaves = {n: v.requires_grad_() for n, v in inp.items()}
    seq = random_seq_idx(Bsz, T, 7, device, max_seqs=8)
    out = {"tokens": Bsz * T}
    for backend in ("kernels", "torch"):

        def step(backend=backend):
            y = chunk_gated_delta_rule(**leaves, seq_idx=seq, use_qk_l2norm=True, backend=backend)
            y.float().square().mean().backward()

        ms = _cuda_median_ms(step, reps, warmup=2)
        out[f"{backend}_ms"] = ms
        out[f"{backend}_us_per_token"] = ms * 1e3 / (Bsz * T)
    out["fla_speedup_vs_torch"] = out["torch_ms"] / out["kernels_ms"]
    return out


def cpu_self_check() -> list[Row]:
    """Torch core only: a packed row == its sequences run alone (fp32, small)."""
    t = ssd_inputs(1, 96, "cpu", torch.float32, H=4, P=8, N=8)
    seq = varlen_seq_idx(1, 96, 7, "cpu")
    y, v = ssd_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], chunk_size=16, seq_idx=seq, return_varlen_states=True)
    starts = [0] + (torch.nonzero(seq[0, 1:] != seq[0, :-1]).squeeze(1) + 1).tolist() + [96]
    err = 0.0
    for i, (s, e) in enumerate(pairwise(starts)):
        ys, fs = ssd_scan(
            t["x"][:, s:e],
            t["dt"][:, s:e],
            t["A"],
            t["B"][:, s:e],
            t["C"][:, s:e],
            chunk_size=16,
            return_final_state=True,
        )
        err = max(err, rel_err(y[:, s:e], ys), rel_err(v[i], fs[0]))
    return [Row("torch core: packed == per-sequence (cpu)", "float32", err, 1e-5)]


# ---------------------------------------------------------------------------------------------------------------
# FSDP2 through accelerate (issue 13). Needs CUDA, not the kernels. accelerate cannot run FSDP on CPU (it selects
# DistributedType.FSDP only for accelerator device types; see tests/examples/test_train_packed.py), so this is
# where the docs' FSDP2 recipe runs: examples/train_packed.py under `accelerate launch --use_fsdp --fsdp_version 2`
# with each NemotronHBlock an FSDP unit, against the same 4 packed rows per step in one process.
# ---------------------------------------------------------------------------------------------------------------


def check_fsdp2_accelerate(steps: int = 4) -> list[Row]:
    """Per-step losses of FSDP2 (min(2, #GPUs) processes) == one process; FSDP units and sharding verified.

    One row: max relative loss difference over the steps, tolerance 5e-6 (the DDP / FSDP2 CPU tests'); a run
    that did not shard (not FSDP, no NemotronHBlock unit, no DTensor parameter, or safepad's mixers lost)
    reports inf. With one GPU the FSDP2 world has one rank (units and DTensors, no cross-rank reduction).
    """
    import json
    import os
    import socket
    import subprocess
    import tempfile

    root = Path(__file__).resolve().parents[1]
    nproc = min(2, torch.cuda.device_count())
    small = ["--max-length", "128", "--max-docs", "120", "--logging-steps", "1", "--seed", "0",
             "--max-steps", str(steps), "--device", "auto"]  # fmt: skip
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    fsdp = [sys.executable, "-m", "accelerate.commands.launch", "--use_fsdp", "--fsdp_version", "2",
            "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP", "--fsdp_transformer_layer_cls_to_wrap",
            "NemotronHBlock", "--fsdp_reshard_after_forward", "true", "--fsdp_state_dict_type", "SHARDED_STATE_DICT",
            "--num_processes", str(nproc), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend",
            "no", "--main_process_ip", "127.0.0.1", "--main_process_port", str(port)]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "HF_HOME": os.path.join(tmp, "hf"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(root)}
        logs = {}
        for name, launcher, batch in (("fsdp", fsdp, 4 // nproc), ("one", [sys.executable], 4)):
            out = os.path.join(tmp, name)
            cmd = [*launcher, str(root / "examples" / "train_packed.py"), "--output-dir", out,
                   "--batch-size", str(batch), *small]  # fmt: skip
            proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600, check=False)
            if proc.returncode != 0:
                print(proc.stdout[-2000:], proc.stderr[-4000:])
                return [Row(f"fsdp2 accelerate: {name} run exited {proc.returncode}", "float32", float("inf"), 5e-6)]
            with open(os.path.join(out, "train_log.json")) as f:
                logs[name] = json.load(f)
    multi, single = logs["fsdp"], logs["one"]
    print(
        f"fsdp2 accelerate: {multi['distributed_type']} v{multi['fsdp_version']}, units {multi['fsdp_units']}, "
        f"{multi['sharded_params']} sharded params, {multi['wrapped_mixers']} wrapped mixers, {nproc} process(es)"
    )
    sharded = (multi["distributed_type"] == "FSDP" and multi["fsdp_version"] == 2 and multi["sharded_params"] > 0
               and "NemotronHBlock" in multi["fsdp_units"] and multi["wrapped_mixers"] == 2)  # fmt: skip
    one = [h["loss"] for h in single["log_history"] if "loss" in h]
    two = [h["loss"] for h in multi["log_history"] if "loss" in h]
    complete = sharded and len(one) == len(two) == steps
    err = max(abs(a - b) / abs(a) for a, b in zip(one, two)) if complete else float("inf")
    return [Row(f"fsdp2 accelerate ({nproc} proc) losses vs 1 proc", "float32", err, 5e-6)]


# ---------------------------------------------------------------------------------------------------------------
# end of the FSDP2 check
# ---------------------------------------------------------------------------------------------------------------


def print_table(rows: list[Row]) -> None:
    print(f"{'check':<44} {'dtype':<9} {'max rel err':>11} {'tol':>8} {'kernel ms':>10} {'torch ms':>10}  ok")
    for r in rows:
        print(
            f"{r.name:<44} {r.dtype:<9} {r.err:>11.2e} {r.tol:>8.0e} {r.t_kernel_ms:>10.2f} {r.t_torch_ms:>10.2f}  "
            f"{'PASS' if r.ok else 'FAIL'}"
        )


# ---------------------------------------------------------------------------------------------------------------
# The runner: parts with a hard time budget each, a progress line per part, one JSON report.
# ---------------------------------------------------------------------------------------------------------------

#: JSON report version (bump when a field changes meaning)
SCHEMA_VERSION = 1


class PartTimeout(Exception):
    """A part ran past its budget (raised in the main thread by SIGALRM)."""


@dataclass
class Part:
    """One section of the check: ``run(device) -> (rows, figures)``; ``needs`` is "cuda" or "any"."""

    name: str
    budget_s: float
    needs: str
    what: str
    run: Callable[[str], tuple[list[Row], dict]]
    figures: tuple[str, ...] = ()
    #: budget under --emulate (the Triton interpreter on CPU is orders of magnitude slower than a GPU)
    emulate_budget_s: float | None = None


def _agreement(device: str) -> tuple[list[Row], dict]:
    rows = []
    for check in CHECKS if not SMALL else CHECKS[:-1]:  # the model-level check takes minutes interpreted
        try:
            rows.extend(check(device))
        except PartTimeout:
            raise
        except Exception as e:
            rows.append(Row(f"{check.__name__}: {type(e).__name__}: {str(e)[:60]}", "-", float("inf"), 0.0))
    return rows, {"routes": len(rows), "failed": sum(not r.ok for r in rows)}


def _figures_only(fn: Callable[[str], dict]) -> Callable[[str], tuple[list[Row], dict]]:
    def run(device: str) -> tuple[list[Row], dict]:
        return [], fn(device)

    run.__name__ = fn.__name__
    return run


def _fsdp2(device: str) -> tuple[list[Row], dict]:
    rows = check_fsdp2_accelerate()
    return rows, {"max_rel_loss_diff": rows[0].err if rows else None}


PARTS: list[Part] = [
    Part(
        "kernel_agreement",
        150,
        "any",
        "every CUDA route == safepad's torch core (fp32 / bf16), per-route rows",
        _agreement,
        ("routes", "failed"),
        emulate_budget_s=900,
    ),
    Part(
        "mixer_vs_mamba_ssm",
        75,
        "cuda",
        "wrapped Mamba2 mixer fwd+bwd vs mamba-ssm's fused Mamba2, 9B geometry, bf16 (target within 5%)",
        _figures_only(bench_mixer_vs_raw),
        ("wrapped_ms", "mamba_ssm_ms", "ratio", "target", "met"),
    ),
    Part(
        "train_tokens_per_s",
        90,
        "cuda",
        "packed+wrapped vs padded stock (kernels) training tokens/s, 2-layer "
        "Nemotron-H slice (mamba, attention) at the 9B geometry; peak memory of each",
        _figures_only(bench_train_tokens),
        (
            "packed_wrapped_tokens_per_s",
            "padded_stock_tokens_per_s",
            "speedup",
            "packed_wrapped_peak_mem_gib",
            "padded_stock_peak_mem_gib",
        ),
    ),
    Part(
        "syncs_per_step",
        45,
        "cuda",
        "host-device syncs in one wrapped packed training step (torch.cuda.set_sync_debug_mode('warn'))",
        _figures_only(count_syncs_per_step),
        ("syncs_per_step", "sites"),
    ),
    Part(
        "decode_cuda_graph",
        30,
        "cuda",
        "Mamba2 decode step captured in a CUDA graph vs eager: tokens/s",
        _figures_only(bench_decode_graph),
        ("eager_tokens_per_s", "graph_tokens_per_s", "speedup", "graph_vs_eager_rel_err"),
    ),
    Part(
        "mamba1_time_per_token",
        45,
        "cuda",
        "Mamba1 selective scan fwd+bwd per token: packed rows (torch core today) vs one sequence per row (mamba-ssm)",
        _figures_only(bench_mamba1),
        ("packed_us_per_token", "unpacked_us_per_token", "packed_vs_unpacked"),
    ),
    Part(
        "gdn_time_per_token",
        45,
        "cuda",
        "Gated DeltaNet fwd+bwd per token, packed rows: FLA vs torch core",
        _figures_only(bench_gdn),
        ("kernels_us_per_token", "torch_us_per_token", "fla_speedup_vs_torch"),
    ),
    Part(
        "fsdp2_accelerate",
        110,
        "cuda",
        "FSDP2 through accelerate: per-step losses == one process",
        _fsdp2,
        ("max_rel_loss_diff",),
    ),
]

#: the JSON report's shape (printed by --dry-run)
REPORT_SCHEMA = {
    "schema_version": "int",
    "mode": "'gpu' | 'emulate' | 'cpu'",
    "device": "str",
    "torch": "str",
    "total_budget_s": "float",
    "total_s": "float",
    "ok": "bool: no part failed, errored or timed out",
    "parts": [
        {
            "name": "str",
            "status": "'ok' | 'fail' | 'error' | 'timeout' | 'skipped'",
            "budget_s": "float",
            "seconds": "float",
            "peak_mem_gib": "float | null (CUDA only)",
            "figures": "{name: number | str | bool | list} (the part's figures below)",
            "rows": [
                {
                    "name": "str",
                    "dtype": "str",
                    "err": "float",
                    "tol": "float",
                    "t_kernel_ms": "float",
                    "t_torch_ms": "float",
                    "ok": "bool",
                }
            ],  # fmt: skip
            "message": "str | null (skip reason, exception, timeout)",
        }
    ],
}


def _json_float(x: object) -> object:
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return str(x)  # JSON has no nan / inf
    if isinstance(x, dict):
        return {k: _json_float(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_float(v) for v in x]
    return x


def run_part(part: Part, device: str, budget_s: float) -> dict:
    """Run one part under a hard wall-clock budget (SIGALRM); never raises."""
    import signal

    def on_alarm(signum, frame):
        raise PartTimeout(f"{part.name} ran past its budget of {budget_s:.0f} s")

    res: dict = {"name": part.name, "status": "ok", "budget_s": budget_s, "seconds": 0.0, "peak_mem_gib": None,
                 "figures": {}, "rows": [], "message": None}  # fmt: skip
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, budget_s)
    t0 = time.perf_counter()
    try:
        rows, figures = part.run(device)
        if rows:
            print_table(rows)
        res["rows"] = [{**r.__dict__, "ok": r.ok} for r in rows]
        res["figures"] = figures
        if not all(r.ok for r in rows):
            res["status"] = "fail"
    except PartTimeout as e:
        res["status"], res["message"] = "timeout", str(e)
    except Exception as e:
        res["status"], res["message"] = "error", f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        res["seconds"] = time.perf_counter() - t0
        if cuda:
            try:
                res["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
                torch.cuda.empty_cache()
            except Exception:
                pass
    return _json_float(res)


def plan(mode: str, scale: float = 1.0) -> list[tuple[Part, str | None, float]]:
    """``(part, skip reason or None, budget_s)`` for every part in ``mode`` ('gpu' | 'emulate' | 'cpu')."""
    out = []
    for p in PARTS:
        skip = None
        if p.needs == "cuda" and mode != "gpu":
            skip = "needs CUDA" + (" (--emulate runs the agreement part only)" if mode == "emulate" else "")
        elif p.needs == "any" and mode == "cpu":
            skip = "no CUDA device (use --emulate to run it on CPU)"
        budget = p.emulate_budget_s if mode == "emulate" and p.emulate_budget_s else p.budget_s
        out.append((p, skip, budget * scale))
    return out


def print_plan(mode: str, scale: float) -> None:
    import json

    rows = plan(mode, scale)
    total = sum(b for p, skip, b in rows if skip is None)
    print(f"gpu_check plan ({mode}): {len(rows)} parts, budget {sum(b for _, _, b in rows):.0f} s in all "
          f"(this mode runs {total:.0f} s of it)")  # fmt: skip
    for i, (p, skip, b) in enumerate(rows, 1):
        print(f"  {i}. {p.name:<22} budget {b:5.0f} s  {'SKIP: ' + skip if skip else 'run'}")
        print(f"     {p.what}; figures: {', '.join(p.figures)}")
    print("JSON report schema:")
    print(json.dumps(REPORT_SCHEMA, indent=2))


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    global SMALL
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--emulate", action="store_true", help="CPU: kernel agreement through the emulated kernels")
    ap.add_argument("--dry-run", action="store_true", help="print the plan, each part's budget and the JSON schema")
    ap.add_argument("--json", metavar="PATH", help="also write the JSON report to PATH")
    ap.add_argument("--parts", help="comma-separated part names to run (default: all)")
    ap.add_argument("--budget-scale", type=float, default=1.0, help="multiply every part's budget (default 1)")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    mode = "emulate" if args.emulate else ("gpu" if torch.cuda.is_available() else "cpu")
    if args.parts:
        unknown = set(args.parts.split(",")) - {p.name for p in PARTS}
        if unknown:
            ap.error(f"unknown parts {sorted(unknown)}; known: {', '.join(p.name for p in PARTS)}")
    if args.dry_run:
        print_plan(mode, args.budget_scale)
        return 0
    need = ("mamba_chunk_scan_combined", "selective_state_update", "causal_conv1d_fn", "causal_conv1d_update")
    missing = [n for n in need if not kernels.kernels_available()[n]]
    device = "cuda" if mode == "gpu" else "cpu"
    if mode == "emulate":
        from safepad.testing import kernel_emulation

        SMALL = True
        if not kernel_emulation.installed():
            missing = ["the emulation was not installed (run this file as a script)"]
        print("device: CPU, kernels emulated (Triton interpreter, C++ stand-ins); small shapes, no timings")
    elif mode == "gpu":
        print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
    report: dict = {"schema_version": SCHEMA_VERSION, "mode": mode,
                    "device": torch.cuda.get_device_name(0) if mode == "gpu" else "cpu", "torch": torch.__version__,
                    "parts": []}  # fmt: skip
    self_rows = cpu_self_check()
    print_table(self_rows)
    steps = plan(mode, args.budget_scale)
    if args.parts:
        steps = [s for s in steps if s[0].name in args.parts.split(",")]
    report["total_budget_s"] = sum(b for _, skip, b in steps if skip is None)
    t_all = time.perf_counter()
    for i, (p, skip, budget) in enumerate(steps, 1):
        if skip is None and missing and p.name != "fsdp2_accelerate":  # FSDP2 needs CUDA, not the kernels
            skip = f"kernels not importable: {', '.join(missing)}"
        if skip is not None:
            print(f"[{i}/{len(steps)}] {p.name}: skipped ({skip})", flush=True)
            report["parts"].append({"name": p.name, "status": "skipped", "budget_s": budget, "seconds": 0.0,
                                    "peak_mem_gib": None, "figures": {}, "rows": [], "message": skip})  # fmt: skip
            continue
        print(f"[{i}/{len(steps)}] {p.name}: running (budget {budget:.0f} s) - {p.what}", flush=True)
        res = run_part(p, device, budget)
        report["parts"].append(res)
        figs = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                         for k, v in res["figures"].items() if k in p.figures)  # fmt: skip
        print(
            f"[{i}/{len(steps)}] {p.name}: {res['status']} in {res['seconds']:.1f} s"
            + (f"; {figs}" if figs else "")
            + (f"; {res['message']}" if res["message"] else ""),
            flush=True,
        )
    report["total_s"] = time.perf_counter() - t_all
    bad = [r for r in report["parts"] if r["status"] in ("fail", "error", "timeout")]
    report["ok"] = not bad and all(r.ok for r in self_rows)
    text = json.dumps(report, indent=None, default=str)
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(report, indent=2, default=str))
    print("GPU_CHECK_JSON " + text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
