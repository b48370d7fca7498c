"""The ILP, solved with OR-Tools CP-SAT: one candidate per group, minimum total cost.

    variables   x[g][k] in {0, 1}, sum_k x[g][k] = 1             one choice per group
                y[a,b][r][c] in {0, 1}                            edge (a, b) in cell (r, c)
    edges       sum_c y[r][c] = sum_{ka in row class r} x[a][ka]
                sum_r y[r][c] = sum_{kb in column class c} x[b][kb]
    memory      sum (bytes * x[g][k]) over a liveness row <= budget
    objective   min sum_g sum_k node[g][k] x[g][k] + sum M[r][c] y[a,b][r][c]

An edge's matrix has few distinct rows and columns (choices of a that hold the value alike,
choices of b that read it alike), so the pair variables are over those classes: few, and their
linear relaxation is tight (a transportation polytope), which is what lets CP-SAT prove
optimality fast. Deterministic: one worker, a fixed seed and a deterministic time limit, so
the same problem gives the same solution on any machine. A `Tracker` may watch a solve (each
better plan and bound as CP-SAT finds them); its callbacks only read, so what is solved is the
same.

Without the memory rows the objective is a sum of tables over one or two groups, and exact
min-sum elimination (`search.factors`) solves it in well under a second where CP-SAT needed
seconds to prove it (a 3-axis mesh's cycles of groups with hundreds of choices); CP-SAT is
left the memory-bound problem, and the rare graph whose elimination needs too large a table.

With the memory rows, the rows relaxed into the objective (`search.lagrange`) give a bound
and, per group and choice, the least any plan taking that choice can cost (min-marginals):
a choice whose least is past a threshold is in no plan below it, so CP-SAT solves the
problem over the few choices left (`_Narrowing`); the 32-layer decoder on 2x4x8 at 60 %:
500 of 4023 choices, OPTIMAL in seconds where CP-SAT on all of them ran for minutes. The
tries that prove a plan (at its value, and halfway to it) hold fewer choices: the relaxation
restricted to those a threshold keeps, its multipliers stepped on, leaves more out
(`lagrange.tightened`). Its model holds the memory rows that bind the relaxation (a positive
multiplier), and those its plan goes over next (`_cp_sat`, row generation): a training
step's thousands of rows, each of hundreds of terms, took seconds a try to write out.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Sequence

import numpy as np

from autoshard.progress import Tracker
from autoshard.search.problem import Problem
from autoshard.search.solver import tuning
from autoshard.search.solver.cp_sat import (
    _cp_sat,
)
from autoshard.search.solver.dual import dual
from autoshard.search.solver.eliminate import _memory_aside
from autoshard.search.solver.lowest import _any_fits
from autoshard.search.solver.marginals import (
    _fitting,
    _within,
    strengthened,
    tightened,
)
from autoshard.search.solver.narrowing import _Narrowing
from autoshard.search.solver.outcome import (
    InfeasibleError,
    Solution,
    SolverStatus,
    _Attempt,
    _fits,
    _Found,
    _Improvements,
    _Limit,
    _NoPlan,
    _proven_infeasible,
    _rounded_up,
    _told,
    time_left,
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
) -> Solution:
    """The best choice per group; `InfeasibleError` when the budget cannot hold any plan.

    First without the memory rows (`_memory_aside`: exact elimination, or CP-SAT where its
    tables would be too large): if that optimum fits the budget it is the optimum. Otherwise
    the memory rows relaxed (`search.lagrange`) give a bound, plans that fit (where none
    does, the least peak says whether any does, `_any_fits`), and the choices a plan cheaper
    than a threshold may take (less those with a memory row alone over the budget,
    `_fitting`; where they are many, the relaxation of the rest is solved again,
    `_within`); CP-SAT solves the problem over those choices, memory rows included, from the
    best plan (or `hint`, if it fits), the threshold rising to the best plan's cost
    (`_Narrowing`). The status and gap are those of the best bound proven. `time_limit`
    bounds the deterministic time of the CP-SAT solves. `tracker` is told each solve's
    progress, its objective in `unit` (`s` or `B`: what `problem.unit` scales the integer
    costs to). `limit` is the user's `--time-limit`, of which `time_limit` is what is left to
    this solve (all of it by default): what the error says when a solve stops without a
    plan. `floor`: a bound proven before (on rows counting less: `budget.auto_plan`'s
    rounds).
    """
    limit = time_limit if limit is None else limit
    relaxed = _memory_aside(problem, _Limit(time_limit, limit, "memory-aside"), tracker, unit)
    if problem.peak(relaxed.choice) <= problem.budget:
        return _told(relaxed, tracker, problem.unit, unit)
    after_aside = time.perf_counter()
    if tracker is not None:
        tracker.detail(f"its optimum does not fit the budget: the {len(problem.memory)} "
                       "memory rows relaxed (Lagrangian multipliers)")  # fmt: skip
    relaxation = Relaxation(problem, exact_up_to=table_limit(problem, relaxed.choice))
    found = dual(problem, relaxation=relaxation, longer=tuning.LONGER)
    if found is not None and not found.infeasible:
        relaxation, found = strengthened(problem, relaxation, found)
    plans = [_Found(tuple(hint), problem.objective(hint))] if _fits(problem, hint) else []
    at_least, marginals, binding = max(floor, math.ceil(relaxed.bound)), None, None
    fitting = None
    if found is not None:
        if found.infeasible:
            raise _proven_infeasible()
        at_least = max(at_least, _rounded_up(found.bound))
        if found.best is not None:
            plans.append(_Found(found.best.choice, found.best.objective))
        fitting = _fitting(problem, found, relaxation)
    aside = relaxed.work
    if not plans:
        plans, work = _any_fits(problem, time_left(time_limit, aside), tracker, limit)
        aside += work
    if found is not None:
        marginals = relaxation.min_marginals(found.multipliers, found.shares)
        binding = np.flatnonzero(found.multipliers > 0)
        if fitting is not None and marginals is not None:
            bound, plan, marginals, again = _within(problem, fitting, marginals, relaxation)
            binding = np.union1d(binding, again)
            at_least = max(at_least, bound)
            plans += [plan] if plan is not None else []
    best = min(plans, key=lambda plan: plan.value, default=None)
    watch = None
    if tracker is not None:
        value = None if best is None else best.value * problem.unit
        tracker.solution(value, at_least * problem.unit, unit)
        watch = _Improvements(tracker, problem.unit, unit, best=best.value if best else None)

    def attempt(narrowed: Problem, hint: Sequence[int], _: int, limit: _Limit) -> _Attempt:
        nonlocal binding  # the rows a try's model held start the next's
        try:
            got, binding = _cp_sat(narrowed, limit, True, hint, watch, binding)
        except _NoPlan as none:
            return _Attempt((), None, 0, True, none.work)
        optimal = got.status is SolverStatus.OPTIMAL
        return _Attempt(
            got.choice, got.objective, math.ceil(got.bound), optimal, got.work, got.variables,
            got.constraints,
        )  # fmt: skip

    tighten = None
    if found is not None:
        tighten = functools.partial(
            tightened, problem, found.multipliers, exact_up_to=relaxation.exact_up_to,
            hubs=bool(relaxation.hubs),
        )  # fmt: skip
    search = _Narrowing(
        problem, marginals, attempt, watch, "the cost", tuning.WHOLE_SHARE, True, tighten
    )  # fmt: skip
    rest = _Limit(time_left(time_limit, aside), limit, "memory-bound")
    best, bound, work = search.run(best, at_least, rest, relaxed.choice)
    if best is None:
        raise InfeasibleError("no plan fits the memory budget")
    proven = bound >= best.value
    solved = Solution(
        choice=best.choice, status=SolverStatus.OPTIMAL if proven else SolverStatus.FEASIBLE,
        objective=best.value, bound=best.value if proven else bound,
        wall_s=relaxed.wall_s + time.perf_counter() - after_aside,
        variables=search.variables, constraints=search.constraints, work=aside + work,
    )  # fmt: skip
    return _told(solved, tracker, problem.unit, unit)


# ---- exact elimination of low-degree groups ----------------------------------------------------
