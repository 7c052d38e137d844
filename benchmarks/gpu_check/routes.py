"""Part ``routes``: every kernel route of ``safepad.ops`` == safepad's torch core, on random packed / padded /
stateful inputs in fp32 and bf16 (forward, and gradients where the route has a backward), then a wrapped model's
packed logits on the kernels == on the torch core.

Each check names the kernel markers it needs (``safepad.ops.kernels``); a check whose kernels did not import is
listed under the part's ``skipped`` figure with the reason (on ``--device cpu`` it runs anyway, through the torch
core, to exercise the code path: its rows then say ``route torch``). Extend the part by appending a
``Check`` to :data:`CHECKS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from safepad.ops import (
    causal_conv1d,
    causal_conv1d_step,
    chunk_gated_delta_rule,
    kernels,
    selective_scan,
    selective_state_step,
    ssd_scan,
    ssd_step,
)

from .common import RUN, TOL, PartTimeout, Row, S, dtype_name, emit, rel_err, small, ssd_inputs, timed, varlen_seq_idx


def KB() -> str:  # noqa: N802
    """The backend of the kernel side: ``"kernels"`` (a missing kernel raises), or ``"auto"`` on the CPU smoke
    run of a check whose kernels are absent (it then exercises the code path through the torch core)."""
    return _KB[0]


_KB = ["kernels"]


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
                out_k, tk = timed(partial(causal_conv1d, x, w, b, activation="silu", backend=KB(), **kw))
                out_t, tt = timed(partial(causal_conv1d, x, w, b, activation="silu", backend="torch", **kw))
            out_k = out_k if isinstance(out_k, tuple) else (out_k,)
            out_t = out_t if isinstance(out_t, tuple) else (out_t,)
            err = max(rel_err(a, c) for a, c in zip(out_k, out_t))
            rows.append(Row(name, dtype_name(dtype), err, TOL[dtype], tk, tt))
    return rows


def check_scan(device: str) -> list[Row]:
    rows = []
    Bsz, T, chunk = 2, S(4096, 24), S(256, 8)
    # the Triton interpreter's tl.dot is wrong for bfloat16 (numpy has no bf16): --emulate checks float16
    for dtype in (torch.float32, torch.float16 if small() else torch.bfloat16):
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
            (yk, fk), tk = timed(partial(ssd_scan, *args, backend=KB(), **kw))
            (yt, ft), tt = timed(partial(ssd_scan, *args, backend="torch", **kw))
        m = mask[..., None, None]
        err = max(rel_err(yk.float() * m, yt.float() * m), rel_err(fk, ft))
        rows.append(Row("scan varlen+init+mask", dtype_name(dtype), err, TOL[dtype], tk, tt))
    t = ssd_inputs(1, T, device, torch.float32, seed=4)
    seq = varlen_seq_idx(1, T, 5, device, max_seqs=12)
    kw = {"chunk_size": chunk, "D": t["D"], "dt_bias": t["dt_bias"], "seq_idx": seq, "return_varlen_states": True}
    args = (t["x"], t["dt"], t["A"], t["B"], t["C"])
    with torch.no_grad():
        (yk, vk), tk = timed(lambda: ssd_scan(*args, backend=KB(), **kw))
        (yt, vt), tt = timed(lambda: ssd_scan(*args, backend="torch", **kw))
    err = max(rel_err(yk, yt), rel_err(vk, vt))
    rows.append(Row("scan varlen states (B=1)", "float32", err, TOL[torch.float32], tk, tt))
    # backward through the Triton kernels: packed rows + initial state, every input's gradient
    t = ssd_inputs(Bsz, T, device, torch.float32, seed=6)
    leaves = {k: v.detach().clone().requires_grad_() for k, v in t.items()}
    seq = varlen_seq_idx(Bsz, T, 7, device)
    grads = {}
    for backend in (KB(), "torch"):
        for v in leaves.values():
            v.grad = None

        def step():
            y, fin = ssd_scan(
                **leaves, chunk_size=chunk, seq_idx=seq, dt_limit=(0.0, 0.5), return_final_state=True, backend=backend
            )
            (y.square().mean() + fin.square().mean()).backward()

        _, ms = timed(step)
        grads[backend] = ({k: v.grad.clone() for k, v in leaves.items()}, ms)
    err = max(rel_err(grads[KB()][0][k], grads["torch"][0][k]) for k in leaves)
    rows.append(Row("scan fwd+bwd grads (packed+init)", "float32", err, 1e-2, grads[KB()][1], grads["torch"][1]))
    return rows


def check_step(device: str) -> list[Row]:
    rows = []
    t = ssd_inputs(8, 1, device, torch.float32)
    args = (t["initial_state"], t["x"][:, 0], t["dt"][:, 0], t["A"], t["B"][:, 0], t["C"][:, 0])
    for lim in ((0.0, float("inf")), (0.05, float("inf")), (0.0, 0.01)):
        kw = {"D": t["D"], "dt_bias": t["dt_bias"], "dt_limit": lim}
        with torch.no_grad():
            (yk, sk), tk = timed(partial(ssd_step, *args, backend=KB(), **kw))
            (yt, st), tt = timed(partial(ssd_step, *args, backend="torch", **kw))
        rows.append(Row(f"ssd_step dt_limit={lim}", "float32", max(rel_err(yk, yt), rel_err(sk, st)), 1e-4, tk, tt))
    return rows


def check_conv_step(device: str) -> list[Row]:
    rows = []
    g = torch.Generator(device=device).manual_seed(2)
    D = S(1280, 16)
    x = torch.randn(8, D, generator=g, device=device)
    state = torch.randn(8, D, 4, generator=g, device=device)
    w, b = torch.randn(D, 4, generator=g, device=device), torch.randn(D, generator=g, device=device)
    with torch.no_grad():
        (yk, sk), tk = timed(lambda: causal_conv1d_step(x, state, w, b, activation="silu", backend=KB()))
        (yt, st), tt = timed(lambda: causal_conv1d_step(x, state, w, b, activation="silu", backend="torch"))
    rows.append(Row("conv step", "float32", max(rel_err(yk, yt), rel_err(sk, st)), 1e-5, tk, tt))
    return rows


def check_mamba1(device: str) -> list[Row]:
    """selective_scan_fn (fwd+bwd, one sequence per row)."""
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
    for backend in (KB(), "torch"):
        for v in leaves.values():
            v.grad = None

        def step():
            y = selective_scan(**leaves, backend=backend)
            y.square().mean().backward()
            return y.detach()

        y, ms = timed(step)
        res[backend] = (y, {k: v.grad.clone() for k, v in leaves.items()}, ms)
    err = max(
        rel_err(res[KB()][0], res["torch"][0]),
        *(rel_err(res[KB()][1][k], res["torch"][1][k]) for k in leaves),
    )
    return [Row("mamba1 selective_scan fwd+bwd", "float32", err, 1e-3, res[KB()][2], res["torch"][2])]


def check_mamba1_step(device: str) -> list[Row]:
    """selective_state_update (decode) with Mamba1's per-channel state."""
    g = torch.Generator(device=device).manual_seed(8)
    Bsz, Dm, N = 2, S(1536, 16), 16
    r = lambda *s: torch.randn(*s, generator=g, device=device)  # noqa: E731
    A, Dskip = -torch.rand(Dm, N, generator=g, device=device), r(Dm)
    rows = []
    st = r(Bsz, Dm, N)
    args = (st, r(Bsz, Dm), r(Bsz, Dm), A, r(Bsz, N), r(Bsz, N))
    with torch.no_grad():
        zz = r(Bsz, Dm)
        (yk, sk), tk = timed(lambda: selective_state_step(*args, D=Dskip, z=zz, backend=KB()))
        (yt, s_t), tt = timed(lambda: selective_state_step(*args, D=Dskip, z=zz, backend="torch"))
    rows.append(Row("mamba1 selective_state_step", "float32", max(rel_err(yk, yt), rel_err(sk, s_t)), 1e-4, tk, tt))
    return rows


