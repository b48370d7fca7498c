"""A training step's backward split as zero-bubble schedules run it (Qi et al. 2023): the
input gradient `B`, which the stage before waits for, and the weight gradient `W`, which
only the update reads, so a schedule may defer it (`cost.schedule`, `zb-h1`).

The split is read off the step's own backward ops, not assumed: a backward op is part of `B`
where a later `B` op reads what it writes, or a backward op of another part (another layer,
the embedding or the head: the gradient handed back across a boundary); every other backward
op feeds only weight gradients (`w@grad0 = Grad[op=MatMul, operand=1](x, "", y@grad0)`, their
accumulation, a bias's reduction), or nothing, and is `W`. The loss's gradient and every
`dX = dY W^T` are `B`; every `dW = X^T dY` is `W`.

Worked example, a 2-layer MLP `y = relu(x @ w1) @ w2`, parts by layer: `y@grad0` (the loss's
gradient) is read by `w2`'s `dW` and by `h@grad0 = dY w2^T`; `h@grad0` by the relu's gradient,
which `w1`'s `dW` and `dX` read. `w2`'s and `w1`'s `dW` feed only their `GradSync`: `W`; the
rest are `B`.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from autoshard.ir.graph import Graph


def weight_gradient_ops(
    graph: Graph, part: Sequence[int], handed_back: Collection[str] = ()
) -> frozenset[int]:
    """The indices of `graph`'s backward ops that compute weight gradients only (`W`, the
    module's docstring), `part` giving each op's part of the model; `handed_back`: values
    read by a part outside `graph` (a pipeline stage's step: the input gradients it sends
    back to the stage before), so their makers are `B`."""
    readers: dict[str, list[int]] = {}
    for i, op in enumerate(graph.ops):
        for name in op.inputs:
            readers.setdefault(name, []).append(i)
    inputs_side: set[int] = set()  # the `B` ops found so far, latest first
    weights: set[int] = set()
    for i in range(len(graph.ops) - 1, -1, -1):
        op = graph.ops[i]
        if graph.phase(op.name) != "backward":
            continue
        read_by = [j for name in op.outputs for j in readers.get(name, ())]
        handed = any(name in handed_back for name in op.outputs) or any(
            j in inputs_side
            or (graph.phase(graph.ops[j].name) == "backward" and part[j] != part[i])
            for j in read_by
        )
        (inputs_side if handed else weights).add(i)
    return frozenset(weights)
