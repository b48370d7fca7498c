"""Lowering: a plan becomes the sharded program that runs it. Materialize inserts a reshard
wherever a value is held otherwise than a use needs it, as the collectives of `plan_reshard`;
the CCL passes then fuse, reassociate and move those collectives (docs/design/lowering.md).

Both the pipeline and the search's budget policy lower (the budget policy measures a plan's
program), so lowering lives here, below both.

The CCL passes trade no memory for communication: a rewrite of the program that would hold
more at its peak than the materialized one is not taken (the search counts the materialized
program's memory, so the program it gets never holds more than it counted).
"""

from __future__ import annotations

from collections.abc import Callable

from autoshard.cost.liveness import Memory, memory
from autoshard.ir.graph import Graph
from autoshard.passes import Stage
from autoshard.passes.ccl import optimize_collectives
from autoshard.passes.materialize import materialize
from autoshard.plan import Plan
from autoshard.program import Program

AfterStage = Callable[[Stage, Program], None]
"""Told each stage and the program it leaves (dump points, timings)."""


def lower(graph: Graph, plan: Plan, after: AfterStage | None = None) -> Program:
    """The sharded program of a plan: reshards inserted and lowered to collectives, then the
    CCL passes."""
    return _lower(graph, plan, after)[0]


def lower_measured(
    graph: Graph, plan: Plan, after: AfterStage | None = None
) -> tuple[Program, Memory]:
    """`lower`, with the program's `memory` (lowering measures it when the CCL passes change
    the program: measured once, for both)."""
    program, usage = _lower(graph, plan, after)
    return program, memory(program) if usage is None else usage


def _lower(graph: Graph, plan: Plan, after: AfterStage | None) -> tuple[Program, Memory | None]:
    """The program, and its memory when measured."""
    program = materialize(graph, plan)
    if after is not None:
        after(Stage.MATERIALIZE, program)
    optimized = optimize_collectives(program, graph)
    chosen, usage = optimized, None
    # Unchanged steps hold the same memory: price the two programs only when they differ.
    if optimized.steps != program.steps:
        usage, held = memory(optimized), memory(program)
        if usage.peak > held.peak:
            chosen, usage = program, held
    if after is not None:
        after(Stage.CCL, chosen)
    return chosen, usage
