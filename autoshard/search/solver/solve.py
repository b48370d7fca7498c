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

import dataclasses
import enum
import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from autoshard.errors import AutoshardError
from autoshard.progress import Tracker
from autoshard.search.memory_rows import NO_ROWS, Chosen, Indicator, MemoryRows
from autoshard.search.problem import Problem
from autoshard.search.solver.factors import minimize, problem_factors, undominated
from autoshard.search.solver.relaxation import (
    LONGER,
    ROUNDING,
    Dual,
    Relaxation,
    dual,
    least_peak,
    peak_marginals,
    peak_relaxation,
    rows_alone,
    still_possible,
    strengthened,
    table_limit,
    tightened,
)


class InfeasibleError(AutoshardError):
    """No plan fits the memory budget; `lowest`, where the solve worked it out, is the least
    memory any plan needs."""

    def __init__(self, message: str, lowest: LowestBudget | None = None) -> None:
        super().__init__(message)
        self.lowest = lowest


def _proven_infeasible() -> InfeasibleError:
    return InfeasibleError("no plan fits the memory budget (the relaxation proves it)")


class _NoPlan(InfeasibleError):
    """CP-SAT proved that no plan fits, in `work` deterministic seconds."""

    def __init__(self, work: float) -> None:
        super().__init__("no plan fits the memory budget")
        self.work = work


class _OutOfTime(AutoshardError):
    """A solve found no plan in its time."""


class SolverStatus(enum.StrEnum):
    """OPTIMAL: proven; FEASIBLE: the best found when the time limit or the budget policy
    stopped the search, with its proven gap (CP-SAT's names)."""

    OPTIMAL = "OPTIMAL"
    FEASIBLE = "FEASIBLE"


@dataclass(frozen=True, kw_only=True)
class Solution:
    choice: tuple[int, ...]
    status: SolverStatus
    objective: int
    bound: float
    wall_s: float
    variables: int
    constraints: int
    work: float = 0.0  # deterministic seconds the solver spent (what --time-limit bounds)

    @property
    def gap(self) -> float:
        return (self.objective - self.bound) / self.objective if self.objective > 0 else 0.0


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
    found = dual(problem, relaxation=relaxation, longer=LONGER)
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
        problem, marginals, attempt, watch, "the cost", WHOLE_SHARE, True, tighten
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


def _any_fits(
    problem: Problem, time_limit: float, tracker: Tracker | None, limit: float
) -> tuple[list[_Found], float]:
    """Where no plan the relaxation found fits the budget, whether any does: a plan that
    does (none where time ran out first) and the work spent, from the least peak
    (`lowest_budget`, stopped once it has such a plan); `InfeasibleError` with the lowest
    budget where none does. Bert's dynamo export on 2x2x2 at 60 %: the cost's tries, each
    over more choices, proved none fits in 74 s; the least peak, 785,921 B for 698,688, in
    5 s, an answer the error needs anyway."""
    if tracker is not None:
        tracker.detail("no plan the relaxation found fits the budget: does any?")
    try:
        lowest = lowest_budget(problem, time_limit, tracker, limit, enough=problem.budget)
    except _OutOfTime:  # the cost's search goes on, with what is left
        return [], time_limit
    if lowest.bound > problem.budget:
        raise InfeasibleError("no plan fits the memory budget", lowest)
    if lowest.peak > problem.budget:
        return [], lowest.work
    return [_Found(lowest.choice, problem.objective(lowest.choice))], lowest.work


def _fitting(
    problem: Problem, found: Dual, relaxation: Relaxation | None = None
) -> list[list[int]] | None:
    """The choices some plan within the budget may take (None: all), leaving out those whose
    least bytes in a row are over it (the rows of the largest multipliers, each alone,
    `lagrange.rows_alone`); `InfeasibleError` when a group has none left. The decoder on
    2x4x8 at its lowest budget: 942 of 4,023 choices left out."""
    weights = found.multipliers
    binding = np.flatnonzero(weights > 0)
    rows = binding[np.argsort(-weights[binding], kind="stable")]
    exact = (None, ()) if relaxation is None else (relaxation.exact_up_to, relaxation.hubs)
    least = rows_alone(peak_relaxation(problem, *exact), rows)
    if least is None:
        return None
    over = problem.budget + ROUNDING * max(1.0, problem.budget)
    fitting = [np.flatnonzero(peak <= over).tolist() for peak in least]
    if not all(fitting):
        raise _proven_infeasible()
    return None if sum(map(len, fitting)) == problem.variables else fitting


def _within(
    problem: Problem, fitting: list[list[int]], marginals: list[np.ndarray], whole: Relaxation
) -> tuple[int, _Found | None, list[np.ndarray], np.ndarray]:
    """The relaxation of the choices that may fit (`_fitting`), solved again where they are
    few enough (`AGAIN`): stronger, as it no longer mixes in those that cannot (the decoder on
    2x4x8 at its lowest budget: bound 0.0394 s, within them 0.05397 s, the optimum, and its
    plan). Its bound, its best plan, the min-marginals of the whole widened by its own,
    infinite for the choices left out (`_widened`), and the rows that bind it. `whole`: the
    whole problem's relaxation."""
    none = np.zeros(0, np.int64)
    if problem.variables - sum(map(len, fitting)) < AGAIN * problem.variables:
        return 0, None, _widened(marginals, None, fitting), none
    within = problem.restricted(fitting)
    hubs = None if whole.hubs else ()  # exact where the whole's are (made anew: fewer choices)
    relaxation = Relaxation(within, exact_up_to=whole.exact_up_to, hubs=hubs)
    again = dual(within, relaxation=relaxation)
    if again is None:
        return 0, None, _widened(marginals, None, fitting), none
    if again.infeasible:
        raise _proven_infeasible()
    plan = None
    if again.best is not None:
        plan = _Found(_original(again.best.choice, fitting), again.best.objective)
    inner = relaxation.min_marginals(again.multipliers, again.shares)
    binding = np.flatnonzero(again.multipliers > 0)
    return _rounded_up(again.bound), plan, _widened(marginals, inner, fitting), binding


def _widened(
    marginals: list[np.ndarray],
    within: list[np.ndarray] | None,
    fitting: Sequence[Sequence[int]],
) -> list[np.ndarray]:
    """The min-marginals of the whole problem and of its `restricted(fitting)` (`within`), the
    greater of the two for each choice kept (both bound the plans that fit), infinite for one
    left out (in no plan that fits)."""
    widened = []
    for g, (whole, kept) in enumerate(zip(marginals, fitting, strict=True)):
        found = np.full(len(whole), np.inf)
        found[kept] = whole[kept] if within is None else np.maximum(whole[kept], within[g])
        widened.append(found)
    return widened


