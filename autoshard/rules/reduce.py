"""Reductions: one loop per input dim; a reduced dim is a reduction loop when partial results
combine (ReduceSum: sum of partial sums), an invalid loop when they do not (ReduceL2,
ReduceLogSumExp: the combination is not the op itself).

    ReduceMean [4, 6, 8] axes [2] keepdims 1 -> [4, 6, 1]
    loops [d0: parallel(4), d1: parallel(6), d2: reduction_average(8)]
    maps  (d0, d1, d2)  ->  (d0, d1, 0)

ReduceMean's partial results are means of equal-size shards: their `average` is the mean only
for even splits, which is what a split of a loop whose size the split divides gives.

Softmax, LogSoftmax, Hardmax, ArgMax, ArgMin and TopK read their axis whole: that loop is
invalid, the others parallel.
"""

from __future__ import annotations

from collections.abc import Sequence

from autoshard.ir.graph import Graph, Op
from autoshard.rules.base import IndexingMap, Loop, OpRule, invalid, reduction
from autoshard.rules.registry import register
from autoshard.rules.shape import axis_attr, constant_ints, normalize_axes
from autoshard.sharding import ReductionKind

REDUCTION_KINDS: dict[str, ReductionKind | None] = {
    "ReduceSum": ReductionKind.SUM,
    "ReduceSumSquare": ReductionKind.SUM,  # local sums of squares add up
    "ReduceL1": ReductionKind.SUM,  # local sums of |x| add up
    "ReduceMean": ReductionKind.AVERAGE,
    "ReduceMax": ReductionKind.MAX,
    "ReduceMin": ReductionKind.MIN,
    "ReduceProd": ReductionKind.PRODUCT,
    "ReduceL2": None,  # sqrt of a sum: partials combine as sqrt(Σ p²), not a ReductionKind
    "ReduceLogSum": None,
    "ReduceLogSumExp": None,
}
"""How partial results of each reduce op combine; None: they do not (the axes are invalid)."""


def _reduced_axes(op: Op, graph: Graph, rank: int) -> tuple[int, ...] | None:
    """The reduced axes, from the `axes` attribute (before opset 18; 13 for ReduceSum) or the
    constant `axes` input; all of them when none are given, unless noop_with_empty_axes."""
    axes: Sequence[int] | None
    attr = op.attr("axes")
    if attr is not None:
        axes = attr if isinstance(attr, tuple) else None
    elif len(op.inputs) > 1 and op.inputs[1]:
        axes = constant_ints(graph, op.inputs[1])
    else:
        axes = ()
    if axes is None:
        return None
    if not axes:
        return () if op.attr("noop_with_empty_axes", 0) else tuple(range(rank))
    return normalize_axes(axes, rank)


@register(*REDUCTION_KINDS)
def reduce(op: Op, graph: Graph) -> OpRule | None:
    shape = graph.values[op.inputs[0]].shape
    axes = _reduced_axes(op, graph, len(shape))
    if axes is None:
        return None
    kind = REDUCTION_KINDS[op.type]
    loops = tuple(
        Loop(d) if k not in axes else invalid(d) if kind is None else reduction(d, kind)
        for k, d in enumerate(shape)
    )
    keep = op.attr("keepdims", 1)
    out = [None if k in axes else k for k in range(len(shape)) if keep or k not in axes]
    if len(out) != len(graph.values[op.outputs[0]].shape):
        return None
    params = (None,) * (len(op.inputs) - 1)
    return OpRule(loops, (IndexingMap.of(*range(len(shape))), *params), (IndexingMap.of(*out),))


@register("Softmax", "LogSoftmax", "Hardmax")
def softmax(op: Op, graph: Graph) -> OpRule | None:
    """Opset 13 semantics: one axis (default -1). Before 13 the input was coerced to 2-D at
    `axis` (default 1), so every dim from the axis on is read whole."""
    shape = graph.values[op.inputs[0]].shape
    old = 0 < graph.opset < 13
    axis = axis_attr(op, len(shape), 1 if old else -1)
    if axis is None:
        return None
    bad = set(range(axis, len(shape))) if old else {axis}
    loops = tuple(invalid(d) if k in bad else Loop(d) for k, d in enumerate(shape))
    identity = IndexingMap.of(*range(len(shape)))
    # A causal fused core's kernel may run load-balanced over the ring's axes (`cost.ring`):
    # its query and key loops split together (`rules.base.ring_loops`), as one kernel.
    region = graph.fused.region(op.name) if graph.fused.kernel(op.name) else None
    balanced = region is not None and region.causal and len(shape) >= 3 and shape[-1] == shape[-2]
    ring = ((len(shape) - 2, len(shape) - 1),) if balanced else ()
    return OpRule(loops, (identity,), (identity,), ring=ring)


@register("ArgMax", "ArgMin")
def arg_reduce(op: Op, graph: Graph) -> OpRule | None:
    shape = graph.values[op.inputs[0]].shape
    axis = axis_attr(op, len(shape), 0)
    if axis is None:
        return None
    loops = tuple(invalid(d) if k == axis else Loop(d) for k, d in enumerate(shape))
    keep = op.attr("keepdims", 1)
    out = [None if k == axis else k for k in range(len(shape)) if keep or k != axis]
    return OpRule(loops, (IndexingMap.of(*range(len(shape))),), (IndexingMap.of(*out),))


@register("TopK")
def top_k(op: Op, graph: Graph) -> OpRule | None:
    """Values and indices keep the input's rank; their axis dim (size K) follows no loop."""
    shape = graph.values[op.inputs[0]].shape
    axis = axis_attr(op, len(shape), -1)
    if axis is None:
        return None
    loops = tuple(invalid(d) if k == axis else Loop(d) for k, d in enumerate(shape))
    out = IndexingMap.of(*(None if k == axis else k for k in range(len(shape))))
    return OpRule(loops, (IndexingMap.of(*range(len(shape))), None), (out, out))
