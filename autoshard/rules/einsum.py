"""Contractions as einsum specs (DTensor's `_matrix_ops` style): MatMul, Gemm, Einsum.

`einsum_rule("bmk,bkn->bmn", shapes)` turns an equation and the operand shapes into an OpRule:
one loop per label, output labels first (in output order), then the contracted labels (in order
of first appearance). Output labels are parallel, the others sum reductions. A dim of size 1
whose label has a larger size is a numpy broadcast and follows no loop. A label repeated inside
one operand (a diagonal, `ii->i`) is invalid: one mesh axis cannot split two dims of a tensor.

    MatMul [4, 1, 6, 8] x [3, 8, 10] = "...mk,...kn->...mn"
    loops [d0: parallel(4), d1: parallel(3), d2: parallel(6), d3: parallel(10),
           d4: reduction_sum(8)]
    maps  (d0, 0, d2, d4)  (d1, d4, d3)  ->  (d0, d1, d2, d3)

Gemm's bias C is added by every device, so a Gemm with C carries the note "bias_once": when
the k loop is split, C must be added on one device of the reduction group only (zero
elsewhere), else the partial sums count it once per device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from autoshard.ir.graph import Graph, Op
from autoshard.rules.base import (
    IndexingMap,
    Loop,
    Note,
    OpRule,
    broadcast_map,
    invalid,
    reduction,
)
from autoshard.rules.registry import register


def _terms(equation: str) -> tuple[list[str], str | None]:
    """The input terms and the output term (None in implicit mode), spaces dropped."""
    eq = equation.replace(" ", "")
    inputs, arrow, output = eq.partition("->")
    return inputs.split(","), (output if arrow else None)


def _labels(term: str, rank: int, ellipsis_rank: int) -> list[str] | None:
    """A term's labels, its `...` dims named `.0`, `.1`, ... right-aligned over all operands."""
    head, dots, tail = term.partition("...")
    if not all(c.isalpha() for c in head + tail):
        return None
    if not dots:
        return list(term) if len(term) == rank else None
    own = rank - len(head) - len(tail)
    if own < 0:
        return None
    first = ellipsis_rank - own
    return [*head, *(f".{first + i}" for i in range(own)), *tail]


def einsum_rule(equation: str, shapes: Sequence[Sequence[int]]) -> OpRule | None:
    """The rule of an einsum over operands of `shapes`, or None if the equation does not fit."""
    terms, output = _terms(equation)
    if len(terms) != len(shapes) or (output is not None and output.count("...") > 1):
        return None
    if any(t.count("...") > 1 for t in terms):
        return None
    ellipsis_rank = max(
        (len(s) - len(t) + 3 for t, s in zip(terms, shapes, strict=True) if "..." in t),
        default=0,
    )
    operand_labels: list[list[str]] = []
    for term, shape in zip(terms, shapes, strict=True):
        labels = _labels(term, len(shape), ellipsis_rank)
        if labels is None:
            return None
        operand_labels.append(labels)
    dots = [f".{i}" for i in range(ellipsis_rank)]
    if output is None:  # implicit mode: `...`, then the labels seen once, alphabetically
        seen = [c for labels in operand_labels for c in labels if not c.startswith(".")]
        out_labels = dots + sorted(c for c in set(seen) if seen.count(c) == 1)
    else:  # an explicit output without `...` sums the ellipsis dims away
        head, has_dots, tail = output.partition("...")
        if not all(c.isalpha() for c in head + tail):
            return None
        out_labels = [*head, *(dots if has_dots else []), *tail]
    if len(set(out_labels)) != len(out_labels):
        return None
    sizes: dict[str, int] = {}
    for labels, shape in zip(operand_labels, shapes, strict=True):
        for label, size in zip(labels, shape, strict=True):
            known = sizes.setdefault(label, size)
            if size != known and 1 not in (size, known):
                return None
            sizes[label] = max(known, size)
    if any(label not in sizes for label in out_labels):
        return None
    contracted = [label for labels in operand_labels for label in labels]
    order = out_labels + [c for c in dict.fromkeys(contracted) if c not in out_labels]
    index = {label: i for i, label in enumerate(order)}
    diagonal = {c for labels in operand_labels for c in labels if labels.count(c) > 1}

    def loop(label: str) -> Loop:
        size = sizes[label]
        if label in diagonal:
            return invalid(size)
        return Loop(size) if label in out_labels else reduction(size)

    def operand_map(labels: list[str], shape: Sequence[int]) -> IndexingMap:
        return IndexingMap.of(
            *(
                None if d == 1 and sizes[c] > 1 else index[c]
                for c, d in zip(labels, shape, strict=True)
            )
        )

    return OpRule(
        loops=tuple(loop(label) for label in order),
        operands=tuple(operand_map(lb, s) for lb, s in zip(operand_labels, shapes, strict=True)),
        results=(IndexingMap.of(*(index[c] for c in out_labels)),),
    )