def check_fla(device: str) -> list[Row]:
    """FLA chunk_gated_delta_rule on a packed, padded bf16 batch with initial states (skipped without FLA)."""
    if RUN["mode"] == "emulate":  # fla 0.6.0's chunk_delta_h stops with a Triton interpreter error: GPU only
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
        (ok, fk), tk = timed(lambda: chunk_gated_delta_rule(**inp, backend=KB(), **kw))
        fp32 = {n: v.float() for n, v in inp.items()}
        (ot, ft), tt = timed(lambda: chunk_gated_delta_rule(**fp32, backend="torch", **kw))
    err = max(rel_err(ok.float()[mask], ot[mask]), rel_err(fk, ft))
    return [Row("fla chunk_gated_delta_rule packed+pad+init", "bfloat16", err, TOL[torch.bfloat16], tk, tt)]




def check_models(device: str) -> list[Row]:
    """safepad.wrap with the kernels == with the torch core: packed logits of tiny models (one per mixer kind)."""
    import copy

    import safepad
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
        row = Row(f"wrap {family}: packed logits auto vs torch", "float32", rel_err(yk, yt), TOL[torch.float32], tk, tt)
        emit(row)
        rows.append(row)
    return rows


@dataclass(frozen=True)
class Check:
    """One agreement check: ``run(device) -> rows``; ``needs``: kernel markers it needs, any of each group."""

    run: Callable[[str], list[Row]]
    needs: tuple[tuple[str, ...], ...] = ()
    #: runs under --emulate (the Triton interpreter): the model-level check takes minutes interpreted
    emulate: bool = True

    @property
    def name(self) -> str:
        return self.run.__name__

    def missing(self) -> list[str]:
        avail = kernels.kernels_available()
        return [" or ".join(group) for group in self.needs if not any(avail.get(n) for n in group)]

    def route(self) -> str:
        """The kernel packages this check's routes resolve to here."""
        avail = kernels.kernels_available()
        names = [next((n for n in group if avail.get(n)), "") for group in self.needs]
        pkgs = sorted({kernels._SOURCES[n][0].split(".")[0] for n in names if n})
        return "+".join(pkgs) or "torch"