AGAIN = 0.1
"""The share of the choices rows alone must leave out for the relaxation of those left to be
solved again: the decoder on 2x4x8 at its lowest budget leaves out 23 % (its bound rises from
0.0394 to 0.05397 s, the optimum); bert on 4x8 at its lowest, 2.6 % (its bound does not move,
and the second relaxation costs 2.7 s)."""

FIRST_GAP = 0.02
"""The first value tried as the least a plan may reach, past the relaxation's bound: at most
that much more, relatively; each try after doubles the distance (`_Narrowing`)."""

FIRST_SHARE = 1 / 8
"""The share of the choices the first threshold keeps at most, each after twice the share of
the one before (`_Narrowing`): CP-SAT's time grows with the choices kept. Where the
relaxation's min-marginals are flat, a small gap keeps most of them (T5 on 2x4 at 60 %: 2 %
over the bound keeps 1,400 of 1,829 choices, 0.5 % keeps 519; 44 s then, 9 s now)."""


WHOLE_SHARE = 0.8
"""A threshold keeping more than this share of the choices sends the cost's whole problem to
CP-SAT instead, with no bound given, from the best plan found (else the memory-aside optimum,
which CP-SAT repairs; `_Narrowing`'s `whole_share`): each try below a threshold costs a
solve (an infeasible budget, gpt2 on 2x4 at 60 %: 12 tries up to 717 of 722 choices, 7 s;
now 3, 1.5 s). Narrowed, most of the choices are proven faster than all of them: BART on 4x8
at 30 %, its optimum's value keeps 1,399 of 1,878 choices, 4.9 s (the whole: 14.6 s); the
405B on 16x8 at 60 %, 561 of 741, 3.5 s (the whole, from the same plan: 6-7 s); T5's dynamo
export on 4x8 at 60 %, where no try found a plan below 50 %, one of 841 of 1,682 choices
found a plan of 7.67e8, and the whole problem's 60 s stopped 4.3 % from the bound (from the
whole at once: a plan of 8.11e8, 10 %). The whole problem from the best plan found rather
than the memory-aside optimum: 405B on 16x8 at 60 % 23 -> 13 s, GPT-2 small on 2x4 at 60 %
8.3 -> 7.2 s, T5 on 4x8 at 60 % 23 -> 26 s, bert on 4x8 at 30 % 13.3 -> 14.8 s (CP-SAT's
time on one problem swings so with its start). The least peak's does better on any part of
it (the decoder's on 2x4x8: 3364 of 4023 choices 9.7 s, all of them 46 s): 1 there."""

MOST = 0.5
"""Where the best plan's value keeps this share of the choices or more, the cost's next
threshold is halfway to it first, once (`_Narrowing`'s `halfway`)."""


@dataclass(frozen=True)
class _Attempt:
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


