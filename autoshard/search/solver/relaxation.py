"""The memory rows relaxed into the objective (Lagrangian relaxation): a lower bound on the
memory-bound optimum, and candidate plans, each from one exact minimization (`factors`).

For multipliers lam_r >= 0, one per memory row r (the base row added to each),

    L(lam) = min_x  cost(x) + sum_r lam_r (bytes_r(x) - budget)

is at most the cost of any plan that fits (its added terms are <= 0), whatever lam; the x
reaching it is a plan, which fits or not. Every term is a table: node costs and each group's
lam-weighted bytes over its choices, edge costs over two groups' choices, and each
indicator's lam-weighted bytes over the groups its literals name (an indicator of two
groups' choices, the most common, summed per pair as a product of their masks). An indicator
naming groups of too many combinations (an AND of a held choice with an OR over three
readers: 171^4 on a 3-axis mesh) is bounded from below by tables of its parts (`bounds`): by
several such bounds, each at most it everywhere, mixed (`_Options`, `Shares`), and where the
indicators together join groups into a table too large to eliminate, every indicator is
bounded within the pairs the edges join already: a weaker bound, still a bound, on a
subproblem as easy as the problem without memory. The plans are checked exactly.

The multipliers (`dual`): projected subgradient steps with Polyak's step length towards the
best plan that fits (or a little above the bound while none does), the step shrunk when the
bound stops rising; each step also moves the mix of each wide indicator's bounds towards the
one highest at its plan. Iteration counts decide, never the clock: the same problem gives the
same bound and the same plans.

Worked example: one group of two choices, cost (0, 10), bytes (8, 2) in the one row, budget 5.
L(lam) = min(0 + 3 lam, 10 - 3 lam); at lam = 5/3 both are 5: the bound is 5, while the only
plan that fits costs 10 (the relaxation's duality gap, which `solve` closes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from threadpoolctl import ThreadpoolController

from autoshard.search.memory.rows import Chosen, Indicator, Literal, MemoryRows
from autoshard.search.problem import Problem
from autoshard.search.solver import tuning
from autoshard.search.solver.bounds import Bound, Bounded, Pieces, Shares
from autoshard.search.solver.factors import (
    Factor,
    additions,
    elimination_order,
    min_marginals,
    minimize,
)


@dataclass(frozen=True)
class Relaxed:
    """One subproblem's minimum: the plan `choice`, its integer `objective`, its `peak`, the
    bound `value` = L(lam) it proves, and each row's bytes less the budget (a subgradient)."""

    choice: tuple[int, ...]
    objective: int
    peak: int
    value: float
    excess: np.ndarray
    work: int  # what it took: entries of the tables built and summed (`_work`)
    bounded: tuple[Bounded, ...] = ()  # the indicators it bounded (`Relaxation.factors`)


