"""Device checks (``safepad._tracing.device_check``) are built for CUDA: their messages fit CUDA's limit.

CUDA's ``torch._assert_async(t, msg)`` refuses a message of 255 bytes or more, even when the check holds
(``RuntimeError: Message length must be smaller than 255``): a long message crashed every wrapped ``generate`` on a GPU (the decode
step's mask check). ``tests/conftest.py`` emulates that rule on CPU for the whole suite
(``safepad.testing.cuda_rules``); here every device check site in safepad is bounded statically, ``device_check``
refuses a long message itself, and the traced branch of the sites that can be called directly runs on CPU (forced
``tracing()``), failing, under CUDA's rules.
"""

from __future__ import annotations

import ast
import string
from pathlib import Path

import pytest
import torch

import safepad
from safepad._tracing import DEVICE_CHECK_MARK, MAX_DEVICE_MESSAGE, device_check, is_device_check_error, require
from safepad.testing import cuda_rules

ROOT = Path(safepad.__file__).parent
#: the most characters a placeholder of a device check's f-string may take (a class name, an argument name, a
#: layer index, a dtype)
PLACEHOLDER = 48


def _names_in(scope: ast.AST) -> dict[str, ast.expr]:
    """``name -> value`` of the simple assignments in ``scope`` (its own statements, not nested functions)."""
    out: dict[str, ast.expr] = {}
    for node in ast.walk(scope):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            out.setdefault(node.targets[0].id, node.value)
    return out


def _bound(node: ast.expr, scopes: list[dict[str, ast.expr]]) -> int | None:
    """An upper bound of the length of the string ``node`` evaluates to, or None when it cannot be bounded."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return len(node.value)
    if isinstance(node, ast.JoinedStr):
        total = 0
        for part in node.values:
            total += len(part.value) if isinstance(part, ast.Constant) else PLACEHOLDER
        return total
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _bound(node.left, scopes), _bound(node.right, scopes)
        return None if left is None or right is None else left + right
    if isinstance(node, ast.Name):
        for scope in scopes:
            if node.id in scope:
                return _bound(scope[node.id], scopes)
        return None
    if (  # "...{x}...".format(...) or TEMPLATE.format(...)
        isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format"
    ):
        template = node.func.value
        for scope in scopes:
            if isinstance(template, ast.Name) and template.id in scope:
                template = scope[template.id]
                break
        if isinstance(template, ast.Constant) and isinstance(template.value, str):
            parts = list(string.Formatter().parse(template.value))
            return sum(len(text) + (PLACEHOLDER if field is not None else 0) for text, field, _, _ in parts)
    return None


def _device_messages():
    """``(where, message node, scopes)`` of every device check in safepad: each ``device_check(ok, message)``, and
    each ``require(ok, message[, device_message])`` (its device message: the third argument, else the second)."""
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        module_scope = {
            node.targets[0].id: node.value
            for node in tree.body
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
        }
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            if name not in ("device_check", "require"):
                continue
            if path.name == "_tracing.py" and name == "device_check":
                continue  # require's own call (its messages are bounded at require's call sites)
            if name == "device_check":
                message = node.args[1] if len(node.args) > 1 else None
            else:
                kw = {k.arg: k.value for k in node.keywords}
                message = (
                    node.args[2] if len(node.args) > 2 else kw.get("device_message", node.args[1] if len(node.args) > 1
                                                                   else kw.get("message"))
                )
            inner = [f for f in functions if f.lineno <= node.lineno <= (f.end_lineno or f.lineno)]
            scopes = [_names_in(f) for f in sorted(inner, key=lambda f: -f.lineno)] + [module_scope]
            yield f"{path.relative_to(ROOT.parent)}:{node.lineno}", message, scopes


def test_every_device_check_message_fits_cuda():
    """Every device check's message, with the mark and each placeholder at its longest, is shorter than CUDA's limit;
    a message that cannot be bounded (built elsewhere) must be written at the call site."""
    sites = list(_device_messages())
    assert len(sites) >= 20, sites  # the scan sees the sites (boundaries, masks, normalize, hooks, ops, mixers, specs)
    problems = []
    for where, message, scopes in sites:
        bound = None if message is None else _bound(message, scopes)
        if bound is None:
            problems.append(f"{where}: the message cannot be bounded; write it as a literal or f-string at the call")
        elif len(DEVICE_CHECK_MARK) + bound >= MAX_DEVICE_MESSAGE:
            problems.append(f"{where}: up to {len(DEVICE_CHECK_MARK) + bound} characters with the mark")
    assert not problems, "\n".join(problems)


def test_device_check_refuses_a_long_message_itself():
    """Without the suite's emulation too: a long message raises on every device, whether or not the check holds."""
    ok = torch.tensor(True)
    was = cuda_rules.installed()
    cuda_rules.uninstall()
    try:
        with pytest.raises(ValueError, match="shorter than 255"):
            device_check(ok, "x" * (MAX_DEVICE_MESSAGE - len(DEVICE_CHECK_MARK)))
        with pytest.raises(ValueError, match="ASCII"):
            device_check(ok, "pads \u2192 front")
        device_check(ok, "x" * (MAX_DEVICE_MESSAGE - len(DEVICE_CHECK_MARK) - 1))  # the longest CUDA takes
    finally:
        if was:
            cuda_rules.install()


