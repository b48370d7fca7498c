"""The memory rows relaxed into the objective (Lagrangian relaxation): a lower bound on the
memory-bound optimum, and candidate plans, each from one exact minimization
(`search.factors`).

For multipliers lam_r >= 0, one per memory row r (the base row added to each),

    L(lam) = min_x  cost(x) + sum_r lam_r (bytes_r(x) - budget)

is at most the cost of any plan that fits (its added terms are <= 0), whatever lam; the x
reaching it is a plan, which fits or not. Every term is a table: node costs and each group's
lam-weighted bytes over its choices, edge costs over two groups' choices, and each
indicator's lam-weighted bytes over the groups its literals name (an indicator of two
groups' choices, the most common, summed per pair as a product of their masks). An indicator
naming groups of too many combinations (an AND of a held choice with an OR over three
readers: 171^4 on a 3-axis mesh) is bounded from below by tables of its parts (`_Bound`): by
several such bounds, each at most it everywhere, mixed (`_Options`, `Shares`), and where the
indicators together join groups into a table too large to eliminate, every indicator is
bounded within the pairs the edges join already: a weaker bound, still a bound, on a
subproblem as easy as the problem without memory. The plans are checked exactly.

The multipliers: projected subgradient steps with Polyak's step length towards the best plan
that fits (or a little above the bound while none does), the step shrunk when the bound stops
rising; each step also moves the mix of each wide indicator's bounds towards the one highest
at its plan. Iteration counts decide, never the clock: the same problem gives the same bound
and the same plans.

Worked example: one group of two choices, cost (0, 10), bytes (8, 2) in the one row, budget 5.
L(lam) = min(0 + 3 lam, 10 - 3 lam); at lam = 5/3 both are 5: the bound is 5, while the only
plan that fits costs 10 (the relaxation's duality gap, which `search.ilp` closes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from threadpoolctl import ThreadpoolController

from autoshard.search.memory_rows import Chosen, Indicator, Literal, MemoryRows
from autoshard.search.problem import Problem
from autoshard.search.solver.factors import (
    MAX_ENTRIES,
    Factor,
    additions,
    elimination_order,
    min_marginals,
    minimize,
)

ITERATIONS = 20
"""Subgradient steps at most: the bound settles in fewer (the 32-layer decoder on 4x8 at 60 %:
9.945e6 after 20 steps, 9.950e6 after 40, its best plan the same)."""

WORK = 8 * 10**8
"""The work (`_work`) the steps may take in all: the bundled models' subproblems are far below
a million entries each (ITERATIONS decides), the 32-layer decoder's on a 2x4x8 mesh ~1.4e8
(about five steps: its bound then, 5.586e6, is 0.8 % under the 5.633e6 of 30 steps, and the
choices its min-marginals keep, 500 of 4023, are 12 more)."""

STEP_WORK = WORK // 4
"""A subproblem whose exact tables would take more work than this is bounded within the pairs
the edges join instead (weaker, and as easy as the problem without memory): a step must leave
room for more (the 32-layer decoder's least peak on 2x4x8: 5.3e9 exact, one step in 19 s)."""

REACH = 0.05
"""While no plan fits, each step aims this much above the bound, relatively, doubled after a
step that raised the bound and halved (to this at least) after one that did not."""

DENSE = 1 << 17
"""An indicator over at most this many combinations of its groups' choices is one table, exact;
a larger one is bounded from below by tables of its parts."""

DENSER = 1 << 19
"""`DENSE` where its bounds lose too much (`table_limit`)."""

HUB = 1 << 22
"""An indicator over more combinations than `DENSE` (`DENSER`) but at most this many is exact
too, in one table per scope summing every such indicator over it (`_Hub`), where the
subproblem's work allows."""

LOOSE = 0.9
"""The share of the bytes of the row at the memory-aside optimum's peak under which the
relaxation's bounds of large indicators are too loose (`table_limit`)."""


Pieces = list[tuple[tuple[int, ...], np.ndarray]]
"""Tables over scopes of groups, to be summed."""

Bounded = tuple[int, float, "_Options"]
"""An indicator a subproblem bounds: its index, its coefficient there, its options."""

Shares = Mapping[int, tuple["_Options", np.ndarray]]
"""How the options bounding each wide indicator are mixed, by indicator: the options (those
of one relaxation's bounds, `_Bound.options`) and their shares; options not named, or named
with other options (another relaxation's), are mixed as they start."""


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
        self.exact_up_to = DENSE if exact_up_to is None else exact_up_to
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
        self.bounds: dict[frozenset | None, _Bound] = {}
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

    def bound(self, joined: frozenset | None) -> _Bound:
        """The indicators' bounds whose exact tables join only the pairs `joined` (None: any),
        kept: they do not depend on the multipliers."""
        if joined not in self.bounds:
            self.bounds[joined] = _Bound(self, joined)
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
                _, largest = elimination_order(self.sizes, [f.scope for f in found])
                if largest <= MAX_ENTRIES and _work(self.sizes, found) <= STEP_WORK:
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
        `exact_up_to` but at most `HUB`, by scope: one exact table each per step. BERT's
        TorchScript export on 4x8 at 5 % over its lowest budget: the hidden state held by
        one group and read by q, k, v and the residual (9 * 27^3 * 17 combinations), whose
        reshard buffers and the home's savings, bounded apart, left the relaxation at 4.60e8
        where the LP of CP-SAT's model reaches 6.30e8 (the optimum 6.705e8)."""
        counted = np.union1d(self.problem.memory.indicated, self.problem.memory_base.indicated)
        by_scope: dict[tuple[int, ...], list[int]] = {}
        for i in counted.tolist():
            scope = tuple(g for g in self.scopes[i] if self.sizes[g] > 1)
            if self.exact_up_to < math.prod(self.sizes[g] for g in scope) <= HUB:
                by_scope.setdefault(scope, []).append(i)
        return by_scope

    def joins_in_time(self, scopes: Sequence[tuple[int, ...]], multipliers: np.ndarray) -> bool:
        """Whether the subproblem at these multipliers with tables over `scopes` too is still
        one to eliminate within `MAX_ENTRIES` and `STEP_WORK` (its tables counted by their
        scopes: none is made)."""
        found, _ = self.at(multipliers)
        every = [f.scope for f in found] + list(scopes)
        order, largest = elimination_order(self.sizes, every)
        tables = sum(math.prod(self.sizes[g] for g in scope) for scope in every)
        return largest <= MAX_ENTRIES and tables + additions(self.sizes, order) <= STEP_WORK

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
        an AND or OR inside many was worked out again for each (Llama's training step on
        2x4: 186,000 tables for 5,400 indicators)."""
        if i not in self.owned:
            ind = self.problem.indicators[i]
            self.owned[i] = self.joint(ind.literals, ind.every, self.scopes[i])
        return self.owned[i]

    def values(
        self, literal: Literal, at: Mapping[int, np.ndarray], memo: dict[Literal, np.ndarray]
    ) -> np.ndarray:
        """A literal's values at some combinations of choices (`at`: each group's choice in
        each; a group of one choice may be left out), kept in `memo`."""
        if literal not in memo:
            if isinstance(literal, Chosen):
                memo[literal] = self.mask(literal)[at.get(literal.group, 0)]
            else:
                ind = self.problem.indicators[literal]
                combine = np.logical_and if ind.every else np.logical_or
                parts = [self.values(lit, at, memo) for lit in ind.literals]
                memo[literal] = functools.reduce(combine, parts)
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


@functools.cache
def _blas() -> ThreadpoolController:
    return ThreadpoolController()


def _one_blas_thread() -> contextlib.AbstractContextManager:
    """The relaxation's products are of a few hundred rows: a BLAS pool's threads cost more
    than they save (one pair's table, 330 x 165 by 330 x 284: 1.2 ms on one OpenBLAS thread,
    5.4 ms on two, on a 2-core machine)."""
    return _blas().limit(limits=1, user_api="blas")


def _work(sizes: Sequence[int], factors: Sequence[Factor]) -> int:
    """The entries of the tables a subproblem builds and the additions its elimination makes:
    what an iteration costs, counted (never timed), so that the work allowed decides alike on
    any machine."""
    order, _ = elimination_order(sizes, [f.scope for f in factors])
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
            if bits == _BITS:
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


_BITS = 40
"""The indicators' bits a hub folds into its class codes before numbering them 0.. again (the
classes, fewer than `HUB` < 2^23, shifted by 40 bits stay within int64)."""


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


@dataclass(frozen=True, eq=False)
class _Options:
    """Bounds of one indicator from one side, each a sum of tables and a constant: from below,
    each at most the indicator wherever the groups' choices are (so the indicator is at least
    their maximum, and at least any mix of them: `shares`, on the simplex); from above, each at
    least it. The LP of CP-SAT's model has every such bound in its rows (an AND at least the
    sum of its literals less one, and at least 0) and weighs them as its duals say; one fixed
    mix may be far weaker: GPT-J's TorchScript export on 4x8 at 5 % over its lowest budget,
    5.78e8 after the first relaxation's steps, the LP 6.76e8 (the optimum 7.52e8); the mix
    stepped too, 6.02e8, and the solve 68 -> 34 s. `start`: the mix a relaxation starts
    from (the even one of an OR)."""

    alternatives: tuple[tuple[Pieces, float], ...]
    start: np.ndarray

    def mix(self, shares: Shares | None, i: int) -> np.ndarray:
        """The mix `shares` gives these options, the options of indicator i."""
        options, mix = (shares or {}).get(i, (None, self.start))
        return mix if options is self else self.start

    def mixed(self, shares: np.ndarray) -> tuple[Pieces, float]:
        """The bound of this mix: each alternative's tables and constant times its share (a
        mix times a coefficient: the bound times it, the tables multiplied once)."""
        pieces: Pieces = []
        constant = 0.0
        for (tables, extra), share in zip(self.alternatives, shares.tolist(), strict=True):
            if share:
                pieces += [(scope, table * share) for scope, table in tables]
                constant += extra * share
        return pieces, constant

    @functools.cached_property
    def at_start(self) -> tuple[Pieces, float]:
        """The bound of the mix it starts from (a part of a larger indicator's options is
        bounded so: worked out once for all of them)."""
        return self.mixed(self.start)

    def values(self, choice: Sequence[int]) -> np.ndarray:
        """Each alternative's value at a plan."""
        return np.array([
            sum(float(table[tuple(choice[g] for g in scope)]) for scope, table in tables) + extra
            for tables, extra in self.alternatives
        ])  # fmt: skip


