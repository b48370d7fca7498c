"""What a plan's recomputation (`training.replay`) frees and costs: the bytes per device of
the forward values the backward reads recomputed (what keeping them would hold from their
forward to their backward) and the compute seconds of the recomputed ops beside the rest of
the step; and the story's sentence saying so."""

from __future__ import annotations

from dataclasses import dataclass

from autoshard.cost.liveness import held_bytes
from autoshard.cost.price import Cost
from autoshard.ir.graph import Graph
from autoshard.plan import Plan
from autoshard.rules.gradient import RECOMPUTE_OF, TrainOp
from autoshard.training.options import Recompute, Training
from autoshard.units import format_bytes


@dataclass(frozen=True)
class ReplayFigures:
    """What a plan's recomputation frees and costs per device: `freed_bytes` of forward
    values not kept for the backward, `added_s` compute seconds of the recomputed ops, over
    `base_s`, the compute seconds of the rest of the step."""

    freed_bytes: int
    added_s: float
    base_s: float

    @property
    def added_share(self) -> float:
        return self.added_s / self.base_s if self.base_s else 0.0


def replay_figures(graph: Graph, plan: Plan, cost: Cost) -> ReplayFigures:
    """The recomputation of training step `graph` priced under `plan` (module docstring): a
    recomputed value counts where a gradient op reads it, at the bytes its forward original
    is held in."""
    ops = graph.op_by_name
    recomputed = {
        new: original
        for op in graph.ops
        if op.attr(RECOMPUTE_OF, "")
        for new, original in zip(op.outputs, ops[str(op.attr(RECOMPUTE_OF))].outputs, strict=True)
        if new
    }
    read = {n for op in graph.ops if op.type == TrainOp.GRAD for n in op.inputs if n}
    freed = 0
    for new in sorted(read.intersection(recomputed)):
        value = graph.values[recomputed[new]]
        sharding = plan.values[value.name]
        freed += held_bytes(value.name, value.shape, value.dtype, sharding, plan.mesh, graph.fused)
    added = sum(c.seconds for name, c in cost.ops.items() if ops[name].attr(RECOMPUTE_OF, ""))
    return ReplayFigures(freed, added, cost.compute_time_s - added)


def replay_text(training: Training, figures: ReplayFigures, chosen: bool) -> str:
    """The story's sentence on recomputation: what was asked, or `chosen` by the search (the
    cheapest that fits the budget), and its figures."""
    what = {
        Recompute.SELECTIVE: "selective recompute (each attention core)",
        Recompute.LAYERS: "layer recompute ("
        + ("every layer" if training.every == 1 else f"every {training.every}th layer")
        + ")",
    }[training.recompute]
    why = "the cheapest that fits the budget" if chosen else "as asked"
    freed, added = format_bytes(figures.freed_bytes), 100 * figures.added_share
    return f"Recomputation: {what}, {why}: frees {freed} per device for {added:.1f} % more compute."