class Relaxation:
    """The subproblem of one problem, for any multipliers: what does not depend on them is
    built once."""

    def __init__(
        self,
        problem: Problem,
        costs: bool = True,
        exact_up_to: int | None = None,
        hubs: Sequence[_Hub] | None = (),
    ) -> None:
        """`hubs`: the exact tables of large indicators (`hub_tables`), those of a relaxation
        of the same problem's rows; None: made at the first step; none by default
        (`strengthened` says when they are worth it)."""
        self.problem = problem
        self.exact_up_to = tuning.DENSE if exact_up_to is None else exact_up_to
        self.sizes = list(problem.sizes)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.fixed = self.tables(
            [((g,), np.asarray(c, np.float64)) for g, c in enumerate(problem.node_costs)]
            + [
                ((a, b), np.asarray(m, np.float64)) if a < b else ((b, a), np.asarray(m).T)
                for a, b, m in problem.edges
            ]
            if costs
            else []
        )
        self.pairs = frozenset(
            (min(a, b), max(a, b))
            for a, b, _ in problem.edges
            if min(self.sizes[a], self.sizes[b]) > 1
        )
        self.scopes: list[tuple[int, ...]] = []
        for ind in problem.indicators:
            groups: set[int] = set()
            for lit in ind.literals:
                groups |= {lit.group} if isinstance(lit, Chosen) else set(self.scopes[lit])
            self.scopes.append(tuple(sorted(groups)))
        self.entries = [math.prod(self.sizes[g] for g in scope) for scope in self.scopes]
        self.within_pairs = False  # once the indicators joined too much, bounded within pairs
        self.hubs = None if hubs is None else [h for h in hubs if h.size > self.exact_up_to]
        # Worked out once, kept while the relaxation lives (a cache on the method would keep
        # every relaxation made: `tightened` makes several per try).
        self.owned: dict[int, np.ndarray] = {}  # `own`'s tables
        self.masks: dict[Chosen, np.ndarray] = {}
        self.bounds: dict[frozenset | None, Bound] = {}
        # Most indicators are an AND or OR of two groups' choices: their tables, summed per
        # pair, are products of the literals' masks (one matrix product per pair).
        by_pair: dict[tuple[tuple[int, ...], bool], list[tuple[int, Chosen, Chosen]]] = {}
        for i, ind in enumerate(problem.indicators):
            chosen = [lit for lit in ind.literals if isinstance(lit, Chosen)]
            if len(chosen) == len(ind.literals) == 2 and len(self.scopes[i]) == 2:
                first, second = sorted(chosen, key=lambda lit: lit.group)
                by_pair.setdefault((self.scopes[i], ind.every), []).append((i, first, second))
        self.paired = [
            _Pair(scope, every, np.array([i for i, _, _ in found]),
                  np.array([self.mask(a) == every for _, a, _ in found], np.float64),
                  np.array([self.mask(b) == every for _, _, b in found], np.float64))
            for (scope, every), found in by_pair.items()
        ]  # fmt: skip

    @property
    def rows(self) -> int:
        return len(self.problem.memory)

    def weighted(self, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows' bytes weighted by `weights`, summed: per choice (flat over the groups) and
        per indicator."""
        total = float(weights.sum())
        unary = np.zeros(int(self.offsets[-1]))
        coefficients = np.zeros(len(self.problem.indicators))
        for rows, w in ((self.problem.memory, weights), (self.problem.memory_base, [total])):
            u, c = _weighted(rows, np.asarray(w, np.float64), self.offsets, len(coefficients))
            unary += u
            coefficients += c
        return unary, coefficients

    def factors(
        self,
        unary: np.ndarray,
        coefficients: np.ndarray,
        joined: frozenset | None = None,
        shares: Shares | None = None,
    ) -> tuple[list[Factor], float, list[Bounded]]:
        """The subproblem's tables and constant: the costs, `unary[offsets[g] + k]` on group
        g's choice k, `coefficients[i]` times indicator i (bounded from below where the
        coefficient is positive, from above where it is negative, its options mixed as
        `shares` says, else as they start: the sum stays at most the subproblem's), whose
        exact tables join only the pairs `joined` (None: any); and the indicators bounded."""
        pieces: Pieces = [
            ((g,), unary[self.offsets[g] : self.offsets[g + 1]])
            for g in range(len(self.sizes))
            if unary[self.offsets[g] : self.offsets[g + 1]].any()
        ]
        bound, constant = self.bound(joined), 0.0
        coefficients = coefficients.copy()
        for hub in (self.hubs or ()) if joined is None else ():  # (exact within pairs: none)
            weights = coefficients[hub.indicators]
            if weights.any():
                pieces.append((hub.scope, hub.table(weights)))
                coefficients[hub.indicators] = 0.0
        for pair in self.paired:
            weights = coefficients[pair.indicators]
            if weights.any() and bound.exact(pair.scope):
                pieces.append((pair.scope, pair.table(weights)))
                coefficients[pair.indicators] = 0.0
        bounded: list[Bounded] = []
        for i in np.flatnonzero(coefficients).tolist():
            weight = float(coefficients[i])
            options = bound.options(i, upper=weight < 0)
            parts, extra = options.mixed(weight * options.mix(shares, i))
            pieces += parts
            constant += extra
            bounded.append((i, weight, options))
        found, fixed = self.tables(pieces)
        return self.fixed[0] + found, self.fixed[1] + fixed + constant, bounded

    def bound(self, joined: frozenset | None) -> Bound:
        """The indicators' bounds whose exact tables join only the pairs `joined` (None: any),
        kept: they do not depend on the multipliers."""
        if joined not in self.bounds:
            self.bounds[joined] = Bound(self, joined)
        return self.bounds[joined]

    def tables(
        self, pieces: Sequence[tuple[tuple[int, ...], np.ndarray]]
    ) -> tuple[list[Factor], float]:
        """The pieces as factors, their one-choice groups taken out (they join nothing), and
        the sum of those left over no group."""
        found, constant = [], 0.0
        for scope, table in pieces:
            keep = tuple(g for g in scope if self.sizes[g] > 1)
            if keep != scope:
                table = table[tuple(slice(None) if self.sizes[g] > 1 else 0 for g in scope)]
            if keep:
                found.append(Factor(keep, np.asarray(table, np.float64)))
            else:
                constant += float(table)
        return found, constant

    def at(
        self, multipliers: np.ndarray, shares: Shares | None = None
    ) -> tuple[list[Factor], float]:
        """The subproblem for these multipliers (and the indicators' options mixed by `shares`,
        else as they start): its tables, and its constant (the rows' fixed bytes less the
        budget, weighted). The indicators' tables join the groups they name
        until that needs too large a table (`factors.MAX_ENTRIES`) or too much work
        (`STEP_WORK`); from then on they are bounded within the pairs the edges join."""
        found, constant, _ = self.subproblem(multipliers, shares)
        return found, constant

    def subproblem(
        self, multipliers: np.ndarray, shares: Shares | None = None
    ) -> tuple[list[Factor], float, list[Bounded]]:
        """`at`'s tables and constant, and the indicators it bounded (`factors`)."""
        with _one_blas_thread():
            unary, coefficients = self.weighted(multipliers)
            if self.hubs is None:
                self.hubs = self.hub_tables()
            while not self.within_pairs:
                found, constant, bounded = self.factors(unary, coefficients, None, shares)
                _, largest = elimination_order(
                    self.sizes, [f.scope for f in found], tuning.MAX_ENTRIES
                )
                if largest <= tuning.MAX_ENTRIES and _work(self.sizes, found) <= tuning.STEP_WORK:
                    break
                if self.hubs:  # without them first
                    self.hubs = []
                    continue
                self.within_pairs = True
            if self.within_pairs:
                found, constant, bounded = self.factors(unary, coefficients, self.pairs, shares)
        problem = self.problem
        constant += float(multipliers @ problem.memory.fixed.astype(np.float64))
        constant += float(multipliers.sum()) * float(problem.memory_base.fixed[0] - problem.budget)
        return found, constant, bounded

    def hub_tables(self) -> list[_Hub]:
        """The hubs of `hub_scopes`."""
        return [_Hub.of(self, scope, members) for scope, members in self.hub_scopes().items()]

    def hub_scopes(self) -> dict[tuple[int, ...], list[int]]:
        """The indicators the rows count whose groups have more combinations than
        `exact_up_to` but at most `HUB`, by scope: one exact table each per step. E.g. a
        hidden state held by one group and read by q, k, v and the residual: its reshard
        buffers and its home's savings, bounded apart, leave the relaxation far below the LP
        of CP-SAT's model."""
        counted = np.union1d(self.problem.memory.indicated, self.problem.memory_base.indicated)
        by_scope: dict[tuple[int, ...], list[int]] = {}
        for i in counted.tolist():
            scope = tuple(g for g in self.scopes[i] if self.sizes[g] > 1)
            if self.exact_up_to < math.prod(self.sizes[g] for g in scope) <= tuning.HUB:
                by_scope.setdefault(scope, []).append(i)
        return by_scope

    def joins_in_time(self, scopes: Sequence[tuple[int, ...]], multipliers: np.ndarray) -> bool:
        """Whether the subproblem at these multipliers with tables over `scopes` too is still
        one to eliminate within `MAX_ENTRIES` and `STEP_WORK` (its tables counted by their
        scopes: none is made)."""
        found, _ = self.at(multipliers)
        every = [f.scope for f in found] + list(scopes)
        order, largest = elimination_order(self.sizes, every, tuning.MAX_ENTRIES)
        tables = sum(math.prod(self.sizes[g] for g in scope) for scope in every)
        return (
            largest <= tuning.MAX_ENTRIES
            and tables + additions(self.sizes, order) <= tuning.STEP_WORK
        )

    def solve(self, multipliers: np.ndarray, shares: Shares | None = None) -> Relaxed | None:
        """The subproblem's minimum for these multipliers and `shares` (`at`; None when too big
        to eliminate)."""
        found, constant, bounded = self.subproblem(multipliers, shares)
        minimum = minimize(self.sizes, found)
        if minimum is None:
            return None
        work = _work(self.sizes, found)
        choice = minimum.choice
        excess = self.problem.live(choice) - self.problem.budget
        peak = int(excess.max()) + self.problem.budget if len(excess) else self.problem.peak(choice)
        value = float(minimum.value) + constant
        objective = self.problem.objective(choice)
        return Relaxed(choice, objective, peak, value, excess, work, tuple(bounded))

    def min_marginals(
        self, multipliers: np.ndarray, shares: Shares | None = None
    ) -> list[np.ndarray] | None:
        """For each group, per choice, the subproblem's minimum with that choice taken (`at`;
        None when too big to eliminate)."""
        found, constant = self.at(multipliers, shares)
        marginals = min_marginals(self.sizes, found)
        return None if marginals is None else [m + constant for m in marginals]

    def mask(self, literal: Chosen) -> np.ndarray:
        if literal not in self.masks:
            self.masks[literal] = np.zeros(self.sizes[literal.group], dtype=bool)
            self.masks[literal][sorted(literal.choices)] = True
        return self.masks[literal]

    def table(self, i: int, scope: tuple[int, ...]) -> np.ndarray:
        """Indicator i's values over `scope` (a superset of its own, both ascending),
        broadcastable."""
        own = self.scopes[i]
        return self.own(i).reshape([self.sizes[g] if g in own else 1 for g in scope])

    def own(self, i: int) -> np.ndarray:
        """Indicator i's values over its own groups, worked out once: indicators nest, and
        an AND or OR inside many would be worked out again for each. Those it names first,
        in index order (`nested`): a layer's indicators name the layer's before, and a walk
        down them would nest as deep as the model."""
        for j in nested(self.problem.indicators, i, self.owned):
            ind = self.problem.indicators[j]
            self.owned[j] = self.joint(ind.literals, ind.every, self.scopes[j])
        return self.owned[i]

    def values(
        self, literal: Literal, at: Mapping[int, np.ndarray], memo: dict[Literal, np.ndarray]
    ) -> np.ndarray:
        """A literal's values at some combinations of choices (`at`: each group's choice in
        each; a group of one choice may be left out), kept in `memo`: an indicator's after
        those it names, in index order (`nested`)."""
        if isinstance(literal, Chosen):
            if literal not in memo:
                memo[literal] = self.mask(literal)[at.get(literal.group, 0)]
            return memo[literal]
        for j in nested(self.problem.indicators, literal, memo):
            ind = self.problem.indicators[j]
            combine = np.logical_and if ind.every else np.logical_or
            parts = [
                self.values(lit, at, memo) if isinstance(lit, Chosen) else memo[lit]
                for lit in ind.literals
            ]
            memo[j] = functools.reduce(combine, parts)
        return memo[literal]

    def chosen_in(self, indicators: Sequence[int]) -> dict[int, set[Chosen]]:
        """The conditions on one group's choices that the indicators name, nested too, by
        group."""
        found: dict[int, set[Chosen]] = {}
        seen: set[int] = set()
        todo = list(indicators)
        while todo:
            i = todo.pop()
            if i in seen:
                continue
            seen.add(i)
            for lit in self.problem.indicators[i].literals:
                if isinstance(lit, Chosen):
                    found.setdefault(lit.group, set()).add(lit)
                else:
                    todo.append(lit)
        return found

    def joint(self, literals: Sequence[Literal], every: bool, scope: tuple[int, ...]) -> np.ndarray:
        """The AND (`every`) or OR of `literals` over `scope` (a superset of theirs)."""
        combine = np.logical_and if every else np.logical_or
        return functools.reduce(combine, [self.literal_table(lit, scope) for lit in literals])

    def scope_of(self, literal: Literal) -> tuple[int, ...]:
        return (literal.group,) if isinstance(literal, Chosen) else self.scopes[literal]

    def dense(self, values: np.ndarray, scope: tuple[int, ...]) -> np.ndarray:
        """Broadcast 0/1 values over `scope`, as float64."""
        return np.broadcast_to(values, [self.sizes[g] for g in scope]).astype(np.float64)

    def literal_table(self, literal: Literal, scope: tuple[int, ...]) -> np.ndarray:
        if isinstance(literal, Chosen):
            shape = [1] * len(scope)
            shape[scope.index(literal.group)] = self.sizes[literal.group]
            return self.mask(literal).reshape(shape)
        return self.table(literal, scope)


def nested(indicators: Sequence[Indicator], i: int, done: Container[Literal]) -> list[int]:
    """Indicator i and those nested in it that are not `done`, ascending: each after those it
    names (an indicator names only earlier ones), so that a pass in this order works out
    each from values already there, with no recursion as deep as the nesting."""
    found: set[int] = set()
    todo = [i]
    while todo:
        j = todo.pop()
        if j in found or j in done:
            continue
        found.add(j)
        todo += [lit for lit in indicators[j].literals if not isinstance(lit, Chosen)]
    return sorted(found)


@functools.cache
def _blas() -> ThreadpoolController:
    return ThreadpoolController()


def _one_blas_thread() -> contextlib.AbstractContextManager:
    """The relaxation's products are of a few hundred rows: a BLAS pool's threads cost more
    than they save."""
    return _blas().limit(limits=1, user_api="blas")


def _work(sizes: Sequence[int], factors: Sequence[Factor]) -> int:
    """The entries of the tables a subproblem builds and the additions its elimination makes:
    what an iteration costs, counted (never timed), so that the work allowed decides alike on
    any machine."""
    scopes = [f.scope for f in factors]
    order, largest = elimination_order(sizes, scopes, tuning.MAX_ENTRIES)  # (as `subproblem`'s)
    if largest > tuning.MAX_ENTRIES:  # (left unfinished: the whole order's work)
        order, _ = elimination_order(sizes, scopes)
    return sum(f.table.size for f in factors) + additions(sizes, order)


@dataclass(frozen=True, eq=False)
class _Pair:
    """Indicators ANDing (`every`) or ORing "group a took one of K" and "group b took one of
    K'" over one pair of groups: their masks over a's choices (rows of `first`) and b's
    (`second`), negated for an OR."""

    scope: tuple[int, ...]
    every: bool
    indicators: np.ndarray
    first: np.ndarray
    second: np.ndarray

    def table(self, weights: np.ndarray) -> np.ndarray:
        """sum_i weights[i] * indicator i, over (a's choice, b's choice)."""
        product = (self.first.T * weights) @ self.second
        # a OR b = 1 - (not a)(not b)
        return product if self.every else weights.sum() - product


@dataclass(frozen=True, eq=False)
class _Hub:
    """Indicators over one scope of many combinations, summed in one exact table: each
    combination's class (which of them hold there, numbered) and each class's members, so
    that a step's table is a lookup of each class's weighted sum, not one table each."""

    scope: tuple[int, ...]
    shape: tuple[int, ...]
    indicators: np.ndarray
    classes: np.ndarray  # per combination of the scope's choices (C order)
    members: np.ndarray  # class x indicator, 0/1

    @classmethod
    def of(cls, relaxation: Relaxation, scope: tuple[int, ...], indicators: list[int]) -> _Hub:
        # A group's choices alike in every condition the indicators name on it are one kind
        # (a reader's choices reading the same sharding): worked out per kind, then spread.
        named = relaxation.chosen_in(indicators)
        kinds, picks = [], []
        for g in scope:
            masks = np.array([relaxation.mask(lit) for lit in named.get(g, ())]).T
            if not masks.size:
                masks = np.zeros((relaxation.sizes[g], 1), bool)
            _, pick, kind = np.unique(masks, axis=0, return_index=True, return_inverse=True)
            kinds.append(kind.reshape(-1))
            picks.append(pick)
        grid = np.meshgrid(*picks, indexing="ij")
        at = {g: choices.reshape(-1) for g, choices in zip(scope, grid, strict=True)}
        memo: dict[Literal, np.ndarray] = {}
        classes, bits = np.zeros(grid[0].size, np.int64), 0
        for i in indicators:  # a bit each, the codes numbered 0.. again before they overflow
            if bits == tuning.BITS:
                classes, bits = np.unique(classes, return_inverse=True)[1], 0
            classes = (classes << 1) | relaxation.values(i, at, memo)
            bits += 1
        _, first, classes = np.unique(classes, return_index=True, return_inverse=True)
        one = {g: choices[first] for g, choices in at.items()}  # a combination of each class
        members = np.stack([relaxation.values(i, one, {}) for i in indicators], axis=1)
        spread = classes.reshape(grid[0].shape)[np.ix_(*kinds)].reshape(-1)
        small = spread.astype(np.min_scalar_type(len(first)))
        shape = tuple(relaxation.sizes[g] for g in scope)
        return cls(scope, shape, np.array(indicators), small, members.astype(np.float64))

    @property
    def size(self) -> int:
        return len(self.classes)

    def table(self, weights: np.ndarray) -> np.ndarray:
        """sum_i weights[i] * indicator i, over the scope."""
        return (self.members @ weights)[self.classes].reshape(self.shape)


def _weighted(
    rows: MemoryRows, weights: np.ndarray, offsets: np.ndarray, indicators: int
) -> tuple[np.ndarray, np.ndarray]:
    """sum_r weights[r] * row r, as bytes per (flat) choice and per indicator."""
    runs, marks = rows.run_spans, rows.marks
    per_run = np.bincount(runs.key, runs.weights(weights), minlength=len(rows.run_group))
    columns = offsets[rows.entry_group] + rows.choices
    unary = np.bincount(columns, per_run[rows.entry_run] * rows.amounts, int(offsets[-1]))
    marked = marks.weights(weights) * marks.amount
    return unary, np.bincount(marks.key, marked, minlength=indicators)


def peak_relaxation(
    problem: Problem, exact_up_to: int | None = None, hubs: Sequence[_Hub] | None = ()
) -> Relaxation:
    """The relaxation of the least peak: the rows' bytes weighted, no costs, no budget."""
    least = dataclasses.replace(problem, budget=0)
    return Relaxation(least, costs=False, exact_up_to=exact_up_to, hubs=hubs)


def table_limit(problem: Problem, plan: Sequence[int]) -> int:
    """How many combinations an indicator's exact table may have: `DENSE`, or `DENSER` where
    the bounds of the larger ones keep less than `LOOSE` of the bytes of the row at `plan`'s
    peak (the memory-aside optimum's: the plans the multipliers start from). On a mesh of
    small axes a reshard buffer ANDs three groups of 49 to 310 choices, and where it is not
    made its bound (the exact pair's table plus the third's mask, less 1) takes its bytes
    off, so that no multipliers raise the bound above the memory-aside optimum. Where the
    bounds keep the row's bytes, larger tables only slow each step."""
    live = problem.live(plan)
    if not len(live):
        return tuning.DENSE
    row = int(np.argmax(live))
    factors, constant = peak_relaxation(problem).at(np.eye(1, len(live), row)[0])
    relaxed = sum(float(f.table[tuple(plan[g] for g in f.scope)]) for f in factors) + constant
    return tuning.DENSE if relaxed >= tuning.LOOSE * float(live[row]) else tuning.DENSER