class _Narrowing:
    """CP-SAT on the choices a plan of a value below a threshold may take (reduced-cost
    fixing, `lagrange.still_possible`): few, where the relaxation's bound is close. A plan
    below the threshold takes only choices kept, so if CP-SAT proves its best plan there
    below the threshold, it is the optimum; if that best is at the threshold or above (or
    there is none), no plan is below it anywhere, which raises the bound to the threshold,
    or to that best, if lower, or the least value a choice left out allows (`beyond`).
    The thresholds: the bound plus `FIRST_GAP` of it, doubling the distance each time, but
    none keeping more than `FIRST_SHARE` of the choices, doubling that share each time (and
    again while either is at the bound or under: a threshold there keeps what a try held); at
    most the value of the best plan found (whose choices are then kept, so that CP-SAT
    proves it or finds better), and that value next once a try finds no plan below its
    threshold but one above; where `halfway` and that value keeps `MOST` of the choices or
    more, halfway to it first, once, unless the shares' next threshold is lower; where that
    value, or halfway to it, keeps too many to narrow, the shares' thresholds go on. Where
    few choices are left out (more than `whole_share` kept, or no min-marginals), the whole
    problem is solved. At the best's value and halfway to it, `tighten` leaves out more of
    the choices a try keeps (`lagrange.tightened`), given them, the threshold and the best
    plan."""

    def __init__(
        self,
        problem: Problem,
        marginals: Sequence[np.ndarray] | None,
        attempt: Callable[[Problem, Sequence[int], int, _Limit], _Attempt],
        watch: _Improvements | None,
        what: str,
        whole_share: float,
        halfway: bool = False,
        tighten: Callable[[list[list[int]], int, Sequence[int]], list[list[int]]] | None = None,
    ) -> None:
        self.problem, self.marginals, self.attempt = problem, marginals, attempt
        self.watch, self.what, self.whole_share = watch, what, whole_share
        self.halfway, self.tighten = halfway, tighten
        self.variables = self.constraints = 0
        flat = np.concatenate(marginals) if marginals else np.zeros(0)
        self.sorted = np.sort(flat[np.isfinite(flat)])  # (infinite: in no plan that fits)

    def run(
        self,
        best: _Found | None,
        bound: int,
        limit: _Limit,
        start: tuple[int, ...] = (),
        enough: int = -1,
    ) -> tuple[_Found | None, int, float]:
        """The best plan found (None: none fits), the bound proven and the work spent.
        `start`: where CP-SAT starts on the whole problem while no plan is found (the
        memory-aside optimum, which it repairs: `WHOLE_SHARE` says why); `enough`: a value
        at which to stop, once a plan reaches it."""
        spent, distance, first = 0.0, max(1, math.ceil(FIRST_GAP * abs(bound))), bound
        share, least, halfway = FIRST_SHARE, 0, self.halfway
        while best is None or (bound < best.value and best.value > enough):
            while first + distance <= bound:
                distance *= 2
            by_share = self.keeping(share)
            while by_share is not None and by_share <= bound:
                share *= 2
                by_share = self.keeping(share)
            reach = first + distance if by_share is None else min(first + distance, by_share)
            threshold = max(bound + 1, least, reach)
            distance, share = distance * 2, share * 2
            if best is not None and threshold >= best.value:
                threshold = best.value
            kept = self.tried(threshold, best, threshold == least)
            narrowed = self.problem if kept is None else self.problem.restricted(kept)
            if self.watch is not None:
                left = "all" if kept is None else f"{narrowed.variables} of"
                below = "" if kept is None else f": {self.what} below {self.watch.say(threshold)}?"
                self.watch.tracker.detail(f"CP-SAT on {left} {self.problem.variables} choices"
                                          f"{below}")  # fmt: skip
                self.watch.floor = bound
                self.watch.ceiling = math.inf if kept is None else threshold
            given = dataclasses.replace(limit, seconds=time_left(limit.seconds, spent))
            try:
                if kept is None and start:  # the whole problem: no bound, from a plan
                    got = self.attempt(narrowed, best.choice if best else start, 0, given)
                else:
                    got = self.attempt(narrowed, _renumbered(best, kept), bound, given)
            except _OutOfTime:
                if best is None:
                    raise
                return best, bound, spent + given.seconds
            spent += got.work
            self.variables, self.constraints = got.variables, got.constraints
            if got.value is not None:
                plan = _Found(_original(got.choice, kept), got.value)
                best = plan if best is None or plan.value < best.value else best
            if kept is None:  # the whole problem: what CP-SAT proved
                return best, max(bound, got.bound if got.value is not None else bound), spent
            if not got.optimal:
                return best, max(bound, min(got.bound, threshold)), spent
            # The optimum of the choices kept: none below the threshold elsewhere, nor below
            # it, or below the least value a choice left out allows (`beyond`), whichever
            # is lower: where that is the best's value, the best is the optimum.
            if got.value is not None and got.value < threshold:
                return best, got.value, spent
            proven = min(self.beyond(kept), math.inf if got.value is None else got.value)
            if proven == math.inf:  # every choice of a plan that fits was kept, and none fits
                return best, threshold, spent
            bound = threshold if proven <= threshold else int(proven)
            if best is None:
                continue
            if bound >= best.value:
                bound = best.value
            elif got.value is not None and (at_best := self.possible(best.value, best)) is not None:
                # One there, none below: its value next (bert's least peak on 2x4, from a
                # bound of 0: 21 tries doubling, 10.6 s; 1.5 s), unless that keeps most
                # choices: then halfway to it, once (DenseNet's dynamo export on 4x8 at 60 %:
                # 291 of 472 choices kept at the best's value, 207 halfway), but not past the
                # shares' next threshold, a try of fewer choices that may find a plan near
                # the optimum where the best is far from it (the 405B-class decoder on 16x8
                # at 60 %: tries of 185 and 370 choices found one 3.7 % under the best, then
                # 563 proved it, 5.9 s; halfway, 512 below 0.655 s took 3.4 s of 7.5; T5's
                # dynamo export on 4x8 at 60 %: 34 s, now 13 s); neither where it would send
                # CP-SAT the whole problem (T5 on 4x8 at 60 %: 1,360 of 2,727 choices kept by
                # the shares found a plan 5.4 % below the best, which the whole problem's 60
                # s had not).
                distance = max(distance, best.value - first)
                if halfway and self.many(at_best, MOST):
                    halfway, middle = False, (bound + best.value) // 2
                    by_share = self.keeping(share)
                    shares_first = by_share is not None and by_share < middle
                    if not shares_first and self.kept(middle, best) is not None:
                        least, distance = middle, middle - first
                elif self.narrowed(at_best) is not None:
                    share = 1.0
        return best, bound, spent

    def keeping(self, share: float) -> int | None:
        """The highest threshold keeping at most `share` of the choices (by their min-marginals
        alone); None where that is all of them: no threshold is too high (past every
        min-marginal, the choices `tighten` leaves may still be fewer)."""
        at = int(share * self.problem.variables)
        return None if at >= len(self.sorted) else math.floor(self.sorted[at])

    def kept(self, threshold: int, best: _Found | None) -> list[list[int]] | None:
        """The choices a plan below `threshold` may take, and the best plan's; None when
        they are `whole_share` of them or more (or when there are no min-marginals)."""
        return self.narrowed(self.possible(threshold, best))

    def possible(self, threshold: int, best: _Found | None) -> list[list[int]] | None:
        """The choices a plan below `threshold` may take, and the best plan's (None: no
        min-marginals)."""
        if self.marginals is None:
            return None
        return still_possible(self.marginals, threshold, best.choice if best else None)

    def tried(self, threshold: int, best: _Found | None, halfway: bool) -> list[list[int]] | None:
        """The choices the try below `threshold` holds: those a plan below it may take, and
        the best plan's, fewer (`tighten`) at the best plan's value or `halfway` to it; None
        where they are `whole_share` of them or more. Tightened, a try finds no plan above
        its threshold that needs a choice left out: at the best's value none is better, but
        a try at a threshold the shares set is also the search for plans better than the
        best (ResNet's training step on 2x4 at 45 %, its tries tightened everywhere: the
        optimum found only at the best's value, 14 % under it, 7.9 s against 3 s; T5 on 4x8
        at 75 %, its first try of 181 choices rather than 258 found a plan of 5.93e8 rather
        than 5.71e8, 32 s against 6 s)."""
        possible = self.possible(threshold, best)
        proving = best is not None and (halfway or threshold == best.value)
        if possible is not None and best is not None and self.tighten is not None and proving:
            possible = self.tighten(possible, threshold, best.choice)
        return self.narrowed(possible)

    def beyond(self, kept: list[list[int]]) -> float:
        """The highest threshold below which every plan takes only choices `kept` (their
        min-marginals alone say so; infinite where every choice left out is in no plan that
        fits): a try proving that none of them reaches a value below its optimum proves it of
        every plan below this too. The NeoX export on 4x8 at 5 % over its lowest budget: a try
        halfway to the best plan found none below it, and the next threshold, 1 above, kept
        the same 509 of 779 choices (3 s for the same answer)."""
        if self.marginals is None:
            return -math.inf
        out = [np.delete(m, k) for m, k in zip(self.marginals, kept, strict=True)]
        least = min((float(m.min()) for m in out if len(m)), default=math.inf)
        if least == math.inf:
            return math.inf
        # still_possible keeps a choice whose min-marginal is at most `below` - 1 plus its
        # rounding (relative: 10 at 1e10): the highest `below` leaving the least out is
        # one of these.
        highest = math.floor(least - ROUNDING * max(1.0, abs(least))) + 2
        for threshold in range(highest, highest - 4, -1):
            if _among(self.possible(threshold, None), kept):
                return threshold
        return -math.inf

    def narrowed(self, possible: list[list[int]] | None) -> list[list[int]] | None:
        """Those choices, or None where they are `whole_share` of them or more."""
        return None if possible is None or self.many(possible, self.whole_share) else possible

    def many(self, possible: list[list[int]], share: float) -> bool:
        """Whether these are `share` of the problem's choices or more."""
        return sum(map(len, possible)) >= share * self.problem.variables