def _one(tables: Pieces) -> _Options:
    """One bound, exact: no mix to move."""
    return _Options(((tables, 0.0),), np.ones(1))


class _Bound:
    """A lower bound on an indicator as a sum of small tables and a constant: exact where the
    groups it names have few combinations of choices, else from its parts (below)."""

    def __init__(self, relaxation: Relaxation, joined: frozenset[tuple[int, ...]] | None) -> None:
        self.relaxation = relaxation
        self.joined = joined  # the pairs an exact table may join (None: any)
        self.found: dict[tuple[Literal, bool], _Options] = {}

    def exact(self, groups: set[int] | tuple[int, ...]) -> bool:
        """Whether a table over `groups` may be kept exact: few combinations, and (when the
        pairs are restricted) no pair the problem does not join already."""
        r = self.relaxation
        keep = tuple(sorted(g for g in groups if r.sizes[g] > 1))
        if math.prod(r.sizes[g] for g in keep) > r.exact_up_to:
            return False
        return self.joined is None or len(keep) <= 1 or (len(keep) == 2 and keep in self.joined)

    def of(self, literal: Literal, upper: bool = False) -> tuple[Pieces, float]:
        """(scope, table) pieces and a constant whose sum is at most `literal` everywhere (at
        least, when `upper`: for an indicator that takes bytes off, a saving): its
        `options` mixed as they start."""
        return self.options(literal, upper).at_start

    def options(self, literal: Literal, upper: bool = False) -> _Options:
        """The bounds of `literal` from below (from above, when `upper`), each worked out once.

        An OR is at least each of its parts (they start mixed evenly), an AND of parts in [0,
        1] at least their sum less one per extra part (but an AND holding ORs, at least each of
        the ANDs it distributes to, where that takes few tables: `distributed`), either at
        least 0; the literals whose groups together have at most `exact_up_to` combinations
        form one exact part. E.g. AND(g2 in K, g4 in K', OR(g4 in .., g5 in .., g6 in ..))
        over 171^4 combinations: AND(g2 in K, g4 in K') exactly (171^2) plus each of the
        three ORed literals, less 1. From above: an AND is at most any one of its parts (it
        starts at the exact one), an OR at most the sum of its parts, either at most 1. A part
        nested in another is bounded as its options start."""
        key = (literal, upper)
        if key not in self.found:
            self.found[key] = self.bounded(literal, upper)
        return self.found[key]

    def bounded(self, literal: Literal, upper: bool) -> _Options:
        r = self.relaxation
        if isinstance(literal, Chosen):
            return _one([((literal.group,), r.mask(literal).astype(np.float64))])
        if self.exact(r.scopes[literal]):
            scope = r.scopes[literal]
            return _one([(scope, r.dense(r.table(literal, scope), scope))])
        ind = r.problem.indicators[literal]
        literals = self.parts(ind)
        if ind.every and not upper:
            distributed = self.distributed(literals, ROOM)
            if distributed is not None:
                alternatives = tuple(([(scope, table)], 0.0) for _, scope, table in distributed)
                mean = [share for share, _, _ in distributed]
                return _Options((*alternatives, ([], 0.0)), np.array([*mean, 0.0]))
        exact, groups, rest = self.split(literals)
        scope = tuple(sorted(groups))
        parts: list[tuple[Pieces, float]] = []
        if exact:
            parts.append(([(scope, r.dense(r.joint(exact, ind.every, scope), scope))], 0.0))
        parts += [self.of(lit, upper) for lit in rest]
        if upper == ind.every:  # at most each part (an AND), at least each (an OR)
            start = np.zeros(len(parts) + 1)
            start[: 1 if upper else len(parts)] = 1.0 if upper else 1.0 / len(parts)
            return _Options((*parts, ([], 1.0 if upper else 0.0)), start)
        summed: Pieces = [piece for tables, _ in parts for piece in tables]
        constant = sum(extra for _, extra in parts)
        if not upper:  # an AND: at least the sum less one per extra part
            constant -= len(parts) - 1
        return _Options(((summed, constant), ([], 1.0 if upper else 0.0)), np.array([1.0, 0.0]))

    def split(self, literals: list[Literal]) -> tuple[list[Literal], set[int], list[Literal]]:
        """The literals that fit one exact table, taken in order while they do, the groups
        they name, and the rest."""
        exact: list[Literal] = []
        groups: set[int] = set()
        rest: list[Literal] = []
        for lit in literals:
            joint = groups | set(self.relaxation.scope_of(lit))
            if self.exact(joint):
                exact.append(lit)
                groups = joint
            else:
                rest.append(lit)
        return exact, groups, rest

    def parts(self, ind: Indicator) -> list[Literal]:
        """The literals of an AND (an OR), those of the ANDs (ORs) in it too large to be one
        table in their place: the more of them, the more fall in one exact part. bert on 2x4
        at its lowest budget: a saving AND(g3 in K, AND(OR over g3 and g29, OR over five
        groups)) was at most g3's mask, now at most AND(g3 in K, the first OR), one table."""
        r = self.relaxation
        found: list[Literal] = []
        for lit in ind.literals:
            if isinstance(lit, Chosen) or self.exact(r.scopes[lit]):
                found.append(lit)
            elif (inner := r.problem.indicators[lit]).every == ind.every:
                found += self.parts(inner)
            else:
                found.append(lit)
        if not ind.every:
            return found
        # An OR holding wherever one of the AND's own literals does is no condition: AND(g4
        # in S, OR(g4 in S, g5 in S)) is g4 in S (a buffer read where it is made).
        chosen = [lit for lit in found if isinstance(lit, Chosen)]
        return [lit for lit in found if not self.implied(lit, chosen)]

    def implied(self, literal: Literal, chosen: list[Chosen]) -> bool:
        """Whether `literal` is an OR holding wherever one of `chosen` does."""
        if isinstance(literal, Chosen):
            return False
        ind = self.relaxation.problem.indicators[literal]
        return not ind.every and any(
            isinstance(part, Chosen) and part.group == c.group and c.choices <= part.choices
            for part in ind.literals
            for c in chosen
        )

    def distributed(
        self, literals: list[Literal], room: int
    ) -> list[tuple[float, tuple[int, ...], np.ndarray]] | None:
        """AND(E, OR(a_1 .. a_m), R), E the literals of `literals` that fit one exact table and
        the OR the first of the rest, as OR_i AND(E, a_i, R): at least each of those, each
        exact or distributed again, as exact tables with the shares of their mean (the mix
        its options start from); None when one cannot be (no OR left) or they are more than
        `room` tables. Unlike E + OR - 1 it is never below 0: a reshard's buffer, AND(held
        elsewhere, OR(the readers reading it)), was priced at -1 times its bytes wherever it
        is not made, and no multipliers raised bert's bound on 4x8 at 30 % above the
        memory-aside optimum (2.27e8; now 3.28e8 in as many steps, the optimum 3.52e8, the LP
        of the CP-SAT model 3.37e8; 15.8 -> 3.3 s). From above the sum of those (a union
        bound) counts a saving once per OR's literal that holds: bert on 2x4 at its lowest
        budget, its relaxation fell far below the LP's (tried, dropped).
        """
        r = self.relaxation
        exact, groups, rest = self.split(literals)
        scope = tuple(sorted(groups))
        if not rest:
            return [(1.0, scope, r.dense(r.joint(exact, True, scope), scope))]
        ors = [
            lit
            for lit in rest
            if not isinstance(lit, Chosen) and not r.problem.indicators[lit].every
        ]
        if not ors:
            return None
        first = r.problem.indicators[ors[0]]
        others = [lit for lit in rest if lit != ors[0]]
        pieces: list[tuple[float, tuple[int, ...], np.ndarray]] = []
        for lit in first.literals:
            inner = None if isinstance(lit, Chosen) else r.problem.indicators[lit]
            these = self.parts(inner) if inner is not None and inner.every else [lit]
            found = self.distributed([*exact, *these, *others], room - len(pieces))
            if found is None or len(pieces) + len(found) > room:
                return None
            pieces += found
        share = 1.0 / len(first.literals)
        return [(part * share, scope, table) for part, scope, table in pieces]


