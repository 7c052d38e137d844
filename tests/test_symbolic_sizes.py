"""Sizes are never compared with ``in`` in the library: under ``torch.compile`` a size may be symbolic.

dynamo makes a size dynamic when a compiled frame meets another shape (automatic dynamic shapes), and a tensor it
sees for the first time keeps static sizes. In the traced pre-hook, ``3 not in (1, s0)`` and ``s0 in (1, s0)`` then
evaluated wrongly (a static size against a symbolic one), and packed rows were silently read as unpacked
(tests/fuzz/test_regressions.py: two such defects, found by the fuzzer). ``safepad._tracing.size_in`` compares one
option at a time with ``==``. This test reads the library's source: no ``<size> in (...)`` / ``not in`` where the
left side is a ``.shape[...]`` / ``.size(...)`` or a tuple of sizes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "safepad"


def _is_size(node: ast.AST) -> bool:
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute):
        return node.value.attr == "shape"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.attr == "size" and bool(node.args)
    return False


def size_membership(source: str, name: str = "<source>") -> list[str]:
    """``"name:line: code"`` for every ``in`` / ``not in`` whose left side is a tensor size."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare) or not any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            continue
        if _is_size(node.left):
            found.append(f"{name}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return found


def test_library_compares_sizes_with_size_in():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        found += size_membership(path.read_text(), str(path.relative_to(ROOT.parent)))
    assert not found, "compare sizes with safepad._tracing.size_in, not `in`:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "code, n",
    [
        pytest.param("if pos.shape[0] not in (1, B): pass", 1, id="shape-not-in"),
        pytest.param("ok = x.size(0) in (1, 4)", 1, id="size-in"),
        pytest.param("ok = size_in(pos.shape[0], (1, B))", 0, id="size_in"),
        pytest.param("ok = name in ('a', 'b')", 0, id="not-a-size"),
    ],
)
def test_checker_finds_size_membership(code: str, n: int):
    assert len(size_membership(code)) == n


@pytest.mark.parametrize("family", [pytest.param("nemotron_h", id="nemotron_h"), pytest.param("lfm2", id="lfm2")])
def test_compiled_packed_positions_after_a_call_of_another_shape(family: str):
    """torch.compile(model): a call of [1, 12] without position_ids, then packed rows [3, 3] given by position_ids that
    restart at 0: input_ids' sizes are dynamic by then and position_ids' static. Each sequence equals it alone
    through the stock model (before the fix: 0.70 / 0.36 off, the sequences read as one)."""
    import torch

    import safepad
    from safepad.testing.tiny import strengthen_mixers, tiny_model

    torch.manual_seed(0)
    model = tiny_model(family).eval()
    strengthen_mixers(model)
    ids = torch.tensor([[40, 35, 14], [250, 44, 55], [228, 98, 126]])
    pos = torch.tensor([[0, 1, 2], [0, 1, 2], [0, 1, 0]])
    with torch.no_grad():
        alone = [model(input_ids=ids[:2], use_cache=False).logits, model(input_ids=ids[2:, :2], use_cache=False).logits,
                 model(input_ids=ids[2:, 2:], use_cache=False).logits]
    safepad.wrap(model)
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        compiled(input_ids=torch.randint(3, 200, (1, 12)), use_cache=False)
        out = compiled(input_ids=ids, position_ids=pos, use_cache=False).logits
    torch.testing.assert_close(out[:2], alone[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[2:, :2], alone[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[2:, 2:], alone[2], atol=1e-5, rtol=1e-5)
