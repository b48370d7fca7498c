"""Reshape's factorization rule: the table of (in, out) -> shared loops, the rule built on it,
and a property: every split of a shared loop is the same flat range of both tensors."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoshard.ir.graph import Graph, Op, Value
from autoshard.rules import rule_for
from autoshard.rules.shape import factorize, reshape_target

FACTORIZATIONS = [
    # (id, in shape, out shape, [(in dim, out dim, loop size)])
    ("split-heads", (2, 6, 768), (2, 6, 12, 64), [(0, 0, 2), (1, 1, 6), (2, 2, 12)]),
    ("merge-heads", (2, 6, 12, 64), (2, 6, 768), [(0, 0, 2), (1, 1, 6), (2, 2, 12)]),
    ("merge-batch-seq", (2, 16, 64), (32, 64), [(0, 0, 2), (2, 1, 64)]),
    ("split-batch-seq", (32, 64), (2, 16, 64), [(0, 0, 2), (1, 2, 64)]),
    ("flatten-all", (4, 6), (24,), [(0, 0, 4)]),
    ("unflatten", (24,), (4, 6), [(0, 0, 4)]),
    ("squeeze", (4, 1, 6), (4, 6), [(0, 0, 4), (2, 1, 6)]),
    ("unsqueeze", (4, 6), (1, 4, 1, 6, 1), [(0, 1, 4), (1, 3, 6)]),
    ("all-ones", (1, 1), (1,), []),
    ("gcd-outer", (4, 6), (8, 3), [(0, 0, 4)]),
    ("gcd-partial", (6, 4), (4, 6), [(0, 0, 2)]),
    ("gcd-12-3", (12,), (3, 4), [(0, 0, 3)]),
    ("three-into-two", (2, 3, 4), (4, 6), [(0, 0, 2)]),
    ("coprime", (2, 3), (3, 2), []),
    ("coprime-then-block", (2, 3, 8), (3, 2, 8), [(2, 2, 8)]),
    ("identity", (3, 5), (3, 5), [(0, 0, 3), (1, 1, 5)]),
]


@pytest.mark.parametrize(
    ("shape", "out", "want"), [c[1:] for c in FACTORIZATIONS], ids=[c[0] for c in FACTORIZATIONS]
)
def test_factorize(shape, out, want) -> None:
    assert factorize(shape, out) == want


@pytest.mark.parametrize(("shape", "out"), [((4, 6), (5, 5)), ((0, 4), (0, 4)), ((4,), (2, 3))])
def test_factorize_refuses(shape, out) -> None:
    assert factorize(shape, out) is None


@pytest.mark.parametrize(
    ("target", "shape", "allowzero", "want"),
    [
        ((0, 0, -1), (2, 6, 12, 64), False, [2, 6, 768]),
        ((-1, 64), (2, 6, 768), False, [144, 64]),
        ((0, 0, 12, 64), (2, 6, 768), False, [2, 6, 12, 64]),
        ((0, 4), (0, 8), True, [0, 4]),
    ],
    ids=["zeros-and-minus-one", "minus-one", "torch-zeros", "allowzero"],
)
def test_reshape_target(target, shape, allowzero, want) -> None:
    assert reshape_target(target, shape, allowzero) == want


def _reshape_graph(shape, out, target=None, allowzero=0) -> tuple[Op, Graph]:
    values = {
        "x": Value("x", shape, "float32"),
        "t": Value("t", (len(out),), "int64"),
        "y": Value("y", out, "float32"),
    }
    constants = {} if target is None else {"t": np.array(target, dtype=np.int64)}
    op = Op("r", "Reshape", inputs=("x", "t"), outputs=("y",), attrs={"allowzero": allowzero})
    inputs = ("x", "t") if target is None else ("x",)
    return op, Graph("g", (op,), values, inputs, ("y",), {}, constants)


@pytest.mark.parametrize(
    ("shape", "target", "want"),
    [
        ((2, 3), (3, 2), "loops [] operands ['(0, 0)', '-'] results ['(0, 0)']"),
        (
            (2, 3, 8),
            (3, 2, 8),
            "loops [d0: parallel(8)] operands ['(0, 0, d0)', '-'] results ['(0, 0, d0)']",
        ),
        (
            (2, 6, 12, 64),
            (0, 0, -1),
            "loops [d0: parallel(2), d1: parallel(6), d2: parallel(12)] "
            "operands ['(d0, d1, d2, 0)', '-'] results ['(d0, d1, d2)']",
        ),
    ],
    ids=["coprime-no-loops", "coprime-block-then-parallel", "merge-heads"],
)
def test_reshape_rule(shape, target, want) -> None:
    """A block that cannot be split still gets a rule: its dims follow no loop."""
    out = tuple(reshape_target(target, shape, False))
    op, graph = _reshape_graph(shape, out, target)
    assert str(rule_for(op, graph)) == want


@pytest.mark.parametrize(
    ("shape", "out", "target"),
    [((2, 6, 768), (2, 6, 12, 64), None), ((2, 6, 768), (2, 6, 12, 64), (2, 6, 64, 12))],
    ids=["target-not-constant", "target-disagrees-with-result"],
)
def test_reshape_without_rule(shape, out, target) -> None:
    op, graph = _reshape_graph(shape, out, target)
    assert rule_for(op, graph) is None


@st.composite
def regroupings(draw):
    """Two shapes with the same element count: one list of factors grouped two ways, with
    size-1 dims sprinkled in."""
    factors = draw(st.lists(st.sampled_from([2, 2, 2, 3, 4, 5, 6]), min_size=1, max_size=6))

    def group():
        inner = st.integers(1, len(factors) - 1) if len(factors) > 1 else st.nothing()
        cuts = sorted(draw(st.sets(inner, max_size=len(factors) - 1)))
        bounds = [0, *cuts, len(factors)]
        dims = [math.prod(factors[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
        for _ in range(draw(st.integers(0, 2))):
            dims.insert(draw(st.integers(0, len(dims))), 1)
        return tuple(dims)

    return group(), group()


@settings(max_examples=200, deadline=None)
@given(regroupings(), st.sampled_from([2, 3]))
def test_split_of_a_shared_loop_is_one_flat_range(shapes, parts) -> None:
    """Shard k of the loop, taken in the input dim and reshaped locally, equals shard k taken
    in the output dim: for every pair whose loop size the split count divides."""
    shape, out = shapes
    pairs = factorize(shape, out)
    assert pairs is not None
    x = np.arange(math.prod(shape)).reshape(shape)
    y = x.reshape(out)
    for i, j, size in pairs:
        assert shape[i] % size == 0 and out[j] % size == 0
        if size % parts:
            continue
        for k in range(parts):
            mine = np.split(x, parts, axis=i)[k]
            local_out = list(out)
            local_out[j] //= parts
            np.testing.assert_array_equal(mine.reshape(local_out), np.split(y, parts, axis=j)[k])