@dataclass(frozen=True)
class _Found:
    """A plan found on the way, and its value (its cost, or its peak)."""

    choice: tuple[int, ...]
    value: int


def _among(choices: Sequence[Sequence[int]] | None, kept: Sequence[Sequence[int]]) -> bool:
    """Whether each group's `choices` (None: all) are among those `kept`."""
    return choices is not None and all(
        set(these) <= set(k) for these, k in zip(choices, kept, strict=True)
    )


def _fits(problem: Problem, choice: Sequence[int]) -> bool:
    return len(choice) == len(problem.sizes) and problem.peak(choice) <= problem.budget


def _rounded_up(bound: float) -> int:
    """A relaxation's float bound as an integer bound: its rounding error taken off first."""
    return math.ceil(bound - ROUNDING * max(1.0, abs(bound)))


def _renumbered(plan: _Found | None, kept: Sequence[Sequence[int]] | None) -> tuple[int, ...]:
    """A plan of the whole problem as a plan of its `restricted(kept)` (no hint where it
    takes a choice left out)."""
    if plan is None:
        return ()
    if kept is None:
        return plan.choice
    if any(k not in choices for choices, k in zip(kept, plan.choice, strict=True)):
        return ()
    return tuple(choices.index(k) for choices, k in zip(kept, plan.choice, strict=True))


def _original(choice: Sequence[int], kept: Sequence[Sequence[int]] | None) -> tuple[int, ...]:
    """A plan of `restricted(kept)` as a plan of the whole problem."""
    if kept is None:
        return tuple(choice)
    return tuple(choices[k] for choices, k in zip(kept, choice, strict=True))


def _memory_aside(problem: Problem, limit: _Limit, tracker: Tracker | None, unit: str) -> Solution:
    """The optimum with memory aside: exact elimination (`factors.minimize`) where its tables
    stay under its cap, of the choices that are no dead end (`factors.undominated`) where
    those of all do not; else CP-SAT on what is left once the groups of degree <= 2 are
    eliminated (the 32-layer decoder's training step on 2x4x8: its min-size order needs a
    table of 25 M entries, and even the best order of its core ~8e9 additions; of the
    choices no dead end, 2.9 M, and CP-SAT's 29 s become 12)."""
    started = time.perf_counter()
    if tracker is not None:
        tracker.detail(f"exact elimination of {len(problem.sizes)} groups, memory aside")
    exact = minimize(problem.sizes, problem_factors(problem))
    if exact is not None:
        objective = problem.objective(exact.choice)
        return Solution(
            choice=exact.choice, status=SolverStatus.OPTIMAL, objective=objective,
            bound=objective, wall_s=time.perf_counter() - started, variables=0, constraints=0,
        )  # fmt: skip
    alive = undominated(problem)
    if sum(map(len, alive)) < problem.variables:
        narrowed = problem.restricted(alive)
        if tracker is not None:
            tracker.detail(f"{narrowed.variables} of {problem.variables} choices no dead end, "
                           "memory aside")  # fmt: skip
        found = _memory_aside(narrowed, limit, tracker, unit)
        return dataclasses.replace(
            found, choice=_original(found.choice, alive), wall_s=time.perf_counter() - started
        )
    reduced, kept, order = eliminate(problem)
    # Elimination folds the groups it removes into the rest but for a constant: the costs of
    # those left with no neighbour. Any choice of the rest tells it.
    zeros = [0] * len(kept)
    offset = problem.objective(_expand(zeros, kept, order, len(problem.sizes)))
    offset -= reduced.objective(zeros)
    watch = None
    if tracker is not None:
        tracker.detail(f"CP-SAT on {len(reduced.sizes)} of {len(problem.sizes)} groups "
                       "(the rest eliminated), memory aside")  # fmt: skip
        watch = _Improvements(tracker, problem.unit, unit, offset)
    relaxed, _ = _cp_sat(reduced, limit, memory=False, watch=watch)
    choice = _expand(relaxed.choice, kept, order, len(problem.sizes))
    objective = problem.objective(choice)
    proven = relaxed.status is SolverStatus.OPTIMAL
    bound = objective if proven else relaxed.bound + offset
    return dataclasses.replace(relaxed, choice=choice, objective=objective, bound=bound)


def _told(solution: Solution, tracker: Tracker | None, scale: float, unit: str) -> Solution:
    """The solve's end as the plan records it, told (CP-SAT's callbacks may not see the bound
    close on the optimum)."""
    if tracker is not None:
        tracker.solution(solution.objective * scale, solution.bound * scale, unit)
    return solution


def time_left(time_limit: float, spent: float) -> float:
    """What a later solve may use of `time_limit` after `spent`: the rest, and at least a
    tenth (a solve given nothing finds nothing)."""
    return max(time_limit - spent, time_limit / 10)


class _Improvements(cp_model.CpSolverSolutionCallback):
    """Tells a tracker each better plan and each better bound of the CP-SAT solves it
    watches, as (CP-SAT's value + offset) * scale. It reads the solver's state and changes
    nothing. `best` may start at a plan found before; the bounds told are at least `floor`
    (a bound proven before) and at most `ceiling` (a narrowed solve's bound holds for the
    whole problem only up to its threshold); while a solve holds fewer memory rows than its
    problem, the plans told are those `fits` accepts."""

    def __init__(
        self, tracker: Tracker, scale: float, unit: str, offset: int = 0, best: int | None = None
    ) -> None:
        super().__init__()
        self.tracker, self.scale, self.unit, self.offset = tracker, scale, unit, offset
        self.best: float | None = best
        self.floor, self.ceiling = -math.inf, math.inf
        self.fits: Callable[[cp_model.CpSolverSolutionCallback], bool] | None = None

    def on_solution_callback(self) -> None:
        value = self.objective_value
        if self.fits is None or self.fits(self):  # (a solve of fewer rows: some do not)
            self.best = value if self.best is None else min(self.best, value)
        self.bound(self.best_objective_bound)

    def bound(self, bound: float) -> None:
        if not math.isfinite(bound):  # no bound proven yet
            return
        objective = None if self.best is None else (self.best + self.offset) * self.scale
        bound = min(max(bound, self.floor), self.ceiling)
        self.tracker.solution(objective, (bound + self.offset) * self.scale, self.unit)

    def say(self, value: int) -> str:
        """A value of the objective as the tracker is told it."""
        return f"{(value + self.offset) * self.scale:.4g} {self.unit}"


