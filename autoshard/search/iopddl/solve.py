"""An IOPDDL problem solved by the planner's solver (`solver.solve`), its memory rows added as
solutions go over them.

A contest problem has tens of thousands of memory rows of thousands of nodes each, most of
which no good solution comes near. So the first solve holds none (the optimum with memory
aside), and each solve after holds, besides the rows before, those the last solution went
over: of each run of consecutive rows over the limit, the one most over, and the rows most
over of all (`ROWS_PER_ROUND`). A solve of fewer rows is a relaxation of the whole problem,
so its bound holds, and its solution, where it fits every row, is the whole problem's; the
rows only grow, so each bound is the floor of the next solve. Where the rounds run out
(`ROUNDS`, or the time limit's work spent), a last solve holds every row some choice may take
over the limit.

The rounds run in a child process; meanwhile this one runs the large-neighbourhood search
(`lns`) from the greedy solution, which improves a solution where the rounds have none yet
(on the contest's large problems, none within a minute). With a limit that does not bind,
the rounds answer first and the search stops there; the answer is the cheaper (the rounds'
where they tie), so the same problem gives the same bytes unless the wall clock decides.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import multiprocessing
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Generic, TypeVar

import numpy as np

from autoshard.deadline import Deadline, TimeUp
from autoshard.errors import AutoshardError
from autoshard.search.iopddl.format import FORBIDDEN, IopddlError, IopddlProblem
from autoshard.search.iopddl.frugal import frugal
from autoshard.search.iopddl.greedy import Greedy, greedy
from autoshard.search.iopddl.lns import improved
from autoshard.search.iopddl.pose import Posed, pose
from autoshard.search.solver import tuning
from autoshard.search.solver.eliminate import memory_aside
from autoshard.search.solver.lowest import lowest_budget
from autoshard.search.solver.outcome import (
    InfeasibleError,
    Limit,
    OutOfTime,
    Solution,
    SolverStatus,
)
from autoshard.search.solver.solve import solve

T = TypeVar("T")

ROUNDS = 12
"""Solves of more rows at most before the last of all the rows that may bind."""

ROWS_PER_ROUND = 256
"""The rows most over the limit a round adds, besides the worst of each run of them."""

ASIDE_SHARE = 0.25
"""The share of the time limit the optimum with memory aside may take at most: past it, its
best found and bound serve (it only starts the memory-bound search, which needs the rest)."""

GREEDY_SHARE = 0.5
"""The share of the time limit past which the greedy solution's sweeps stop (its repair
does not): the rest is the neighbourhood search's."""

FRUGAL_SHARE = 0.2
"""The share of the time limit the least-usage start (`frugal`) may take at most."""

MARGIN = 2.0
"""Seconds before the time limit at which the solver's rounds stop, at most..."""

MARGIN_SHARE = 0.1
"""...and at most this share of it: the time to hand their solution back."""


@dataclass(frozen=True)
class Solved:
    """A contest problem solved: the strategy per node, its cost (the evaluator's), its
    usage's peak, the bound proven on any solution's cost, whether it is the optimum, the
    rounds of solves, the memory rows the last held, the groups the nodes made (`ties`) and
    the neighbourhoods searched (`lns`)."""

    solution: tuple[int, ...]
    cost: int
    usage: int
    bound: int
    optimal: bool
    wall_s: float
    rounds: int = 1
    rows: int = 0
    groups: int = 0
    tried: int = 0  # the neighbourhoods the large-neighbourhood search solved

    @property
    def gap(self) -> float:
        return (self.cost - self.bound) / self.cost if self.cost > 0 else 0.0


def solve_iopddl(
    iop: IopddlProblem, time_limit: float = 60.0, deadline: Deadline | None = None
) -> Solved:
    """The least-cost solution within the usage limit found in `time_limit` seconds of wall
    clock: the greedy solution (`greedy`, from its own starts and the least-usage one,
    `frugal`) at once; then, side by side, the solver's rounds
    (the module's docstring says how) in a child process and the large-neighbourhood search
    (`lns`) from the greedy solution here, both stopped where the time runs out (the search
    too where the rounds answered first); the best of the three. `IopddlError` naming the
    limit and the least usage found where none fits; `TimeUp` where the time ran out before
    any solution fit. `deadline`: started before (the command's, which read the problem),
    else now."""
    started = time.perf_counter()
    deadline = deadline or Deadline.start(time_limit)
    posed = pose(iop)
    # The least-usage start in a child (its elimination is not stopped within: the child is
    # ended at its share of the limit), beside the greedy's own starts here.
    by = _share(deadline, FRUGAL_SHARE)
    frugal_child = _Child(functools.partial(frugal, posed, time_limit * FRUGAL_SHARE, by))
    quick = greedy(posed, _share(deadline, GREEDY_SHARE))
    least = frugal_child.result(by)
    if least is not None:
        other = greedy(posed, _share(deadline, GREEDY_SHARE), [least], own=False)
        if other.fits and (not quick.fits or other.objective < quick.objective):
            quick = other
    margin = min(MARGIN, deadline.seconds * MARGIN_SHARE)
    within = Deadline(deadline.seconds - margin, deadline.started, deadline.clock)
    rounds = functools.partial(_rounds, iop, posed, quick, time_limit, within)
    child: _Child[Solved] = _Child(rounds)
    searched = None
    if quick.fits:
        searched = improved(posed, quick.choice, time_limit, within, stop=child.answered)
    exact = child.result(deadline)
    groups = len(posed.problem.sizes)
    if searched is not None:
        solution = tuple(posed.solution(searched.choice))
        cost = iop.cost(solution)
        if exact is None or cost < exact.cost:
            floor = exact.bound if exact is not None else posed.cost_bound(_least(posed))
            bound = cost if searched.optimal else min(cost, floor)
            wall = time.perf_counter() - started
            return Solved(solution, cost, iop.usage(solution), bound, bound == cost, wall,
                          groups=groups, tried=searched.tried)  # fmt: skip
    if exact is None:
        raise TimeUp(deadline.ran_out("before a solution within the usage limit was found"))
    return dataclasses.replace(exact, wall_s=time.perf_counter() - started, groups=groups)


