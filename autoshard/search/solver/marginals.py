"""Reduced-cost fixing: the choices a plan below a threshold may take, from the relaxation's
min-marginals (`still_possible`), rows weighed alone (`rows_alone`, `peak_marginals`,
`fitting_choices`), and the relaxation solved again on fewer choices for higher min-marginals
(`tightened`, `within_budget`) or with its large indicators exact (`strengthened`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from autoshard.deadline import NEVER, Deadline
from autoshard.search.problem import Problem
from autoshard.search.solver import tuning
from autoshard.search.solver.dual import Dual, dual
from autoshard.search.solver.outcome import (
    Found,
    in_whole,
    proven_infeasible,
    rounded_up,
)
from autoshard.search.solver.relaxation import Relaxation, peak_relaxation


def still_possible(
    marginals: Sequence[np.ndarray], below: int, keep: Sequence[int] | None = None
) -> list[list[int]]:
    """The choices of each group that a plan whose value is below `below` may take (and the
    choices `keep`, a plan's): choice k of group g is left out when the subproblem's minimum
    with k taken (`marginals[g][k]`, `Relaxation.min_marginals`) is `below` or more, since
    a plan's value (its cost, or its peak for `least_peak`'s relaxation) is at least the
    subproblem's at any multipliers, and both are integers (reduced-cost fixing)."""
    limit = below - 1 + tuning.ROUNDING * max(1.0, abs(below))
    found = [set(np.flatnonzero(m <= limit).tolist()) for m in marginals]
    for choices, k in zip(found, keep or (), strict=False):
        choices.add(k)
    return [sorted(choices) for choices in found]


def rows_alone(relaxation: Relaxation, rows: np.ndarray) -> list[np.ndarray] | None:
    """For each group and choice, the greatest over the first `MARGINAL_ROWS` of `rows` of the
    least bytes the row holds in a plan taking it (`relaxation`: `peak_relaxation`'s), a
    lower bound on the peak of those plans. None when too big to eliminate."""
    greatest = None
    for r in rows[: tuning.MARGINAL_ROWS].tolist():
        alone = relaxation.min_marginals(np.eye(1, relaxation.rows, r)[0])
        if alone is None:
            return None
        greatest = alone if greatest is None else [
            np.maximum(m, a) for m, a in zip(greatest, alone, strict=True)
        ]  # fmt: skip
    return greatest


def peak_marginals(relaxation: Relaxation, found: Dual) -> list[np.ndarray] | None:
    """For each group and choice, a least peak of the plans taking it: the greatest of the
    min-marginals at the best weights and of the rows at the best plan's peak alone
    (`rows_alone`; None when too big to eliminate). Rows alone see what a mix blurs: where
    the best weights' bound leaves most choices at it, the row at the peak alone may prove
    the least peak at once (the least of a group's choices bounds every plan:
    `lowest_budget`)."""
    marginals = relaxation.min_marginals(found.multipliers, found.shares)
    if marginals is None or found.best is None:
        return marginals
    alone = rows_alone(relaxation, np.argsort(-found.best.excess, kind="stable"))
    if alone is None:
        return marginals
    return [np.maximum(m, a) for m, a in zip(marginals, alone, strict=True)]


def fitting_choices(
    problem: Problem, found: Dual, relaxation: Relaxation | None = None
) -> list[list[int]] | None:
    """The choices some plan within the budget may take (None: all), leaving out those whose
    least bytes in a row are over it (the rows of the largest multipliers, each alone,
    `rows_alone`); `InfeasibleError` when a group has none left. Near the lowest budget,
    many."""
    weights = found.multipliers
    binding = np.flatnonzero(weights > 0)
    rows = binding[np.argsort(-weights[binding], kind="stable")]
    exact = (None, ()) if relaxation is None else (relaxation.exact_up_to, relaxation.hubs)
    least = rows_alone(peak_relaxation(problem, *exact), rows)
    if least is None:
        return None
    over = problem.budget + tuning.ROUNDING * max(1.0, problem.budget)
    fitting = [np.flatnonzero(peak <= over).tolist() for peak in least]
    if not all(fitting):
        raise proven_infeasible()
    return None if sum(map(len, fitting)) == problem.variables else fitting


