"""The parts, most valuable first, each with its budget on a BARE lent machine (cold Triton cache included).

``budget_s`` is a hard wall-clock limit (a part run in its own process is killed there; in-process, SIGALRM). The
default plan keeps the parts that fit ``--max-total`` (480 s, 8 minutes) in this order and reports the rest as
skipped; ``--parts`` picks parts by name, ``--max-total 0`` lifts the cap. Extend the check by appending a
:class:`Part` here (and a module beside this one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import audit, fsdp2, generate, graphs, routes, serving, speed
from .common import Row


@dataclass
class Part:
    """One section of the check: ``run(device) -> (rows, figures)``.

    ``needs``: ``"cuda"`` (a real CUDA device: CUDA graphs, sync debug mode, FSDP), ``"any"`` (runs on
    ``--device cpu`` / ``--emulate`` too, at small shapes). ``requires``: ``() -> reason | None``, why the part
    cannot run here (a missing package), checked in the plan. ``autotune``: ``"pin"`` (first config, one
    compile per kernel) or ``"full"`` (Triton times every config; speed figures need it).
    """

    name: str
    budget_s: float
    needs: str
    what: str
    run: Callable[[str], tuple[list[Row], dict]]
    figures: tuple[str, ...] = ()
    #: budget under --emulate (the Triton interpreter on CPU is orders of magnitude slower than a GPU)
    emulate_budget_s: float | None = None
    #: budget on --device cpu (small shapes, torch core)
    cpu_budget_s: float | None = None
    requires: Callable[[], str | None] | None = None
    autotune: str = "pin"

    def budget(self, mode: str) -> float:
        if mode == "emulate" and self.emulate_budget_s:
            return self.emulate_budget_s
        if mode == "cpu" and self.cpu_budget_s:
            return self.cpu_budget_s
        return self.budget_s


def _figures_only(fn: Callable[[str], dict]) -> Callable[[str], tuple[list[Row], dict]]:
    def run(device: str) -> tuple[list[Row], dict]:
        return [], fn(device)

    run.__name__ = fn.__name__
    return run


def _kernel(*names: str) -> Callable[[], str | None]:
    """``requires``: every kernel marker in ``names`` imported."""

    def missing() -> str | None:
        from safepad.ops import kernels

        avail = kernels.kernels_available()
        gone = [n for n in names if not avail.get(n)]
        return f"kernels not importable: {', '.join(gone)}" if gone else None

    return missing


def _module(name: str, why: str) -> Callable[[], str | None]:
    def missing() -> str | None:
        import importlib

        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001
            return f"{name} not importable ({why}): {type(e).__name__}: {str(e)[:80]}"
        return None

    return missing


def _all(*checks: Callable[[], str | None]) -> Callable[[], str | None]:
    def missing() -> str | None:
        return next((r for c in checks if (r := c()) is not None), None)

    return missing


PARTS: list[Part] = [
    Part("audit", 100, "any",
         "safepad audit of every family's tiny model on the device, fp32 and bf16 (wrapped on the torch core)",
         audit.run, ("models", "failed", "failures"), emulate_budget_s=300, cpu_budget_s=240),
    Part("routes", 150, "any",
         "every kernel route == safepad's torch core (fp32 / bf16; fwd, bwd), then wrapped packed logits "
         "kernels == torch core; autotune pinned to one config",
         routes.run, ("routes", "failed", "skipped"), emulate_budget_s=900, cpu_budget_s=120),
    Part("generate", 60, "any",
         "wrapped models on the kernels: right-padded cached decode, chunked prefill with pads, generate, vs "
         "the stock per-sequence runs",
         generate.run, ("scenarios", "failed", "kernels"), emulate_budget_s=600, cpu_budget_s=120),
    Part("decode_cuda_graph", 20, "any", "Mamba2 decode step captured in a CUDA graph vs eager: tokens/s",
         _figures_only(speed.bench_decode_graph),
         ("eager_tokens_per_s", "graph_tokens_per_s", "speedup", "graph_vs_eager_rel_err"), cpu_budget_s=60),
    Part("gdn_time_per_token", 45, "any", "Gated DeltaNet fwd+bwd per token, packed rows: FLA vs torch core",
         _figures_only(speed.bench_gdn), ("kernels_us_per_token", "torch_us_per_token", "fla_speedup_vs_torch"),
         cpu_budget_s=60, autotune="full"),
    Part("train_tokens_per_s", 80, "any",
         "packed+wrapped vs padded stock training tokens/s, 2-layer Nemotron-H slice (mamba, attention) at the 9B "
         "geometry; peak memory of each",
         _figures_only(speed.bench_train_tokens),
         ("packed_wrapped_tokens_per_s", "padded_stock_tokens_per_s", "speedup", "packed_wrapped_peak_mem_gib",
          "padded_stock_peak_mem_gib"), cpu_budget_s=120, autotune="full"),
    Part("generate_cuda_graph", 240, "any",
         "padded-batch generate, static cache compiled with CUDA graphs (reduce-overhead) vs eager: tokens/s of "
         "stock (left pads) and wrapped (right, left pads) at the 9B slice, bf16; captured == eager",
         graphs.run, ("stock_left_graph_tokens_per_s", "wrapped_right_graph_tokens_per_s",
                      "wrapped_left_graph_tokens_per_s", "wrapped_right_graph_vs_stock_graph"),
         cpu_budget_s=120, autotune="full"),
    Part("syncs_per_step", 25, "cuda",
         "host-device syncs in one wrapped packed training step (torch.cuda.set_sync_debug_mode('warn'))",
         _figures_only(speed.count_syncs_per_step), ("syncs_per_step", "sites"), autotune="full"),
    Part("mixer_vs_mamba_ssm", 75, "cuda",
         "wrapped Mamba2 mixer fwd+bwd vs mamba-ssm's fused Mamba2, 9B geometry, bf16 (target within 5%)",
         _figures_only(speed.bench_mixer_vs_raw), ("wrapped_ms", "mamba_ssm_ms", "ratio", "target", "met"),
         requires=_all(_kernel("mamba_split_conv1d_scan_combined", "causal_conv1d_fn"),
                       _module("mamba_ssm.modules.mamba2", "mamba-ssm's Mamba2 module")),
         autotune="full"),
    Part("mamba1_time_per_token", 45, "cuda",
         "Mamba1 selective scan fwd+bwd per token: packed rows (torch core today) vs one sequence per row "
         "(mamba-ssm)",
         _figures_only(speed.bench_mamba1), ("packed_us_per_token", "unpacked_us_per_token", "packed_vs_unpacked"),
         requires=_kernel("selective_scan_fn")),
    Part("fsdp2_accelerate", 110, "cuda", "FSDP2 through accelerate: per-step losses == one process", fsdp2.run,
         ("max_rel_loss_diff",)),
    Part("serving", 90, "any",
         "continuous batching (manager) of a wrapped Nemotron-H vs generate over left-padded batches, same "
         "lognormal load: requests/s, tokens/s (benchmarks/bench_serving.py)",
         serving.run, ("continuous_requests_per_s", "continuous_tokens_per_s", "padded_requests_per_s",
                       "padded_tokens_per_s", "continuous_vs_padded", "same_tokens_fraction"), cpu_budget_s=120),
]  # fmt: skip


def _test_part(device: str) -> tuple[list[Row], dict]:
    """The runner's own test (tests/benchmarks): emits a row, then hangs past any budget; with
    ``SAFEPAD_GPU_CHECK_TEST_PART=hang`` it also ignores SIGALRM, as a Triton compile in C++ does."""
    import os
    import signal
    import time

    from .common import emit

    if os.environ.get("SAFEPAD_GPU_CHECK_TEST_PART") == "hang":
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
    emit(Row("measured before the hang", "float32", 0.0, 1.0), before=1)
    time.sleep(120)
    return [], {}


if __import__("os").environ.get("SAFEPAD_GPU_CHECK_TEST_PART"):
    PARTS.append(Part("test_hang", 5, "any", "the runner's own test: hangs", _test_part))
