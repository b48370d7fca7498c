"""A neighbourhood of the large-neighbourhood search solved by exact elimination, memory
aside (`factors.minimize`), before CP-SAT is asked: far cheaper on the neighbourhoods the
search draws, whose edges form few cycles.

Its optimum with memory aside is a bound of the neighbourhood's: where it fits every row, it
is the neighbourhood's optimum, proven; where it costs no less than the incumbent, so is the
incumbent. Else the usage is priced in, as a Lagrangian relaxation does: each choice of a
freed group costs `price` more per unit of usage its nodes hold at the rows that went over the
limit (rows added as solutions go over others), the price doubled from the one at which the
relaxed optimum's excess would cost its saving until a solution fits (`STEPS` at most), then
bisected between the last that did not and the least that did (`BISECT`). The cheapest
fitting solution, where cheaper than the incumbent, is an improvement, though not proven the
best.

Deterministic: elimination's tables are exact integers, the prices a fixed sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from autoshard.search.problem import Problem
from autoshard.search.solver.factors import Factor, minimize, problem_factors


class Neighbourhood(Protocol):
    """What this needs of a neighbourhood (`lns.Neighbourhood`): its problem (memory aside),
    the incumbent's choice there, each row's usage under a choice of it, and per group per
    choice the usage its nodes hold summed over some rows."""

    @property
    def problem(self) -> Problem: ...

    @property
    def hint(self) -> tuple[int, ...]: ...

    def live(self, choice: Sequence[int]) -> np.ndarray: ...

    def held_at(self, rows: np.ndarray) -> list[np.ndarray]: ...


MAX_ENTRIES = 2**20
"""The largest table elimination may build here; past it CP-SAT solves the neighbourhood."""

STEPS = 6
"""Prices tried at most, each twice the one before, until a solution fits..."""

BISECT = 3
"""...then prices halfway between the highest that did not and the lowest that did, for a
cheaper solution that fits."""

WORK = 1e-5
"""The deterministic seconds one elimination counts per choice of the neighbourhood's (its
cost grows with them; CP-SAT's slices count in the same budget)."""


@dataclass(frozen=True)
class Relaxed:
    """A neighbourhood's answer by elimination: its solution (None: none cheaper than the
    incumbent found that fits), whether it is proven the neighbourhood's optimum, and the
    deterministic seconds it counts. `settled`: nothing is left for CP-SAT (proven, or an
    improvement found)."""

    choice: tuple[int, ...] | None
    proven: bool
    work: float

    @property
    def settled(self) -> bool:
        return self.proven or self.choice is not None


def eliminated(sub: Neighbourhood, limit: int | None) -> Relaxed | None:
    """The neighbourhood by elimination (the module's docstring), within the usage `limit`;
    None where its tables would pass `MAX_ENTRIES`."""
    problem = sub.problem
    factors = problem_factors(problem)
    groups = len(problem.sizes)
    work = WORK * problem.variables
    found = minimize(problem.sizes, factors, MAX_ENTRIES)
    if found is None:
        return None
    incumbent = problem.objective(sub.hint)
    if problem.objective(found.choice) >= incumbent:
        return Relaxed(None, True, work)  # the incumbent is the optimum
    live = sub.live(found.choice)
    if limit is None or not len(live) or live.max() <= limit:
        return Relaxed(found.choice, True, work)
    rows = np.zeros(len(live), np.int64)
    saving = incumbent - problem.objective(found.choice)
    low, high = 0.0, saving / max(1, int(np.maximum(live - limit, 0).sum()))
    best, doubling, tries = sub.hint, True, 0
    while tries < (STEPS if doubling else BISECT):
        tries += 1
        price = high if doubling else (low + high) / 2
        rows |= live > limit
        held = sub.held_at(rows)
        node = [Factor((g,), f.table + np.ceil(price * held[g]).astype(np.int64))
                for g, f in enumerate(factors[:groups])]  # fmt: skip
        priced = minimize(problem.sizes, node + factors[groups:], MAX_ENTRIES)
        work += WORK * problem.variables
        if priced is None:  # pragma: no cover - the same scopes as the first solve's
            return None
        live = sub.live(priced.choice)
        if live.max() > limit:
            low, high = price, 2 * price if doubling else high
            continue
        high = price
        if doubling:  # (a price that fits: bisect below it for a cheaper solution)
            doubling, tries = False, 0
        if problem.objective(priced.choice) < problem.objective(best):
            best = priced.choice
    return Relaxed(best if best != sub.hint else None, False, work)