ROOM = 64
"""The most tables an indicator distributed over its ORs may take (`_Bound.distributed`)."""


def dual(
    problem: Problem,
    iterations: int = ITERATIONS,
    work: int = WORK,
    relaxation: Relaxation | None = None,
    start: np.ndarray | None = None,
    longer: int = 0,
    shares: Shares | None = None,
) -> Dual | None:
    """The best bound the multipliers reach in `iterations` subgradient steps (fewer when
    their subproblems' `work` adds up to more), and the cheapest plan that fits among the
    minima on the way (None when a subproblem is too big). `relaxation`: the problem's, if
    made already; `start`: the multipliers to step from (none: zeros), and `shares` the mix
    of the indicators' options (none: as they start), which each step moves too
    (`_stepped_shares`); `longer`: steps more, at most, `RISE_STEPS` at a time
    while they still raise the bound by `RISE`."""
    relaxation = relaxation or Relaxation(problem)
    # No plan costs more: a bound above it proves that none fits.
    most = sum(max(costs) for costs in problem.node_costs) + sum(
        max(max(row) for row in m) for _, _, m in problem.edges
    )
    multipliers = np.zeros(relaxation.rows) if start is None else start
    best: Relaxed | None = None
    steps, spent, reach = _Steps(multipliers), 0, REACH
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
        reach = reach * 2 if rose else max(REACH, reach / 2)
        if best is not None and best.objective - bound < 1:
            break
        if bound > most * (1 + 1e-9) + 1:
            return Dual(bound, None, steps.at, done, infeasible=True, shares=steps.shares)
        direction = relaxed.excess.astype(np.float64)
        direction[(multipliers <= 0) & (direction < 0)] = 0.0
        norm = float(direction @ direction)
        if norm == 0 or spent >= work:  # (norm 0: no multiplier can change)
            break
        shares = _stepped_shares(relaxed, shares, _share_step(done))
        target = best.objective if best is not None else bound + max(reach * abs(bound), 1.0)
        length = steps.length * (target - relaxed.value) / norm
        multipliers = np.maximum(0.0, multipliers + length * direction)
        bounds.append(bound)
        if done == iterations and longer > 0 and _rising(bounds):
            grant = min(RISE_STEPS, longer)
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
    one that bounds it best at the step's plan (`_stepped_shares`): 1 / (done + 1),
    so that the mix is the mean of the options that were best (the start counted once) and
    settles. OR(g0, g1) of `test_the_mix_of_an_ors_options_moves_the_bound_to_its_best`,
    whose bound is 3 mixed evenly and 5.25 mixed best: 5.24 after 200 steps; moved half way
    each step, 4.58 after 20 and no higher. Elsewhere the rules differ little (GPT-J on 4x8
    at 5 % over its lowest budget, 40 steps: 6.02e8 this way, 5.99e8 half way, 5.98e8 half
    the multipliers' step length), but on BART's dynamo export on 2x2x2 at 80 % this way
    stays at 4.85e9 for 30 steps, half way reaches 5.06e9 and half the step length 5.03e9 (the
    LP 5.08e9): there the steps' `work` allows one step, and GPT-J's solve took 45 s with
    half the step length, 34 s this way."""
    return 1.0 / (done + 1)


def _rising(bounds: Sequence[float]) -> bool:
    """Whether the last `RISE_STEPS` steps raised the bound by `RISE` of it or more."""
    if len(bounds) <= RISE_STEPS:
        return False
    before = bounds[-1 - RISE_STEPS]
    return bounds[-1] - before >= RISE * abs(before)


LONGER = 40
"""The steps `search.ilp` lets its first relaxation take past `ITERATIONS` while the bound
still rises (`dual`'s `longer`): after 20 steps NeoX's bound at 5 % over its lowest budget
rose 1.3 % in the last 10, T5's at its lowest 1 %, BERT's and BART's not at all. Ten rows of
the zoo's slowest, end to end: 309 -> 298 s (Qwen2's training step on 2x4 at 45 % 22.9 ->
10.1 s, NeoX 16.2 -> 13.8 s, none slower by more than 3 %)."""

RISE_STEPS = 10
RISE = 0.005
"""How much the bound must have risen in the last `RISE_STEPS` steps for `dual` to go on."""


def least_peak(
    problem: Problem,
    iterations: int = ITERATIONS,
    work: int = WORK,
    relaxation: Relaxation | None = None,
) -> Dual | None:
    """The least peak any plan reaches, bounded from below: for weights mu on the simplex,
    min_x sum_r mu_r bytes_r(x) <= min_x max_r bytes_r(x). Projected subgradient steps on the
    simplex with Polyak's length towards the least peak found; `best` is the plan of the
    least peak among the minima (its `peak`), `bound` the best bound. `relaxation`: the
    problem's `peak_relaxation`, if made already."""
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
            peak_rows = np.argsort(-relaxed.excess, kind="stable")[:PEAK_ROWS]
            probes = [np.eye(1, rows, int(r))[0] for r in reversed(peak_rows.tolist())]
        steps.saw(relaxed.value, at, shares)
        if best.peak - steps.bound < 1 or spent >= work:
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


PEAK_ROWS = 4
"""The rows at the first plan's peak that `least_peak` weighs alone (vertices of the simplex,
where its steps rarely land). The least peak is often one row's least bytes: the 32-layer
decoder's on 2x4x8, 290,269,454 B, is that of the row at its peak, where 30 steps reach a
bound of 271,971,555 B."""


MARGINAL_ROWS = 16
"""How many rows `rows_alone` weighs alone."""


def peak_marginals(relaxation: Relaxation, found: Dual) -> list[np.ndarray] | None:
    """For each group and choice, a least peak of the plans taking it: the greatest of the
    min-marginals at the best weights and of the rows at the best plan's peak alone
    (`rows_alone`; None when too big to eliminate). Rows alone see what a mix blurs: T5 on
    2x4, its least peak 132,016 B; the best weights' bound 126,896 B, and 1,631 of 1,829
    choices at it; 16 rows alone prove 132,016 B at once (the least of a group's choices
    bounds every plan: `ilp.lowest_budget`)."""
    marginals = relaxation.min_marginals(found.multipliers, found.shares)
    if marginals is None or found.best is None:
        return marginals
    alone = rows_alone(relaxation, np.argsort(-found.best.excess, kind="stable"))
    if alone is None:
        return marginals
    return [np.maximum(m, a) for m, a in zip(marginals, alone, strict=True)]


def rows_alone(relaxation: Relaxation, rows: np.ndarray) -> list[np.ndarray] | None:
    """For each group and choice, the greatest over the first `MARGINAL_ROWS` of `rows` of the
    least bytes the row holds in a plan taking it (`relaxation`: `peak_relaxation`'s), a
    lower bound on the peak of those plans. None when too big to eliminate."""
    greatest = None
    for r in rows[:MARGINAL_ROWS].tolist():
        alone = relaxation.min_marginals(np.eye(1, relaxation.rows, r)[0])
        if alone is None:
            return None
        greatest = alone if greatest is None else [
            np.maximum(m, a) for m, a in zip(greatest, alone, strict=True)
        ]  # fmt: skip
    return greatest


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
    off: GPT-2's TorchScript export on 2x2x2 at 60 %, 231,821 of the row's 1,444,237 B, and
    no multipliers raised the bound above the memory-aside optimum (1.810e9; exact to
    2^19 entries, 2.183e9, the optimum 2.201e9: OPTIMAL in 6 s, over 120 s before). On 2x4
    and 4x8 every zoo model's row keeps 96-100 %, and there the larger tables only slow each
    step (BART's TorchScript export on 4x8 at 30 %: 9.3 -> 19 s)."""
    live = problem.live(plan)
    if not len(live):
        return DENSE
    row = int(np.argmax(live))
    factors, constant = peak_relaxation(problem).at(np.eye(1, len(live), row)[0])
    relaxed = sum(float(f.table[tuple(plan[g] for g in f.scope)]) for f in factors) + constant
    return DENSE if relaxed >= LOOSE * float(live[row]) else DENSER


ROUNDING = 1e-9
"""The relative error a relaxation's float values may carry (its multipliers are floats)."""


def still_possible(
    marginals: Sequence[np.ndarray], below: int, keep: Sequence[int] | None = None
) -> list[list[int]]:
    """The choices of each group that a plan whose value is below `below` may take (and the
    choices `keep`, a plan's): choice k of group g is left out when the subproblem's minimum
    with k taken (`marginals[g][k]`, `Relaxation.min_marginals`) is `below` or more, since
    a plan's value (its cost, or its peak for `least_peak`'s relaxation) is at least the
    subproblem's at any multipliers, and both are integers (reduced-cost fixing)."""
    limit = below - 1 + ROUNDING * max(1.0, abs(below))
    found = [set(np.flatnonzero(m <= limit).tolist()) for m in marginals]
    for choices, k in zip(found, keep or (), strict=False):
        choices.add(k)
    return [sorted(choices) for choices in found]


def tightened(
    problem: Problem,
    multipliers: np.ndarray,
    kept: list[list[int]],
    below: int,
    keep: Sequence[int],
    exact_up_to: int | None = None,
    hubs: bool = False,
) -> list[list[int]]:
    """The choices `kept` of each group, which hold every plan below `below` and the plan `keep`
    (`still_possible`'s), fewer: the multipliers (`multipliers`: the whole problem's)
    stepped on (`TIGHTEN_STEPS`) in the relaxation of the problem restricted to them (its
    exact tables as large as `exact_up_to`, `table_limit`, and `hubs` where the whole's has
    them, `strengthened`) give higher min-marginals, which
    leave more out; again while they do (at most `TIGHTEN_ROUNDS` times). Where the bound
    reaches `below`, no plan below takes only them: `keep`'s choices alone. The whole
    problem's 20 steps stop short of its best bound (T5's dynamo export on 4x8 at 60 %:
    7.013e8 in 1.5 s; 60 steps 7.269e8, 150 steps 7.275e8 in 5.8 s), and steps on the few
    choices a threshold keeps go further for less (restricted to the 1,296 choices below
    7.457e8: 7.325e8 after three rounds of 8 steps, 1.5 s, and 583 choices left). BART's
    dynamo export on 4x8 at 45 %, at its optimum's value: 1,138 of 1,584 choices, 933 left;
    its training step on 2x4 at 45 %, halfway to it, 1,713 of 3,029, 270 left."""
    limit = below - 1 + ROUNDING * max(1.0, abs(below))
    for _ in range(TIGHTEN_ROUNDS):
        restricted = problem.restricted(kept)
        relaxation = Relaxation(restricted, exact_up_to=exact_up_to, hubs=None if hubs else ())
        found = dual(restricted, TIGHTEN_STEPS, relaxation=relaxation, start=multipliers)
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


TIGHTEN_STEPS = 8
"""The subgradient steps of each round of `tightened`: from the whole problem's multipliers,
a few reach most of the restricted problem's bound (BART on 4x8 at 30 %: the choices left
after 8 steps a round and after 20 are the same, in half the time; T5 on 4x8 at 75 %, 869
and 864 choices, 0.7 s and 2.3 s; BART's dynamo export at 45 %, 933 and 804, 1.7 s and
1.8 s)."""

TIGHTEN_ROUNDS = 8
"""The most rounds of `tightened`. T5's dynamo export on 4x8 at 60 %, at its optimum's value:
1,486 -> 1,094 choices in eight rounds, each leaving out fewer (two rounds: 1,279; halfway to
it, 583 rather than 865, CP-SAT's try 1.7 s rather than 8 s); BART's training step on 2x4 at
75 %, 670 -> 454 in 2.5 s (two rounds: 531, 1.4 s), where CP-SAT's try is 0.1 s either way."""


def strengthened(problem: Problem, relaxation: Relaxation, found: Dual) -> tuple[Relaxation, Dual]:
    """The relaxation with its large indicators exact (`hub_tables`) and its multipliers
    stepped on from `found`'s, where `HUB_TRIAL` steps raise the bound by `HUB_GAIN` or more;
    else `relaxation` and `found` as they are. Where a value is read by several groups at
    once (BERT's hidden state by q, k, v and the residual), its reshard buffers and its own
    savings are bounded apart, and near the lowest budget their sum binds: BERT's
    TorchScript export on 4x8 at 5 % over its lowest, 4.60e8 after 20 steps, 3 steps more
    with them exact 5.78e8 (20: 6.27e8; the LP of CP-SAT's model 6.30e8, the optimum
    6.705e8), the solve 65 -> 41 s; DistilBERT +26 %; BART's TorchScript export on 2x4 at 5 %
    over its lowest, 26 -> 6 s. Elsewhere they change little (BART on 4x8 at 30 to 60 %: 0
    to 1 %) and the trial costs about a second (0.5 s of it making the hubs)."""
    scopes = relaxation.hub_scopes()
    if not scopes or not relaxation.joins_in_time(list(scopes), found.multipliers):
        return relaxation, found
    exact = Relaxation(problem, exact_up_to=relaxation.exact_up_to, hubs=relaxation.hub_tables())
    trial = dual(problem, HUB_TRIAL, relaxation=exact, start=found.multipliers)
    if trial is None:
        return relaxation, found
    if not trial.infeasible and trial.bound < found.bound + HUB_GAIN * abs(found.bound):
        return relaxation, found
    more: Dual | None = trial
    if not trial.infeasible:
        more = dual(problem, relaxation=exact, start=trial.multipliers, shares=trial.shares)
    stepped = trial if more is None or more.bound < trial.bound else more
    plans = [d.best for d in (found, trial, stepped) if d.best is not None]
    best = min(plans, key=lambda plan: plan.objective, default=None)
    return exact, dataclasses.replace(stepped, best=best)


HUB_TRIAL = 3
"""The steps that try the relaxation with its large indicators exact (`strengthened`)."""

HUB_GAIN = 0.05
"""How much higher, relatively, those steps must take the bound for the rest to use them: 11 to
26 % where they matter, at most 1 % where they do not (`strengthened`)."""


class _Steps:
    """The best bound so far and the multipliers `at` which it was reached, and the
    subgradient's step length: halved after five steps that did not raise the bound."""

    def __init__(self, start: np.ndarray) -> None:
        self.bound, self.at, self.length, self.stalled = -math.inf, start, 1.0, 0
        self.shares: Shares | None = None

    def saw(self, value: float, at: np.ndarray, shares: Shares | None = None) -> None:
        """One subproblem's value, at these multipliers and shares."""
        if value > self.bound:
            self.bound, self.at, self.shares, self.stalled = value, at, shares, 0
            return
        self.stalled += 1
        if self.stalled >= 5:
            self.length, self.stalled = self.length / 2, 0


def _onto_simplex(v: np.ndarray) -> np.ndarray:
    """The nearest point of the simplex {w >= 0, sum w = 1} (sort-based projection)."""
    u = np.sort(v)[::-1]
    cumulative = np.cumsum(u) - 1.0
    k = np.nonzero(u - cumulative / np.arange(1, len(v) + 1) > 0)[0][-1]
    return np.maximum(v - cumulative[k] / (k + 1), 0.0)