def _shape(graph: Graph, name: str) -> tuple[int, ...]:
    return graph.values[name].shape


def matmul_equation(rank_a: int, rank_b: int) -> str:
    """numpy.matmul as einsum: batch dims broadcast, a 1-D operand loses its m or n dim."""
    if rank_a == 1:
        return "k,k->" if rank_b == 1 else "k,...kn->...n"
    return "...mk,k->...m" if rank_b == 1 else "...mk,...kn->...mn"


@register("MatMul")
def matmul(op: Op, graph: Graph) -> OpRule | None:
    shapes = [_shape(graph, name) for name in op.inputs]
    if any(len(s) == 0 for s in shapes):
        return None
    rule = einsum_rule(matmul_equation(len(shapes[0]), len(shapes[1])), shapes)
    ring = _attention_ring(op, graph)
    if rule is None or ring is None:
        return rule
    return dataclasses.replace(rule, ring=(ring,))


def _attention_ring(op: Op, graph: Graph) -> tuple[int, int] | None:
    """The (query, key) loops of a MatMul of a fused attention core over as many keys as
    queries, which ring attention splits together (`rules.base.ring_loops`): the scores'
    Q·Kᵀ (loops ..., m, n, k: m and n) and the output's P·V (m and k)."""
    if graph.fused.kernel(op.name) is None:
        return None
    region = graph.fused.region(op.name)
    scores = graph.values[graph.op_by_name[region.ops[0]].outputs[0]].shape
    if (
        len(scores) < 3
        or scores[-1] != scores[-2]
        or op.name not in (region.ops[0], region.ops[-1])
    ):
        return None
    rank = len(graph.values[op.outputs[0]].shape)
    return (rank - 2, rank - 1 if op.name == region.ops[0] else rank)


@register("Gemm")
def gemm(op: Op, graph: Graph) -> OpRule | None:
    a, b = (_shape(graph, name) for name in op.inputs[:2])
    if len(a) != 2 or len(b) != 2:
        return None
    lhs = "km" if op.attr("transA", 0) else "mk"
    rhs = "nk" if op.attr("transB", 0) else "kn"
    rule = einsum_rule(f"{lhs},{rhs}->mn", (a, b))
    if rule is None:
        return None
    bias = op.inputs[2] if len(op.inputs) > 2 else ""
    if not bias:
        return rule
    c = _shape(graph, bias)
    if len(c) > 2:
        return None
    # loops 0 and 1 are m and n (output labels come first): C broadcasts onto them.
    return dataclasses.replace(
        rule, operands=(*rule.operands, broadcast_map(c, 2)), note=Note.BIAS_ONCE
    )


@register("Einsum")
def einsum(op: Op, graph: Graph) -> OpRule | None:
    equation = op.attr("equation")
    if not isinstance(equation, str):
        return None
    return einsum_rule(equation, [_shape(graph, name) for name in op.inputs])
