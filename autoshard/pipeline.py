"""The order of the stages, in one place: import -> (propagate | search) -> materialize -> CCL
passes -> partition. The faces (CLI, service) call these; each stage stays a pure function."""

from __future__ import annotations

from autoshard.ir.graph import Graph
from autoshard.passes.ccl import optimize_collectives
from autoshard.passes.materialize import materialize
from autoshard.plan import Plan
from autoshard.program import Program


def lower(graph: Graph, plan: Plan) -> Program:
    """The sharded program of a plan: reshards inserted and lowered to collectives, then the
    CCL passes."""
    return optimize_collectives(materialize(graph, plan), graph)
