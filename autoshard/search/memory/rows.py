"""The memory rows' types and arrays: the bytes live at each program step as a linear function
of the choices (`Chosen` literals and `Indicator`s over them), stored as arrays of runs and
spans so that summing a plan's rows, or weighting them, stays a few vector operations.

`search.memory` builds the rows; the solver (`search.solver`) bounds, sums and restricts them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Chosen:
    """1 when group `group` takes one of `choices`."""

    group: int
    choices: frozenset[int]


Literal = Chosen | int  # an int is the index of an Indicator


NO_ENTRIES = np.zeros(0, np.int64)


@dataclass(frozen=True)
class Indicator:
    """1 when all (`every`) or any of `literals` are 1."""

    every: bool
    literals: tuple[Literal, ...]


@dataclass(frozen=True)
class MemoryRow:
    """Bytes live at one program step: `fixed`, plus `bytes` for each (group, choice, bytes)
    term whose choice is taken, plus `bytes` for each (indicator, bytes) term that holds."""

    fixed: int
    terms: tuple[tuple[int, int, int], ...]
    indicated: tuple[tuple[int, int], ...]


@dataclass(frozen=True, eq=False)
class MemoryRows:
    """Memory rows as arrays. A row's terms fall in *runs*, the bytes one group's values hold
    at the step under each of its choices, and runs recur from row to row: each is stored once,
    and a row is its runs (by group), so that rows of thousands of terms stay small to build and
    to sum.

    Row r is `self[r]`: `fixed[r]`; plus, for each run u in `runs[starts[r]:starts[r + 1]]`,
    `amounts[j]` for each j in `run_starts[u]:run_starts[u + 1]` if group `run_group[u]` takes
    choice `choices[j]`; plus `indicated_amounts[j]` for each j in
    `indicated_starts[r]:indicated_starts[r + 1]` whose indicator `indicated[j]` holds."""

    fixed: np.ndarray
    starts: np.ndarray
    runs: np.ndarray
    run_group: np.ndarray
    run_starts: np.ndarray
    choices: np.ndarray
    amounts: np.ndarray
    indicated_starts: np.ndarray
    indicated: np.ndarray
    indicated_amounts: np.ndarray

    @staticmethod
    def of(rows: Sequence[MemoryRow]) -> MemoryRows:
        """Rows written out one by one, as arrays."""
        table = RunTable()
        runs = []
        for row in rows:
            by_group: dict[int, list[tuple[int, int]]] = {}
            for g, k, b in row.terms:
                by_group.setdefault(g, []).append((k, b))
            runs.append([table.add(g, *_columns(terms)) for g, terms in by_group.items()])
        marks = [_columns(row.indicated) for row in rows]
        return table.rows([row.fixed for row in rows], runs, marks)

    def __len__(self) -> int:
        return len(self.fixed)

    def __getitem__(self, r: int) -> MemoryRow:
        terms = []
        for u in self.runs[self.starts[r] : self.starts[r + 1]].tolist():
            first, last = self.run_starts[u], self.run_starts[u + 1]
            choices, amounts = self.choices[first:last].tolist(), self.amounts[first:last].tolist()
            group = int(self.run_group[u])
            terms += [(group, k, b) for k, b in zip(choices, amounts, strict=True)]
        i, j = self.indicated_starts[r], self.indicated_starts[r + 1]
        marks = zip(self.indicated[i:j].tolist(), self.indicated_amounts[i:j].tolist(), strict=True)
        return MemoryRow(int(self.fixed[r]), tuple(terms), tuple(marks))

    def bytes(self, choice: Sequence[int], indicated: np.ndarray) -> np.ndarray:
        """Each row's bytes under one choice per group and the indicators' values."""
        taken = np.asarray(choice, np.int64)[self.entry_group] == self.choices
        run_bytes = _sums(np.where(taken, self.amounts, 0), self.run_starts)
        holds = indicated[self.marks.key]
        return (
            self.fixed
            + self.run_spans.sums(run_bytes[self.run_spans.key])
            + self.marks.sums(np.where(holds, self.marks.amount, 0))
        )

    @functools.cached_property
    def entry_run(self) -> np.ndarray:
        """The run of each (choice, bytes) entry of the runs."""
        return _segment_of(self.run_starts)

    @functools.cached_property
    def entry_group(self) -> np.ndarray:
        """The group of each (choice, bytes) entry of the runs."""
        return self.run_group[self.entry_run]

    @functools.cached_property
    def run_spans(self) -> Spans:
        """The rows' runs as spans of rows (`amount` 1)."""
        return Spans.of(self.starts, self.runs)

    @functools.cached_property
    def marks(self) -> Spans:
        """The rows' indicator terms as spans of rows."""
        return Spans.of(self.indicated_starts, self.indicated, self.indicated_amounts)

    def most(self) -> np.ndarray:
        """An upper bound of each row's bytes: each run's largest amount (its group takes one
        choice), every indicated term that adds bytes, none that takes bytes off."""
        run_bytes = _maxima(np.maximum(self.amounts, 0), self.run_starts)
        return (
            self.fixed
            + _sums(run_bytes[self.runs], self.starts)
            + _sums(np.maximum(self.indicated_amounts, 0), self.indicated_starts)
        )

    def restricted(self, renumber: Sequence[Sequence[int]]) -> MemoryRows:
        """The rows over fewer choices: `renumber[g][k]` is choice k of group g's new number,
        or -1 where it is left out (its terms go: no plan of the fewer choices takes it)."""
        group = self.entry_group
        flat = np.concatenate([np.asarray(r, np.int64) for r in renumber] or [NO_ENTRIES])
        offsets = _starts([len(r) for r in renumber])
        new = flat[offsets[group] + self.choices] if len(group) else NO_ENTRIES
        stays = new >= 0
        per_run = _sums(stays.astype(np.int64), self.run_starts)
        fewer = dataclasses.replace(
            self, run_starts=_starts(per_run.tolist()), choices=new[stays],
            amounts=self.amounts[stays],
        )  # fmt: skip
        # The same rows of the same runs and indicators: their spans are these.
        fewer.__dict__.update(run_spans=self.run_spans, marks=self.marks)
        return fewer


