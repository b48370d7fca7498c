"""What a solve returns and tells: the solution and its status, the lowest budget, the
errors, the plans found on the way and the time each solve may take; small helpers shared by
the solver's steps (a plan renumbered between a problem and its narrowed form, a float bound
rounded up to an integer one)."""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autoshard.deadline import NEVER, Deadline
from autoshard.errors import AutoshardError
from autoshard.progress import Tracker
from autoshard.search.problem import Problem
from autoshard.search.solver import tuning
from autoshard.units import in_units

if TYPE_CHECKING:
    from ortools.sat.python import cp_model


class InfeasibleError(AutoshardError):
    """No plan fits the memory budget; `lowest`, where the solve worked it out, is the least
    memory any plan needs."""

    def __init__(self, message: str, lowest: LowestBudget | None = None) -> None:
        super().__init__(message)
        self.lowest = lowest


def proven_infeasible() -> InfeasibleError:
    return InfeasibleError("no plan fits the memory budget (the relaxation proves it)")


class NoPlan(InfeasibleError):
    """CP-SAT proved that no plan fits, in `work` deterministic seconds."""

    def __init__(self, work: float) -> None:
        super().__init__("no plan fits the memory budget")
        self.work = work


class OutOfTime(AutoshardError):
    """A solve found no plan in its time (its deterministic seconds, or the wall clock's)."""


class SolverStatus(enum.StrEnum):
    """OPTIMAL: proven; FEASIBLE: the best found when the time limit or the budget policy
    stopped the search, with its proven gap (CP-SAT's names)."""

    OPTIMAL = "OPTIMAL"
    FEASIBLE = "FEASIBLE"


@dataclass(frozen=True, kw_only=True)
class Solution:
    """A solve's answer: a choice per group, its status, its objective (the problem's integer
    cost) and the bound proven, the wall time, the size of CP-SAT's last model (0: none was
    built) and the deterministic seconds spent."""

    choice: tuple[int, ...]
    status: SolverStatus
    objective: int
    bound: float
    wall_s: float
    variables: int
    constraints: int
    work: float = 0.0  # deterministic seconds the solver spent (what --time-limit bounds)
    memory_binds: bool = True
    """False where the optimum with memory aside fits the budget (and is the answer)."""

    @property
    def gap(self) -> float:
        return (self.objective - self.bound) / self.objective if self.objective > 0 else 0.0


@dataclass(frozen=True, kw_only=True)
class LowestBudget:
    """The least memory per device any plan needs (`peak`, reached by `choice`) and the bound
    the solver proved: OPTIMAL when `bound == peak`."""

    peak: int
    bound: int
    status: SolverStatus
    choice: tuple[int, ...]
    work: float = 0.0  # deterministic seconds the solver spent


@dataclass(frozen=True)
class Limit:
    """The deterministic seconds one solve may use, the user's `--time-limit` they are part of,
    and which solve it is: what the error says when the solve stops without a plan; and the
    command's wall-clock `deadline`, which CP-SAT is given what is left of."""

    seconds: float
    of: float
    solve: str
    deadline: Deadline = NEVER

    def out_of_time(self, status: str) -> str:
        """Why the solve stopped without a plan (CP-SAT's `status`): the deadline passed, or
        the solve's deterministic seconds ran out."""
        if self.deadline.passed():
            return self.deadline.ran_out(
                f"in the {self.solve} solve, before any plan that fits was found"
            )
        share = f"{self.seconds:.2g} s left for the {self.solve} solve, "
        return (
            f"the solver found no plan within --time-limit {self.of:g} s "
            f"({share if self.seconds < self.of else ''}{status}); raise --time-limit"
        )


def time_left(time_limit: float, spent: float) -> float:
    """What a later solve may use of `time_limit` after `spent`: the rest, and at least a
    tenth (a solve given nothing finds nothing)."""
    return max(time_limit - spent, time_limit / 10)


@dataclass(frozen=True)
class Found:
    """A plan found on the way, and its value (its cost, or its peak)."""

    choice: tuple[int, ...]
    value: int