def _run(
    solver: cp_model.CpSolver, model: cp_model.CpModel, watch: _Improvements | None
) -> cp_model.CpSolverStatus:
    if watch is None:
        return solver.solve(model)
    solver.best_bound_callback = watch.bound
    return solver.solve(model, watch)


@dataclass(frozen=True)
class _Limit:
    """The deterministic seconds one solve may use, the user's `--time-limit` they are part of,
    and which solve it is: what the error says when the solve stops without a plan."""

    seconds: float
    of: float
    solve: str


def _cp_sat(
    problem: Problem,
    limit: _Limit,
    memory: bool,
    hint: Sequence[int] = (),
    watch: _Improvements | None = None,
    rows: np.ndarray | None = None,
) -> tuple[Solution, np.ndarray | None]:
    """CP-SAT on `problem`, its memory rows too where `memory`; and the rows its last model
    held (None: all). Given `rows` (those that bind the relaxation, or that a solve before
    held), the model holds those alone at first, and the rows its plan goes over join it for
    the next solve, until the plan fits them all (row generation: a model of fewer rows has no
    higher optimum, so a plan of it that fits every row and that it proves optimal is the
    optimum, and its bound holds for the whole). A training step's rows are thousands of
    hundreds of terms each, a few hundred bind (the decoder's on 4x8 at 12 GiB: 10,228 and
    451), and building the whole model took 3 s a try. BART on 4x8 at 60 %: three narrowed
    tries, each solved twice from the relaxation's rows, 6.8 s; from the rows of the try
    before, the last two once, 4.7 s.

    A bound proven elsewhere is not written into the model (the objective at least it):
    OR-Tools 9.15's presolve, given one, can cut the optimum off (or-tools#5293, in
    `ProcessAtMostOneAndLinear`). A narrowed gpt2_dynamo problem on 4x8 at its lowest budget
    (162 choices, the 24 rows binding its relaxation), whose optimum is 3,330,816,595: its 60
    s ran to a plan of 3,435,479,089 and a "bound" of 3,435,479,036
    (`test_a_narrowed_solve_finds_its_optimum`). Without the bound CP-SAT is as fast or faster
    on every memory-bound row of bench/plan_memory.py and of the 32-layer decoder
    (deterministic seconds summed per row)."""
    among = rows if memory else None
    started, work, bound = time.perf_counter(), 0.0, -math.inf
    while True:
        model, x = ilp_model(problem, memory, hint, among)
        given = dataclasses.replace(limit, seconds=limit.seconds - work)
        solver = _solver(max(given.seconds, 0.0))
        if watch is not None:
            watch.fits = None if among is None else _fitting_plans(problem, x, problem.budget)
        status = _run(solver, model, watch)
        work += solver.response_proto.deterministic_time
        if status == cp_model.INFEASIBLE:
            raise _NoPlan(work)
        choice = _chosen(solver, status, x, given)
        bound = max(bound, solver.best_objective_bound)
        if among is None:  # every row in the model
            break
        over = np.flatnonzero(problem.live(choice) > problem.budget)
        if not len(over):
            break
        if watch is not None:  # the next solve's bound starts lower
            watch.floor = max(watch.floor, bound)
        if work >= limit.seconds:
            raise _OutOfTime(_out_of_time(given, "FEASIBLE"))
        among = np.union1d(among, over)
    optimal = status == cp_model.OPTIMAL
    proto = model.proto
    solved = Solution(
        choice=choice,
        status=SolverStatus.OPTIMAL if optimal else SolverStatus.FEASIBLE,
        objective=problem.objective(choice),
        bound=bound,
        wall_s=time.perf_counter() - started,
        variables=len(proto.variables),
        constraints=len(proto.constraints),
        work=work,
    )
    return solved, among


def _fitting_plans(
    problem: Problem, x: list[list[cp_model.IntVar]], budget: int | None
) -> Callable[[cp_model.CpSolverSolutionCallback], bool]:
    """Whether the plan a solve of fewer memory rows found holds at most `budget` in them all
    (None: its objective, the least peak's peak)."""

    def fits(solution: cp_model.CpSolverSolutionCallback) -> bool:
        most = solution.objective_value if budget is None else budget
        return problem.peak(_read(solution.value, x)) <= most

    return fits


def ilp_model(
    problem: Problem,
    memory: bool,
    hint: Sequence[int] = (),
    among: np.ndarray | None = None,
) -> tuple[cp_model.CpModel, list[list[cp_model.IntVar]]]:
    """The ILP of the module's docstring as a CP-SAT model (the memory rows too where
    `memory`: those in `among`, or all), and its one-hot variables x[g][k]: what `_cp_sat`
    solves, and what `bench/relaxation_gap.py` relaxes to an LP."""
    model = cp_model.CpModel()
    x = _one_hot(model, problem)
    _hint(model, x, hint)
    objective = [
        cost * var
        for costs, row in zip(problem.node_costs, x, strict=True)
        for cost, var in zip(costs, row, strict=True)
        if cost
    ]
    for a, b, matrix in problem.edges:
        rows, row_of = _classes(matrix)
        columns, column_of = _classes(list(zip(*matrix, strict=True)))
        if all(c == 0 for row in rows for c in row):
            continue
        y = [[model.new_bool_var(f"y{a}_{b}_{r}_{c}") for c in range(len(columns))]
             for r in range(len(rows))]  # fmt: skip
        for r, cells in enumerate(y):
            members = [x[a][k] for k, cls in enumerate(row_of) if cls == r]
            model.add(sum(cells) == sum(members))
        for c in range(len(columns)):
            members = [x[b][k] for k, cls in enumerate(column_of) if cls == c]
            model.add(sum(y[r][c] for r in range(len(rows))) == sum(members))
        objective += [
            rows[r][column_members[0]] * y[r][c]
            for c, column_members in enumerate(_members(column_of, len(columns)))
            for r in range(len(rows))
            if rows[r][column_members[0]]
        ]
    if memory:
        for bytes_live in _memory_rows(model, problem, x, problem.budget, among):
            model.add(bytes_live <= problem.budget)
    model.minimize(sum(objective))
    return model, x


def _one_hot(model: cp_model.CpModel, problem: Problem) -> list[list[cp_model.IntVar]]:
    """x[g][k]: group g takes choice k; exactly one per group."""
    x = [[model.new_bool_var(f"x{g}_{k}") for k in range(n)] for g, n in enumerate(problem.sizes)]
    for one_hot in x:
        model.add_exactly_one(one_hot)
    return x


