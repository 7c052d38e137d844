"""``safepad audit --gradients``: a gradient-leak check, per layer kind.

In one packed row holding sequences ``A`` before ``B``, nothing of ``A`` may reach ``B``'s loss: ``d loss_B /
d x_A`` must be exactly 0 for the token embeddings ``x`` and for every layer's input. Two measures, each
relative to the gradient that ``loss_B`` puts on ``B``'s own tokens:

* ``embeddings``: ``max |d loss_B / d x[A]| / max |d loss_B / d x[B]|`` through the whole model;
* per layer ``l``: the layer ALONE, ``max |VJP_l(g_B)[A]| / max |VJP_l(g_B)[B]|`` where ``g_B`` is
  ``d loss_B / d h_{l+1}`` kept on ``B``'s positions. A layer that keeps sequences apart has a zero Jacobian
  block from ``A``'s inputs to ``B``'s outputs, so this is 0; each leaking layer shows on its own, whatever the
  layers above it do. Layers are grouped by kind (their mixer's class, ``Safepad`` prefix dropped).

The packed row passes its boundaries as restarting ``position_ids`` (and ``seq_idx`` to a model whose forward
does not take positions), as TRL's ``padding_free`` and safepad's collator do.
"""

from __future__ import annotations

import copy
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

logger = logging.getLogger(__name__)

__all__ = [
    "GRADIENT_LENGTHS",
    "GradientReport",
    "add_arguments",
    "audit_gradients",
    "gradient_leaks",
    "gradient_tol",
    "print_gradient_reports",
    "run",
]

#: sequence lengths of the packed row (several chunks of the tiny models' chunk size)
GRADIENT_LENGTHS: tuple[int, ...] = (7, 17, 33)
_MIXER_ATTRS = ("mixer", "mamba", "linear_attn", "self_attn", "attention", "temporal_block", "conv", "mlp")


def gradient_tol(dtype: torch.dtype) -> float:
    """Tolerated relative leak. A correct layer's block is 0 up to rounding of masked terms: wrapped tiny models of
    every family measure <= 9.4e-7 in fp32 (jamba, mamba1, short-conv and attention layers exactly 0), stock
    ones >= 0.1 (the leaking kind). Half-precision values are not measured: the fp32 one scaled by the eps ratio."""
    return {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}.get(dtype, 1e-6)


@dataclass
class GradientReport:
    """Relative gradient leaks of one model: ``embeddings`` and the worst layer of each kind."""

    label: str
    tol: float
    embeddings: float = 0.0
    kinds: dict[str, float] = field(default_factory=dict)  #: kind -> worst relative leak of its layers
    layers: list[tuple[str, str, float]] = field(default_factory=list)  #: (name, kind, relative leak)
    error: str | None = None

    @property
    def passed(self) -> bool:
        return self.error is None and self.embeddings <= self.tol and all(v <= self.tol for v in self.kinds.values())

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "tol": self.tol, "embeddings": self.embeddings, "kinds": dict(self.kinds),
                "layers": [list(x) for x in self.layers], "error": self.error, "passed": self.passed}  # fmt: skip


def _decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The decoder layers: the ``nn.ModuleList`` named ``*layers`` holding the first sequence mixer (a VLM's
    vision tower and a MoE's expert lists are not it), else the longest ``*layers`` list, else the longest list."""
    from ..testing.tiny import find_mixers

    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    named = [(n, m) for n, m in lists if n.rsplit(".", 1)[-1].endswith("layers")]
    mixers = [n for n, _ in find_mixers(model)]
    holding = [(n, m) for n, m in named if mixers and mixers[0].startswith(n + ".")]
    pool = holding or named or lists
    if not pool:
        raise ValueError(f"{type(model).__name__}: no nn.ModuleList of decoder layers found to check per layer")
    name, layers = max(pool, key=lambda nm: len(nm[1]))
    return [(f"{name}.{i}", layer) for i, layer in enumerate(layers)]


def _kind(layer: nn.Module) -> str:
    for attr in _MIXER_ATTRS:
        sub = getattr(layer, attr, None)
        if isinstance(sub, nn.Module):
            return type(sub).__name__.removeprefix("Safepad")
    return type(layer).__name__.removeprefix("Safepad")


def _first_tensor(value: Any) -> Tensor | None:
    if isinstance(value, Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], Tensor):
        return value[0]
    return getattr(value, "last_hidden_state", None)


