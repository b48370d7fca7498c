"""The search under a memory budget: one solve decides.

The ILP's memory rows are the program's memory (`search.memory`): the plan it finds fits the
budget as lowered, reshard buffers and all. One thing the rows leave out until a plan uses it:
the intermediate tensors of reshards of several collectives (on a 3-axis mesh most pairs of
candidate shardings have some, a plan few). When a plan's program holds more than its rows
say, those reshards (from any held sharding to their targets) are counted from then on and
the ILP solves again, from that plan and the bound it proved (rows counting more have no
lower optimum, so the bound it proved holds for the next round); every such round counts more of
the program, and none is needed unless a plan uses them. Counting every reshard a plan could
make from the start is exact but costly (the indicators grow by an order of magnitude), and
none may be left out for being small: an intermediate no larger than either end is still
live beside the next step's result.

When no plan fits, the least memory any plan needs is an ILP of its own
(`solver.lowest.lowest_budget`), answered with its proof and the tensors its plan holds at the peak.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from autoshard.annotations import Annotation
from autoshard.cost.cluster import Cluster
from autoshard.cost.liveness import Memory
from autoshard.cost.price import Cost, price
from autoshard.deadline import NEVER, Deadline, TimeUp
from autoshard.errors import AutoshardError
from autoshard.ir import dtypes
from autoshard.ir.graph import Graph
from autoshard.limits import check_search_axes
from autoshard.passes.lower import lower_measured
from autoshard.plan import RETURN, Plan
from autoshard.program import Program
from autoshard.progress import Tracker
from autoshard.reshard import plan_reshard
from autoshard.search.memory.build import Chain
from autoshard.search.options import Objective, SolverOptions
from autoshard.search.problem import Problem, Search, build_search
from autoshard.search.solver.outcome import (
    InfeasibleError,
    LowestBudget,
    Solution,
    SolverStatus,
    time_left,
)
from autoshard.search.solver.solve import solve
from autoshard.training.options import Overlap
from autoshard.units import format_bytes


class NoPlanFits(InfeasibleError):
    """No plan fits the budget; `lowest` is the least memory any plan needs, with its proof."""

    lowest: LowestBudget

    def __init__(self, message: str, lowest: LowestBudget) -> None:
        super().__init__(message, lowest)

    def __reduce__(self) -> tuple[type[NoPlanFits], tuple[str, LowestBudget]]:
        return type(self), (str(self), self.lowest)  # across processes (the service's workers)


@dataclass(frozen=True, kw_only=True)
class Planned:
    """A plan found by search, with its program, its cost and how the solver did."""

    plan: Plan
    program: Program
    cost: Cost
    usage: Memory  # the program's memory (`cost.liveness.memory`)
    solution: Solution
    search: Search
    build_s: float
    solve_s: float  # wall-clock seconds in the solver, every solve of the search


def auto_plan(
    graph: Graph,
    cluster: Cluster,
    annotations: Sequence[Annotation] = (),
    options: SolverOptions | None = None,
    tracker: Tracker | None = None,
    deadline: Deadline = NEVER,
    explain: bool = True,
    overlap: Overlap | None = None,
    reuse: Search | None = None,
    aside: Solution | None = None,
) -> Planned:
    """Search the cheapest plan that fits the memory budget (CP-SAT), then lower and price
    it (a training step's schedule as `overlap` runs it: `cost.price`; None: none);
    `NoPlanFits` with the lowest feasible budget when none fits (`explain`; else the solve's
    `InfeasibleError` as it comes: a caller with other steps to try skips that solve, longer
    than the search's own). `tracker` is told what the search does and each solve's objective
    and bound. `deadline`: the command's wall clock, shared by every step (`solve` says what
    each answers when it passes); `TimeUp` where it passes while the problem is built.
    `reuse`: the search of an earlier call on the same graph, annotations and cluster but for
    its budget, solved under `cluster`'s; `aside`: its memory-aside optimum (`search.shared`)."""
    started = time.perf_counter()
    say = tracker.detail if tracker is not None else (lambda _: None)
    options = options or SolverOptions()
    unit = "B" if options.objective == Objective.BYTES else "s"
    check_search_axes(cluster.mesh.ndim, f"mesh {cluster.mesh}")
    search = _search_for(graph, cluster, annotations, options, deadline, reuse)
    built = time.perf_counter() - started
    problem = search.problem
    say(
        f"the problem: {len(problem.sizes)} groups, {problem.variables} choices, "
        f"{len(problem.edges)} edges, {len(problem.memory)} memory rows ({built:.1f} s)"
    )
    spent, solve_s = 0.0, 0.0
    hint: tuple[int, ...] = ()
    floor = 0  # proven on rows counting less, it bounds the rows counting more
    while True:
        try:
            left = time_left(options.time_limit, spent)
            solution = solve(search.problem, left, hint, tracker, unit, options.time_limit,
                             floor, deadline, None if hint else aside)  # fmt: skip
        except InfeasibleError as none:
            lowest = none.lowest
            if not explain:
                raise
            if lowest is None:
                say("no plan fits the budget")
                lowest = _lowest(search.problem, options.time_limit, tracker, deadline)
            raise no_plan_fits(graph, cluster, search, lowest) from None
        spent, solve_s = spent + solution.work, solve_s + solution.wall_s
        if tracker is not None:
            tracker.solved(f"solved: {solution.status} ({solution.wall_s:.1f} s)")
        plan = search.plan(graph, cluster, solution.choice)
        program, usage = lower_measured(graph, plan)
        counted, held = search.problem.peak(solution.choice), usage.peak
        fits = held <= cluster.memory  # (where no time is left to count more, it is the plan)
        if held <= counted or (fits and deadline.passed()):
            break
        deadline.check("counting the reshards' intermediates", f"the plan found holds {held} B")
        chains = search.chains | _chains(graph, plan)
        if chains == search.chains:  # the model's promise: checked on every plan
            raise AutoshardError(
                f"internal error: the program holds {held} bytes per device, more than the "
                f"search counted ({counted}); please report it with the model"
            )
        say(f"the program holds {held} bytes, with {len(chains)} reshards' intermediates")
        try:
            search, hint = search.counting(chains), solution.choice
        except TimeUp:
            if fits:
                break
            raise
        floor = math.floor(solution.bound)
    cost = price(program, graph, cluster, usage, overlap)
    return Planned(
        plan=plan, program=program, cost=cost, usage=usage, solution=solution, search=search,
        build_s=built, solve_s=solve_s,
    )  # fmt: skip


def _lowest(
    problem: Problem, time_limit: float, tracker: Tracker | None, deadline: Deadline
) -> LowestBudget:
    """The least peak any plan needs (`solver.lowest`, imported where it is called: it loads
    OR-Tools, which a plan that fits its budget may never need)."""
    from autoshard.search.solver.lowest import lowest_budget

    return lowest_budget(problem, time_limit, tracker, deadline=deadline)


def _search_for(
    graph: Graph, cluster: Cluster, annotations: Sequence[Annotation], options: SolverOptions,
    deadline: Deadline, reuse: Search | None,
) -> Search:  # fmt: skip
    """The search of `graph` on `cluster`: built, or `reuse` under `cluster`'s budget."""
    if reuse is None:
        return build_search(graph, cluster, annotations, options.objective, deadline=deadline)
    return dataclasses.replace(
        reuse, problem=dataclasses.replace(reuse.problem, budget=cluster.memory)
    )


def _chains(graph: Graph, plan: Plan) -> frozenset[Chain]:
    """The reshards of several collectives a plan makes."""
    found = set()
    inputs = {op.name: op.inputs for op in graph.ops}
    for (op, i), need in plan.needs.items():
        name = graph.outputs[i] if op == RETURN else inputs[op][i]
        held, info = plan.values[name], graph.values[name]
        itemsize = dtypes.nbytes(info.dtype, 1)
        if held != need and len(plan_reshard(held, need, info.shape, plan.mesh, itemsize)) > 1:
            found.add((info.shape, info.dtype, held, need))
    return frozenset(found)


def no_plan_fits(
    graph: Graph, cluster: Cluster, search: Search, lowest: LowestBudget
) -> NoPlanFits:
    """No plan fits: the lowest feasible budget, how sure the solver is of it, and the largest
    tensors the plan reaching it holds at its peak."""
    usage = lower_measured(graph, search.plan(graph, cluster, lowest.choice))[1]
    proof = (
        "proven optimal"
        if lowest.status is SolverStatus.OPTIMAL
        else f"the least found; no plan needs less than {lowest.bound} bytes"
    )
    biggest = ", ".join(f"{name} ({format_bytes(size)})" for name, size in usage.live[:5])
    return NoPlanFits(
        f"infeasible budget: no plan fits {cluster.memory} bytes "
        f"({format_bytes(cluster.memory)}) per device; "
        f"the lowest feasible budget is {lowest.peak} bytes ({format_bytes(lowest.peak)}, "
        f"{proof}; --memory {lowest.peak}); the largest tensors live at its peak: {biggest}",
        lowest,
    )
