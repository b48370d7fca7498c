"""The search under a memory budget: one solve decides.

The ILP's memory rows are the program's memory (`search.memory`): the plan it finds fits the
budget as lowered, reshard buffers and all, so no plan is lowered twice. When no plan fits,
the least memory any plan needs is an ILP of its own (`ilp.lowest_budget`), answered with its
proof and the tensors its plan holds at the peak.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from autoshard.annotations import Annotation
from autoshard.cost.cluster import Cluster, format_bytes
from autoshard.cost.model import Cost, memory, price
from autoshard.errors import AutoshardError
from autoshard.ir.graph import Graph
from autoshard.passes.lower import lower
from autoshard.plan import Plan
from autoshard.program import Program
from autoshard.search.ilp import (
    InfeasibleError,
    Solution,
    SolverStatus,
    lowest_budget,
    solve,
    time_left,
)
from autoshard.search.options import SolverOptions
from autoshard.search.problem import Search, build_search


@dataclass(frozen=True, kw_only=True)
class Planned:
    """A plan found by search, with its program, its cost and how the solver did."""

    plan: Plan
    program: Program
    cost: Cost
    solution: Solution
    search: Search
    build_s: float


def auto_plan(
    graph: Graph,
    cluster: Cluster,
    annotations: Sequence[Annotation] = (),
    options: SolverOptions | None = None,
    progress: Callable[[str], None] | None = None,
) -> Planned:
    """Search the cheapest plan that fits the memory budget (CP-SAT), then lower and price
    it; `InfeasibleError` with the lowest feasible budget when none fits."""
    started = time.perf_counter()
    say = progress or (lambda _: None)
    options = options or SolverOptions()
    search = build_search(graph, cluster, annotations, options.objective)
    built = time.perf_counter() - started
    problem = search.problem
    say(
        f"search problem: {len(problem.sizes)} groups, {problem.variables} choices, "
        f"{len(problem.edges)} edges, {len(problem.memory)} memory rows ({built:.1f} s)"
    )
    try:
        solution = solve(problem, options.time_limit)
    except InfeasibleError:
        raise _infeasible(graph, cluster, search, options.time_limit) from None
    say(f"solved: {solution.status}, gap {solution.gap:.2%} ({solution.wall_s:.1f} s)")
    plan = search.plan(graph, cluster, solution.choice)
    program = lower(graph, plan)
    held = memory(program).peak
    if held > max(cluster.memory, problem.peak(solution.choice)):
        raise AutoshardError(  # the memory model's promise, checked on every plan
            f"internal error: the program holds {held} bytes per device, more than the search "
            f"counted ({problem.peak(solution.choice)}); please report it with the model"
        )
    cost = price(program, graph, cluster)
    return Planned(
        plan=plan, program=program, cost=cost, solution=solution, search=search, build_s=built
    )


def _infeasible(
    graph: Graph, cluster: Cluster, search: Search, time_limit: float
) -> InfeasibleError:
    """No plan fits: the lowest feasible budget, how sure the solver is of it, and the largest
    tensors the plan reaching it holds at its peak."""
    lowest = lowest_budget(search.problem, time_left(time_limit, 0.0))
    usage = memory(lower(graph, search.plan(graph, cluster, lowest.choice)))
    proof = (
        "proven optimal"
        if lowest.status is SolverStatus.OPTIMAL
        else f"the least found; no plan needs less than {lowest.bound} bytes"
    )
    biggest = ", ".join(f"{name} ({format_bytes(size)})" for name, size in usage.live[:5])
    return InfeasibleError(
        f"no plan fits {cluster.memory} bytes ({format_bytes(cluster.memory)}) per device; "
        f"the lowest feasible budget is {lowest.peak} bytes ({format_bytes(lowest.peak)}, "
        f"{proof}; --memory {lowest.peak}); the largest tensors live at its peak: {biggest}"
    )