def _rel(g: Tensor, a: Tensor, b: Tensor) -> float:
    """``max |g[a]| / max |g[b]|`` over ``[1, T, ...]`` ``g`` and ``[T]`` bool position masks."""
    scale = float(g[0, b].abs().max())
    leak = float(g[0, a].abs().max())
    if leak == 0.0:
        return 0.0
    return leak / scale if scale > 0 else float("inf")


def gradient_leaks(
    model: nn.Module, label: str = "model", lengths: Sequence[int] = GRADIENT_LENGTHS, seed: int = 0
) -> GradientReport:
    """Relative gradient leaks between the sequences of one packed row through ``model`` (see module doc).

    ``model`` is run in eval mode (no dropout) on a copy's parameters' dtype and device; its gradients are left
    cleared. An exception raised by the model is recorded in ``GradientReport.error``.
    """
    if len(lengths) < 2 or min(lengths) < 2:
        raise ValueError(f"lengths: need >= 2 sequences of >= 2 tokens each, got {tuple(lengths)}")
    first = next(model.parameters())
    report = GradientReport(label, gradient_tol(first.dtype))
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, int(cfg.vocab_size), (1, sum(lengths)), generator=gen).to(first.device)  # [1, T]
    bounds = [0, *itertools.accumulate(lengths)]
    pos = torch.cat([torch.arange(n) for n in lengths])[None].to(first.device)  # [1, T]
    seq = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])[None].to(first.device)
    import inspect

    takes_pos = "position_ids" in inspect.signature(model.forward).parameters
    kwargs = {"position_ids": pos} if takes_pos else {"seq_idx": seq}
    try:
        report.embeddings = _embedding_leak(model, ids, kwargs, bounds)
        report.layers = _layer_leaks(model, ids, kwargs, bounds)
    except Exception as exc:  # noqa: BLE001 - a stock model refusing the packed row is a finding, not a crash
        report.error = f"{type(exc).__name__}: {exc}"
        return report
    finally:
        model.zero_grad(set_to_none=True)
    for _, kind, leak in report.layers:
        report.kinds[kind] = max(report.kinds.get(kind, 0.0), leak)
    return report


def _loss_of(logits: Tensor, ids: Tensor, a: int, b: int) -> Tensor:
    """Summed next-token loss of the sequence at tokens ``[a, b)`` of ``[1, T, V]`` logits."""
    return F.cross_entropy(logits[0, a : b - 1].float(), ids[0, a + 1 : b], reduction="sum")