@dataclass(frozen=True)
class Spans:
    """Terms that stand alike in consecutive rows, each once: `key[j]` (a run, an indicator)
    with `amount[j]` in rows `first[j]` to `last[j]`, of `rows`. A row of a training step
    holds most of the terms of the row before, so a sum per row, and the rows' weighted sum per
    term (every step of the relaxation), go over the far fewer spans."""

    key: np.ndarray
    amount: np.ndarray
    first: np.ndarray
    last: np.ndarray
    rows: int

    @staticmethod
    def of(starts: np.ndarray, keys: np.ndarray, amounts: np.ndarray | None = None) -> Spans:
        """The spans of row r's terms `keys[starts[r]:starts[r + 1]]` (with `amounts`; none:
        1 each)."""
        # By key, each key's rows ascending (keys of 16 bits sort by radix, stable alike).
        small = len(keys) and keys.min() >= 0 and keys.max() < 1 << 16
        order = np.argsort(keys.astype(np.uint16) if small else keys, kind="stable")
        key, row = keys[order], _segment_of(starts)[order]
        amount = np.ones(len(key), np.int64) if amounts is None else amounts[order]
        opens = np.ones(len(key), bool)
        opens[1:] = (key[1:] != key[:-1]) | (amount[1:] != amount[:-1]) | (row[1:] != row[:-1] + 1)
        at = np.flatnonzero(opens)
        ends = np.append(at[1:], len(key))[: len(at)] - 1
        return Spans(key[at], amount[at], row[at], row[ends], len(starts) - 1)

    def sums(self, values: np.ndarray) -> np.ndarray:
        """Each row's sum of `values[j]` over the spans j over it (exact integers)."""
        change = np.zeros(self.rows + 1, np.int64)
        np.add.at(change, self.first, values)
        np.add.at(change, self.last + 1, -values)
        return np.cumsum(change[:-1])

    def weights(self, weights: np.ndarray) -> np.ndarray:
        """Each span's sum of the rows' `weights` over its rows."""
        total = np.concatenate([[0.0], np.cumsum(weights, dtype=np.float64)])
        return total[self.last + 1] - total[self.first]


class RunTable:
    """Runs, each stored once: a group and the (choice, bytes) its values hold under each of
    its choices that holds any."""

    def __init__(self) -> None:
        self.index: dict[tuple[int, bytes, bytes], int] = {}
        self.group: list[int] = []
        self.choices: list[np.ndarray] = []
        self.amounts: list[np.ndarray] = []

    def add(self, group: int, choices: np.ndarray, amounts: np.ndarray) -> int:
        """The run's index (a new one, or the same run's seen before)."""
        key = (group, choices.tobytes(), amounts.tobytes())
        found = self.index.get(key)
        if found is None:
            found = self.index[key] = len(self.group)
            self.group.append(group)
            self.choices.append(choices)
            self.amounts.append(amounts)
        return found

    def rows(
        self,
        fixed: Sequence[int],
        runs: Sequence[Sequence[int] | np.ndarray],
        indicated: Sequence[tuple[np.ndarray, np.ndarray]],
    ) -> MemoryRows:
        """Rows of these runs (each row's by group), with their fixed terms and their indicator
        terms (indicators, ascending, and their bytes)."""
        return MemoryRows(
            np.array(fixed, np.int64).reshape(-1),
            _starts([len(r) for r in runs]),
            concatenated([np.asarray(r, np.int64) for r in runs]),
            np.array(self.group, np.int64),
            _starts([len(c) for c in self.choices]),
            concatenated(self.choices),
            concatenated(self.amounts),
            _starts([len(i) for i, _ in indicated]),
            concatenated([i for i, _ in indicated]),
            concatenated([b for _, b in indicated]),
        )


