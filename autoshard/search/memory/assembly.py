"""The row assembly: the distinct memory rows out of the terms gathered at their slots.

The slots are swept in order over the terms' events (+bytes at a span's first slot, -bytes
after its last): one vector of the choices' bytes is updated in place, never a matrix of slots
x choices, and at each slot only the runs of the groups whose bytes changed are looked up
again. What every row holds (the resident shards, mostly) is stated once, as the base row.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence

import numpy as np

from autoshard.search.memory.record import Terms
from autoshard.search.memory.rows import (
    NO_ENTRIES,
    Indicator,
    MemoryModel,
    RunTable,
    Spans,
    concatenated,
)

_Events = tuple[np.ndarray, np.ndarray, np.ndarray]
"""Events sorted by slot: (slot, column or indicator, bytes added)."""


def assemble_rows(
    terms: Terms, sizes: Sequence[int], indicators: Sequence[Indicator]
) -> MemoryModel:
    """The distinct rows, in the order of the first slot holding each, less the base row (what
    every slot holds: rows of a few terms each instead of every weight's in each, which keeps
    CP-SAT's LP light)."""
    slots, groups, offsets = terms.layout.slots, len(sizes), terms.offsets
    at, columns, amounts = _group_events(terms)
    bounds = np.searchsorted(at, np.arange(slots + 1))
    fixed = np.cumsum(terms.fixed[:-1])
    common = np.zeros(int(offsets[-1]), np.int64)
    for slot, vector, _ in _sweep(offsets, slots, bounds, columns, amounts):
        if slot:
            np.minimum(common, vector, out=common)
        else:
            np.copyto(common, vector)
    table = RunTable()

    columns_of = list(zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True))

    def run(group: int, held: np.ndarray) -> int:
        """The run of the group's bytes under each of its choices, `held`."""
        (nonzero,) = np.nonzero(held)
        return table.add(group, nonzero, held[nonzero]) if len(nonzero) else -1

    base_runs = [u for g, (a, b) in enumerate(columns_of) if (u := run(g, common[a:b])) >= 0]
    base_fixed = int(fixed.min())
    # Indicator terms as events too, over a vector of the indicators' bytes.
    marked = _indicator_events(terms)
    marked_bounds = np.searchsorted(marked[0], np.arange(slots + 1))
    live = np.zeros(len(indicators), np.int64)
    marks = (NO_ENTRIES, NO_ENTRIES)
    runs = np.full(groups, -1, np.int64)  # each group's run at this slot (-1: none)
    group_of = np.repeat(np.arange(groups), sizes)
    found: dict[tuple, tuple[int, np.ndarray, tuple[np.ndarray, np.ndarray]]] = {}
    row_slots: list[int] = []
    changed = set(np.flatnonzero(terms.fixed[:slots] | np.diff(marked_bounds)).tolist())
    for slot, vector, moved in _sweep(offsets, slots, bounds, columns, amounts, changed):
        first, last = marked_bounds[slot], marked_bounds[slot + 1]
        if first < last:
            np.add.at(live, marked[1][first:last], marked[2][first:last])
            (held,) = np.nonzero(live)
            marks = (held, live[held])
        for g in range(groups) if slot == 0 else sorted(set(group_of[moved].tolist())):
            a, b = columns_of[g]
            runs[g] = run(g, vector[a:b] - common[a:b])
        key = (int(fixed[slot]), runs.tobytes(), marks[0].tobytes(), marks[1].tobytes())
        if key not in found:
            found[key] = (key[0] - base_fixed, runs[runs >= 0], marks)
            row_slots.append(slot)
    rows = list(found.values())
    memory = table.rows([f for f, _, _ in rows], [r for _, r, _ in rows], [m for *_, m in rows])
    memory.__dict__["marks"] = _mark_spans(marked, row_slots)  # `MemoryRows.marks`, made here
    return MemoryModel(
        table.rows([base_fixed], [base_runs], [(NO_ENTRIES, NO_ENTRIES)]),
        memory,
        tuple(indicators),
    )


