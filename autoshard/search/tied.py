"""Weights a pipeline trains on two stages: those its first and its last stage both read (an
embedding tied to the LM head). Megatron keeps a copy on each stage and sums their gradients
after the backward (`execute.tied` runs it); the pipeline's price counts the sum
(`cost.price.tied_sync_time`, once a step, before the update) and the second copy's memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autoshard.cost.liveness import held_bytes
from autoshard.ir.graph import Graph
from autoshard.plan import Plan
from autoshard.training.step import gradient_name, state_name


@dataclass(frozen=True)
class TiedCost:
    """A weight read at both ends of a stage's model: its gradient's bytes per device (what
    the two stages all-reduce; 0 where it is not trained), the bytes per device of the copy
    the other end's stage holds (the weight, its gradient and optimizer state), and whether
    the plan's price counts the weight with the first stage (its first reader's)."""

    weight: str
    gradient_bytes: int
    copy_bytes: int
    first: bool


def tied_costs(graph: Graph, plan: Plan, part: Sequence[int], last: int) -> tuple[TiedCost, ...]:
    """The weights of `graph` (a stage's model, or its training step) whose forward readers
    fall in both part 0 and part `last` (`search.pipelined.stage_of_ops`'s parts), held as
    `plan` holds them."""
    index = {op.name: i for i, op in enumerate(graph.ops)}

    def size(name: str) -> int:
        if name not in graph.values or name not in plan.values:
            return 0
        value = graph.values[name]
        return held_bytes(name, value.shape, value.dtype, plan.values[name], plan.mesh,
                          graph.fused)  # fmt: skip

    found = []
    for w in sorted(graph.weights):
        readers = [op for op in graph.consumers(w) if graph.phase(op.name) == "forward"]
        parts = [part[index[op.name]] for op in readers]
        if 0 in parts and last in parts:
            gradient = size(gradient_name(w))
            copy = size(w) + gradient + size(state_name(w))
            found.append(TiedCost(w, gradient, copy, parts[0] == 0))
    return tuple(found)