def concatenated(arrays: Sequence[np.ndarray]) -> np.ndarray:
    # Concatenated as int64 at once: a copy afterwards would double the rows' largest arrays.
    return np.concatenate(arrays, dtype=np.int64, casting="unsafe") if arrays else NO_ENTRIES


def _columns(pairs: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """(a, b) pairs as an array of the a's and one of the b's."""
    return np.array([a for a, _ in pairs], np.int64), np.array([b for _, b in pairs], np.int64)


def _starts(lengths: Sequence[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)


def _segment_of(starts: np.ndarray) -> np.ndarray:
    """For each entry of the segments `starts` delimit, the segment's index."""
    return np.repeat(np.arange(len(starts) - 1, dtype=np.int64), np.diff(starts))


def _sums(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """The sum of `values[starts[r]:starts[r + 1]]` for each r (exact integers)."""
    total = np.concatenate([[0], np.cumsum(values, dtype=np.int64)])
    return total[starts[1:]] - total[starts[:-1]]


def _maxima(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """The largest of `values[starts[r]:starts[r + 1]]` for each r (0 where none)."""
    found = np.zeros(len(starts) - 1, values.dtype)
    filled = np.diff(starts) > 0
    if filled.any():  # (an empty span starts where the next does: reduceat skips it)
        found[filled] = np.maximum.reduceat(values, starts[:-1][filled])
    return found


NO_ROWS = MemoryRows.of(())


ZERO_ROW = MemoryRows.of((MemoryRow(0, (), ()),))


class IndicatorTable:
    """The indicators' values under any one choice per group, worked out level by level (an
    indicator after those it names) over arrays rather than literal by literal: checking a
    relaxation step's plan against the rows (`Problem.live`) is mostly this."""

    def __init__(self, indicators: Sequence[Indicator]) -> None:
        """`indicators`: each after those it names."""
        chosen: dict[Chosen, int] = {}
        for ind in indicators:
            for lit in ind.literals:
                if isinstance(lit, Chosen):
                    chosen.setdefault(lit, len(chosen))
        # Literal l holds where member[base[l] + min(choice[group[l]], width[l])]: a table
        # over its group's choices up to its largest, and one False past them.
        widths = [max(lit.choices, default=-1) + 1 for lit in chosen]
        self.group = np.array([lit.group for lit in chosen], np.int64)
        self.width = np.array(widths, np.int64)
        self.base = _starts([w + 1 for w in widths])[:-1]
        self.member = np.zeros(sum(widths) + len(widths), bool)
        for lit, base in zip(chosen, self.base.tolist(), strict=True):
            self.member[base + np.array(sorted(lit.choices), np.int64)] = True
        # Operands numbered: the Chosen literals, then the indicators.
        depth: list[int] = []
        for ind in indicators:
            depth.append(max((depth[lit] + 1 for lit in ind.literals if isinstance(lit, int)),
                             default=0))  # fmt: skip
        self.levels = []
        for level in range(max(depth, default=-1) + 1):
            at = [i for i, d in enumerate(depth) if d == level]
            operands = [[chosen[lit] if isinstance(lit, Chosen) else len(chosen) + lit
                         for lit in indicators[i].literals] for i in at]  # fmt: skip
            self.levels.append(_Level(
                np.array(at, np.int64) + len(chosen),
                np.repeat(np.arange(len(at)), [len(ops) for ops in operands]),
                np.array([o for ops in operands for o in ops], np.int64),
                np.array([len(ops) for ops in operands], np.int64),
                np.array([indicators[i].every for i in at], bool),
            ))  # fmt: skip
        self.chosen, self.count = len(chosen), len(indicators)

    def values(self, choice: Sequence[int]) -> np.ndarray:
        """Each indicator's value (bool) under one choice per group."""
        value = np.zeros(self.chosen + self.count, bool)
        held = np.minimum(np.asarray(choice, np.int64)[self.group], self.width)
        value[: self.chosen] = self.member[self.base + held]
        for level in self.levels:
            holding = np.bincount(level.position, value[level.operands], len(level.counts))
            value[level.indicators] = np.where(level.every, holding == level.counts, holding > 0)
        return value[self.chosen :]


@dataclass(frozen=True)
class _Level:
    """Indicators whose operands are worked out before them: their numbers among the
    operands, each operand entry's position among them and the operand it is, how many
    operands each has, and which are ANDs."""

    indicators: np.ndarray
    position: np.ndarray
    operands: np.ndarray
    counts: np.ndarray
    every: np.ndarray


@dataclass(frozen=True)
class MemoryModel:
    """Bytes live at each program step: `base` (one row: live at every step) plus one of
    `rows`."""

    base: MemoryRows
    rows: MemoryRows
    indicators: tuple[Indicator, ...]
