"""``safepad audit``: run the scenario matrix on a stock model and on its wrapped copy, side by side.

Exit status: 0 iff every applicable scenario of the wrapped model (of the stock model with ``--no-wrap``)
passes, 1 otherwise, 2 for usage errors (unknown family or scenario, bad model path, wrap unavailable).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import UnsupportedModelError
from ..testing.scenarios import AUDIT_SCENARIOS, ROUNDING_FACTOR, AuditReport, ScenarioResult, audit
from ..testing.tiny import family_available, family_names, tiny_model
from . import gradients as gradients_cmd

logger = logging.getLogger(__name__)

__all__ = ["add_parser", "plot_pad_sweep", "run"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: ``safepad.wrap(model, backend=...)`` values
_BACKENDS = ("auto", "torch", "kernels")
#: what installs matplotlib for ``--plot``
PLOT_EXTRA = 'pip install "safepad[plot]"'


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "audit",
        help="check a model's padding / packing / caching correctness, stock vs wrapped",
        description=(
            "Run every padding, packing and caching scenario on the stock model and on a safepad-wrapped copy, "
            "each compared with the sequences run one at a time through the stock model. Default model: the "
            "built-in tiny Nemotron-H."
        ),
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--family",
        default=None,
        help=f"built-in tiny model: {', '.join(family_names())} (default nemotron_h)",
    )
    src.add_argument(
        "--model",
        metavar="PATH",
        default=None,
        help="local checkpoint directory: a causal LM, or a VLM (its language model is audited)",
    )
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="float32", help="model dtype (default float32)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cuda (default cpu)")
    p.add_argument("--backend", choices=_BACKENDS, default="auto", help="safepad.wrap backend (default auto)")
    p.add_argument("--scenarios", default=None, metavar="A,B,C", help=f"subset of: {', '.join(AUDIT_SCENARIOS)}")
    p.add_argument("--tol", type=float, default=None, help="max |Δ| tolerated (default: by dtype, 1e-4 for fp32)")
    p.add_argument("--no-wrap", action="store_true", help="audit the stock model only")
    p.add_argument("--json", metavar="FILE", default=None, help="also write the results as JSON")
    p.add_argument("--plot", metavar="FILE", default=None, help="PNG: cached-state error vs trailing pad count")
    p.add_argument("--max-pads", type=int, default=8, help="pad counts 0..N for --plot (default 8)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    gradients_cmd.add_arguments(p)
    p.set_defaults(run=run)
    return p


def _parse_scenarios(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    if args.scenarios is None:
        return list(AUDIT_SCENARIOS)
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in AUDIT_SCENARIOS]
    if unknown or not names:
        parser.error(
            f"--scenarios: unknown {', '.join(unknown) or '(empty)'}; choose from {', '.join(AUDIT_SCENARIOS)}"
        )
    return names


def _check_outputs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Usage errors (exit 2) before anything runs: an output file whose directory does not exist, or ``--plot``
    without matplotlib."""
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is None:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            parser.error(f"{flag}: {path!r} is a directory; pass a file name")
        if not os.path.isdir(folder):
            parser.error(f"{flag}: the directory {folder!r} does not exist; create it first or write elsewhere")
        if not os.access(folder, os.W_OK):
            parser.error(f"{flag}: the directory {folder!r} is not writable")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError as exc:
            parser.error(f"--plot needs matplotlib, which cannot be imported ({exc}): {PLOT_EXTRA}")