def _masks(T: int, bounds: Sequence[int], j: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(``[T]`` positions of every sequence before ``j``, ``[T]`` positions of sequence ``j``)."""
    t = torch.arange(T, device=device)
    return t < bounds[j], (t >= bounds[j]) & (t < bounds[j + 1])


def _embedding_leak(model: nn.Module, ids: Tensor, kwargs: dict, bounds: Sequence[int]) -> float:
    embed = model.get_input_embeddings()
    held: list[Tensor] = []

    def leaf(module, args, output):
        x = output.detach().requires_grad_(True)
        held.append(x)
        return x

    handle = embed.register_forward_hook(leaf)
    try:
        with torch.enable_grad():
            logits = model(input_ids=ids, use_cache=False, **kwargs).logits
    finally:
        handle.remove()
    if len(held) != 1:
        raise RuntimeError(f"the input embeddings ran {len(held)} times in one forward; expected once")
    worst = 0.0
    for j in range(1, len(bounds) - 1):
        (g,) = torch.autograd.grad(_loss_of(logits, ids, bounds[j], bounds[j + 1]), held[0], retain_graph=True)
        before, own = _masks(ids.shape[1], bounds, j, ids.device)
        worst = max(worst, _rel(g, before, own))
    return worst


def _layer_leaks(model: nn.Module, ids: Tensor, kwargs: dict, bounds: Sequence[int]) -> list[tuple[str, str, float]]:
    layers = _decoder_layers(model)
    records: dict[int, tuple[Tensor, Tensor]] = {}
    handles = []

    def pre(i):
        def hook(module, args, kw):
            if args:
                x = args[0].detach().requires_grad_(True)
                records[i] = (x, None)
                return (x, *args[1:]), kw
            x = kw["hidden_states"].detach().requires_grad_(True)
            records[i] = (x, None)
            return args, {**kw, "hidden_states": x}

        return hook

    def post(i):
        def hook(module, args, kw, output):
            records[i] = (records[i][0], _first_tensor(output))

        return hook

    for i, (_, layer) in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(pre(i), with_kwargs=True))
        handles.append(layer.register_forward_hook(post(i), with_kwargs=True))
    try:
        with torch.enable_grad():
            logits = model(input_ids=ids, use_cache=False, **kwargs).logits
    finally:
        for h in handles:
            h.remove()
    if len(records) != len(layers) or any(out is None for _, out in records.values()):
        raise RuntimeError("not every decoder layer ran once with a tensor output; cannot check them one by one")
    T = ids.shape[1]
    worst = [0.0] * len(layers)
    for j in range(1, len(bounds) - 1):
        before, own = _masks(T, bounds, j, ids.device)
        loss = _loss_of(logits, ids, bounds[j], bounds[j + 1])
        top_out = records[len(layers) - 1][1]
        (g,) = torch.autograd.grad(loss, top_out, retain_graph=True)  # d loss_B / d h_L
        for i in reversed(range(len(layers))):
            x, out = records[i]
            keep = own.reshape(1, T, *([1] * (g.dim() - 2))).to(g.dtype)  # [1, T, 1...]: hidden [1, T, (streams,) D]
            g_own = g * keep  # the cotangent kept on B's positions
            (local,) = torch.autograd.grad(out, x, grad_outputs=g_own, retain_graph=True, allow_unused=True)
            if local is not None:
                worst[i] = max(worst[i], _rel(local, before, own))
            (g,) = torch.autograd.grad(out, x, grad_outputs=g, retain_graph=True, allow_unused=True)  # chain
            if g is None:
                break
    return [(name, _kind(layer), worst[i]) for i, (name, layer) in enumerate(layers)]


def audit_gradients(
    model: nn.Module, wrap_fn: Callable[[nn.Module], nn.Module] | None, label: str
) -> list[GradientReport]:
    """Gradient leaks of a deep copy of the stock ``model`` and, with ``wrap_fn``, of a wrapped copy."""
    reports = [gradient_leaks(copy.deepcopy(model).eval(), f"stock {label}")]
    if wrap_fn is not None:
        reports.append(gradient_leaks(wrap_fn(copy.deepcopy(model)).eval(), f"wrapped {label}"))
    return reports


def _fmt(x: float) -> str:
    return "0" if x == 0 else f"{x:.1e}"


def print_gradient_reports(console: Any, reports: Sequence[GradientReport]) -> bool:
    """Print one table (rows: embeddings and each layer kind; a column per model); True iff the last passes."""
    from rich.table import Table

    table = Table(title=f"gradient leak d loss_B / d x_A, relative (tol {reports[-1].tol:g})")
    table.add_column("gradient into")
    for r in reports:
        table.add_column(r.label, justify="right")
    kinds = list(dict.fromkeys(k for r in reports for k in r.kinds))

    def cell(r: GradientReport, value: float | None) -> str:
        if r.error is not None:
            return f"[red]raises {r.error.split(':')[0]}[/]"
        if value is None:
            return "[dim]n/a[/]"
        return f"[green]{_fmt(value)}[/]" if value <= r.tol else f"[red]{_fmt(value)} LEAK[/]"

    table.add_row("token embeddings (whole model)", *(cell(r, r.embeddings) for r in reports))
    for k in kinds:
        table.add_row(f"layers: {k}", *(cell(r, r.kinds.get(k)) for r in reports))
    console.print(table)
    for r in reports:
        if r.error is not None:
            console.print(f"[red]{r.label}:[/] {r.error}", markup=True, highlight=False)
    last = reports[-1]
    if last.passed:
        verdict = "[bold green]PASS[/]: no gradient crosses a packed boundary"
    elif last.error is not None:  # e.g. stock Mamba2 on transformers >= 5.25 without the CUDA kernels
        verdict = "[bold red]FAIL[/]: the model raises on a packed row (it does not serve packed sequences)"
    else:
        verdict = "[bold red]FAIL[/]: gradients leak across packed boundaries"
    console.print(f"{verdict} ({last.label})")
    return last.passed


def add_arguments(p: Any) -> None:
    """``--gradients`` on the ``audit`` subcommand."""
    p.add_argument(
        "--gradients",
        action="store_true",
        help="also check that no gradient crosses a packed boundary (d loss_B / d x_A = 0), per layer kind",
    )


def run(args: Any, model: nn.Module, wrap_fn: Callable[[nn.Module], nn.Module] | None, label: str, console: Any) -> int:
    """``safepad audit --gradients``: print the table; 0 iff the audited model (wrapped, or stock with
    ``--no-wrap``) leaks nothing. The reports go to ``args.gradient_json`` for ``--json``."""
    reports = audit_gradients(model, wrap_fn, label)
    args.gradient_json = {"gradients": [r.to_dict() for r in reports]}
    return 0 if print_gradient_reports(console, reports) else 1