@dataclass(frozen=True)
class Attempt:
    """One CP-SAT solve of a narrowed problem: its best plan (in its own numbering) and that
    plan's value (None: it has no plan that fits), the bound it proved, whether that plan is
    its optimum, and the deterministic seconds it took."""

    choice: tuple[int, ...]
    value: int | None
    bound: int
    optimal: bool
    work: float
    variables: int = 0  # the size of CP-SAT's model
    constraints: int = 0


def plan_fits(problem: Problem, choice: Sequence[int]) -> bool:
    return len(choice) == len(problem.sizes) and problem.peak(choice) <= problem.budget


def rounded_up(bound: float) -> int:
    """A relaxation's float bound as an integer bound: its rounding error taken off first."""
    return math.ceil(bound - tuning.ROUNDING * max(1.0, abs(bound)))


def renumbered(plan: Found | None, kept: Sequence[Sequence[int]] | None) -> tuple[int, ...]:
    """A plan of the whole problem as a plan of its `restricted(kept)` (no hint where it
    takes a choice left out)."""
    if plan is None:
        return ()
    if kept is None:
        return plan.choice
    if any(k not in choices for choices, k in zip(kept, plan.choice, strict=True)):
        return ()
    return tuple(choices.index(k) for choices, k in zip(kept, plan.choice, strict=True))


def in_whole(choice: Sequence[int], kept: Sequence[Sequence[int]] | None) -> tuple[int, ...]:
    """A plan of `restricted(kept)` as a plan of the whole problem."""
    if kept is None:
        return tuple(choice)
    return tuple(choices[k] for choices, k in zip(kept, choice, strict=True))


def kept_among(choices: Sequence[Sequence[int]] | None, kept: Sequence[Sequence[int]]) -> bool:
    """Whether each group's `choices` (None: all) are among those `kept`."""
    return choices is not None and all(
        set(these) <= set(k) for these, k in zip(choices, kept, strict=True)
    )


class Improvements:
    """Tells a tracker each better plan and each better bound of the CP-SAT solves it
    watches, as (CP-SAT's value + offset) * scale (`cp_sat.run_solver` hands it what CP-SAT
    finds). It reads the solver's state and changes nothing. `best` may start at a plan found
    before; the bounds told are at least `floor` (a bound proven before) and at most `ceiling`
    (a narrowed solve's bound holds for the whole problem only up to its threshold); while a
    solve holds fewer memory rows than its problem, the plans told are those `fits` accepts.
    Free of OR-Tools: a plan that never reaches CP-SAT never imports it."""

    def __init__(
        self, tracker: Tracker, scale: float, unit: str, offset: int = 0, best: int | None = None
    ) -> None:
        self.tracker, self.scale, self.unit, self.offset = tracker, scale, unit, offset
        self.best: float | None = best
        self.floor, self.ceiling = -math.inf, math.inf
        self.fits: Callable[[cp_model.CpSolverSolutionCallback], bool] | None = None

    def solution(self, found: cp_model.CpSolverSolutionCallback) -> None:
        """A plan CP-SAT found (`found`, its callback's view of the solve)."""
        value = found.objective_value
        if self.fits is None or self.fits(found):  # (a solve of fewer rows: some do not)
            self.best = value if self.best is None else min(self.best, value)
        self.bound(found.best_objective_bound)

    def bound(self, bound: float) -> None:
        if not math.isfinite(bound):  # no bound proven yet
            return
        objective = None if self.best is None else (self.best + self.offset) * self.scale
        bound = min(max(bound, self.floor), self.ceiling)
        self.tracker.solution(objective, (bound + self.offset) * self.scale, self.unit)

    def say(self, value: int) -> str:
        """A value of the objective as the tracker is told it."""
        return in_units((value + self.offset) * self.scale, self.unit)


def told_end(solution: Solution, tracker: Tracker | None, scale: float, unit: str) -> Solution:
    """The solve's end as the plan records it, told (CP-SAT's callbacks may not see the bound
    close on the optimum)."""
    if tracker is not None:
        tracker.solution(solution.objective * scale, solution.bound * scale, unit)
    return solution