def _hint(model: cp_model.CpModel, x: list[list[cp_model.IntVar]], hint: Sequence[int]) -> None:
    """Start CP-SAT's search from a choice per group (none: no hint)."""
    for row, k in zip(x, hint, strict=False):
        for j, var in enumerate(row):
            model.add_hint(var, j == k)


def _memory_rows(
    model: cp_model.CpModel,
    problem: Problem,
    x: list[list[cp_model.IntVar]],
    above: int,
    among: np.ndarray | None = None,
    hint: Sequence[int] = (),
) -> list[cp_model.LinearExpr]:
    """The bytes of each memory row (of those `among`, or all) that may hold more than
    `above` as a linear expression (the others cannot bind: a narrowed problem's choices
    leave most rows of a training step under the budget, and each row is hundreds of terms),
    with a variable for each indicator those rows use. An indicator is a variable bounded
    on one side only: where rows add its bytes (bounded from above by the budget), from below
    (an AND by the sum of its literals less their number plus one, an OR by each literal);
    where they take bytes off (`search.memory`'s savings), from above (an AND by each literal,
    an OR by their sum). Either way any plan that fits can set it to its true value, and a
    solver setting it otherwise only makes its rows larger (`search.memory`). The literals of
    an indicator are bounded as it is (ANDs and ORs are monotone). Given a `hint` (a plan),
    each variable is hinted its value under it."""
    which = rows_over(problem, above)
    if among is not None:
        which = np.intersect1d(which, among)
    if not len(which):
        return []
    made: dict[int, cp_model.IntVar] = {}

    def literal(lit: Chosen | int) -> cp_model.LinearExprT:
        if isinstance(lit, Chosen):
            return cp_model.LinearExpr.sum([x[lit.group][k] for k in sorted(lit.choices)])
        return made[lit]

    adds, takes = _polarity(problem, which)
    values = problem.indicator_table.values(hint) if hint else np.zeros(0, bool)
    for i, ind in enumerate(problem.indicators):
        if not (adds[i] or takes[i]):  # in none of these rows
            continue
        var = model.new_bool_var(f"m{i}")
        if hint:
            model.add_hint(var, bool(values[i]))
        terms = [literal(lit) for lit in ind.literals]
        if adds[i]:
            if ind.every:
                model.add(var >= sum(terms) - (len(terms) - 1))
            else:
                for term in terms:
                    model.add(var >= term)
        if takes[i]:
            if ind.every:
                for term in terms:
                    model.add(var <= term)
            else:
                model.add(var <= sum(terms))
        made[i] = var
    # Savings of one thing under exclusive choices (ANDs of one literal on one group, its
    # choices disjoint, with the same rest: the home tensor held in shardings of each size,
    # dead) hold one at a time, and only where the rest does: their sum is at most it.
    for rest, members in _exclusive_ands(problem.indicators, takes):
        model.add(sum(made[i] for i in members) <= literal(rest))

    # A group's bytes in a row (a run: the values of that group live there) as one variable,
    # shared by every row holding the same: rows of a term per group, not per choice.
    held: dict[tuple[int, bytes, bytes], cp_model.IntVar] = {}

    def run_bytes(rows: MemoryRows, run: int) -> cp_model.IntVar:
        group = int(rows.run_group[run])
        first, last = rows.run_starts[run], rows.run_starts[run + 1]
        choices, amounts = rows.choices[first:last], rows.amounts[first:last]
        key = (group, choices.tobytes(), amounts.tobytes())
        if key not in held:
            low, high = int(amounts.min(initial=0)), int(amounts.max(initial=0))
            var = model.new_int_var(low, high, f"g{group}_{len(held)}")
            terms = list(zip(choices.tolist(), amounts.tolist(), strict=True))
            model.add(var == sum(b * x[group][k] for k, b in terms))
            if hint:
                model.add_hint(var, sum(b for k, b in terms if k == hint[group]))
            held[key] = var
        return held[key]

    def bytes_of(rows: MemoryRows, which: Sequence[int]) -> list[cp_model.LinearExpr]:
        made_runs: dict[int, cp_model.IntVar] = {}
        runs, starts = rows.runs.tolist(), rows.starts.tolist()
        marks, indices = rows.indicated_starts.tolist(), rows.indicated.tolist()
        amounts = rows.indicated_amounts.tolist()
        found = []
        for r in which:
            groups = []
            for u in runs[starts[r] : starts[r + 1]]:
                if u not in made_runs:
                    made_runs[u] = run_bytes(rows, u)
                groups.append(made_runs[u])
            indicated = [made[i] for i in indices[marks[r] : marks[r + 1]]]
            weights = [1] * len(groups) + amounts[marks[r] : marks[r + 1]]
            expr = cp_model.LinearExpr.weighted_sum(groups + indicated, weights)
            found.append(expr + int(rows.fixed[r]))
        return found

    (base,) = bytes_of(problem.memory_base, [0])
    return [base + row for row in bytes_of(problem.memory, which.tolist())]


def rows_over(problem: Problem, above: int) -> np.ndarray:
    """The memory rows that may hold more than `above` under some choice: those CP-SAT's
    model constrains (`_memory_rows`), in order."""
    return np.flatnonzero(problem.most() > above)


def _exclusive_ands(
    indicators: Sequence[Indicator], takes: Sequence[bool]
) -> list[tuple[int, list[int]]]:
    """Indicators bounded from above that hold one at a time, and only where another does:
    ANDs of a `Chosen` and an indicator `rest`, two or more with the same rest and disjoint
    choices of one group; as (rest, the ANDs)."""
    found: dict[tuple[int, int], list[int]] = {}
    for i, ind in enumerate(indicators):
        if takes[i] and ind.every and len(ind.literals) == 2:
            chosen, rest = ind.literals
            if isinstance(chosen, Chosen) and not isinstance(rest, Chosen):
                found.setdefault((rest, chosen.group), []).append(i)
    sums = []
    for (rest, _), members in found.items():
        choices = [
            lit.choices for i in members if isinstance(lit := indicators[i].literals[0], Chosen)
        ]
        if len(members) > 1 and sum(map(len, choices)) == len(frozenset().union(*choices)):
            sums.append((rest, members))
    return sums