def test_require_checks_on_the_device_with_its_device_message(monkeypatch):
    """While tracing, ``require`` runs its short device message (the eager message may be long: a host error)."""
    long = "a long eager explanation " * 20
    with pytest.raises(ValueError, match="a long eager"):
        require(torch.tensor(False), long, "short")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(RuntimeError) as info:
        require(torch.tensor(False), long, "x must hold (docs/limits.md, check D0)")
    assert is_device_check_error(info.value) and "check D0" in str(info.value)
    require(torch.tensor(True), long, "short")


# ---------------------------------------------------------------------------------------------------------------
# the traced branch of the sites that can be called directly, failing, under CUDA's rules (forced tracing on CPU)
# ---------------------------------------------------------------------------------------------------------------


def _seq_idx_decreasing():
    from safepad.layout.boundaries import validate_seq_idx

    validate_seq_idx(torch.tensor([[0, 1, 0]]), (1, 3), name="seq_idx")


def _seq_idx_negative():
    from safepad.layout.boundaries import validate_seq_idx

    validate_seq_idx(torch.tensor([[-1, 0, 0]]), (1, 3), name="seq_idx")


def _cu_seqlens_start():
    from safepad.layout.boundaries import validate_cu_seqlens

    validate_cu_seqlens(torch.tensor([1, 3]), 3, "cu_seq_lens_q")


def _cu_seqlens_total():
    from safepad.layout.boundaries import validate_cu_seqlens

    validate_cu_seqlens(torch.tensor([0, 2]), 3, "cu_seq_lens_q")


def _cu_seqlens_row_start():
    from safepad.layout.normalize import normalize_boundaries

    normalize_boundaries((2, 3), cu_seq_lens_q=torch.tensor([0, 2, 6]))


def _cu_seqlens_differ():
    from safepad.layout.normalize import normalize_boundaries

    normalize_boundaries((1, 4), cu_seq_lens_q=torch.tensor([0, 2, 4]), cu_seq_lens_k=torch.tensor([0, 1, 4]))


def _position_ids_disagree():
    from safepad.layout.normalize import normalize_boundaries

    normalize_boundaries((1, 4), seq_idx=torch.tensor([[0, 0, 1, 1]]), position_ids=torch.tensor([[0, 1, 2, 0]]))


def _cu_seqlens_disagree():
    from safepad.layout.normalize import normalize_boundaries

    normalize_boundaries((1, 4), seq_idx=torch.tensor([[0, 0, 1, 1]]), cu_seq_lens_q=torch.tensor([0, 1, 4]))


def _mask_values():
    from safepad.layout.masks import check_mask_values

    check_mask_values(torch.tensor([[0.0, float("-inf")]]))


def _selective_scan_A():
    from safepad.ops.selective_scan import _check_A

    _check_A(torch.ones(2, 3), 2)


SITES = {
    "seq_idx_decreasing": (_seq_idx_decreasing, "non-decreasing"),
    "seq_idx_negative": (_seq_idx_negative, "non-negative"),
    "cu_seqlens_start": (_cu_seqlens_start, "start at 0"),
    "cu_seqlens_total": (_cu_seqlens_total, "add up to the row length"),
    "cu_seqlens_row_start": (_cu_seqlens_row_start, "row start must be a boundary"),
    "cu_seqlens_differ": (_cu_seqlens_differ, "differ"),
    "cu_seqlens_disagree": (_cu_seqlens_disagree, "disagrees with seq_idx"),
    "position_ids_disagree": (_position_ids_disagree, "check D8"),
    "mask_values": (_mask_values, "check D1"),
    "selective_scan_A": (_selective_scan_A, "non-positive"),
}


@pytest.mark.parametrize("site", list(SITES))
def test_traced_check_fails_with_a_short_message(site, monkeypatch):
    """Each site's traced branch, run eagerly with a failing input: a device check's ``RuntimeError`` (CPU) with
    the mark and a message CUDA takes (the suite's emulation raises CUDA's error for a long one first)."""
    fn, words = SITES[site]
    assert cuda_rules.installed()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(RuntimeError) as info:
        fn()
    assert is_device_check_error(info.value), info.value
    assert words in str(info.value) and len(str(info.value)) < MAX_DEVICE_MESSAGE
