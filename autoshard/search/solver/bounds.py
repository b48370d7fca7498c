"""Bounds of the indicators too wide for one exact table: each a sum of small tables and a
constant, at most the indicator everywhere (at least it, from above), several of them mixed
(`_Options`, `Shares`)."""

from __future__ import annotations

import functools
import math
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np

from autoshard.search.memory.rows import Chosen, Indicator, Literal
from autoshard.search.problem import Problem
from autoshard.search.solver import tuning


class Tables(Protocol):
    """What a bound reads of the relaxation (`relaxation.Relaxation`): the problem, its groups'
    sizes, each indicator's scope and the tables over scopes."""

    problem: Problem
    sizes: list[int]
    scopes: list[tuple[int, ...]]
    exact_up_to: int

    def mask(self, literal: Chosen) -> np.ndarray: ...
    def table(self, i: int, scope: tuple[int, ...]) -> np.ndarray: ...
    def joint(
        self, literals: Sequence[Literal], every: bool, scope: tuple[int, ...]
    ) -> np.ndarray: ...
    def scope_of(self, literal: Literal) -> tuple[int, ...]: ...
    def dense(self, values: np.ndarray, scope: tuple[int, ...]) -> np.ndarray: ...


T = TypeVar("T")

Call = Generator["Call[Any]", Any, T]
"""A call that would recurse, as a generator for `unnested`: it yields each call it needs
and is sent that call's result; it returns its own."""


def unnested(call: Call[T]) -> T:
    """The result of `call`, its calls run from an explicit stack rather than Python's: an
    indicator's bounds need those of the indicators it names, nested once per layer of a model
    (deeper than the interpreter's recursion limit), and each call runs as it would have."""
    stack: list[Call[Any]] = [call]
    sent: Any = None
    while True:
        try:
            inner = stack[-1].send(sent)
        except StopIteration as done:
            stack.pop()
            if not stack:
                return done.value
            sent = done.value
        else:
            stack.append(inner)
            sent = None


Pieces = list[tuple[tuple[int, ...], np.ndarray]]
"""Tables over scopes of groups, to be summed."""


Bounded = tuple[int, float, "_Options"]
"""An indicator a subproblem bounds: its index, its coefficient there, its options."""


Shares = Mapping[int, tuple["_Options", np.ndarray]]
"""How the options bounding each wide indicator are mixed, by indicator: the options (those
of one relaxation's bounds, `Bound.options`) and their shares; options not named, or named
with other options (another relaxation's), are mixed as they start."""


@dataclass(frozen=True, eq=False)
class _Options:
    """Bounds of one indicator from one side, each a sum of tables and a constant: from below,
    each at most the indicator wherever the groups' choices are (so the indicator is at least
    their maximum, and at least any mix of them: `shares`, on the simplex); from above, each at
    least it. The LP of CP-SAT's model has every such bound in its rows (an AND at least the
    sum of its literals less one, and at least 0) and weighs them as its duals say; one fixed
    mix may be far weaker, so the steps move the mix too. `start`: the mix a relaxation
    starts from (the even one of an OR)."""

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


class Bound:
    """A lower bound on an indicator as a sum of small tables and a constant: exact where the
    groups it names have few combinations of choices, else from its parts (below)."""

    def __init__(self, relaxation: Tables, joined: frozenset[tuple[int, ...]] | None) -> None:
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
        return unnested(self.options_of(literal, upper))

    def options_of(self, literal: Literal, upper: bool) -> Call[_Options]:
        """`options` as a call for `unnested`."""
        key = (literal, upper)
        if key not in self.found:
            self.found[key] = yield self.bounded(literal, upper)
        return self.found[key]

    def bounded(self, literal: Literal, upper: bool) -> Call[_Options]:
        r = self.relaxation
        if isinstance(literal, Chosen):
            return _one([((literal.group,), r.mask(literal).astype(np.float64))])
        if self.exact(r.scopes[literal]):
            scope = r.scopes[literal]
            return _one([(scope, r.dense(r.table(literal, scope), scope))])
        ind = r.problem.indicators[literal]
        literals = self.parts(ind)
        if ind.every and not upper:
            distributed = yield self.distributed(literals, tuning.ROOM)
            if distributed is not None:
                alternatives = tuple(([(scope, table)], 0.0) for _, scope, table in distributed)
                mean = [share for share, _, _ in distributed]
                return _Options((*alternatives, ([], 0.0)), np.array([*mean, 0.0]))
        exact, groups, rest = self.split(literals)
        scope = tuple(sorted(groups))
        parts: list[tuple[Pieces, float]] = []
        if exact:
            parts.append(([(scope, r.dense(r.joint(exact, ind.every, scope), scope))], 0.0))
        for lit in rest:
            options = yield self.options_of(lit, upper)
            parts.append(options.at_start)
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
        table in their place: the more of them, the more fall in one exact part. E.g. a
        saving AND(g3 in K, AND(OR over g3 and g29, OR over five groups)) is at most AND(g3 in
        K, the first OR), one table, rather than g3's mask alone."""
        r = self.relaxation
        found: list[Literal] = []
        todo = [iter(ind.literals)]  # the literals left of each AND (OR) opened, innermost last
        while todo:
            lit = next(todo[-1], None)
            if lit is None:
                todo.pop()
            elif isinstance(lit, Chosen) or self.exact(r.scopes[lit]):
                found.append(lit)
            elif (inner := r.problem.indicators[lit]).every == ind.every:
                todo.append(iter(inner.literals))
            else:
                found.append(lit)
        if not ind.every:
            return found
        # An OR holding wherever one of the AND's own literals does is no condition: AND(g4
        # in S, OR(g4 in S, g5 in S)) is g4 in S (a buffer read where it is made). (Each AND
        # opened names fewer of them than the whole: what it leaves out, this leaves out too.)
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
    ) -> Call[list[tuple[float, tuple[int, ...], np.ndarray]] | None]:
        """AND(E, OR(a_1 .. a_m), R), E the literals of `literals` that fit one exact table and
        the OR the first of the rest, as OR_i AND(E, a_i, R): at least each of those, each
        exact or distributed again, as exact tables with the shares of their mean (the mix
        its options start from); None when one cannot be (no OR left) or they are more than
        `room` tables. Unlike E + OR - 1 it is never below 0: a reshard's buffer, AND(held
        elsewhere, OR(the readers reading it)), would be priced at -1 times its bytes wherever
        it is not made, and no multipliers could raise the bound above the memory-aside
        optimum. Not from above: the sum of those (a union bound) counts a saving once per
        OR's literal that holds, far below the LP's bound. A call for `unnested`.
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
            found = yield self.distributed([*exact, *these, *others], room - len(pieces))
            if found is None or len(pieces) + len(found) > room:
                return None
            pieces += found
        share = 1.0 / len(first.literals)
        return [(part * share, scope, table) for part, scope, table in pieces]