def _mark_spans(marked: _Events, row_slots: Sequence[int]) -> Spans:
    """The rows' indicator terms as spans (`Spans`, as `Spans.of` finds them in the rows'
    terms, in its order), from the indicator events rather than the rows: row r holds the
    bytes live at slot `row_slots[r]` (ascending), so an indicator's bytes change at the first
    row at or after each of its events; a span runs from a row where they change to a nonzero
    amount to the row before the next change. Rows of a training step share most of their
    terms: far fewer events than the rows hold terms."""
    at, key, amount = marked
    rows = len(row_slots)
    if not len(key):
        return Spans(key, amount, key, key, rows)
    order = np.argsort(key, kind="stable")  # by indicator, each one's events by slot
    at, key = at[order], key[order]
    bytes_after = np.cumsum(amount[order])  # each indicator's bytes after each of its events
    starts = np.flatnonzero(np.diff(key, prepend=-1))
    before = np.append(0, bytes_after[starts[1:] - 1])  # the indicators' before each's first
    bytes_after -= np.repeat(before, np.diff(np.append(starts, len(key))))
    row = np.searchsorted(np.asarray(row_slots, np.int64), at)
    # The last event of an indicator before each row, the rows before its first event aside.
    last = np.append((key[1:] != key[:-1]) | (row[1:] != row[:-1]), True) & (row < rows)
    key, row, bytes_after = key[last], row[last], bytes_after[last]
    opens = np.diff(key, prepend=-1) != 0
    changes = opens | (np.diff(bytes_after, prepend=0) != 0)
    key, row, bytes_after = key[changes], row[changes], bytes_after[changes]
    ends = np.append(np.where(key[1:] == key[:-1], row[1:] - 1, rows - 1), rows - 1)
    held = bytes_after != 0
    return Spans(key[held], bytes_after[held], row[held], ends[held], rows)


def _group_events(terms: Terms) -> _Events:
    """The group terms' events, by slot: (slot, column of a choice, bytes added)."""
    held, chosen = terms.held_spans, terms.chosen_marks
    lengths = [len(c) for _, _, c, _ in held]
    spans = np.array([(f, t) for f, t, _, _ in held], np.int64).reshape(-1, 2)
    # A mark's spans (one per copy) times its columns.
    return _events(
        concatenated([np.repeat(spans[:, 0], lengths)]
                     + [np.repeat(f, len(c)) for f, _, c, _ in chosen]),
        concatenated([np.repeat(spans[:, 1], lengths)]
                     + [np.repeat(t, len(c)) for _, t, c, _ in chosen]),
        concatenated([c for _, _, c, _ in held]
                     + [np.tile(c, len(f)) for f, _, c, _ in chosen]),
        concatenated([a for *_, a in held]
                     + [np.full(len(f) * len(c), a, np.int64) for f, _, c, a in chosen]),
    )  # fmt: skip


def _indicator_events(terms: Terms) -> _Events:
    """The indicator terms' events, by slot: (slot, indicator, bytes added)."""
    marks = terms.indicated
    return _events(
        concatenated([f for f, _, _, _ in marks]),
        concatenated([t for _, t, _, _ in marks]),
        concatenated([np.full(len(f), i, np.int64) for f, _, i, _ in marks]),
        concatenated([np.full(len(f), a, np.int64) for f, _, _, a in marks]),
    )


def _sweep(
    offsets: np.ndarray,
    slots: int,
    bounds: np.ndarray,
    columns: np.ndarray,
    amounts: np.ndarray,
    changes: Collection[int] = (),
) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Each slot, its vector of group-term bytes and the columns changed there, for the
    first slot and those where the vector changes or `changes` names (the vector is one
    array, updated in place)."""
    vector = np.zeros(int(offsets[-1]), np.int64)
    for slot in range(slots):
        first, last = bounds[slot], bounds[slot + 1]
        if first < last:
            np.add.at(vector, columns[first:last], amounts[first:last])
        if first < last or slot == 0 or slot in changes:
            yield slot, vector, columns[first:last]


def _events(
    firsts: np.ndarray, lasts: np.ndarray, columns: np.ndarray, amounts: np.ndarray
) -> _Events:
    """Terms live over spans of slots (first..last, a column, bytes) as events sorted by slot:
    (slot, column, bytes added), +bytes at a span's first slot and -bytes after its last."""
    at = np.concatenate([firsts, lasts + 1]).astype(np.int64)
    order = np.argsort(at, kind="stable")
    return (
        at[order],
        np.concatenate([columns, columns]).astype(np.int64)[order],
        np.concatenate([amounts, -amounts]).astype(np.int64)[order],
    )