#: the checks, in order; model-level checks (safepad.wrap) come last
CHECKS: list[Check] = [
    Check(check_conv, (("causal_conv1d_fn", "fla_causal_conv1d"),)),
    Check(check_conv_step, (("causal_conv1d_update", "fla_causal_conv1d_update"),)),
    Check(check_scan, (("mamba_chunk_scan_combined",),)),
    Check(check_step, (("selective_state_update",),)),
    Check(check_mamba1, (("selective_scan_fn",),)),
    Check(check_mamba1_step, (("selective_state_update",),)),
    Check(check_fla, (("fla_chunk_gated_delta_rule",),)),
    Check(check_models, (), emulate=False),
]


def run(device: str) -> tuple[list[Row], dict]:
    """The part: every check whose kernels imported (all of them on the CPU smoke run, through the torch core)."""
    rows: list[Row] = []
    skipped: list[str] = []
    for check in CHECKS:
        if RUN["mode"] == "emulate" and not check.emulate:
            skipped.append(f"{check.name}: not under --emulate (minutes in the Triton interpreter)")
            continue
        missing = check.missing()
        if missing and RUN["mode"] != "cpu":
            skipped.append(f"{check.name}: needs {', '.join(missing)}")
            emit(skipped=skipped)
            continue
        _KB[0] = "auto" if missing else "kernels"
        route = "torch (no kernel here)" if missing else check.route()
        try:
            got = check.run(device)
        except PartTimeout:
            raise
        except Exception as e:  # noqa: BLE001 - a broken route is a finding, not the end of the part
            got = [Row(f"{check.name}: {type(e).__name__}: {str(e)[:80]}", "-", float("inf"), 0.0)]
        finally:
            _KB[0] = "kernels"
        for r in got:
            r.route = r.route or route
        if check.name != "check_models":  # check_models emits its rows one model at a time
            emit(got)
        rows.extend(got)
        emit(skipped=skipped)
    figures = {"routes": len(rows), "failed": sum(not r.ok for r in rows), "skipped": skipped}
    return rows, figures
