"""One-shot GPU check (< 10 min on one GPU): CUDA kernels == safepad's torch core, then mixer speed.

    python benchmarks/gpu_check.py              # on a GPU with mamba-ssm, causal-conv1d (and FLA)
    TRITON_INTERPRET=1 python benchmarks/gpu_check.py --emulate   # CPU: the same routes, tiny shapes

Part 1 runs every function in ``CHECKS`` on random packed / padded / stateful inputs in fp32 and bf16 and
prints one row per route: max relative error of the kernel path against the torch core (forward, and
gradients where the route has a backward), the tolerance, and both timings. Part 2 (GPU only) times
fwd+bwd of a wrapped Mamba2 mixer against mamba-ssm's own ``Mamba2`` module (the raw fused kernels) on the
same shapes and prints the ratio (target <= 1.05). Without CUDA it runs a torch-core self-check, prints
``skipping kernel half: <reason>`` and exits 0; ``--emulate`` runs part 1 on CPU through
``safepad.testing.kernel_emulation`` (Triton interpreter, C++ stand-ins) at small shapes.

Extend it by appending a function to ``CHECKS``: ``check(device: str) -> list[Row]``. With CUDA (kernels or
not) it also runs ``check_fsdp2_accelerate``: the FSDP2 recipe through accelerate, which cannot run on CPU.
Exit status: 0 when every row passes (or the kernel half is skipped), 1 otherwise.
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
                "initial_state": init, "token_mask": mask, "return_final_state": True, "state_len": K,
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
        kw = {"chunk_size": chunk, "D": t["D"], "dt_bias": t["dt_bias"], "dt_limit": (0.01, 0.5), "seq_idx": seq,
                  "initial_state": t["initial_state"], "token_mask": mask, "return_final_state": True}
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
            y, fin = ssd_scan(**leaves, chunk_size=chunk, seq_idx=seq, dt_limit=(0.0, 0.5), return_final_state=True,
                              backend=backend)
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
    inp = {"u": r(Bsz, T, Dm), "delta": r(Bsz, T, Dm) * 0.5 - 1, "A": -torch.rand(Dm, N, generator=g, device=device),
           "B": r(Bsz, T, N), "C": r(Bsz, T, N), "D": r(Dm), "z": r(Bsz, T, Dm), "delta_bias": r(Dm) * 0.3}
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
    err = max(rel_err(res["kernels"][0], res["torch"][0]),
              *(rel_err(res["kernels"][1][k], res["torch"][1][k]) for k in leaves))
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
    inp = {"q": torch.randn(Bsz, T, H, Dk, generator=g, device=device).bfloat16(), "k": k.bfloat16(),
           "v": torch.randn(Bsz, T, H, Dk, generator=g, device=device).bfloat16(),
           "g": -torch.rand(Bsz, T, H, generator=g, device=device) * 0.3,
           "beta": torch.rand(Bsz, T, H, generator=g, device=device).bfloat16()}
    mask = torch.ones(Bsz, T, dtype=torch.bool, device=device)
    mask[1, T - T // 4 :] = False
    kw = {"seq_idx": varlen_seq_idx(Bsz, T, 10, device), "token_mask": mask, "use_qk_l2norm": True,
          "initial_state": torch.randn(Bsz, H, Dk, Dk, generator=g, device=device) * 0.1, "return_final_state": True}
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


def bench_mixer_vs_raw(device: str, reps: int = 20) -> list[str]:
    """fwd+bwd of a wrapped transformers Mamba2 mixer vs mamba-ssm's ``Mamba2`` module, same shapes, bf16.

    Both sides run the same math: in_proj, depthwise conv, SSD scan, gated RMSNorm, out_proj. The raw
    module takes mamba-ssm's fused path (``mamba_split_conv1d_scan_combined``); the wrapped mixer takes
    safepad's dispatch (causal_conv1d_fn + mamba_chunk_scan_combined + its own norm). Target ratio <= 1.05.
    """
    from mamba_ssm.modules.mamba2 import Mamba2 as RawMamba2
    from transformers import Mamba2Config, Mamba2Model

    import safepad

    hidden, heads, head_dim, N, groups, chunk, Bsz, T = 2048, 64, 64, 128, 8, 256, 2, 4096
    cfg = Mamba2Config(hidden_size=hidden, num_heads=heads, head_dim=head_dim, state_size=N, n_groups=groups,
                       expand=heads * head_dim // hidden, chunk_size=chunk, num_hidden_layers=1, vocab_size=256,
                       use_conv_bias=True, use_bias=False, conv_kernel=4)
    hf = safepad.wrap(Mamba2Model(cfg)).to(device, torch.bfloat16)
    mixer = hf.layers[0].mixer
    raw = RawMamba2(d_model=hidden, d_state=N, d_conv=4, expand=heads * head_dim // hidden, headdim=head_dim,
                    ngroups=groups, chunk_size=chunk, bias=False, conv_bias=True).to(device, torch.bfloat16)
    x = torch.randn(Bsz, T, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)

    def run(fn):
        def step():
            y = fn(x)
            y.sum().backward()
        return step

    sides = {"wrapped mixer": run(lambda h: mixer(h)), "raw mamba-ssm Mamba2": run(lambda h: raw(h))}
    times = {k: [] for k in sides}
    for _ in range(3):  # warm-up (autotune) both
        for f in sides.values():
            f()
    for _ in range(reps):  # interleaved
        for k, f in sides.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            f()
            torch.cuda.synchronize()
            times[k].append((time.perf_counter() - t0) * 1e3)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    ratio = med["wrapped mixer"] / med["raw mamba-ssm Mamba2"]
    return [f"{k:<24} fwd+bwd median {v:8.2f} ms  (B={Bsz}, T={T}, hidden={hidden}, bf16)" for k, v in med.items()] + [
        f"wrapped / raw ratio: {ratio:.3f}  (target <= 1.05: {'MET' if ratio <= 1.05 else 'NOT MET'})"]


def cpu_self_check() -> list[Row]:
    """Torch core only: a packed row == its sequences run alone (fp32, small)."""
    t = ssd_inputs(1, 96, "cpu", torch.float32, H=4, P=8, N=8)
    seq = varlen_seq_idx(1, 96, 7, "cpu")
    y, v = ssd_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], chunk_size=16, seq_idx=seq, return_varlen_states=True)
    starts = [0] + (torch.nonzero(seq[0, 1:] != seq[0, :-1]).squeeze(1) + 1).tolist() + [96]
    err = 0.0
    for i, (s, e) in enumerate(pairwise(starts)):
        ys, fs = ssd_scan(t["x"][:, s:e], t["dt"][:, s:e], t["A"], t["B"][:, s:e], t["C"][:, s:e], chunk_size=16,
                          return_final_state=True)
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
    print(f"fsdp2 accelerate: {multi['distributed_type']} v{multi['fsdp_version']}, units {multi['fsdp_units']}, "
          f"{multi['sharded_params']} sharded params, {multi['wrapped_mixers']} wrapped mixers, {nproc} process(es)")
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
        print(f"{r.name:<44} {r.dtype:<9} {r.err:>11.2e} {r.tol:>8.0e} {r.t_kernel_ms:>10.2f} {r.t_torch_ms:>10.2f}  "
              f"{'PASS' if r.ok else 'FAIL'}")


def main(argv: list[str] | None = None) -> int:
    global SMALL
    argv = sys.argv[1:] if argv is None else argv
    emulate = "--emulate" in argv
    rows = cpu_self_check()
    need = ("mamba_chunk_scan_combined", "selective_state_update", "causal_conv1d_fn", "causal_conv1d_update")
    missing = [n for n in need if not kernels.kernels_available()[n]]
    reason = None
    if emulate:
        from safepad.testing import kernel_emulation

        if not kernel_emulation.installed():
            reason = "--emulate: the emulation was not installed (run this file as a script)"
        SMALL, device = True, "cpu"
        print("device: CPU, kernels emulated (Triton interpreter, C++ stand-ins); small shapes, no timings")
    elif not torch.cuda.is_available():
        reason = "no CUDA device"
    else:
        device = "cuda"
    if reason is None and missing:
        reason = f"kernels not importable: {', '.join(missing)}"
    if reason is None:
        if not emulate:
            print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
        for check in CHECKS if not emulate else CHECKS[:-1]:  # the model-level check takes minutes interpreted
            try:
                rows.extend(check(device))
            except Exception as e:
                rows.append(Row(f"{check.__name__}: {type(e).__name__}: {str(e)[:60]}", "-", float("inf"), 0.0))
    if torch.cuda.is_available():  # FSDP2 through accelerate needs CUDA, not the kernels
        try:
            rows.extend(check_fsdp2_accelerate())
        except Exception as e:
            rows.append(Row(f"check_fsdp2_accelerate: {type(e).__name__}: {str(e)[:60]}", "-", float("inf"), 0.0))
    print_table(rows)
    if reason is not None:
        print(f"skipping kernel half: {reason}")
    elif not emulate:
        try:
            for line in bench_mixer_vs_raw(device):
                print(line)
        except Exception as e:
            print(f"mixer speed: {type(e).__name__}: {str(e)[:200]}")
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
