"""The einsum spec helper as a table, and the op instances rules refuse (None: computed
replicated) rather than describe wrongly."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest

from autoshard.ir.graph import Graph, Op, Value
from autoshard.rules import rule_for, supported_op_types
from autoshard.rules.einsum import einsum_rule, matmul_equation

EINSUM = [
    (
        "matmul",
        "ij,jk->ik",
        [(4, 6), (6, 8)],
        "loops [d0: parallel(4), d1: parallel(8), d2: reduction_sum(6)] "
        "operands ['(d0, d2)', '(d2, d1)'] results ['(d0, d1)']",
    ),
    (
        "ellipsis-broadcast",
        "...ij,...jk->...ik",
        [(3, 1, 4, 6), (5, 6, 8)],
        "loops [d0: parallel(3), d1: parallel(5), d2: parallel(4), d3: parallel(8), "
        "d4: reduction_sum(6)] operands ['(d0, 0, d2, d4)', '(d1, d4, d3)'] "
        "results ['(d0, d1, d2, d3)']",
    ),
    (
        "implicit-ellipsis",
        "...ij,jk",
        [(2, 4, 6), (6, 8)],
        "loops [d0: parallel(2), d1: parallel(4), d2: parallel(8), d3: reduction_sum(6)] "
        "operands ['(d0, d1, d3)', '(d3, d2)'] results ['(d0, d1, d2)']",
    ),
    (
        "ellipsis-summed-away",
        "...i->i",
        [(2, 3, 4)],
        "loops [d0: parallel(4), d1: reduction_sum(2), d2: reduction_sum(3)] "
        "operands ['(d1, d2, d0)'] results ['(d0)']",
    ),
    (
        "trace",
        "ii",
        [(4, 4)],
        "loops [d0: invalid(4)] operands ['(d0, d0)'] results ['()']",
    ),
    (
        "spaces-and-capitals",
        "bI, Ij -> bj",
        [(2, 3), (3, 5)],
        "loops [d0: parallel(2), d1: parallel(5), d2: reduction_sum(3)] "
        "operands ['(d0, d2)', '(d2, d1)'] results ['(d0, d1)']",
    ),
]


@pytest.mark.parametrize(
    ("equation", "shapes", "want"), [c[1:] for c in EINSUM], ids=[c[0] for c in EINSUM]
)
def test_einsum_rule(equation, shapes, want) -> None:
    assert str(einsum_rule(equation, shapes)) == want


@pytest.mark.parametrize(
    ("equation", "shapes"),
    [
        ("ij,jk->il", [(4, 6), (6, 8)]),
        ("ij,jk->ii", [(4, 6), (6, 8)]),
        ("ij,jk->ik", [(4, 6), (5, 8)]),
        ("ijk,jk->ik", [(4, 6), (6, 8)]),
        ("i...j...,j->i", [(4, 6, 6), (6,)]),
        ("i1,1k->ik", [(4, 6), (6, 8)]),
        ("ij->i", [(4, 6), (6, 8)]),
    ],
    ids=[
        "unknown-output-label",
        "repeated-output-label",
        "size-mismatch",
        "rank-mismatch",
        "two-ellipses",
        "not-a-letter",
        "operand-count",
    ],
)
def test_einsum_rule_refuses(equation, shapes) -> None:
    assert einsum_rule(equation, shapes) is None


@pytest.mark.parametrize(
    ("ranks", "want"),
    [
        ((2, 2), "...mk,...kn->...mn"),
        ((4, 3), "...mk,...kn->...mn"),
        ((1, 3), "k,...kn->...n"),
        ((3, 1), "...mk,k->...m"),
        ((1, 1), "k,k->"),
    ],
    ids=str,
)
def test_matmul_equation(ranks, want) -> None:
    assert matmul_equation(*ranks) == want


def node(
    op_type: str,
    inputs: Mapping[str, tuple[int, ...]],
    outputs: Mapping[str, tuple[int, ...]],
    constants: Mapping[str, object] | None = None,
    domain: str = "",
    **attrs,
) -> tuple[Op, Graph]:
    """One op in a hand-built graph: float values; `constants` are int64 constants."""
    consts = {k: np.asarray(v, dtype=np.int64) for k, v in (constants or {}).items()}
    values = {n: Value(n, s, "float32") for n, s in {**inputs, **outputs}.items() if n}
    values |= {n: Value(n, a.shape, "int64") for n, a in consts.items()}
    op = Op("op", op_type, domain, tuple(inputs), tuple(outputs), attrs)
    graph_inputs = tuple(n for n in inputs if n and n not in consts)
    return op, Graph("g", (op,), values, graph_inputs, tuple(o for o in outputs if o), {}, consts)


REFUSED = {
    "BatchNormalization-training": node(
        "BatchNormalization",
        {"x": (2, 4, 3), "s": (4,), "b": (4,), "m": (4,), "v": (4,)},
        {"y": (2, 4, 3)},
        training_mode=1,
    ),
    "MaxPool-indices": node(
        "MaxPool", {"x": (2, 4, 6)}, {"y": (2, 4, 3), "i": (2, 4, 3)}, kernel_shape=(2,)
    ),
    "Slice-bounds-not-constant": node("Slice", {"x": (4, 6), "s": (1,), "e": (1,)}, {"y": (3, 6)}),
    "Pad-pads-not-constant": node("Pad", {"x": (4, 6), "p": (4,)}, {"y": (4, 8)}),
    "CumSum-axis-not-constant": node("CumSum", {"x": (4, 6), "a": ()}, {"y": (4, 6)}),
    "ReduceSum-axes-not-constant": node("ReduceSum", {"x": (4, 6), "a": (1,)}, {"y": (4, 1)}),
    "Conv-group-mismatch": node(
        "Conv", {"x": (2, 4, 6), "w": (6, 3, 3)}, {"y": (2, 6, 4)}, group=2
    ),
    "Einsum-bad-equation": node(
        "Einsum", {"a": (4, 6), "b": (6, 8)}, {"y": (4, 8)}, equation="ij,jk->iz"
    ),
    "Resize-crop": node(
        "Resize",
        {"x": (1, 1, 4, 4), "roi": (8,), "": (), "sizes": (4,)},
        {"y": (1, 1, 2, 2)},
        {"sizes": [1, 1, 2, 2]},
        coordinate_transformation_mode="tf_crop_and_resize",
    ),
    "Gelu-other-domain": node("Gelu", {"x": (4, 6)}, {"y": (4, 6)}, domain="com.example"),
    # 4 query heads over 3 key-value heads: no grouping
    "Attention-heads-not-grouped": node(
        "Attention", {"q": (2, 4, 4, 8), "k": (2, 3, 4, 8), "v": (2, 3, 4, 8)}, {"y": (2, 4, 4, 8)}
    ),
    # a mask of 3 rows for 4 queries: neither the query dim nor a broadcast
    "Attention-mask-mismatch": node(
        "Attention",
        {"q": (2, 4, 4, 8), "k": (2, 2, 4, 8), "v": (2, 2, 4, 8), "m": (3, 4)},
        {"y": (2, 4, 4, 8)},
    ),
    # a quantized cache (k_scale)
    "GroupQueryAttention-quantized": node(
        "GroupQueryAttention",
        {
            "q": (2, 4, 32),
            "k": (2, 4, 16),
            "v": (2, 4, 16),
            "pk": (2, 2, 3, 8),
            "pv": (2, 2, 3, 8),
            "s": (2,),
            "t": (),
            **{f"x{i}": (1,) for i in range(7, 13)},
        },
        {"y": (2, 4, 32)},
        domain="com.microsoft",
        num_heads=4,
        kv_num_heads=2,
    ),  # fmt: skip
    "Shape": node("Shape", {"x": (4, 6)}, {"y": (2,)}),
    "Size": node("Size", {"x": (4, 6)}, {"y": ()}),
    "Range": node("Range", {"a": (), "b": (), "c": ()}, {"y": (8,)}),
    "NonZero": node("NonZero", {"x": (4, 6)}, {"y": (2, 5)}),
    "UnknownOp": node("NotAnOnnxOp", {"x": (4, 6)}, {"y": (4, 6)}),
}


@pytest.mark.parametrize("name", sorted(REFUSED), ids=str)
def test_refused(name: str) -> None:
    op, graph = REFUSED[name]
    if op.type != "NotAnOnnxOp":  # the refusal comes from the rule, not from a missing one,
        # or from the domain: another domain's op of an ONNX op's name is not that op
        assert op.type in supported_op_types(op.domain if op.domain != "com.example" else "")
    assert rule_for(op, graph) is None


ACCEPTED = {
    "BatchNormalization-training": node(
        "BatchNormalization",
        {"x": (2, 4, 3), "s": (4,), "b": (4,), "m": (4,), "v": (4,)},
        {"y": (2, 4, 3)},
    ),
    "MaxPool-indices": node("MaxPool", {"x": (2, 4, 6)}, {"y": (2, 4, 3)}, kernel_shape=(2,)),
    "Slice-bounds-not-constant": node(
        "Slice", {"x": (4, 6), "s": (1,), "e": (1,)}, {"y": (3, 6)}, {"s": [0], "e": [3]}
    ),
    "Pad-pads-not-constant": node(
        "Pad", {"x": (4, 6), "p": (4,)}, {"y": (4, 8)}, {"p": [0, 1, 0, 1]}
    ),
    "CumSum-axis-not-constant": node("CumSum", {"x": (4, 6), "a": ()}, {"y": (4, 6)}, {"a": 1}),
    "ReduceSum-axes-not-constant": node(
        "ReduceSum", {"x": (4, 6), "a": (1,)}, {"y": (4, 1)}, {"a": [1]}
    ),
    "Conv-group-mismatch": node(
        "Conv", {"x": (2, 4, 6), "w": (6, 2, 3)}, {"y": (2, 6, 4)}, group=2
    ),
    "Einsum-bad-equation": node(
        "Einsum", {"a": (4, 6), "b": (6, 8)}, {"y": (4, 8)}, equation="ij,jk->ik"
    ),
    "Gelu-other-domain": node("Gelu", {"x": (4, 6)}, {"y": (4, 6)}),
    "Attention-heads-not-grouped": node(
        "Attention", {"q": (2, 4, 4, 8), "k": (2, 2, 4, 8), "v": (2, 2, 4, 8)}, {"y": (2, 4, 4, 8)}
    ),
    "Attention-mask-mismatch": node(
        "Attention",
        {"q": (2, 4, 4, 8), "k": (2, 2, 4, 8), "v": (2, 2, 4, 8), "m": (4, 4)},
        {"y": (2, 4, 4, 8)},
    ),
    "GroupQueryAttention-quantized": node(
        "GroupQueryAttention",
        {
            "q": (2, 4, 32),
            "k": (2, 4, 16),
            "v": (2, 4, 16),
            "pk": (2, 2, 3, 8),
            "pv": (2, 2, 3, 8),
            "s": (2,),
            "t": (),
        },
        {"y": (2, 4, 32)},
        domain="com.microsoft",
        num_heads=4,
        kv_num_heads=2,
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", sorted(ACCEPTED), ids=str)
def test_refusal_control(name: str) -> None:
    """The refused op with the odd part removed does get a rule."""
    op, graph = ACCEPTED[name]
    assert rule_for(op, graph) is not None


def test_registered_but_replicated() -> None:
    assert {"Shape", "Size", "Range", "NonZero"} <= supported_op_types()
    assert "NotAnOnnxOp" not in supported_op_types()
