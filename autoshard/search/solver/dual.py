"""The relaxation's multipliers, stepped: projected subgradient steps with Polyak's step length
towards the best plan that fits (`dual`), or on the simplex towards the least peak found
(`least_peak`); each step also moves the mix of each wide indicator's bounds towards the one
highest at its plan. Iteration counts and counted work decide, never the clock, but for the
command's wall-clock deadline: once it has passed, no step more (the bound and plans so far
stand)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autoshard.deadline import NEVER, Deadline
from autoshard.search.problem import Problem
from autoshard.search.solver import tuning
from autoshard.search.solver.bounds import Shares
from autoshard.search.solver.relaxation import Relaxation, Relaxed, peak_relaxation


@dataclass(frozen=True)
class Dual:
    """What the multipliers found: the best bound (no plan that fits costs less), the cheapest
    plan that fits among the minima (None when none did) and the multipliers of the bound."""

    bound: float
    best: Relaxed | None
    multipliers: np.ndarray
    iterations: int
    infeasible: bool = False  # the bound exceeds what any plan costs: none fits
    shares: Shares | None = None  # the mix of the indicators' options at the bound


def dual(
    problem: Problem,
    iterations: int = tuning.ITERATIONS,
    work: int = tuning.WORK,
    relaxation: Relaxation | None = None,
    start: np.ndarray | None = None,
    longer: int = 0,
    shares: Shares | None = None,
    deadline: Deadline = NEVER,
) -> Dual | None:
    """The best bound the multipliers reach in `iterations` subgradient steps (fewer when
    their subproblems' `work` adds up to more), and the cheapest plan that fits among the
    minima on the way (None when a subproblem is too big). `relaxation`: the problem's, if
    made already; `start`: the multipliers to step from (none: zeros), and `shares` the mix
    of the indicators' options (none: as they start), which each step moves too
    (`_stepped_shares`); `longer`: steps more, at most, `RISE_STEPS` at a time
    while they still raise the bound by `RISE`; none after the first once `deadline` has
    passed."""
    relaxation = relaxation or Relaxation(problem)
    # No plan costs more: a bound above it proves that none fits.
    most = sum(max(costs) for costs in problem.node_costs) + sum(
        max(max(row) for row in m) for _, _, m in problem.edges
    )
    multipliers = np.zeros(relaxation.rows) if start is None else start
    best: Relaxed | None = None
    steps, spent, reach = _Steps(multipliers), 0, tuning.REACH
    bounds: list[float] = []
    done = 0
    while done < iterations:
        done += 1
        relaxed = relaxation.solve(multipliers, shares)
        if relaxed is None:
            return None
        spent += relaxed.work
        if relaxed.peak <= problem.budget and (best is None or relaxed.objective < best.objective):
            best = relaxed
        rose = relaxed.value > steps.bound
        steps.saw(relaxed.value, multipliers, shares)
        bound = steps.bound
        reach = reach * 2 if rose else max(tuning.REACH, reach / 2)
        if best is not None and best.objective - bound < 1:
            break
        if bound > most * (1 + tuning.ROUNDING) + 1:
            return Dual(bound, None, steps.at, done, infeasible=True, shares=steps.shares)
        direction = relaxed.excess.astype(np.float64)
        direction[(multipliers <= 0) & (direction < 0)] = 0.0
        norm = float(direction @ direction)
        if norm == 0 or spent >= work or deadline.passed():  # (norm 0: no multiplier can change)
            break
        shares = _stepped_shares(relaxed, shares, _share_step(done))
        target = best.objective if best is not None else bound + max(reach * abs(bound), 1.0)
        length = steps.length * (target - relaxed.value) / norm
        multipliers = np.maximum(0.0, multipliers + length * direction)
        bounds.append(bound)
        if done == iterations and longer > 0 and _rising(bounds):
            grant = min(tuning.RISE_STEPS, longer)
            iterations, longer = iterations + grant, longer - grant
    return Dual(steps.bound, best, steps.at, done, shares=steps.shares)


def _stepped_shares(relaxed: Relaxed, shares: Shares | None, step: float) -> Shares:
    """The shares of the options of each indicator the subproblem bounded (`shares`, else
    as they start) moved by `step` towards the one option that bounds it best at its
    minimum, `relaxed` (so that the next subproblem's minimum is higher there): the
    greatest from below, the least from above. Any mix is a bound, so the steps only
    move the subproblem, as the multipliers do."""
    moved = dict(shares or {})
    for i, weight, options in relaxed.bounded:
        if len(options.start) == 1:
            continue
        values = options.values(relaxed.choice)
        best = int(np.argmin(values) if weight < 0 else np.argmax(values))
        mix = (1.0 - step) * options.mix(shares, i)
        mix[best] += step
        moved[i] = (options, mix)
    return moved


def _share_step(done: int) -> float:
    """How far the `done`-th step moves the mix of each wide indicator's options towards the
    one that bounds it best at the step's plan (`_stepped_shares`): 1 / (done + 1), so that
    the mix is the mean of the options that were best (the start counted once) and settles.
    Moved half way each step instead, it stops short of the best mix
    (`test_the_mix_of_an_ors_options_moves_the_bound_to_its_best`)."""
    return 1.0 / (done + 1)


def _rising(bounds: Sequence[float]) -> bool:
    """Whether the last `RISE_STEPS` steps raised the bound by `RISE` of it or more."""
    if len(bounds) <= tuning.RISE_STEPS:
        return False
    before = bounds[-1 - tuning.RISE_STEPS]
    return bounds[-1] - before >= tuning.RISE * abs(before)


def least_peak(
    problem: Problem,
    iterations: int = tuning.ITERATIONS,
    work: int = tuning.WORK,
    relaxation: Relaxation | None = None,
    deadline: Deadline = NEVER,
) -> Dual | None:
    """The least peak any plan reaches, bounded from below: for weights mu on the simplex,
    min_x sum_r mu_r bytes_r(x) <= min_x max_r bytes_r(x). Projected subgradient steps on the
    simplex with Polyak's length towards the least peak found; `best` is the plan of the
    least peak among the minima (its `peak`), `bound` the best bound. `relaxation`: the
    problem's `peak_relaxation`, if made already; no step after the first once `deadline`
    has passed."""
    relaxation = relaxation or peak_relaxation(problem)
    rows = relaxation.rows
    if rows == 0:
        return None
    weights = np.full(rows, 1.0 / rows)
    best: Relaxed | None = None
    steps, spent, done = _Steps(weights), 0, 0
    probes: list[np.ndarray] = []
    shares: Shares | None = None
    while done < iterations:
        at = probes.pop() if probes else weights
        done += 1
        relaxed = relaxation.solve(at, shares)
        if relaxed is None:
            return None
        spent += relaxed.work
        if best is None or relaxed.peak < best.peak:
            best = relaxed
        if done == 1:  # the rows at the first plan's peak, each alone, next
            peak_rows = np.argsort(-relaxed.excess, kind="stable")[: tuning.PEAK_ROWS]
            probes = [np.eye(1, rows, int(r))[0] for r in reversed(peak_rows.tolist())]
        steps.saw(relaxed.value, at, shares)
        if best.peak - steps.bound < 1 or spent >= work or deadline.passed():
            break
        if at is not weights:  # a probe: no step from it
            continue
        shares = _stepped_shares(relaxed, shares, _share_step(done))
        direction = relaxed.excess.astype(np.float64)
        direction -= direction.mean()  # along the simplex
        norm = float(direction @ direction)
        if norm == 0:
            break
        length = steps.length * (best.peak - relaxed.value) / norm
        weights = _onto_simplex(weights + length * direction)
    return Dual(steps.bound, best, steps.at, done, shares=steps.shares)


class _Steps:
    """The best bound so far and the multipliers `at` which it was reached, and the
    subgradient's step length: halved after `STALLED` steps that did not raise the bound."""

    def __init__(self, start: np.ndarray) -> None:
        self.bound, self.at, self.length, self.stalled = -math.inf, start, 1.0, 0
        self.shares: Shares | None = None

    def saw(self, value: float, at: np.ndarray, shares: Shares | None = None) -> None:
        """One subproblem's value, at these multipliers and shares."""
        if value > self.bound:
            self.bound, self.at, self.shares, self.stalled = value, at, shares, 0
            return
        self.stalled += 1
        if self.stalled >= tuning.STALLED:
            self.length, self.stalled = self.length / 2, 0


def _onto_simplex(v: np.ndarray) -> np.ndarray:
    """The nearest point of the simplex {w >= 0, sum w = 1} (sort-based projection)."""
    u = np.sort(v)[::-1]
    cumulative = np.cumsum(u) - 1.0
    k = np.nonzero(u - cumulative / np.arange(1, len(v) + 1) > 0)[0][-1]
    return np.maximum(v - cumulative[k] / (k + 1), 0.0)