def _load_model(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[nn.Module, str]:
    dtype = _DTYPES[args.dtype]
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        parser.error(f"--device: {exc}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available; use --device cpu")
    if args.model is not None:
        if not os.path.isdir(args.model):
            parser.error(f"--model: {args.model!r} is not a directory; pass a local checkpoint directory")
        model, label = _load_checkpoint(args.model, dtype, parser)
        return model.to(device).eval(), label
    family = args.family or "nemotron_h"
    known = family_names()  # every safepad.supported_model_types() entry is one
    if family not in known:
        parser.error(f"--family: unknown family {family!r}; choose from {', '.join(known)}")
    available, why = family_available(family)
    if not available:
        parser.error(f"--family: {why}")
    return tiny_model(family, dtype=dtype).to(device), f"tiny {family}"


# Auto classes tried for --model, in order: text models first, then VLMs (whose language part is audited).
_AUTO_CLASSES = ("AutoModelForCausalLM", "AutoModelForImageTextToText", "AutoModelForMultimodalLM")


def _load_checkpoint(path: str, dtype: torch.dtype, parser: argparse.ArgumentParser) -> tuple[nn.Module, str]:
    """Load ``path`` with the auto class its config belongs to; return the part to audit and its label.

    A VLM is audited through its language model: the outermost submodule that is a causal LM (e.g. the
    ``NemotronHForCausalLM`` inside ``NemotronH_Omni_Reasoning_V3``), or, when the language model has no head of
    its own, the VLM itself on text-only inputs. Every failure is a usage error (exit 2), never a traceback.
    """
    import transformers
    from transformers import AutoConfig

    from ..guard import find_ssm_layers
    from ..wrap import supported_model_types

    name = os.path.basename(os.path.normpath(path))
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        parser.error(f"--model: cannot load {path!r}: cannot read its config: {exc}")
    classes = [getattr(transformers, c) for c in _AUTO_CLASSES if hasattr(transformers, c)]
    auto = next((c for c in classes if type(config) in c._model_mapping), None)
    if auto is None:
        parser.error(
            f"--model: {path!r} holds a {config.model_type!r} model ({type(config).__name__}), which none of "
            f"{', '.join(c.__name__ for c in classes)} loads; safepad audit needs a causal language model or a "
            "VLM built around one"
        )
    try:
        model = auto.from_pretrained(path, dtype=dtype, local_files_only=True)
    except (OSError, ValueError, KeyError, RuntimeError, TypeError) as exc:
        parser.error(f"--model: cannot load {path!r} with {auto.__name__}: {exc}")
    if find_ssm_layers(model) is None:
        parser.error(
            f"--model: {name} ({type(model).__name__}, model_type={config.model_type!r}) has no recurrent "
            "(SSM / linear-attention) layer, so padding and packing are its attention's business and safepad has "
            f"nothing to audit. Models with such layers: {', '.join(supported_model_types())}"
        )
    if auto.__name__ == "AutoModelForCausalLM":
        return model, name
    lm_classes = set(transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    for sub_name, sub in model.named_modules():
        if sub_name and type(sub).__name__ in lm_classes and find_ssm_layers(sub) is not None:
            logger.info("safepad audit: auditing %s.%s (%s) of %s", name, sub_name, type(sub).__name__, name)
            return sub, f"{name}: {sub_name} ({type(sub).__name__})"
    return model, f"{name} ({type(model).__name__}, text-only inputs)"


def _resolve_wrap(
    args: argparse.Namespace, parser: argparse.ArgumentParser, wrap_fn: Callable[[nn.Module], nn.Module] | None
) -> Callable[[nn.Module], nn.Module] | None:
    if args.no_wrap:
        return None
    if wrap_fn is not None:
        return wrap_fn
    try:
        from ..wrap import wrap
    except ImportError as exc:
        parser.error(f"safepad.wrap is not available ({exc}); run with --no-wrap for a stock-only audit")
    backend = args.backend
    return lambda model: wrap(model, backend=backend)


def _fmt(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:.1e}" if math.isfinite(x) else str(x)


def _cell(r: ScenarioResult) -> str:
    """Rich markup for one model's max |Δ logits| cell."""
    if not r.applicable:
        return "[dim]n/a[/]"
    if r.error is not None:
        return f"[red]raises {r.error.split(':')[0]}[/]"
    text = _fmt(r.max_abs_logits)
    if r.rounding_factor is not None and r.rms_logits is not None and r.rounding_rms:
        text += f" ({r.rms_logits / r.rounding_rms:.1f}x rnd)"  # RMS error / the stock model's own RMS rounding
    if r.same_dtype_error is not None:
        text += f" / {_fmt(r.same_dtype_error)}"  # against the model's own runs alone, same dtype
    if r.mismatched_tokens:
        text += f" ({r.mismatched_tokens} tok)"
    return f"[green]{text}[/]" if r.passed else f"[red]{text}[/]"


def _states(r: ScenarioResult | None) -> str:
    if r is None or not r.state_errors:
        return ""
    return f"conv {_fmt(r.max_state_error_of('conv'))} / rec {_fmt(r.max_state_error_of('recurrent'))}"


def _verdict(r: ScenarioResult) -> str:
    return {"n/a": "[dim]n/a[/]", "ok": "[green]pass[/]"}.get(r.status, "[bold red]FAIL[/]")


def _legend(tol: float, wrapped: bool, same_dtype_tol: float | None = None) -> str:
    """What every cell of the table means (printed under it)."""
    subject = "the wrapped model" if wrapped else "the stock model"
    half = ()
    if same_dtype_tol is not None:
        half = (
            "  a (Nx rnd) / b  half precision: a as above, against the stock model in float64 (each sequence",
            "                alone); the logits pass iff N, their RMS |Δ| from it over the stock model's own RMS",
            "                rounding in this dtype on the same sequences (each alone, vs the same float64 reference),",
            f"                is at most {ROUNDING_FACTOR:g} (--json: rms_logits, rounding_rms): a weight or math"
            " defect",
            "                fails, rounding does not; cached states keep tol. b: against each sequence run alone"
            " through the same",
            "                model in the same dtype (one-shot, no padding, no cache), within tol",
            f"                {same_dtype_tol:g} x max(1, largest |reference logit|) (half an ulp, or 4 x that",
            "                reference's measured noise): b separates a layout defect (stock Bamba's decode past"
            " its dt",
            "                floor) from rounding",
        )
    return "\n".join(
        (
            "How to read the cells: every number is the largest |difference| from the reference, which is each",
            "sequence run alone through the stock model (full forward: no padding, no packing, no cache; its",
            "cached states: its own cached prefill).",
            "  max|Δ|        largest |Δ logits| over every compared token (prefill and decode steps); 'N tok' after",
            "                it: generate produced N tokens that differ from the prompt's own greedy continuation",
            "  raises X      the model raised exception X (its message is printed below the table)",
            "  n/a           the scenario does not apply to the model (e.g. no time_step_limit for decode_dt_*)",
            "  conv a / rec b  largest |Δ| of the cached conv states / recurrent (SSM, delta-rule) states right after",
            "                the prefill, over every layer and row; '—': the model has no such state",
            f"  result        pass: {subject} is within tol {tol:g} x max(1,",
            "                largest |reference value|) for the logits and every state, and raises nothing",
            "  *_no_pos      the same call without position_ids (mask and cache only, as the README's recipes)",
            *half,
        )
    )


def _print_report(console: Any, report: AuditReport) -> None:
    from rich.table import Table

    wrapped = report.wrapped is not None
    table = Table(title=f"safepad audit: {report.model_name} ({report.dtype}, {report.device}, tol {report.tol:g})")
    width = max((len(stock.name) for stock, _ in report.rows()), default=8)
    table.add_column("scenario", no_wrap=True, min_width=width)  # never cut to "chunked_pr…"
    # a narrow terminal folds the other cells onto more lines rather than cutting them ("…")
    table.add_column("stock max|Δ|", justify="right", overflow="fold")
    if wrapped:
        table.add_column("wrapped max|Δ|", justify="right", overflow="fold")
    table.add_column("result", overflow="fold")
    table.add_column("stock cached state max|Δ|", overflow="fold")
    if wrapped:
        table.add_column("wrapped cached state max|Δ|", overflow="fold")
    for stock, wr in report.rows():
        subject = wr if wr is not None else stock
        row = [stock.name, _cell(stock)]
        if wrapped:
            row.append(_cell(wr))
        row += [_verdict(subject), _states(stock)]
        if wrapped:
            row.append(_states(wr))
        table.add_row(*row)
    console.print(table)
    same = next((r.same_dtype_tol for r in report.subject if r.same_dtype_tol is not None), None)
    console.print(_legend(report.tol, wrapped, same), markup=False, highlight=False, soft_wrap=True)
    if report.reference_rounding is not None:
        console.print(
            f"  tol on {report.device}: at least 4 x the float32 reference's own rounding there, "
            f"{report.reference_rounding:.1e} x max(1, scale) against a float64 copy (a stock model on CUDA runs "
            "mamba-ssm / FLA Triton kernels whose float32 matmuls round to TF32; docs/limits.md)",
            markup=False, highlight=False, soft_wrap=True,
        )
    for stock, wr in report.rows():  # the legend's promise: every "raises X" cell's message
        for label, r in (("stock", stock), ("wrapped", wr)):
            if r is not None and r.applicable and r.error is not None:
                console.print(f"[red]{label} {r.name}:[/] ", end="", markup=True, highlight=False)
                console.print(r.error, markup=False, highlight=False, soft_wrap=True)
    subject = "wrapped" if wrapped else "stock"
    n_fail = sum(1 for r in report.subject if r.applicable and not r.passed)
    if report.passed:
        console.print(f"[bold green]PASS[/]: every applicable {subject} scenario is within tolerance")
    else:
        console.print(f"[bold red]FAIL[/]: {n_fail} {subject} scenario(s) out of tolerance or raising")


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def plot_pad_sweep(sweep: dict[str, list[float]], path: str, title: str = "") -> None:
    """Write a PNG of cached-state error vs number of trailing pad tokens (one line per model)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    try:
        for label, errors in sweep.items():
            # log axis: exact zeros are drawn at 1e-12, a raising model (inf) leaves a gap
            ys = [max(e, 1e-12) if math.isfinite(e) else math.nan for e in errors]
            ax.plot(range(len(ys)), ys, marker="o", label=label)
        ax.set_yscale("log")
        ax.set_xlabel("trailing pad tokens in the prefill")
        ax.set_ylabel("max |Δ| of cached states vs unpadded run")
        ax.set_title(title or "cached state after right-padded prefill")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)


def run(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    *,
    wrap_fn: Callable[[nn.Module], nn.Module] | None = None,
) -> int:
    """Execute ``safepad audit``; return the exit status."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    names = _parse_scenarios(args, parser)
    if args.max_pads < 0:
        parser.error("--max-pads: must be >= 0")
    if args.tol is not None and not args.tol > 0:
        parser.error("--tol: must be > 0")
    _check_outputs(args, parser)
    fn = _resolve_wrap(args, parser, wrap_fn)
    model, label = _load_model(args, parser)
    console = Console() if sys.stdout.isatty() else Console(width=150)  # no 80-column wrap in logs and pipes
    total = len(names) * (1 if fn is None else 2)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=args.no_progress,
    ) as progress:
        task = progress.add_task(f"auditing {label}", total=total)

        def _advance(which: str, r: ScenarioResult) -> None:
            progress.update(task, advance=1, description=f"{which} {r.name}")

        try:
            report = audit(
                model,
                fn,
                names,
                tol=args.tol,
                progress=_advance,
                model_name=label,
                sweep_pads=args.max_pads if args.plot else None,
            )
        except UnsupportedModelError as exc:  # raised by wrap before any scenario ran
            parser.error(f"{label}: {exc} Run with --no-wrap for a stock-only audit.")
    _print_report(console, report)
    code = 0 if report.passed else 1
    if args.gradients:  # safepad/cli/gradients.py
        code = max(code, gradients_cmd.run(args, model, fn, label, console))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(
                _jsonable({**report.to_dict(), **getattr(args, "gradient_json", {}), "exit_code": code}), fh, indent=2
            )
        console.print(f"results written to {args.json}")
    if args.plot and report.pad_sweep is not None:
        plot_pad_sweep(report.pad_sweep, args.plot, title=f"{label}: cached state after right-padded prefill")
        console.print(f"plot written to {args.plot}")
    return code
