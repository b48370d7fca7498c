"""The live conditions of the memory model: literals on the groups' choices (`Chosen`) and the
ANDs and ORs of them (`Indicator`), simplified as they are made and each distinct one made
once, so that repeated layers, asking for the same conditions, share them.
"""

from __future__ import annotations

from collections.abc import Sequence

from autoshard.search.memory.rows import Chosen, Indicator, Literal
from autoshard.sharding import Sharding


class Literals:
    """The indicators made so far (`indicators`, each after those it names) and the literals
    on `sizes[g]` choices of each group g."""

    def __init__(self, sizes: Sequence[int]) -> None:
        self.sizes = list(sizes)
        self.indicators: list[Indicator] = []
        self.index: dict[tuple[bool, frozenset[Literal]], int] = {}
        self.choice_sets: dict[int, dict[Sharding, frozenset[int]]] = {}
        self.kept: list[tuple[Sharding, ...]] = []
        # Repeated layers ask for the same combinations: each worked out once.
        self.combined: dict[tuple, Literal | bool] = {}
        self.ran: dict[tuple, list[Literal | bool]] = {}

    def chosen(
        self, group: int | None, choices: tuple[Sharding, ...], sharding: Sharding, equal: bool
    ) -> Literal | bool:
        """Group `group` takes a choice whose sharding is (`equal`) or is not `sharding`."""
        if group is None:
            return (choices[0] == sharding) == equal
        ks = self.choices_of(choices).get(sharding, frozenset())
        if not equal:
            ks = frozenset(range(self.sizes[group])) - ks
        if not ks:
            return False
        if len(ks) == self.sizes[group]:
            return True
        return Chosen(group, ks)

    def choices_of(self, choices: tuple[Sharding, ...]) -> dict[Sharding, frozenset[int]]:
        """The choices giving each sharding. The tuples of a value's copies in repeated layers
        are one object, so this is worked out once for them."""
        found = self.choice_sets.get(id(choices))
        if found is None:
            table: dict[Sharding, set[int]] = {}
            for k, s in enumerate(choices):
                table.setdefault(s, set()).add(k)
            found = {s: frozenset(ks) for s, ks in table.items()}
            self.choice_sets[id(choices)] = found
            self.kept.append(choices)  # alive, so that its id stays its own
        return found

    def combine(self, every: bool, literals: Sequence[Literal | bool]) -> Literal | bool:
        """AND (`every`) or OR of literals, simplified: constants folded, literals on one group
        merged (intersection or union of its choices), repeated conditions shared."""
        key = (every, *map(_code, literals))
        found = self.combined.get(key)
        if found is None:
            found = self.combined[key] = self._combined(every, literals)
        return found

    def _combined(self, every: bool, literals: Sequence[Literal | bool]) -> Literal | bool:
        merged: dict[int, frozenset[int]] = {}
        rest: set[Literal] = set()
        for lit in literals:
            decided = _merge(every, merged, rest, lit)
            if decided is not None:
                return decided
        return self._settled(every, merged, rest)

    def running(self, every: bool, literals: Sequence[Literal | bool]) -> list[Literal | bool]:
        """`combine(every, literals[:j + 1])` for each j, in one pass (a buffer read at many
        slots asks for the OR of every prefix of its events: combined one by one, that grows
        with the square of its reads)."""
        key = (every, *map(_code, literals))
        if key not in self.ran:
            self.ran[key] = self._running(every, literals)
        return list(self.ran[key])

    def _running(self, every: bool, literals: Sequence[Literal | bool]) -> list[Literal | bool]:
        merged: dict[int, frozenset[int]] = {}
        rest: set[Literal] = set()
        found: list[Literal | bool] = []
        for lit in literals:
            last = found[-1] if found else every
            if isinstance(last, bool) and last is not every and found:
                found.append(last)  # decided: an AND's empty choices, an OR's full ones
            elif isinstance(lit, bool):
                found.append(last if lit == every else lit)
            else:
                _merge(every, merged, rest, lit)
                found.append(self._settled(every, merged, rest))
        return found

    def _settled(
        self, every: bool, merged: dict[int, frozenset[int]], rest: set[Literal]
    ) -> Literal | bool:
        """The AND (`every`) or OR of the literals on each group (`merged`) and the others."""
        found: set[Literal] = set(rest)
        for group, ks in merged.items():
            if not ks:
                if every:
                    return False
                continue
            if len(ks) == self.sizes[group]:
                if not every:
                    return True
                continue
            found.add(Chosen(group, ks))
        if not found:
            return every
        if len(found) == 1:
            return next(iter(found))
        return self.indicator(every, found)

    def indicator(self, every: bool, found: set[Literal]) -> int:
        """The indicator of an AND or OR of these literals: a new one, or the same seen before."""
        signature = (every, frozenset(found))
        if signature not in self.index:
            ordered = sorted(found, key=_order)
            self.index[signature] = len(self.indicators)
            self.indicators.append(Indicator(every, tuple(ordered)))
        return self.index[signature]


def _code(literal: Literal | bool) -> Literal:
    """A literal as a key: the constants apart from the indicators 0 and 1 (`True == 1`)."""
    return -2 if literal is True else -1 if literal is False else literal  # type: ignore[return-value]


def _merge(
    every: bool, merged: dict[int, frozenset[int]], rest: set[Literal], lit: Literal | bool
) -> bool | None:
    """`lit` merged into an AND's (`every`) or OR's literals so far; the constant deciding it,
    if `lit` is one (False in an AND, True in an OR)."""
    if isinstance(lit, bool):
        return lit if lit != every else None
    if isinstance(lit, Chosen):
        have = merged.get(lit.group)
        merged[lit.group] = (
            lit.choices if have is None else have & lit.choices if every else have | lit.choices
        )
    else:
        rest.add(lit)
    return None


def _order(literal: Literal) -> tuple:
    if isinstance(literal, Chosen):
        return (0, literal.group, sorted(literal.choices))
    return (1, literal)
