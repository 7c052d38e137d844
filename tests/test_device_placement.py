"""CUDA's device rule on CPU: no tensor the library creates lands on the CPU by default.

On a GPU, a tensor made by a torch factory without ``device=`` (``torch.arange(T)``, ``torch.zeros(B)``,
``torch.tensor(lengths)``) is a CPU tensor, and the first op that meets a CUDA tensor raises "Expected all tensors
to be on the same device" (or, for a CPU index into a CUDA tensor, copies and syncs). On CPU CI every tensor is a CPU
tensor, so no run can see it. This test reads the library's source instead: every torch factory call in ``safepad/``
(but ``safepad/testing``, which builds test inputs on the CPU on purpose) passes ``device=``, is moved with ``.to(``
(``(...).to(device or tensor)``), or says why it is a host tensor with a ``# host:`` comment on its line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "safepad"
FACTORIES = frozenset(
    {"arange", "zeros", "ones", "full", "empty", "tensor", "as_tensor", "eye", "linspace", "logspace", "rand",
     "randn", "randint", "randperm", "scalar_tensor", "empty_strided", "tril_indices", "triu_indices"}
)  # fmt: skip


def unplaced_factories(source: str, name: str = "<source>") -> list[str]:
    """``"name:line: code"`` for every ``torch.<factory>(...)`` in ``source`` that may land on the CPU by default."""
    lines = source.splitlines()
    tree = ast.parse(source)
    moved = _moved_calls(tree)
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES):
            continue
        if not (isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
            continue
        keywords = {k.arg for k in node.keywords}
        if "device" in keywords or None in keywords:  # device= given, or **kwargs that may carry it
            continue
        line = lines[node.lineno - 1]
        if id(node) in moved or "# host:" in line:
            continue
        found.append(f"{name}:{node.lineno}: {line.strip()}")
    return found


def _moved_calls(tree: ast.AST) -> set[int]:
    """ids of the calls inside a ``(...).to(x)`` whose ``x`` is not a dtype (a tensor, a device or a string), e.g.
    ``torch.cat([torch.arange(n) for n in lengths]).to(first.device)``; ``.to(torch.int32)`` keeps the CPU."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "to"):
            continue
        first = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "device"), None)
        is_dtype = isinstance(first, ast.Attribute) and isinstance(first.value, ast.Name) and first.value.id == "torch"
        if first is None or is_dtype:
            continue
        out.update(id(n) for n in ast.walk(node.func.value) if isinstance(n, ast.Call))
    return out


def test_library_factories_are_placed():
    files = [p for p in sorted(ROOT.rglob("*.py")) if "testing" not in p.relative_to(ROOT).parts]
    assert len(files) > 50, files  # the library's tree, not an empty glob
    found = [f for p in files for f in unplaced_factories(p.read_text(), str(p.relative_to(ROOT.parent)))]
    assert not found, (
        "torch factories without device= (a CPU tensor on a GPU run): pass device=, move the result with "
        ".to(device), or mark a deliberate host tensor with '# host: why'\n" + "\n".join(found)
    )


@pytest.mark.parametrize(
    "code, n",
    [
        pytest.param("idx = torch.arange(T)\n", 1, id="arange"),
        pytest.param("lens = torch.tensor(lengths, dtype=torch.int32)\n", 1, id="tensor-with-dtype-only"),
        pytest.param("z = torch.zeros(B, device=x.device)\n", 0, id="device-kw"),
        pytest.param("z = torch.zeros(B).to(x)\n", 0, id="moved"),
        pytest.param("z = torch.cat([torch.arange(n) for n in ns])[None].to(x.device)\n", 0, id="moved-expression"),
        pytest.param("z = torch.arange(T).to(torch.int32)\n", 1, id="dtype-only-move"),
        pytest.param('z = torch.arange(T).to("cpu")\n', 0, id="explicit-cpu"),
        pytest.param("z = torch.full((B,), 1, **kw)\n", 0, id="kwargs"),
        pytest.param("rows = torch.arange(B)  # host: row indices\n", 0, id="host-marked"),
        pytest.param("y = x.new_zeros(B)\n", 0, id="method-inherits-device"),
    ],
)
def test_checker_finds_unplaced_factories(code, n):
    assert len(unplaced_factories(code)) == n