def _share(deadline: Deadline, share: float) -> Deadline:
    """A deadline `share` of `deadline`'s seconds from its start (at most `deadline`)."""
    return Deadline(deadline.seconds * share, deadline.started, deadline.clock)


class _Child(Generic[T]):
    """`work` done in a child process, started at once; `result` waits for it until the
    deadline, then ends it (None, as where its time ran out); the problem's error it raised,
    raised there."""

    def __init__(self, work: Callable[[], T | None]) -> None:
        context = multiprocessing.get_context("fork")
        self.receive, send = context.Pipe(duplex=False)
        self.child = context.Process(target=_report, args=(work, send), daemon=True)
        self.child.start()
        send.close()

    def answered(self) -> bool:
        return self.receive.poll(0)

    def result(self, deadline: Deadline) -> T | None:
        try:
            if not self.receive.poll(deadline.left()):
                return None
            kind, value = self.receive.recv()
        except EOFError:  # (it died without a word: killed for memory)
            return None
        finally:
            if self.child.is_alive():
                self.child.kill()
            self.child.join()
            self.receive.close()
        if kind == "error" and isinstance(value, IopddlError):
            raise value
        return None if kind == "error" else value  # (else the time ran out in the child)


def _report(work: Callable[[], object], send: Connection) -> None:
    try:
        send.send(("solved", work()))
    except AutoshardError as error:
        send.send(("error", error))
    finally:
        send.close()


def _rounds(
    iop: IopddlProblem, posed: Posed, quick: Greedy, time_limit: float, deadline: Deadline
) -> Solved:
    """The solver's rounds (the module's docstring), each from the greedy solution where it
    fits, each stopped where `deadline` passes."""
    started = time.perf_counter()
    hint = quick.choice if quick.fits else ()
    rows, floor, spent, rounds = np.zeros(0, np.int64), 0, 0.0, 0
    # The optimum with memory aside is every round's: solved once (where the time runs out
    # first, the first round's solve answers from the hint).
    aside: Solution | None = None
    with contextlib.suppress(OutOfTime):
        within = Limit(time_limit * ASIDE_SHARE, time_limit, "memory-aside", deadline)
        aside = memory_aside(posed.problem, within, None, "s")
        spent += aside.work
    while True:
        rounds += 1
        last = rounds > ROUNDS or spent >= time_limit or deadline.passed()
        if last:  # every row that may bind
            rows = posed.usage.may_bind()
        problem = posed.problem_with(rows)
        left = max(time_limit - spent, time_limit / 10)
        try:
            found = solve(problem, time_limit=left, hint=hint, limit=time_limit, floor=floor,
                          deadline=deadline, aside=aside)  # fmt: skip
        except InfeasibleError:
            raise _infeasible(iop, posed, time_limit) from None
        spent += found.work
        floor = max(floor, _bound(found))
        over = posed.usage.over(posed.usage.profile(found.choice), ROWS_PER_ROUND)
        if not len(over) or last:
            break
        rows = np.union1d(rows, over)
    solution = tuple(posed.solution(found.choice))
    cost = iop.cost(solution)
    bound = min(cost, posed.cost_bound(floor))
    # The scaled problem's optimum is the contest's where no cost was scaled.
    optimal = bound == cost or (found.status is SolverStatus.OPTIMAL and posed.step == 1)
    return Solved(solution, cost, iop.usage(solution), bound, optimal,
                  time.perf_counter() - started, rounds, len(rows))  # fmt: skip


def _least(posed: Posed) -> int:
    """A bound of the scaled problem at once: each group's least cost and each edge's."""
    problem = posed.problem
    return sum(min(c) for c in problem.node_costs) + sum(
        min(map(min, rows)) for _, _, rows in problem.edges
    )


def _bound(found: Solution) -> int:
    return math.ceil(found.bound - tuning.ROUNDING * max(1.0, abs(found.bound)))


def _infeasible(iop: IopddlProblem, posed: Posed, time_limit: float) -> IopddlError:
    """The error where no solution fits: the limit, and the least usage found (over every
    row that may bind, so that it is the usage of the solution found)."""
    rows = posed.usage.may_bind()
    lowest = lowest_budget(posed.problem_with(rows), time_limit)
    usage = iop.usage(posed.solution(lowest.choice))
    if iop.usage_limit is None or usage <= iop.usage_limit:  # (the rows keeping pairs apart)
        return IopddlError(f"no solution within the usage limit {iop.usage_limit} avoids "
                           f"the forbidden costs ({FORBIDDEN})")  # fmt: skip
    exact = lowest.bound >= lowest.peak
    return IopddlError(
        f"no solution fits the usage limit {iop.usage_limit}: the least usage found is {usage}"
        + (" (the least any solution reaches)" if exact else f" (none uses less than "
           f"{lowest.bound})")
    )  # fmt: skip