def _polarity(problem: Problem, which: np.ndarray) -> tuple[list[bool], list[bool]]:
    """For each indicator, whether the base row or a row of `which` adds bytes when it holds,
    and whether one takes bytes off, directly or through an indicator it is a literal of
    (neither: those rows do not use it)."""
    count = len(problem.indicators)
    adding, taking = np.zeros(count, bool), np.zeros(count, bool)
    for rows, selected in ((problem.memory_base, np.zeros(1, np.int64)), (problem.memory, which)):
        marks, selected = rows.marks, np.sort(selected)
        # A span's term is used where a row selected lies within it.
        within = np.searchsorted(selected, marks.last, "right")
        used = within > np.searchsorted(selected, marks.first)
        indicated, amounts = marks.key[used], marks.amount[used]
        adding[indicated[amounts > 0]] = True
        taking[indicated[amounts < 0]] = True
    adds, takes = adding.tolist(), taking.tolist()
    for i in reversed(range(len(problem.indicators))):  # users come after their literals
        for lit in problem.indicators[i].literals:
            if not isinstance(lit, Chosen):
                adds[lit] |= adds[i]
                takes[lit] |= takes[i]
    return adds, takes


def _chosen(
    solver: cp_model.CpSolver,
    status: cp_model.CpSolverStatus,
    x: list[list[cp_model.IntVar]],
    limit: _Limit,
) -> tuple[int, ...]:
    """The choice per group of a solve that found a plan."""
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise _OutOfTime(_out_of_time(limit, solver.status_name(status)))
    return _read(solver.value, x)


def _read(
    value: Callable[[cp_model.IntVar], int], x: list[list[cp_model.IntVar]]
) -> tuple[int, ...]:
    """The choice per group of a solution, from the value of each one-hot variable."""
    return tuple(next(k for k, v in enumerate(row) if value(v)) for row in x)


def _out_of_time(limit: _Limit, status: str) -> str:
    share = f"{limit.seconds:.2g} s left for the {limit.solve} solve, "
    return (
        f"the solver found no plan within --time-limit {limit.of:g} s "
        f"({share if limit.seconds < limit.of else ''}{status}); raise --time-limit"
    )


def _solver(time_limit: float) -> cp_model.CpSolver:
    """Deterministic settings. Probing in presolve only (level 1), the LP the full
    linearization (its bound is what proves optimality here). Probing's deterministic time
    is charged above its wall time, the search's below: the slowest memory-bound solves of
    the zoo (12 rows at and over the lowest budget and training steps at 45-60 %, two
    processes on 2 cores) took 448 s without probing, 335-344 s with level 1 (333 s with
    level 2, the default, which swings more: a T5 training step's narrowed try 30 -> 34 s,
    with level 1 11 s)."""
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    solver.parameters.max_deterministic_time = time_limit
    solver.parameters.cp_model_probing_level = 1
    solver.parameters.linearization_level = 2
    return solver


@dataclass(frozen=True, kw_only=True)
class LowestBudget:
    """The least memory per device any plan needs (`peak`, reached by `choice`) and the bound
    the solver proved: OPTIMAL when `bound == peak`."""

    peak: int
    bound: int
    status: SolverStatus
    choice: tuple[int, ...]
    work: float = 0.0  # deterministic seconds the solver spent


def lowest_budget(
    problem: Problem,
    time_limit: float = 60.0,
    tracker: Tracker | None = None,
    of: float | None = None,
    enough: int = -1,
) -> LowestBudget:
    """The smallest peak memory any choice reaches. The rows' weighted sums relaxed
    (`lagrange.least_peak`) give a bound and plans; CP-SAT minimizes the peak over the
    choices a plan of a lower peak may take (`_Narrowing`), from the least found. `of`: the
    user's `--time-limit`, where `time_limit` is what is left of it; `enough`: a peak at
    which to stop (FEASIBLE), once a plan reaches it."""
    if tracker is not None:
        tracker.detail("the least memory any plan needs: the rows' weighted sums relaxed")
    relaxation = peak_relaxation(problem)
    found = least_peak(problem, relaxation=relaxation)
    best, bound, marginals = None, 0, None
    if found is not None and found.best is not None:
        best = _Found(found.best.choice, found.best.peak)
        marginals = peak_marginals(relaxation, found)
        # A plan's peak is at least each of its choices' least: the least choice of a group
        # bounds them all.
        least = [float(m.min()) for m in marginals or ()]
        bound = max(0, _rounded_up(max([found.bound, *least])))
    watch = None
    if tracker is not None:
        watch = _Improvements(tracker, 1.0, "B", best=best.value if best else None)

    joined = None  # the rows the tries' models held, for the next

    def attempt(narrowed: Problem, hint: Sequence[int], at_least: int, limit: _Limit) -> _Attempt:
        nonlocal joined
        got, joined = _least_peak(narrowed, limit, watch, hint, at_least, joined)
        return got

    search = _Narrowing(problem, marginals, attempt, watch, "the peak", 1.0)
    limit = _Limit(time_limit, time_limit if of is None else of, "lowest-budget")
    best, bound, work = search.run(best, bound, limit, enough=enough)
    assert best is not None  # the least peak is always some plan's
    bound = min(bound, best.value)
    status = SolverStatus.OPTIMAL if bound == best.value else SolverStatus.FEASIBLE
    return LowestBudget(
        peak=best.value, bound=bound, status=status, choice=best.choice, work=work
    )  # fmt: skip


def _least_peak(
    problem: Problem,
    limit: _Limit,
    watch: _Improvements | None,
    hint: Sequence[int] = (),
    at_least: int = 0,
    joined: np.ndarray | None = None,
) -> tuple[_Attempt, np.ndarray | None]:
    """CP-SAT on the least peak: from `hint`, no less than `at_least` (a bound proven); and
    the rows its last model held (None: all). From a hint, the model holds at first the rows
    the hint holds `at_least` or more in (any other may be the peak of a plan below the best,
    but few are), and the rows its plan goes over join it for the next solve, until its
    plan's peak is its optimum (row generation, as in `_cp_sat`: a model of fewer rows has no
    higher optimum). The rows that joined a try's model start the next's (`joined`; they are
    the rows of the whole problem too). Without a hint, every row that may go over the bound.
    The 32-layer decoder's training step on 4x8 (batch 32, at 40 GB): 10,228 rows may go over
    the bound, the relaxation's best plan holds it in 187, and 11 more joined; the lowest
    budget proven in 11 s, 144 s with every row (two solves of 47 and 80 s)."""
    among = None
    if hint:
        among = np.flatnonzero(problem.live(hint) >= at_least)
        among = among if joined is None else np.union1d(among, joined)
    best, bound, work = tuple(hint), at_least, 0.0
    reached = problem.peak(best) if best else None
    while True:
        model, x = least_peak_model(problem, best, at_least, among)
        solver = _solver(max(limit.seconds - work, 0.0))
        if watch is not None:
            watch.fits = None if among is None else _fitting_plans(problem, x, None)
        status = _run(solver, model, watch)
        work += solver.response_proto.deterministic_time
        if best and status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            break  # out of time: the best plan so far
        choice = _chosen(solver, status, x, limit)
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
    proto = model.proto
    got = _Attempt(
        best, reached, bound, bound == reached, work, len(proto.variables), len(proto.constraints)
    )
    return got, among


