"""Rules of the ops a training step adds (`autoshard.training`), derived from the forward
rules: no hand list of backward ops per op type.

The gradient of an operand X of a forward op has the *same loops* as the op: it reads the
gradients of the results (indexed as the results are) and the operands it needs, and writes
dX, indexed as X is. A loop that indexes X stays parallel (dX is split where X is); a loop
that does not becomes a sum reduction (dX sums over it). So for Y = X·W with loops (m, n, k):

    dW = Xᵀ·dY   loops m: reduction(sum), n, k    (partial over the batch axes: DDP's sync)
    dX = dY·Wᵀ   loops m, n: reduction(sum), k    (partial over the output-feature axes:
                                                   Megatron's column-parallel all_reduce)

Computed with its forward op's option, the gradient is split and partial exactly as the
backward of that sharding is. The other ops of the step are elementwise over their tensor:
the loss gradient of an output, the gradient sync (which reads a gradient in the sharding it
is kept in, so the reshard before it is the all_reduce or reduce_scatter), and the optimizer
update of a weight, whose optimizer state carries a leading dim of planes (master copy,
moments) that is never split.
"""

from __future__ import annotations

import enum

from autoshard.ir.graph import Graph, Op
from autoshard.rules.base import IndexingMap, IteratorType, Loop, OpRule, parallel, reduction
from autoshard.rules.elementwise import elementwise_rule
from autoshard.rules.registry import register, rule_for

TRAIN = "autoshard.train"
"""The domain of the ops a training step adds."""


class TrainOp(enum.StrEnum):
    """The op types of domain `TRAIN`."""

    GRAD = "Grad"  # attrs op (the forward op), operand (the index it differentiates)
    LOSS_GRAD = "LossGrad"  # the loss's gradient with respect to a model output
    GRAD_SYNC = "GradSync"  # a weight's gradient, synchronized: kept so until the update
    UPDATE = "Update"  # (gradient, weight, state) -> (next weight, next state)


RECOMPUTE_OF = "recompute_of"
"""The attribute naming the forward op an op recomputes (activation checkpointing)."""


def computed_with(op: Op) -> str:
    """The op whose sharding option `op` computes with: a gradient's forward op, the op a
    recomputation repeats ("" for any other op, which has an option of its own)."""
    if op.domain == TRAIN and op.type == TrainOp.GRAD:
        return str(op.attr("op"))
    return str(op.attr(RECOMPUTE_OF, ""))


def accumulated_gradients(graph: Graph) -> frozenset[str]:
    """The gradients a training step of several micro-batches accumulates (what its gradient
    syncs read): held from the step's start, through every micro-batch's forward."""
    if graph.micro_batches == 1:
        return frozenset()
    return frozenset(
        op.inputs[0] for op in graph.ops if op.domain == TRAIN and op.type == TrainOp.GRAD_SYNC
    )


@register(TrainOp.GRAD, domain=TRAIN)
def grad_rule(op: Op, graph: Graph) -> OpRule | None:
    """The forward op's loops, results' maps and operands' maps; reductions over every loop
    not indexing the differentiated operand. Inputs: the forward op's (those it does not read
    left empty), then the gradient of each forward result."""
    forward = graph.op_by_name[str(op.attr("op"))]
    rule = rule_for(forward, graph)
    operand = op.attr("operand", 0)
    assert isinstance(operand, int)
    if rule is None:
        return None
    operands = rule.operands + (None,) * (len(forward.inputs) - len(rule.operands))
    target = operands[operand]
    if target is None:
        return None
    indexes = {loop for dim in range(len(target.dims)) for loop in target.loops(dim)}
    loops = tuple(_gradient_loop(loop, k in indexes) for k, loop in enumerate(rule.loops))
    return OpRule(loops, operands + rule.results, (target,), ring=rule.ring, partial=rule.partial)


def _gradient_loop(loop: Loop, indexes_operand: bool) -> Loop:
    if loop.kind is IteratorType.INVALID:
        return loop
    return Loop(loop.size) if indexes_operand else reduction(loop.size)


@register(TrainOp.LOSS_GRAD, TrainOp.GRAD_SYNC, domain=TRAIN)
def one_tensor_rule(op: Op, graph: Graph) -> OpRule | None:
    return elementwise_rule(op, graph, 1)


@register(TrainOp.UPDATE, domain=TRAIN)
def update_rule(op: Op, graph: Graph) -> OpRule:
    """Loops over the weight's dims; the state's leading dim of planes is indexed by none."""
    shape = graph.values[op.inputs[1]].shape
    plain = IndexingMap.of(*range(len(shape)))
    planes = IndexingMap(((), *plain.dims))
    return OpRule(parallel(*shape), (plain, plain, planes), (plain, planes))
