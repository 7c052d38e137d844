"""``safepad.ops.prepared``: parameter-derived values kept inside ``keep_prepared`` only, rebuilt whenever a
parameter they came from changes (another object, an in-place write, new storage), never kept outside a scope, for
a call that needs their gradient, or past the scope's end."""

from __future__ import annotations

import torch

from safepad.ops.prepared import _SCOPE, keep_prepared, prepared


class _Builds:
    """``build`` for :func:`prepared`: ``2 * w``, counting its calls."""

    def __init__(self, w: torch.Tensor):
        self.w, self.n = w, 0

    def __call__(self) -> torch.Tensor:
        self.n += 1
        return self.w.detach() * 2


def _get(b: _Builds, extra=("float32",)) -> torch.Tensor:
    return prepared(("test", id(b.w)), (b.w,), extra, b)


def test_outside_a_scope_every_call_builds():
    b = _Builds(torch.nn.Parameter(torch.ones(3)))
    with torch.no_grad():
        _get(b), _get(b)
    assert b.n == 2 and _SCOPE.get() is None


def test_inside_a_scope_one_build_until_a_parameter_changes():
    w = torch.nn.Parameter(torch.ones(3))
    b = _Builds(w)
    with keep_prepared(), torch.no_grad():
        first, again = _get(b), _get(b)
        assert b.n == 1 and again is first
        w.add_(1.0)  # in place: the version moves
        assert torch.equal(_get(b), torch.full((3,), 4.0)) and b.n == 2
        w.data = torch.full((3,), 5.0)  # new storage: the data pointer moves
        assert torch.equal(_get(b), torch.full((3,), 10.0)) and b.n == 3
        _get(b, extra=("bfloat16",))  # another dtype / constant
        assert b.n == 4
        b.w = torch.nn.Parameter(torch.full((3,), 6.0))  # another object
        assert torch.equal(prepared(("test", id(w)), (b.w,), ("bfloat16",), b), torch.full((3,), 12.0))
    assert _SCOPE.get() is None


def test_a_call_that_needs_the_gradient_builds_in_its_graph():
    w = torch.nn.Parameter(torch.ones(3))
    with keep_prepared():
        with torch.no_grad():
            prepared(("g", id(w)), (w,), (), lambda: w * 2)
        y = prepared(("g", id(w)), (w,), (), lambda: w * 2)
    y.sum().backward()
    assert torch.equal(w.grad, torch.full((3,), 2.0))


def test_nested_scopes_share_the_outer_store():
    b = _Builds(torch.nn.Parameter(torch.ones(3)))
    with keep_prepared(), torch.no_grad():
        _get(b)
        with keep_prepared():
            _get(b)
        _get(b)
    assert b.n == 1


def test_a_traced_call_builds():
    """Under ``torch.compile`` the value is built in the graph (a Python dict is no state to trace)."""
    w = torch.nn.Parameter(torch.ones(3))

    def fn(x):
        return x + prepared(("t", id(w)), (w,), (), lambda: w.detach() * 2)

    with keep_prepared(), torch.no_grad():
        out = torch.compile(fn, backend="eager", fullgraph=True)(torch.zeros(3))
        w.data.copy_(torch.full((3,), 3.0))  # no version counter moves; the graph reads w again
        out2 = torch.compile(fn, backend="eager", fullgraph=True)(torch.zeros(3))
    assert torch.equal(out, torch.full((3,), 2.0)) and torch.equal(out2, torch.full((3,), 6.0))
