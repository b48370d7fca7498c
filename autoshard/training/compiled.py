"""Compiled kernels (`Kernels.COMPILED`, `--kernels compiled`): the values a compiler's fused
elementwise kernels (torch.compile's Inductor) keep in registers, never written to memory nor
read back (`Graph.on_chip`), so a chain of elementwise ops and the reduction ending it are
priced as the traffic of the chain's inputs and outputs once, not one pass per op.

One rule, the same for every model: a value is on chip when the op computing it and every op
reading it are fusible (elementwise, a reduction, or the gradient of one), all in the same
phase of the step, and it is not an output of the step. A value the backward reads (a saved
activation) is read in another phase, so it is written, as a compiled step saves it; a value
a matmul, a move or an attention kernel reads is written too. Memory is not changed: the
values on chip are each short-lived, between two ops of one phase.
"""

from __future__ import annotations

from autoshard.ir.graph import Graph, Op
from autoshard.rules.elementwise import ELEMENTWISE
from autoshard.rules.gradient import TRAIN, TrainOp

REDUCTIONS = frozenset({"ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceSumSquare",
                        "ReduceL2", "ReduceL1", "ReduceLogSumExp", "ReduceProd"})  # fmt: skip
"""Reductions a compiler fuses with the elementwise ops producing and reading them."""

FUSIBLE = ELEMENTWISE | REDUCTIONS


def on_chip(graph: Graph) -> frozenset[str]:
    """The values of `graph` (a training step) that compiled kernels keep on chip (above)."""
    by_name = {op.name: op for op in graph.ops}

    def fusible(op: Op | None) -> bool:
        if op is None or graph.fused.kernel(op.name) is not None:
            return False
        if op.domain == TRAIN:
            forward = by_name.get(str(op.attr("op", ""))) if op.type == TrainOp.GRAD else None
            return fusible(forward)
        return op.domain == "" and op.type in FUSIBLE

    outputs = set(graph.outputs)
    found = set()
    for op in graph.ops:
        if not fusible(op):
            continue
        phase = graph.phase(op.name)
        for name in op.outputs:
            readers = graph.consumers(name)
            if name and name not in outputs and readers and all(
                fusible(r) and graph.phase(r.name) == phase for r in readers
            ):  # fmt: skip
                found.add(name)
    return frozenset(found)
