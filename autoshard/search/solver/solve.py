"""The solve: the best choice per group, memory aside first, then the memory rows relaxed,
then CP-SAT on the choices a plan below a threshold may take.

1. Memory aside (`eliminate`): the objective is a sum of tables over one or two groups, which
   exact min-sum elimination solves fast; where that optimum fits the budget it is the answer.
2. The memory rows relaxed into the objective (`relaxation`, `dual`): a bound, plans that may
   fit, and per group and choice the least any plan taking that choice can cost
   (min-marginals, `marginals`); where no plan found fits, the least peak says whether any
   does (`lowest`).
3. Narrowing (`narrowing`): a choice whose min-marginal is past a threshold is in no plan
   below it, so CP-SAT (`cp_sat`) solves the problem over the few choices left, the threshold
   rising to the best plan's value.

Deterministic: iteration counts and CP-SAT's deterministic time decide, never the clock, so
the same problem gives the same solution on any machine. The one exception is the command's
wall-clock deadline (`--time-limit`, `Deadline`): where it passes first, every step stops
where it is and the best plan so far is the answer (FEASIBLE, with the bound proven so far),
which depends on how fast the machine got there. A `Tracker` may watch a solve; its callbacks
only read.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from autoshard.deadline import NEVER, Deadline
from autoshard.progress import Tracker
from autoshard.search.problem import Problem
from autoshard.search.solver import tuning
from autoshard.search.solver.dual import Dual, dual
from autoshard.search.solver.eliminate import memory_aside
from autoshard.search.solver.marginals import (
    fitting_choices,
    strengthened,
    tightened,
    within_budget,
)
from autoshard.search.solver.narrowing import Narrowing
from autoshard.search.solver.outcome import (
    Attempt,
    Found,
    Improvements,
    InfeasibleError,
    Limit,
    NoPlan,
    OutOfTime,
    Solution,
    SolverStatus,
    plan_fits,
    proven_infeasible,
    rounded_up,
    time_left,
    told_end,
)
from autoshard.search.solver.relaxation import Relaxation, table_limit


def solve(
    problem: Problem,
    time_limit: float = 60.0,
    hint: Sequence[int] = (),
    tracker: Tracker | None = None,
    unit: str = "s",
    limit: float | None = None,
    floor: int = 0,
    deadline: Deadline = NEVER,
    aside: Solution | None = None,
) -> Solution:
    """The best choice per group; `InfeasibleError` when the budget cannot hold any plan.

    The memory-aside optimum, if it fits; else CP-SAT over the choices the relaxation leaves
    (`_relaxed`), from the best plan (or `hint`, if it fits), the threshold rising to the
    best plan's cost (`Narrowing`). The status and gap are those of the best bound proven.
    `time_limit` bounds the deterministic time of the CP-SAT solves. `tracker` is told each
    solve's progress, its objective in `unit` (`s` or `B`: what `problem.unit` scales the
    integer costs to). `limit` is the user's `--time-limit`, of which `time_limit` is what
    is left to this solve (all of it by default): what the error says when a solve stops
    without a plan. `floor`: a bound proven before (on rows counting less:
    `budget.auto_plan`'s rounds). `deadline`: the command's wall clock. Where it passes, or
    `time_limit` runs out, before a step has found a plan, the plan `hint` or every group's
    first choice (replicated, where the annotations allow) is the answer where it fits
    (FEASIBLE, the bound proven so far), else `OutOfTime` names the step. `aside`: the
    memory-aside optimum (`memory_aside`) where the caller has it, as for a problem that
    differs from one solved before in its memory rows alone (rounds adding rows).
    """
    known, started = _Known(floor), time.perf_counter()
    try:
        return _search(problem, time_limit, hint, tracker, unit, limit, deadline, known, aside)
    except OutOfTime:  # (the wall clock, or the deterministic seconds, as on any machine)
        fallback = [plan for plan in (tuple(hint), (0,) * len(problem.sizes))
                    if plan_fits(problem, plan)]  # fmt: skip
        if not fallback:
            raise
        choice = min(fallback, key=problem.objective)
        if tracker is not None:
            which = "the plan found before" if choice == tuple(hint) else "the replicated plan"
            tracker.detail(f"out of time before a plan of its own: {which}, which fits")
        objective = problem.objective(choice)
        proven = min(known.bound, objective)
        solved = Solution(
            choice=choice, status=SolverStatus.OPTIMAL if proven == objective else
            SolverStatus.FEASIBLE, objective=objective, bound=proven,
            wall_s=time.perf_counter() - started, variables=0, constraints=0, work=known.work,
        )  # fmt: skip
        return told_end(solved, tracker, problem.unit, unit)


@dataclass
class _Known:
    """The bound proven and the deterministic seconds spent so far by a solve: what it
    answers with when the deadline cuts it short before it has a plan of its own."""

    bound: int
    work: float = 0.0


def _search(
    problem: Problem,
    time_limit: float,
    hint: Sequence[int],
    tracker: Tracker | None,
    unit: str,
    limit: float | None,
    deadline: Deadline,
    known: _Known,
    aside: Solution | None,
) -> Solution:
    """`solve`'s steps, telling `known` what each proves."""
    limit = time_limit if limit is None else limit
    if aside is None:
        aside = memory_aside(
            problem, Limit(time_limit, limit, "memory-aside", deadline), tracker, unit
        )
    if problem.peak(aside.choice) <= problem.budget:
        return told_end(dataclasses.replace(aside, memory_binds=False), tracker, problem.unit, unit)
    known.bound, known.work = max(known.bound, math.ceil(aside.bound)), aside.work
    if deadline.passed():  # (the memory-bound search's no plan, `solve`'s fallback)
        raise OutOfTime(Limit(time_limit, limit, "memory-bound", deadline).out_of_time(""))
    after_aside = time.perf_counter()
    start = _relaxed(problem, aside, hint, known.bound, time_limit, limit, tracker, deadline)
    known.bound, known.work = start.at_least, start.work
    watch = None
    if tracker is not None:
        value = None if start.best is None else start.best.value * problem.unit
        tracker.solution(value, start.at_least * problem.unit, unit)
        best = start.best.value if start.best else None
        watch = Improvements(tracker, problem.unit, unit, best=best)
    tighten = None
    if start.found is not None:
        tighten = functools.partial(
            tightened, problem, start.found.multipliers,
            exact_up_to=start.relaxation.exact_up_to, hubs=bool(start.relaxation.hubs),
            deadline=deadline,
        )  # fmt: skip
    attempt = _attempts(watch, start.binding)
    search = Narrowing(
        problem, start.marginals, attempt, watch, "the cost", tuning.WHOLE_SHARE, True, tighten
    )  # fmt: skip
    rest = Limit(time_left(time_limit, start.work), limit, "memory-bound", deadline)
    found, bound, work = search.run(start.best, start.at_least, rest, aside.choice)
    if found is None:
        raise InfeasibleError("no plan fits the memory budget")
    proven = bound >= found.value
    solved = Solution(
        choice=found.choice, status=SolverStatus.OPTIMAL if proven else SolverStatus.FEASIBLE,
        objective=found.value, bound=found.value if proven else bound,
        wall_s=aside.wall_s + time.perf_counter() - after_aside,
        variables=search.variables, constraints=search.constraints, work=start.work + work,
    )  # fmt: skip
    return told_end(solved, tracker, problem.unit, unit)


@dataclass(frozen=True)
class _Start:
    """What the relaxation leaves the narrowing: the best plan found (None: none fits yet), the
    bound proven, the min-marginals (None: none), the rows that bind (those CP-SAT's first
    model holds), the relaxation and its multipliers (None: too big to eliminate), and the
    deterministic seconds spent so far."""

    best: Found | None
    at_least: int
    marginals: list[np.ndarray] | None
    binding: np.ndarray | None
    relaxation: Relaxation
    found: Dual | None
    work: float


def _relaxed(
    problem: Problem,
    aside: Solution,
    hint: Sequence[int],
    floor: int,
    time_limit: float,
    limit: float,
    tracker: Tracker | None,
    deadline: Deadline = NEVER,
) -> _Start:
    """The memory rows relaxed (`dual`, `strengthened`): a bound, plans that fit (where none
    does, the least peak says whether any does, `any_fits`), and the min-marginals, less the
    choices with a memory row alone over the budget (`fitting_choices`; where they are many, the
    relaxation of the rest solved again, `within_budget`). `aside`: the memory-aside optimum,
    which does not fit; `time_limit`, `limit` and `deadline` as `solve`'s: past it, each
    step after the first relaxation is left out (the plans and bound found so far stand)."""
    if tracker is not None:
        tracker.detail(f"its optimum does not fit the budget: the {len(problem.memory)} "
                       "memory rows relaxed (Lagrangian multipliers)")  # fmt: skip
    relaxation = Relaxation(problem, exact_up_to=table_limit(problem, aside.choice))
    found = dual(problem, relaxation=relaxation, longer=tuning.LONGER, deadline=deadline)
    if found is not None and not found.infeasible and not deadline.passed():
        relaxation, found = strengthened(problem, relaxation, found, deadline)
    plans = [Found(tuple(hint), problem.objective(hint))] if plan_fits(problem, hint) else []
    at_least, marginals, binding = floor, None, None
    fitting = None
    if found is not None:
        if found.infeasible:
            raise proven_infeasible()
        at_least = max(at_least, rounded_up(found.bound))
        if found.best is not None:
            plans.append(Found(found.best.choice, found.best.objective))
        if not deadline.passed():
            fitting = fitting_choices(problem, found, relaxation)
    spent = aside.work
    if not plans and not deadline.passed():
        from autoshard.search.solver.lowest import any_fits  # (OR-Tools, loaded where called)

        plans, work = any_fits(problem, time_left(time_limit, spent), tracker, limit, deadline)
        spent += work
    if found is not None and not deadline.passed():
        marginals = relaxation.min_marginals(found.multipliers, found.shares)
        binding = np.flatnonzero(found.multipliers > 0)
        if fitting is not None and marginals is not None:
            bound, plan, marginals, again = within_budget(
                problem, fitting, marginals, relaxation, deadline
            )
            binding = np.union1d(binding, again)
            at_least = max(at_least, bound)
            plans += [plan] if plan is not None else []
    best = min(plans, key=lambda plan: plan.value, default=None)
    return _Start(best, at_least, marginals, binding, relaxation, found, spent)


def _attempts(
    watch: Improvements | None, binding: np.ndarray | None
) -> Callable[[Problem, Sequence[int], int, Limit], Attempt]:
    """A try of the narrowing: CP-SAT on the narrowed problem, memory rows included, from
    `hint`; its model holds at first the rows `binding` (those that bind the relaxation),
    then those the try before held (`solve_cp_sat`'s row generation)."""

    def attempt(narrowed: Problem, hint: Sequence[int], _: int, limit: Limit) -> Attempt:
        nonlocal binding
        from autoshard.search.solver.cp_sat import solve_cp_sat  # (OR-Tools, loaded here)

        try:
            got, binding = solve_cp_sat(narrowed, limit, True, hint, watch, binding)
        except NoPlan as none:
            return Attempt((), None, 0, True, none.work)
        optimal = got.status is SolverStatus.OPTIMAL
        return Attempt(
            got.choice, got.objective, math.ceil(got.bound), optimal, got.work, got.variables,
            got.constraints,
        )  # fmt: skip

    return attempt
