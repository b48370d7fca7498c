"""The memory-budget policy: search, lower the plan, and make sure its program fits.

The ILP counts each value once; the program also holds reshard buffers (the result of an
all_reduce next to its partial input). When those push the program over the budget, the ILP's
budget is lowered by the excess and it solves again. When no round fits, the plans of least
memory decide: the cheapest of them that fits, or the proof that none does.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from autoshard.annotations import Annotation
from autoshard.cost.cluster import Cluster
from autoshard.cost.model import Cost, Memory, memory, price
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

_BUDGET_ROUNDS = 5
_BUDGET_PROBES = 6


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
    """Search the cheapest plan (CP-SAT), then lower and price it."""
    started = time.perf_counter()
    options = options or SolverOptions()
    say = progress or (lambda _: None)
    search = build_search(graph, cluster, annotations, options.objective)
    built = time.perf_counter() - started
    problem = search.problem
    say(
        f"search problem: {len(problem.sizes)} groups, {problem.variables} choices, "
        f"{len(problem.edges)} edges, {len(problem.memory)} memory rows ({built:.1f} s)"
    )

    def planned(solution: Solution, plan: Plan, program: Program) -> Planned:
        cost = price(program, graph, cluster)
        return Planned(
            plan=plan, program=program, cost=cost, solution=solution, search=search, build_s=built
        )

    # The first solve stays the bound: the ILP undercounts memory, so every plan that really
    # fits is feasible for it.
    budget, bound, spent = cluster.memory, None, 0.0
    hint: tuple[int, ...] = ()
    for _ in range(_BUDGET_ROUNDS):
        try:
            left = time_left(options.time_limit, spent)
            solution = solve(dataclasses.replace(problem, budget=budget), left, hint)
        except InfeasibleError:
            break
        spent += solution.work
        bound = bound if bound is not None else solution.bound
        plan = search.plan(graph, cluster, solution.choice)
        program = lower(graph, plan)
        peak = memory(program).peak
        if peak <= cluster.memory:
            if solution.objective > bound:  # proven for the lowered budget only
                solution = dataclasses.replace(solution, status=SolverStatus.FEASIBLE, bound=bound)
            say(f"solved: {solution.status}, gap {solution.gap:.2%} ({solution.wall_s:.1f} s)")
            return planned(solution, plan, program)
        # Below what this plan's values take, by what its buffers add: the next plan differs.
        budget = min(budget, problem.peak(solution.choice)) - (peak - cluster.memory)
        hint = solution.choice
        say(f"the program needs {peak} bytes with its reshard buffers; solving again")
    # The rounds found nothing that fits: the plans of least memory decide.
    usage, choice = _least_memory(graph, cluster, search, options.time_limit)
    if usage.peak > cluster.memory:
        biggest = ", ".join(f"{name} ({size} B)" for name, size in usage.live[:5])
        raise InfeasibleError(
            f"no plan fits {cluster.memory} bytes per device; the lowest feasible budget is "
            f"{usage.peak} bytes (--memory {usage.peak}); the largest tensors live at its "
            f"peak: {biggest}"
        )
    plan = search.plan(graph, cluster, choice)
    solution = Solution(
        choice=choice, status=SolverStatus.FEASIBLE, objective=problem.objective(choice),
        bound=bound or 0.0, wall_s=0.0, variables=0, constraints=0,
    )  # fmt: skip
    say(f"solved: {solution.status}, gap {solution.gap:.2%} (the plan of least memory)")
    return planned(solution, plan, lower(graph, plan))


def _least_memory(
    graph: Graph, cluster: Cluster, search: Search, time_limit: float
) -> tuple[Memory, tuple[int, ...]]:
    """When the budget rounds fail: the ILP's own least-memory plan and the plans it finds
    under a few budgets between that plan's ILP peak and its real peak (reshard buffers
    included). Of those that fit the budget, the cheapest; if none fits, the least memory."""
    problem = search.problem
    lowest, choice = lowest_budget(problem, time_limit)
    found = [(memory(lower(graph, search.plan(graph, cluster, choice))), choice)]
    top, spent = found[0][0].peak, 0.0
    for step in range(1, _BUDGET_PROBES + 1):
        budget = lowest + (top - lowest) * step // (_BUDGET_PROBES + 1)
        try:
            left = time_left(time_limit, spent)
            solution = solve(dataclasses.replace(problem, budget=budget), left, choice)
        except InfeasibleError:
            continue
        spent += solution.work
        choice = solution.choice
        found.append((memory(lower(graph, search.plan(graph, cluster, choice))), choice))
    fitting = [f for f in found if f[0].peak <= cluster.memory]
    if fitting:
        return min(fitting, key=lambda f: (problem.objective(f[1]), f[1]))
    return min(found, key=lambda f: (f[0].peak, f[1]))