def within_budget(
    problem: Problem,
    fitting: list[list[int]],
    marginals: list[np.ndarray],
    whole: Relaxation,
    deadline: Deadline = NEVER,
) -> tuple[int, Found | None, list[np.ndarray], np.ndarray]:
    """The relaxation of the choices that may fit (`fitting_choices`), solved again where they are
    few enough (`AGAIN`): stronger, as it no longer mixes in those that cannot (near the
    lowest budget, it may reach the optimum). Its bound, its best plan, the min-marginals of
    the whole widened by its own, infinite for the choices left out (`_widened`), and the
    rows that bind it. `whole`: the whole problem's relaxation; its steps stop at `deadline`."""
    none = np.zeros(0, np.int64)
    if problem.variables - sum(map(len, fitting)) < tuning.AGAIN * problem.variables:
        return 0, None, _widened(marginals, None, fitting), none
    within = problem.restricted(fitting)
    hubs = None if whole.hubs else ()  # exact where the whole's are (made anew: fewer choices)
    relaxation = Relaxation(within, exact_up_to=whole.exact_up_to, hubs=hubs)
    again = dual(within, relaxation=relaxation, deadline=deadline)
    if again is None:
        return 0, None, _widened(marginals, None, fitting), none
    if again.infeasible:
        raise proven_infeasible()
    plan = None
    if again.best is not None:
        plan = Found(in_whole(again.best.choice, fitting), again.best.objective)
    inner = relaxation.min_marginals(again.multipliers, again.shares)
    binding = np.flatnonzero(again.multipliers > 0)
    return rounded_up(again.bound), plan, _widened(marginals, inner, fitting), binding


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


def tightened(
    problem: Problem,
    multipliers: np.ndarray,
    kept: list[list[int]],
    below: int,
    keep: Sequence[int],
    exact_up_to: int | None = None,
    hubs: bool = False,
    deadline: Deadline = NEVER,
) -> list[list[int]]:
    """The choices `kept` of each group, which hold every plan below `below` and the plan `keep`
    (`still_possible`'s), fewer: the multipliers (`multipliers`: the whole problem's)
    stepped on (`TIGHTEN_STEPS`) in the relaxation of the problem restricted to them (its
    exact tables as large as `exact_up_to`, `table_limit`, and `hubs` where the whole's has
    them, `strengthened`) give higher min-marginals, which leave more out; again while they
    do (at most `TIGHTEN_ROUNDS` times). Where the bound reaches `below`, no plan below takes
    only them: `keep`'s choices alone. The whole problem's steps stop short of its best
    bound, and steps on the few choices a threshold keeps go further for less. No round
    starts once `deadline` has passed (any multipliers' min-marginals leave out only choices
    in no plan below `below`)."""
    limit = below - 1 + tuning.ROUNDING * max(1.0, abs(below))
    for _ in range(tuning.TIGHTEN_ROUNDS):
        if deadline.passed():
            break
        restricted = problem.restricted(kept)
        relaxation = Relaxation(restricted, exact_up_to=exact_up_to, hubs=None if hubs else ())
        found = dual(
            restricted, tuning.TIGHTEN_STEPS, relaxation=relaxation, start=multipliers,
            deadline=deadline,
        )  # fmt: skip
        if found is None:
            break
        if found.infeasible or found.bound > limit:
            return [[k] for k in keep]
        multipliers = found.multipliers
        marginals = relaxation.min_marginals(multipliers, found.shares)
        if marginals is None:
            break
        left = still_possible(marginals, below)
        fewer = [sorted({choices[i] for i in these} | {k})
                 for choices, these, k in zip(kept, left, keep, strict=True)]  # fmt: skip
        if fewer == kept:
            break
        kept = fewer
    return kept


def strengthened(
    problem: Problem, relaxation: Relaxation, found: Dual, deadline: Deadline = NEVER
) -> tuple[Relaxation, Dual]:
    """The relaxation with its large indicators exact (`hub_tables`) and its multipliers
    stepped on from `found`'s, where `HUB_TRIAL` steps raise the bound by `HUB_GAIN` or more;
    else `relaxation` and `found` as they are. Where a value is read by several groups at
    once (BERT's hidden state by q, k, v and the residual), its reshard buffers and its own
    savings are bounded apart, and near the lowest budget their sum binds: exact, they raise
    the bound much. Elsewhere they change little, and the trial is cheap. Its steps stop at
    `deadline`."""
    scopes = relaxation.hub_scopes()
    if not scopes or not relaxation.joins_in_time(list(scopes), found.multipliers):
        return relaxation, found
    exact = Relaxation(problem, exact_up_to=relaxation.exact_up_to, hubs=relaxation.hub_tables())
    trial = dual(
        problem, tuning.HUB_TRIAL, relaxation=exact, start=found.multipliers, deadline=deadline
    )
    if trial is None:
        return relaxation, found
    if not trial.infeasible and trial.bound < found.bound + tuning.HUB_GAIN * abs(found.bound):
        return relaxation, found
    more: Dual | None = trial
    if not trial.infeasible:
        more = dual(
            problem, relaxation=exact, start=trial.multipliers, shares=trial.shares,
            deadline=deadline,
        )  # fmt: skip
    stepped = trial if more is None or more.bound < trial.bound else more
    plans = [d.best for d in (found, trial, stepped) if d.best is not None]
    best = min(plans, key=lambda plan: plan.objective, default=None)
    return exact, dataclasses.replace(stepped, best=best)
