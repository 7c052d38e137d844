"""The speed parts (CUDA figures; the CPU smoke run takes the same code paths at small shapes, where the figures
prove the path, not a speed). Each function returns a dict of figures; :mod:`.parts` gives each a budget."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from safepad.ops import causal_conv1d_step, chunk_gated_delta_rule, kernels, selective_scan, ssd_step

from .common import RUN, PartSkipped, S, median_ms, sync, rel_err, small, varlen_seq_idx

#: vocabulary of the speed parts' models
VOCAB = 32000

GEOMETRY = {"hidden": 4096, "heads": 128, "head_dim": 64, "groups": 8, "state": 128, "chunk": 128, "conv": 4}
#: the CPU smoke run's geometry (same code paths, seconds instead of minutes)
SMALL_GEOMETRY = {"hidden": 64, "heads": 8, "head_dim": 16, "groups": 2, "state": 8, "chunk": 16, "conv": 4}


def geometry() -> dict:
    return SMALL_GEOMETRY if small() else GEOMETRY


def _peak_gib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if RUN["device"] == "cuda" else None


def _reset_peak() -> None:
    if RUN["device"] == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _mamba2_config(layers: int = 1, block_types: tuple[str, ...] | None = None):
    """A transformers ``Mamba2Config`` (``block_types`` None) or ``NemotronHConfig`` at :data:`GEOMETRY`."""
    g = geometry()
    common = dict(hidden_size=g["hidden"], n_groups=g["groups"], chunk_size=g["chunk"], conv_kernel=g["conv"],
                  vocab_size=VOCAB, use_conv_bias=True, use_bias=False)  # fmt: skip
    if block_types is None:
        from transformers import Mamba2Config

        return Mamba2Config(num_heads=g["heads"], head_dim=g["head_dim"], state_size=g["state"], expand=2,
                            num_hidden_layers=layers, **common)  # fmt: skip
    from transformers import NemotronHConfig

    return NemotronHConfig(mamba_num_heads=g["heads"], mamba_head_dim=g["head_dim"], ssm_state_size=g["state"],
                           expand=2, layers_block_type=list(block_types), num_attention_heads=S(32, 4),
                           num_key_value_heads=S(8, 2), head_dim=S(128, 16), intermediate_size=4 * g["hidden"],
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

    g, Bsz, T = geometry(), 2, S(4096, 64)
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
    for _ in range(2 if small() else reps):  # interleaved
        for k, f in sides.items():
            sync()
            t0 = time.perf_counter()
            f()
            sync()
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

    row = S(8192, 256)
    lengths, total = [], 0
    for n in _doc_lengths(64, S(600, 40), S(2048, 128), seed=0):
        if total + n > row:
            break
        lengths.append(n)
        total += n
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(3, VOCAB, (n,), generator=gen) for n in lengths]
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

        _reset_peak()
        ms = median_ms(step, steps, warmup=2)
        out[f"{name}_step_ms"] = ms
        out[f"{name}_tokens_per_s"] = total / (ms / 1e3)
        out[f"{name}_peak_mem_gib"] = _peak_gib()
        del opt
    out["speedup"] = out["packed_wrapped_tokens_per_s"] / out["padded_stock_tokens_per_s"]
    return out


def count_syncs_per_step(device: str) -> dict:
    """Host-device syncs in one wrapped packed training step (1-layer slice), ``set_sync_debug_mode("warn")``.

    Every synchronising CUDA call warns once per call; the warnings are counted (after two warm-up steps).
    """
    import warnings

    from transformers import NemotronHForCausalLM

    if RUN["device"] != "cuda":
        raise PartSkipped("torch.cuda.set_sync_debug_mode needs CUDA")

    import safepad
    from safepad.collators import DataCollatorForPackedSSM

    model = safepad.wrap(NemotronHForCausalLM(_mamba2_config(block_types=("mamba", "attention"))))
    model = model.to(device, torch.bfloat16).train()
    gen = torch.Generator().manual_seed(2)
    feats = [{"input_ids": torch.randint(3, VOCAB, (S(n, n // 16),), generator=gen)} for n in (700, 1500, 300, 1200, 396)]
    batch = DataCollatorForPackedSSM(pad_to_length=S(4096, 256))(feats)
    batch = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}

    def step():
        model(**batch, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)

    step()
    step()
    sync()
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
    g, Bsz = geometry(), 8
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
    if RUN["device"] != "cuda":  # no CUDA graph on CPU: the eager step only (its code path)
        eager_ms = median_ms(step, reps)
        return {"eager_step_ms": eager_ms, "eager_tokens_per_s": Bsz / (eager_ms / 1e3), "batch": Bsz,
                "graph": "skipped: CUDA graphs need CUDA"}  # fmt: skip
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
    eager_ms = median_ms(step, reps)
    graph_ms = median_ms(graph.replay, reps)
    return {"eager_step_ms": eager_ms, "graph_step_ms": graph_ms, "eager_tokens_per_s": Bsz / (eager_ms / 1e3),
            "graph_tokens_per_s": Bsz / (graph_ms / 1e3), "speedup": eager_ms / graph_ms,
            "graph_vs_eager_rel_err": err, "batch": Bsz}  # fmt: skip


def bench_mamba1(device: str, reps: int = 10) -> dict:
    """Mamba1 selective scan fwd+bwd time per token (Falcon-Mamba-7B-like: d_inner 8192, state 16, bf16 inputs):
    packed rows (``seq_idx``: the torch core today) vs the same tokens as one sequence per row (mamba-ssm)."""
    gen = torch.Generator(device=device).manual_seed(4)
    Bsz, T, Dm, N = 1, S(4096, 64), S(8192, 32), 16

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
    seq = varlen_seq_idx(Bsz, T, 5, device, max_seqs=8)
    out = {"tokens": Bsz * T, "d_inner": Dm, "state": N}
    for name, kw in (("packed", {"seq_idx": seq}), ("unpacked", {})):

        def step(kw=kw):
            selective_scan(**leaves, **kw).square().mean().backward()

        ms = median_ms(step, reps, warmup=2)
        out[f"{name}_ms"] = ms
        out[f"{name}_us_per_token"] = ms * 1e3 / (Bsz * T)
    out["packed_vs_unpacked"] = out["packed_ms"] / out["unpacked_ms"]
    return out


def bench_gdn(device: str, reps: int = 10) -> dict:
    """Gated DeltaNet fwd+bwd time per token through FLA (``chunk_gated_delta_rule``, packed rows, bf16,
    Qwen3-Next-like: 32 value heads x 128, 16 key heads x 128) vs safepad's torch core."""
    if kernels.fla_chunk_gated_delta_rule is None:
        if RUN["mode"] != "cpu":
            raise PartSkipped("flash-linear-attention (fla) is not importable")
    gen = torch.Generator(device=device).manual_seed(6)
    Bsz, T, H, Hk, Dk = 1, S(4096, 64), S(32, 4), S(16, 2), S(128, 16)

    def r(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    k = torch.nn.functional.normalize(r(Bsz, T, Hk, Dk), dim=-1)
    inp = {"q": r(Bsz, T, Hk, Dk).bfloat16(), "k": k.bfloat16(), "v": r(Bsz, T, H, Dk).bfloat16(),
           "g": -torch.rand(Bsz, T, H, generator=gen, device=device) * 0.3,
           "beta": torch.rand(Bsz, T, H, generator=gen, device=device).bfloat16()}  # fmt: skip
    leaves = {n: v.requires_grad_() for n, v in inp.items()}
    seq = varlen_seq_idx(Bsz, T, 7, device, max_seqs=8)
    out = {"tokens": Bsz * T}
    # the CPU smoke run has no FLA: its "kernels" side goes through backend="auto" (the torch core)
    kernel_side = "auto" if RUN["mode"] == "cpu" else "kernels"
    for name, backend in (("kernels", kernel_side), ("torch", "torch")):

        def step(backend=backend):
            y = chunk_gated_delta_rule(**leaves, seq_idx=seq, use_qk_l2norm=True, backend=backend)
            y.float().square().mean().backward()

        ms = median_ms(step, reps, warmup=2)
        out[f"{name}_ms"] = ms
        out[f"{name}_us_per_token"] = ms * 1e3 / (Bsz * T)
    out["fla_speedup_vs_torch"] = out["torch_ms"] / out["kernels_ms"]
    return out


