"""The lowest budget: the least peak memory any plan reaches (`lowest_budget`), and whether any
plan fits a budget at all (`any_fits`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from ortools.sat.python import cp_model

from autoshard.deadline import NEVER, Deadline
from autoshard.progress import Tracker
from autoshard.search.problem import Problem
from autoshard.search.solver.cp_sat import (
    chosen_plan,
    deterministic_solver,
    fitting_plans,
    least_peak_model,
    run_solver,
)
from autoshard.search.solver.dual import least_peak
from autoshard.search.solver.marginals import peak_marginals
from autoshard.search.solver.narrowing import Narrowing
from autoshard.search.solver.outcome import (
    Attempt,
    Found,
    Improvements,
    InfeasibleError,
    Limit,
    LowestBudget,
    OutOfTime,
    SolverStatus,
    rounded_up,
)
from autoshard.search.solver.relaxation import peak_relaxation


def lowest_budget(
    problem: Problem,
    time_limit: float = 60.0,
    tracker: Tracker | None = None,
    of: float | None = None,
    enough: int = -1,
    deadline: Deadline = NEVER,
) -> LowestBudget:
    """The smallest peak memory any choice reaches. The rows' weighted sums relaxed
    (`dual.least_peak`) give a bound and plans; CP-SAT minimizes the peak over the
    choices a plan of a lower peak may take (`Narrowing`), from the least found. `of`: the
    user's `--time-limit`, where `time_limit` is what is left of it; `enough`: a peak at
    which to stop (FEASIBLE), once a plan reaches it; `deadline`: the command's wall clock,
    at which the least peak found so far is the answer (FEASIBLE; `OutOfTime` where the
    relaxation found none)."""
    if tracker is not None:
        tracker.detail("the least memory any plan needs: the rows' weighted sums relaxed")
    relaxation = peak_relaxation(problem)
    found = least_peak(problem, relaxation=relaxation, deadline=deadline)
    best, bound, marginals = None, 0, None
    if found is not None and found.best is not None:
        best = Found(found.best.choice, found.best.peak)
        marginals = peak_marginals(relaxation, found)
        # A plan's peak is at least each of its choices' least: the least choice of a group
        # bounds them all.
        least = [float(m.min()) for m in marginals or ()]
        bound = max(0, rounded_up(max([found.bound, *least])))
    watch = None
    if tracker is not None:
        watch = Improvements(tracker, 1.0, "B", best=best.value if best else None)

    joined = None  # the rows the tries' models held, for the next

    def attempt(narrowed: Problem, hint: Sequence[int], at_least: int, limit: Limit) -> Attempt:
        nonlocal joined
        got, joined = _least_peak(narrowed, limit, watch, hint, at_least, joined)
        return got

    search = Narrowing(problem, marginals, attempt, watch, "the peak", 1.0)
    limit = Limit(time_limit, time_limit if of is None else of, "lowest-budget", deadline)
    best, bound, work = search.run(best, bound, limit, enough=enough)
    assert best is not None  # the least peak is always some plan's
    bound = min(bound, best.value)
    status = SolverStatus.OPTIMAL if bound == best.value else SolverStatus.FEASIBLE
    return LowestBudget(
        peak=best.value, bound=bound, status=status, choice=best.choice, work=work
    )  # fmt: skip


def _least_peak(
    problem: Problem,
    limit: Limit,
    watch: Improvements | None,
    hint: Sequence[int] = (),
    at_least: int = 0,
    joined: np.ndarray | None = None,
) -> tuple[Attempt, np.ndarray | None]:
    """CP-SAT on the least peak: from `hint`, no less than `at_least` (a bound proven); and
    the rows its last model held (None: all). From a hint, the model holds at first the rows
    the hint holds `at_least` or more in (any other may be the peak of a plan below the best,
    but few are), and the rows its plan goes over join it for the next solve, until its
    plan's peak is its optimum (row generation, as in `solve_cp_sat`: a model of fewer rows has no
    higher optimum). The rows that joined a try's model start the next's (`joined`; they are
    the rows of the whole problem too). Without a hint, every row that may go over the bound.
    Of a training step's thousands of rows that may, a good plan holds the bound in few."""
    among = None
    if hint:
        among = np.flatnonzero(problem.live(hint) >= at_least)
        among = among if joined is None else np.union1d(among, joined)
    best, bound, work = tuple(hint), at_least, 0.0
    reached = problem.peak(best) if best else None
    size = (0, 0)  # the last model's variables and constraints
    while True:
        if limit.deadline.passed():
            if best:
                break  # the best plan so far
            raise OutOfTime(limit.out_of_time("UNKNOWN"))
        model, x = least_peak_model(problem, best, at_least, among)
        solver = deterministic_solver(max(limit.seconds - work, 0.0), limit.deadline.left())
        size = (len(model.proto.variables), len(model.proto.constraints))
        if watch is not None:
            watch.fits = None if among is None else fitting_plans(problem, x, None)
        status = run_solver(solver, model, watch)
        work += solver.response_proto.deterministic_time
        if best and status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            break  # out of time: the best plan so far
        choice = chosen_plan(solver, status, x, limit)
        bound = max(bound, math.ceil(solver.best_objective_bound))
        peak, least = problem.peak(choice), int(solver.objective_value)
        if reached is None or peak < reached:
            best, reached = choice, peak
        if among is None or peak <= least or status != cp_model.OPTIMAL:
            break
        if work >= limit.seconds:
            break
        if watch is not None:  # the next solve's bound starts lower
            watch.floor = max(watch.floor, bound)
        among = np.union1d(among, np.flatnonzero(problem.live(choice) > least))
    assert reached is not None  # (a plan: the hint, or the first solve's)
    bound = min(reached, bound)
    return Attempt(best, reached, bound, bound == reached, work, *size), among


def any_fits(
    problem: Problem,
    time_limit: float,
    tracker: Tracker | None,
    limit: float,
    deadline: Deadline = NEVER,
) -> tuple[list[Found], float]:
    """Where no plan the relaxation found fits the budget, whether any does: a plan that
    does (none where time ran out first) and the work spent, from the least peak
    (`lowest_budget`, stopped once it has such a plan); `InfeasibleError` with the lowest
    budget where none does. The least peak answers faster than the cost's tries, each over
    more choices, and the error needs it anyway."""
    if tracker is not None:
        tracker.detail("no plan the relaxation found fits the budget: does any?")
    try:
        lowest = lowest_budget(
            problem, time_limit, tracker, limit, enough=problem.budget, deadline=deadline
        )
    except OutOfTime:  # the cost's search goes on, with what is left
        return [], time_limit
    if lowest.bound > problem.budget:
        raise InfeasibleError("no plan fits the memory budget", lowest)
    if lowest.peak > problem.budget:
        return [], lowest.work
    return [Found(lowest.choice, problem.objective(lowest.choice))], lowest.work
