"""Elementwise ops: one parallel loop per result dim, operands aligned by numpy broadcasting.

    Add [4, 1, 8] + [6, 8] -> [4, 6, 8]
    loops [d0: parallel(4), d1: parallel(6), d2: parallel(8)]
    maps  (d0, 0, d2)  (d1, d2)  ->  (d0, d1, d2)

Inputs that are parameters rather than data (Clip's min/max, Dropout's ratio, CastLike's
target, Expand's shape) get a None map: they are never sharded, and a split of the result needs
no change to them except Expand's shape, which the partitioner rewrites to the local shape.
"""

from __future__ import annotations

import dataclasses

from autoshard.ir.graph import Graph, Op
from autoshard.rules.base import IndexingMap, OpRule, broadcast_map, parallel
from autoshard.rules.registry import register
from autoshard.sharding import ReductionKind

UNARY = frozenset(
    {
        "Abs", "Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "BitwiseNot", "Cast",
        "CastLike", "Ceil", "Celu", "Clip", "Cos", "Cosh", "Dropout", "Elu", "Erf", "Exp",
        "Floor", "Gelu", "HardSigmoid", "HardSwish", "Identity", "IsInf", "IsNaN", "LeakyRelu",
        "Log", "Mish", "Neg", "Not", "Reciprocal", "Relu", "Round", "Selu", "Shrink", "Sigmoid",
        "Sign", "Sin", "Sinh", "Softplus", "Softsign", "Sqrt", "Swish", "Tan", "Tanh",
        "ThresholdedRelu",
    }
)  # fmt: skip
"""Ops of one data input (input 0); their other inputs are parameters."""

BROADCAST = frozenset(
    {
        "Add", "And", "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "Div", "Equal",
        "Greater", "GreaterOrEqual", "Less", "LessOrEqual", "Max", "Mean", "Min", "Mod", "Mul",
        "Or", "Pow", "PRelu", "Sub", "Sum", "Where", "Xor",
    }
)  # fmt: skip
"""Ops whose inputs are all data, broadcast against each other like numpy (Where: three)."""

ELEMENTWISE = UNARY | BROADCAST
"""The elementwise family: each element of the result comes from the same element of the
(broadcast) data inputs. Expand shares their rule but is left out on purpose: its result is
larger than its input, which neither the CCL passes (moving a collective across the op) nor
the search's followers (an op computing where its input lies) are meant for."""


COMMUTES_WITH = {
    ReductionKind.SUM: frozenset({"Add", "Sub", "Sum", "Neg", "Identity"}),
    ReductionKind.MAX: frozenset({"Max", "Identity"}),
    ReductionKind.MIN: frozenset({"Min", "Identity"}),
}
"""Elementwise ops f with f(reduce(x_i), reduce(y_i)) = reduce(f(x_i, y_i)) for the reduction
(a broadcast operand too: each device adds its partial copy, and the copies sum to the whole):
a collective may move across them (`passes.ccl.reassociate`), and those of a sum may compute
on partial sums (`OpRule.partial`)."""


def elementwise_rule(op: Op, graph: Graph, data_inputs: int) -> OpRule | None:
    """Loops over the result; the first `data_inputs` inputs broadcast onto them, the others
    (parameters) and omitted inputs get None maps. Every result has the result's shape. An op
    that commutes with a reduction (`COMMUTES_WITH`) may read and write its partial values."""
    shape = graph.values[op.outputs[0]].shape
    if any(graph.values[out].shape != shape for out in op.outputs if out):
        return None
    operands: list[IndexingMap | None] = []
    for index, name in enumerate(op.inputs):
        if not name or index >= data_inputs:
            operands.append(None)
            continue
        operand = graph.values[name].shape
        if len(operand) > len(shape) or any(
            d not in (1, n) for d, n in zip(reversed(operand), reversed(shape), strict=False)
        ):
            return None
        operands.append(broadcast_map(operand, len(shape)))
    identity = IndexingMap.of(*range(len(shape)))
    # Partial sums only: a gradient computes with its forward op's option, and the gradient of
    # a linear op is linear (that of Max is not).
    linear = not op.domain and op.type in COMMUTES_WITH[ReductionKind.SUM]
    results = tuple(identity for _ in op.outputs)
    return OpRule(parallel(*shape), tuple(operands), results, partial=(ReductionKind.SUM,) * linear)


@register(*UNARY)
def unary(op: Op, graph: Graph) -> OpRule | None:
    return elementwise_rule(op, graph, data_inputs=1)


@register(*BROADCAST)
def broadcast(op: Op, graph: Graph) -> OpRule | None:
    return elementwise_rule(op, graph, data_inputs=len(op.inputs))


MICROSOFT_ACTIVATIONS = frozenset({"BiasGelu", "FastGelu", "Gelu", "QuickGelu"})
"""onnxruntime's com.microsoft activations: Gelu and QuickGelu of one input, FastGelu (a tanh
Gelu) and BiasGelu of the input plus a bias broadcast onto it."""


@register(*MICROSOFT_ACTIVATIONS, domain="com.microsoft")
def microsoft_activation(op: Op, graph: Graph) -> OpRule | None:
    return elementwise_rule(op, graph, data_inputs=len(op.inputs))


@register("Expand")
def expand(op: Op, graph: Graph) -> OpRule | None:
    """The result's loops; the input broadcast onto them; the shape input a parameter. A
    broadcast of partial sums is the partial sums of the broadcast: it may read and write them."""
    rule = elementwise_rule(op, graph, data_inputs=1)
    return None if rule is None else dataclasses.replace(rule, partial=(ReductionKind.SUM,))