def least_peak_model(
    problem: Problem,
    hint: Sequence[int] = (),
    at_least: int = 0,
    among: np.ndarray | None = None,
) -> tuple[cp_model.CpModel, list[list[cp_model.IntVar]]]:
    """The least peak as a CP-SAT model: each row (of those `among`, or all) that may hold
    more than `at_least` at most the peak, minimized; and its one-hot variables x[g][k]. A
    `hint` is given whole: its peak, and each indicator and group's bytes as the plan sets
    them. Of its choices alone, CP-SAT set the others to a plan of a higher peak and searched
    its way back (T5 on 4x8: 2,177,946 B where the hint's peak is 2,145,178 B, found again
    after 8.8 s; proven in 2.7 s from the whole hint)."""
    model = cp_model.CpModel()
    x = _one_hot(model, problem)
    _hint(model, x, hint)
    top = int(problem.most().max(initial=problem.memory_base.most()[0]))
    low, high = min(at_least, max(top, 1)), max(top, 1)
    peak = model.new_int_var(low, high, "peak")
    if hint:
        model.add_hint(peak, min(max(problem.peak(hint), low), high))
    for bytes_live in _memory_rows(model, problem, x, low, among, hint):
        model.add(bytes_live <= peak)
    model.minimize(peak)
    return model, x


def _classes(rows: Sequence[Sequence[int]]) -> tuple[list[tuple[int, ...]], list[int]]:
    """The distinct rows, and the class of each row."""
    index: dict[tuple[int, ...], int] = {}
    of = [index.setdefault(tuple(row), len(index)) for row in rows]
    return list(index), of


def _members(of: Sequence[int], count: int) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(count)]
    for k, cls in enumerate(of):
        out[cls].append(k)
    return out


# ---- exact elimination of low-degree groups ----------------------------------------------------


@dataclass(frozen=True)
class _Eliminated:
    """Group g, removed given its neighbours' choices: `best[k1][k2]` (or `best[k1]`, or
    `best[0]`) is its optimal choice for neighbour choices k1 (k2)."""

    group: int
    neighbours: tuple[int, ...]
    best: np.ndarray


def eliminate(problem: Problem) -> tuple[Problem, list[int], list[_Eliminated]]:
    """Remove groups of degree <= 2 by exact min-sum elimination (variable elimination on the
    pairwise cost graph): a leaf g of neighbour h adds min_kg (node_g + M[kh][kg]) to h; a
    chain link g between h1 and h2 adds min_kg (node_g + M1[k1][kg] + M2[kg][k2]) as an edge
    (h1, h2); a group with one choice adds its edges to its neighbours, whatever its degree.
    The optimum of the rest, plus the recorded argmins, is the optimum of the whole. Only valid
    without memory rows (they couple groups beyond the edges). Returns the reduced problem, the
    original group of each of its groups, and the eliminations in order."""
    node = [np.array(c, dtype=np.int64) for c in problem.node_costs]
    edges: dict[tuple[int, int], np.ndarray] = {}

    def add(a: int, b: int, m: np.ndarray) -> None:
        if a > b:
            a, b, m = b, a, m.T
        edges[(a, b)] = edges[(a, b)] + m if (a, b) in edges else m.copy()

    for a, b, m in problem.edges:
        if a == b:  # pragma: no cover - the builder folds these into node costs
            node[a] += np.diag(np.array(m))
        else:
            add(a, b, np.array(m, dtype=np.int64))
    alive = set(range(len(node)))
    order: list[_Eliminated] = []

    def neighbours(g: int) -> list[int]:
        return sorted({b if a == g else a for a, b in edges if g in (a, b)})

    def matrix(g: int, h: int) -> np.ndarray:  # rows: h's choices, columns: g's
        return edges[(h, g)] if (h, g) in edges else edges[(g, h)].T

    progress = True
    while progress:
        progress = False
        for g in sorted(alive):
            near = neighbours(g)
            if len(node[g]) == 1:  # no choice: its edges are costs of its neighbours' choices
                for h in near:
                    node[h] = node[h] + matrix(g, h)[:, 0]
                near, best = [], np.zeros(1, dtype=np.int64)
            elif len(near) > 2:
                continue
            elif not near:
                best = np.array([int(np.argmin(node[g]))])
            elif len(near) == 1:
                (h,) = near
                total = matrix(g, h) + node[g][None, :]
                best = np.argmin(total, axis=1)
                node[h] = node[h] + total[np.arange(len(best)), best]
            else:
                h1, h2 = near
                total = (
                    matrix(g, h1)[:, :, None] + node[g][None, :, None] + matrix(g, h2).T[None]
                )  # [k1, kg, k2]
                best = np.argmin(total, axis=1)
                add(h1, h2, np.take_along_axis(total, best[:, None, :], axis=1)[:, 0, :])
            for key in [k for k in edges if g in k]:
                del edges[key]
            alive.discard(g)
            order.append(_Eliminated(g, tuple(near), best))
            progress = True
            break
    kept = sorted(alive)
    index = {g: i for i, g in enumerate(kept)}
    reduced = Problem(
        tuple(len(node[g]) for g in kept),
        tuple(tuple(int(c) for c in node[g]) for g in kept),
        tuple(
            (index[a], index[b], tuple(tuple(int(c) for c in row) for row in m))
            for (a, b), m in sorted(edges.items())
        ),
        NO_ROWS,
        problem.budget,
        problem.unit,
    )
    return reduced, kept, order


def _expand(choice_of_kept: Sequence[int], kept: Sequence[int], order: Sequence[_Eliminated],
            groups: int) -> tuple[int, ...]:  # fmt: skip
    """Choices of every group: the kept ones as solved, the eliminated ones from their
    recorded argmins, in reverse elimination order."""
    choice = [-1] * groups
    for g, k in zip(kept, choice_of_kept, strict=True):
        choice[g] = k
    for step in reversed(order):
        picks = [choice[h] for h in step.neighbours]
        choice[step.group] = int(step.best[tuple(picks)] if picks else step.best[0])
    return tuple(choice)
